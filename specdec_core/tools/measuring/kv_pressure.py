"""`specdec kv-pressure`: many chats without max_tokens against a KV pool that holds a few contexts.
Each chat may run to the end of the context, so admission by reach (prompt, the context's room,
a block of drafts) runs as many at a time as the pool holds contexts; admission on demand runs
all that fit now and preempts the youngest when the pool runs out (kv_room.py). Reported for
both: wall time, tokens per second, the sessions a step held and what a step's target forward
took, preemptions, and whether every output equals the chat's own output decoded alone (the
exactness check; T = 0). Prefills, a resumed session's recompute among them, count in the wall
time only."""

from __future__ import annotations

import json
import statistics
import time
from typing import Optional

import typer

from ...api.request import GenerationRequest
from ...calibration.questions import load_questions, question_messages
from ...loop.lockstep import StepTimes, complete_together
from ..cli_common import (
    DraftDtypeOpt,
    DraftLayersOpt,
    DraftOpt,
    QuestionsOpt,
    TargetDtypeOpt,
    TargetOpt,
    build_engine,
    print_table,
)


def chats(engine, questions: list[dict], drafter: str, num_draft: int) -> list[GenerationRequest]:
    """Each question as a chat without max_tokens, greedy, as a request of prompt ids."""
    return [
        GenerationRequest(
            prompt_ids=engine.frontend.encode(GenerationRequest(messages=question_messages(question))),
            drafter={"name": drafter},
            num_draft_tokens=num_draft,
            sampling={"temperature": 0.0},
        )
        for question in questions
    ]


def pressure_row(engine, requests, alone: list[list[int]], admission: str, kv_positions: int) -> dict:
    times = StepTimes()
    clock = time.perf_counter()
    done = complete_together(engine, requests, times, kv_positions=kv_positions, admission=admission)
    wall_s = time.perf_counter() - clock
    tokens = sum(len(completion.token_ids) for completion in done)
    return {
        "admission": admission,
        "wall s": round(wall_s, 1),
        "tok/s": round(tokens / wall_s, 1),
        "tokens": tokens,
        "rows a step (mean / most)": f"{statistics.mean(times.target_rows):.1f} / {max(times.target_rows)}",
        "target ms a step": round(statistics.mean(times.target_s) * 1e3, 1),
        "preemptions": sum(completion.metrics["preemptions"] for completion in done),
        "preempted chats": sum(completion.metrics["preemptions"] > 0 for completion in done),
        "same as alone": f"{sum(c.token_ids == a for c, a in zip(done, alone))}/{len(alone)}",
    }


def kv_pressure_command(
    chats_count: int = typer.Option(32, "--chats", help="chats decoded together"),
    contexts: float = typer.Option(4.0, "--contexts", help="the KV pool holds this many contexts"),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", help="the context, below the target's own (vLLM's max_model_len)"
    ),
    drafter: str = typer.Option("pld", "--drafter"),
    num_draft: int = typer.Option(4, "-k", "--num-draft-tokens"),
    questions: str = QuestionsOpt,
    target: str = TargetOpt,
    target_dtype: str = TargetDtypeOpt,
    draft: str = DraftOpt,
    draft_dtype: str = DraftDtypeOpt,
    draft_layers: Optional[int] = DraftLayersOpt,
    out: Optional[str] = typer.Option(None, "--out", help="also write the rows as JSON here"),
):
    """Chats without max_tokens under a KV pool of a few contexts: admission on demand with
    preemption against admission by reach."""
    engine = build_engine(target, target_dtype, draft, draft_dtype, draft_layers)
    if max_model_len is not None:
        engine.frontend.max_positions = min(max_model_len, engine.frontend.max_positions)
    per_category = max(1, -(-chats_count // 13))  # Spec-Bench's 13 categories, or a named set's
    requests = chats(engine, load_questions(questions, ["all"], per_category)[:chats_count], drafter, num_draft)
    kv_positions = int(contexts * engine.frontend.max_positions)
    clock = time.perf_counter()
    alone = [engine.complete(request).token_ids for request in requests]
    alone_s = time.perf_counter() - clock
    rows = [pressure_row(engine, requests, alone, admission, kv_positions) for admission in ("reach", "on_demand")]
    longest = max(map(len, alone))
    print_table(rows, list(rows[0]), left=("admission",))
    context = engine.frontend.max_positions
    print(
        f"{len(requests)} chats, {kv_positions} KV positions ({contexts:g} contexts of {context}); alone one after "
        f"another: {alone_s:.1f} s, outputs of {min(map(len, alone))}-{longest} tokens"
    )
    if out:
        with open(out, "w") as stream:
            json.dump(rows, stream, indent=1)
