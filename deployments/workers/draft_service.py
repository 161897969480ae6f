"""The draft worker's service: drafter sessions over the draft model (or none: lookups only), whose
proposals of one step run their draft-model forwards in lockstep (`propose_together`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from specdec_core.api.errors import SpecdecError
from specdec_core.api.request import MAX_DRAFT_TOKENS, ComponentSpec
from specdec_core.api.sampling import SamplingParams
from specdec_core.drafters import SuffixCache, make_drafter, validate_drafter
from specdec_core.drafters.model import ModelDrafter, propose_step
from specdec_core.loop.stage_types import DraftBlock
from specdec_core.structured.grammar_compiler import GrammarCompiler

from .admission import Admission
from .steps import PendingRow
from .tensor_parallel import ControlChannel
from .worker_ops import DraftRow, DraftStep, OpenDraft, Release
from .worker_service import MAX_BATCH_ROWS, WorkerService


class DraftService(WorkerService):
    def __init__(
        self,
        draft_model: Optional[torch.nn.Module],
        target_config: Any,
        idle_timeout_s: float = 120.0,
        channel: Optional[ControlChannel] = None,
        admission: Optional[Admission] = None,
        batch_window_s: float = 0.005,
        tokenizer: Any = None,
        suffixes: Optional[SuffixCache] = None,
    ):
        """`tokenizer`: the target's, with which a draft model masks its proposals by a request's
        grammar (None: they are cut by the verifier's grammar instead). `suffixes`: the suffix
        trees this worker's sessions share (by default its own, with the default settings)."""
        super().__init__(target_config, idle_timeout_s, channel, admission, draft_model, batch_window_s)
        self.draft_model = draft_model
        self.suffixes = suffixes if suffixes is not None else SuffixCache()
        # built here, not at a session's opening: building llguidance's vocabulary takes a while
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size) if tokenizer is not None else None
        self.operations.update({OpenDraft: self.open, DraftStep: self.step})

    def reset(
        self,
        session_id: str,
        prompt_ids: list[int],
        drafter: ComponentSpec,
        sampling: SamplingParams,
        with_logits: bool,
    ) -> None:
        """Open a session; `with_logits`: its proposals carry the draft's rows."""
        validate_drafter(drafter.name, drafter.params)
        prompt_ids = self.check_prompt(prompt_ids)
        op = OpenDraft(
            session_id=session_id,
            prompt_ids=prompt_ids,
            drafter=drafter,
            sampling=sampling.seeded(),
            with_logits=with_logits,
        )
        self.open_session(op)

    def open(self, op: OpenDraft) -> None:
        drafter_session = make_drafter(op.drafter.name, op.drafter.params, self.draft_model, suffixes=self.suffixes)
        drafter_session.reset(op.prompt_ids, op.sampling)
        constraint = op.sampling.structured_output
        if constraint is not None and drafter_session.follows_grammar and self.grammars is not None:
            drafter_session.follow_grammar(self.grammars.state(constraint))
        self.table.put(op.session_id, (drafter_session, op.with_logits))

    def propose(
        self,
        session_id: str,
        max_tokens: int,
        commit_tokens: list[int],
        batch_rows: int,
        after_tokens: Sequence[int] = (),
    ) -> tuple[DraftBlock, bool]:
        """Commit what the verifier kept, then propose up to `max_tokens` (in the next step), after
        `after_tokens` where run-ahead gives them; returns the block and whether the session's
        caller asked for its logits."""
        drafter_session, _ = self.session(session_id)
        if after_tokens and not drafter_session.drafts_ahead:
            raise SpecdecError(f"after_tokens: drafter {drafter_session.name!r} drafts inline, never ahead")
        after_tokens = self.check_tokens(after_tokens, "after_tokens", 0, MAX_DRAFT_TOKENS)
        if not 0 <= max_tokens <= MAX_DRAFT_TOKENS:
            raise SpecdecError(f"max_tokens must lie in [0, {MAX_DRAFT_TOKENS}]")
        commit_tokens = self.check_tokens(commit_tokens, "commit_tokens", 0, MAX_DRAFT_TOKENS + 1)
        if not 0 <= batch_rows <= MAX_BATCH_ROWS:
            raise SpecdecError(f"batch_rows must lie in [0, {MAX_BATCH_ROWS}]")
        batch_rows = max(1, batch_rows)
        row = DraftRow(
            session_id=session_id,
            max_tokens=max_tokens,
            commit_tokens=commit_tokens,
            batch_rows=batch_rows,
            after_tokens=after_tokens,
        )
        return self.batcher.submit(row).result()

    def release(self, op: Release) -> None:
        """Commit the session's last tokens (none where it proposed after them), then free it."""
        commit_tokens = self.check_tokens(op.commit_tokens, "commit_tokens", 0, 2 * (MAX_DRAFT_TOKENS + 1))
        drafter_session = self.table.get(op.session_id)
        if commit_tokens and drafter_session is not None:
            drafter_session[0].commit(commit_tokens)
        super().release(op)

    def sessions_in_steps(self) -> int:
        # only chain model drafters share a step's forwards: a lookup row never waits for companions
        return self.table.count(lambda session: isinstance(session[0], ModelDrafter))

    def check_row(self, row: PendingRow) -> None:
        _, with_logits = self.session(row.session_id)
        row.reply = lambda block: (block, with_logits)

    def step_of(self, rows: list[DraftRow]) -> DraftStep:
        return DraftStep(rows=rows)

    def step(self, op: DraftStep) -> list[DraftBlock]:
        """One step over the rows' proposals (after their commits): model drafters' forwards in
        lockstep, the others on their own."""
        proposals = []
        for row in op.rows:
            drafter_session, _ = self.session(row.session_id)
            if row.commit_tokens:
                drafter_session.commit(row.commit_tokens)
            proposals.append((drafter_session, row.max_tokens, row.batch_rows, row.after_tokens))
        return propose_step(self.draft_model, proposals)
