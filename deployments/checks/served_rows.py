"""What `specdec served-rows` measures: the host's cost, per request and step, of a sampled
verdict's whole target rows in the served path. The target worker sends a request's `[K + 1, V]`
rows (wire.py), the server decodes them and warps them (temperature, top-p) before its policy
decides; or the target worker decides them beside its rows, many sessions' at once, and sends the
verdicts (specdec_core/target/verdicts.py). Rows are the target's own, over a fixed prompt;
`vocab` pads them to a larger vocabulary's size with entries far below the row's least (their
mass is nil: the nucleus stays the model's, the sizes are the larger vocabulary's)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from protos import specdec_pb2 as pb
from specdec_core.api import sampling
from specdec_core.api.sampling import SamplingParams, warp_logits
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.policies import make_policy
from specdec_core.policies.sampled_chains import Check
from specdec_core.policies.step_verdicts import decide_together
from specdec_core.tools.measuring.device_clock import seconds_per_call

from ..coordination.wire import tensor_from_proto, tensor_to_proto, verdict_to_proto

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle, and say what it says."
CONTINUATION = " Once upon a time, on a rocky island far from the coast, there lived an old lighthouse keeper named"


def target_rows(model, tokenizer, num_rows: int, vocab: int) -> torch.Tensor:
    """`[num_rows, max(V, vocab)]` float32: the model's rows at the continuation's last positions."""
    messages = [{"role": "user", "content": PROMPT}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(chat + CONTINUATION, return_tensors="pt").input_ids
    with torch.no_grad():
        rows = model(ids.to(model.device)).logits[0, -num_rows:].float().cpu()
    if vocab > rows.shape[-1]:
        floor = rows.min() - 50.0  # e^-50 of the least entry's weight each
        rows = torch.cat([rows, floor.expand(num_rows, vocab - rows.shape[-1])], -1)
    return rows


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timed calls, after one untimed."""
    call()
    return round(statistics.median(seconds_per_call(call, warm_up=False) for _ in range(repeats)) * 1e3, 2)


def through_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` after encoding, serializing, parsing and decoding, as a worker's reply takes it."""
    received = pb.Tensor()
    received.ParseFromString(tensor_to_proto(tensor).SerializeToString())
    return tensor_from_proto(received)


def row_costs(rows: torch.Tensor, temperature: float, top_p: float, repeats: int) -> list[dict]:
    """A row per wire dtype: the rows' bytes, their wire ms (encode, serialize, parse, decode), and
    their warp's ms with top-p looked for among the top entries and by a full sort."""
    warp = SamplingParams(temperature=temperature, top_p=top_p)
    nucleus = warp_logits(rows, warp).isfinite().sum(-1)
    costs = []
    for dtype in (torch.float32, torch.bfloat16):
        sent = rows.to(dtype)
        cost = {"dtype": str(dtype).removeprefix("torch."), "MB": round(len(tensor_to_proto(sent).data) / 1e6, 2)}
        cost["wire ms"] = median_ms(lambda: through_the_wire(sent), repeats)
        for name, candidates in (("warp ms", sampling.NUCLEUS_CANDIDATES), ("warp ms, full sort", ())):
            kept, sampling.NUCLEUS_CANDIDATES = sampling.NUCLEUS_CANDIDATES, candidates
            try:
                cost[name] = median_ms(lambda: warp_logits(through_the_wire(sent), warp), repeats)
            finally:
                sampling.NUCLEUS_CANDIDATES = kept
            cost[name] = round(cost[name] - cost["wire ms"], 2)
        cost["nucleus tokens"] = f"{int(nucleus.min())}-{int(nucleus.max())}"
        costs.append(cost)
    return costs


def step_costs(rows: torch.Tensor, sessions: int, temperature: float, top_p: float, repeats: int) -> dict:
    """A step of `sessions` sampled rejection chains over `rows` (drafts: each row's likeliest
    token, as a lookup would propose it), ms: the server deciding each from its rows after the
    wire (float32), one by one as its loops come; and the target worker deciding all together
    beside them, with only the verdicts to send."""
    warp = SamplingParams(temperature=temperature, top_p=top_p, seed=0)
    policy, drafts = make_policy("rejection"), rows[:-1].argmax(-1)  # [K]

    def checks(received: Callable[[torch.Tensor], torch.Tensor]) -> list[Check]:
        draft = DraftBlock(drafts)
        return [
            Check(policy, draft, TargetBlock(received(rows)), warp, warp.generator("verify")) for _ in range(sessions)
        ]

    def on_the_server():
        return [check.verdict() for check in checks(through_the_wire)]

    def on_the_target():
        return [verdict_to_proto(verdict).SerializeToString() for verdict in decide_together(checks(lambda kept: kept))]

    return {
        "sessions": sessions,
        "server ms": median_ms(on_the_server, repeats),
        "target ms": median_ms(on_the_target, repeats),
    }
