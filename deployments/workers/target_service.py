"""The target worker's service: scorer sessions over the target model, whose verify blocks and
prompt chunks of one step share a forward (`forward_rows`), the heads' guesses, and the target's
profile. A verify row's answer (its verdict, or its rows) is verify_answers.py's."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Optional, Sequence, Union

import torch

from specdec_core.api.errors import SpecdecError, check_token_ids
from specdec_core.api.request import MAX_DRAFT_TOKENS, ComponentSpec
from specdec_core.api.sampling import SamplingParams
from specdec_core.calibration.profile_types import CalibrationSettings, TargetProfile
from specdec_core.calibration.target_profile import calibration_progress, measure_profile
from specdec_core.heads.contract import HeadGuesses, Heads
from specdec_core.loop.frontend import Frontend
from specdec_core.loop.stage_types import DraftBlock, Prefilled, TargetBlock
from specdec_core.models.loader import ModelSpec
from specdec_core.policies import make_policy
from specdec_core.runtime.model_runner import runner_of
from specdec_core.target.scorer import PREFILL_CHUNK, Row, TargetScorer, forward_rows
from specdec_core.target.verdicts import SessionVerdicts, decides_on_target
from specdec_core.trees.dynamic_tree import check_guess_tree
from specdec_core.trees.topologies import default_bank

from .admission import Admission
from .forwarded_blocks import ForwardedBlock, ForwardedBlocks, ScoredRows
from .held_answers import HeldAnswers
from .pool_scheduler import PoolScheduler, apply_pool_operation
from .steps import PendingRow
from .tensor_parallel import ControlChannel
from .verify_answers import checked_draft, settle_verdicts, verify_answer
from .worker_ops import Admit, Guess, MeasureProfile, OpenTarget, Preempt, Release, Resume, TargetRow, TargetStep
from .worker_service import WorkerService


class TargetService(WorkerService):
    def __init__(
        self,
        target_model: torch.nn.Module,
        idle_timeout_s: float = 120.0,
        profile: Optional[TargetProfile] = None,
        channel: Optional[ControlChannel] = None,
        batch_window_s: float = 0.005,
        prefill_chunk: int = PREFILL_CHUNK,
        admission: Optional[Admission] = None,
        heads: Optional[dict[str, Heads]] = None,
        rank: int = 0,
    ):
        """`profile`: the target's, measured at load (the defaults of policies that need one);
        `heads`: its multi-token heads by kind (drafters `heads`, `eagle3`), on its device; `rank`:
        this one's in its group (rank 0 schedules an on-demand `admission`'s pool)."""
        super().__init__(
            target_model.config, idle_timeout_s, channel, admission, target_model, batch_window_s, prefill_chunk
        )
        self.target_model = target_model
        self.profile = profile
        self.heads = heads or {}
        self.operations.update(
            {
                OpenTarget: self.open,
                TargetStep: self.step,
                Guess: self.guess_after,
                MeasureProfile: self.measure,
                Admit: self.pool_operation,
                Preempt: self.pool_operation,
                Resume: self.pool_operation,
            }
        )
        self.operations[Release] = self.release
        self.forwarded = ForwardedBlocks(self.batcher.submit)  # rank 0's: the other ranks follow its steps
        self.held = HeldAnswers()  # Score answers not ready within their call's deadline
        self.scheduler: Optional[PoolScheduler] = None
        if rank == 0 and admission is not None and admission.on_demand and admission.budget_bytes is not None:
            pool = runner_of(target_model.model).kv_pool()
            self.scheduler = PoolScheduler(
                pool, self.run, self.batcher, self.forwarded.pause, admission, self.max_positions
            )

    def reset(
        self,
        session_id: str,
        prompt_ids: list[int],
        policy: ComponentSpec,
        sampling: SamplingParams,
        heads_kind: Optional[str],
        takes_forwarded: bool = False,
        stop_ids: Optional[list[int]] = None,
    ) -> Prefilled:
        """Open a session and prefill its prompt (in steps); the prompt's scores when asked.
        `takes_forwarded`: the draft worker forwards the session's ahead blocks (`forward`);
        `stop_ids` (those min_tokens holds back): decide its verdicts here where its rule allows
        (and take forwarded blocks, unasked)."""
        policy_object = make_policy(policy.name, policy.params)
        check_token_ids(list(sampling.logit_bias), self.vocab_size, "logit_bias")  # the target may apply it
        if stop_ids is not None:
            check_token_ids(stop_ids, self.vocab_size, "stop_ids")
            stop_ids = stop_ids if decides_on_target(policy_object, sampling) else None
        if takes_forwarded and not policy_object.decided_by_target_rows(sampling):
            raise SpecdecError(f"policy {policy.name!r} decides with the server: it takes no forwarded blocks")
        if policy_object.needs_profile:
            policy_object = policy_object.for_target(self.profile)
        prompt_ids = self.check_prompt(prompt_ids)
        if heads_kind is not None and heads_kind not in self.heads:
            raise SpecdecError(f"this target has no {heads_kind} heads (it has: {', '.join(self.heads) or 'none'})")
        # the policy travels with its target-dependent parameters filled in, for every rank
        filled = ComponentSpec(name=policy_object.name, params=json.loads(policy_object.params.model_dump_json()))
        op = OpenTarget(
            session_id=session_id,
            prompt_ids=prompt_ids,
            policy=filled,
            sampling=sampling.seeded(),
            heads_kind=heads_kind,
            admitted=self.scheduler is None,
            stop_ids=stop_ids,
        )
        prefill = self.open_session(op, self.heads[heads_kind].cache_bytes_per_token() if heads_kind else 0.0)
        if self.scheduler is not None:
            prefill = self.wait_admitted(session_id, len(prompt_ids), op.sampling.max_tokens or self.max_positions)
        if prefill:
            self.batcher.submit(TargetRow(session_id=session_id, tokens=prefill, prefill=True)).result()
        scorer = self.session(session_id)
        if takes_forwarded or scorer.verdicts is not None:  # a session deciding its verdicts takes them too
            self.forwarded.open(session_id, scorer.verdicts)
        return scorer.prefilled()

    def wait_admitted(self, session_id: str, num_prompt: int, max_tokens: int) -> list[int]:
        """Wait until the pool admits the opened session: the tokens to prefill. A session refused
        (Overloaded) or failed is released."""
        try:
            return self.scheduler.wait_admitted(session_id, self.session(session_id), num_prompt, max_tokens)
        except BaseException:
            self.call(Release(session_id=session_id))
            raise

    def open(self, op: OpenTarget) -> list[int]:
        """Open the session; returns the prompt tokens to prefill (in steps)."""
        scorer = TargetScorer(self.target_model, self.heads)
        policy = make_policy(op.policy.name, op.policy.params)
        prefill = scorer.start(op.prompt_ids, policy, op.sampling, op.heads_kind, op.admitted)
        if op.stop_ids is not None:
            scorer.verdicts = SessionVerdicts.of(policy, op.sampling, op.stop_ids)
        self.table.put(op.session_id, scorer)
        return prefill

    def measure(self, op: MeasureProfile) -> TargetProfile:
        """Measure the target's profile (every rank of a group runs the same forwards)."""
        frontend = Frontend.from_spec(op.spec)
        progress = calibration_progress(op.spec.source)
        self.profile = measure_profile(self.target_model, frontend, op.settings, progress)
        return self.profile

    def measure_profile(self, spec: ModelSpec, settings: CalibrationSettings) -> TargetProfile:
        return self.call(MeasureProfile(spec=spec, settings=settings))

    def score(
        self,
        session_id: str,
        tokens: list[int],
        commit_keep: int,
        commit_path: list[int],
        tree: str,
        wait_s: Optional[float] = None,
        draft_token_probs: Sequence[float] = (),
        draft_logits: Optional[torch.Tensor] = None,
    ) -> Optional[ScoredRows]:
        """Commit the last score (`commit_keep` tokens or a tree's `commit_path`), then score
        `[last committed, drafts]` (or a tree's root and nodes) in the next step, and decide its
        verdict where its session does (by the drafts' probabilities, verify_answers.py). None where
        the answer is not ready within `wait_s` (its session waits for KV blocks): held for `score_held`."""
        tokens, draft = self.check_block(self.session(session_id), tokens, tree, draft_token_probs, draft_logits)
        row = TargetRow(
            session_id=session_id, tokens=tokens, commit_keep=commit_keep, commit_path=commit_path, tree=tree
        )
        scored_ahead, row = self.forwarded.claim(row, draft)
        if scored_ahead is not None:
            return dataclasses.replace(scored_ahead.result(), forwarded=True)
        return self.answer(session_id, self.batcher.submit(row, draft), wait_s)

    def score_held(self, session_id: str, wait_s: Optional[float] = None) -> Optional[ScoredRows]:
        """The answer of the session's Score held before (as `score`)."""
        self.session(session_id)
        return self.answer(session_id, self.held.take(session_id), wait_s)

    def answer(self, session_id: str, future, wait_s: Optional[float]) -> Optional[ScoredRows]:
        """Held only while its session waits for KV blocks: a late answer otherwise runs into the
        call's deadline, as a hung worker's should."""
        scheduler = self.scheduler
        answer = self.held.wait(
            session_id, future, wait_s, lambda: scheduler is not None and scheduler.waits(session_id)
        )
        if answer is None and self.table.get(session_id) is None:  # released meanwhile
            self.held.drop(session_id)
        return answer

    def forward(self, session_id: str, block: ForwardedBlock, token_probs: Sequence[float] = (), logits: Any = None):
        """A block the draft worker sends ahead (run-ahead), its drafts' probabilities as its Score's:
        scored before that Score comes, when the target's verdict on the last block is the one it assumed."""
        scorer = self.session(session_id)
        if not self.forwarded.takes(session_id):
            raise SpecdecError(f"session {session_id!r} was not reset to take forwarded blocks")
        self.check_tokens(block.assumed, "assumed", 1, MAX_DRAFT_TOKENS + 1)
        if scorer.verdicts is not None and not block.drafts_as_scored:  # (it would be decided as unsampled)
            raise SpecdecError("drafts_as_scored: this session's forwarded blocks carry their drafts' probabilities")
        _, draft = self.check_block(scorer, block.tokens, block.tree, token_probs, logits)
        self.forwarded.on_forwarded(session_id, dataclasses.replace(block, draft=draft))

    def check_block(
        self, scorer: TargetScorer, tokens: list[int], tree: str, token_probs: Sequence[float], logits: Any
    ) -> tuple[list[int], Optional[DraftBlock]]:
        """A block to score (`[last committed, drafts]`, or a named tree's root and nodes), and its
        drafts as `scorer`'s rule reads them, by what was sent of their probabilities."""
        tokens = self.check_tokens(tokens, "tokens", 1, MAX_DRAFT_TOKENS + 1)
        topology = default_bank().get(tree) if tree else None
        if topology is not None and len(tokens) != topology.num_nodes + 1:
            raise SpecdecError(f"tree {tree!r} takes {topology.num_nodes + 1} tokens (root and nodes)")
        return tokens, checked_draft(scorer, tokens, topology, token_probs, logits, self.vocab_size)

    def stats(self) -> dict:
        on_demand = self.scheduler.stats(self.kv_bytes_per_token) if self.scheduler is not None else {}
        return {**super().stats(), **self.forwarded.stats(), **on_demand}

    def release(self, op: Release) -> None:
        scorer = self.table.get(op.session_id)
        if scorer is not None:
            scorer.cache.drop()  # its blocks back now, on every rank alike
        super().release(op)
        self.forwarded.close(op.session_id)
        self.held.drop(op.session_id)
        if self.scheduler is not None:
            self.scheduler.leave(op.session_id)

    def on_expire(self, session_id: str) -> None:
        super().on_expire(session_id)
        self.forwarded.close(session_id)
        self.held.drop(session_id)

    def expired(self, session_id: str) -> None:
        super().expired(session_id)
        if self.scheduler is not None and self.broken is None:
            self.scheduler.leave(session_id)

    def pool_operation(self, op: Union[Admit, Preempt, Resume]) -> Optional[list[int]]:
        """Rank 0's scheduler keeps a session's scorer until it has left every rank (an expired
        one is gone from rank 0's table first)."""
        scorers = self.scheduler.scorers if self.scheduler is not None else {}
        return apply_pool_operation(op, scorers.get(op.session_id) or self.session(op.session_id))

    def check_row(self, row: PendingRow) -> None:
        scorer = self.session(row.session_id)
        if row.prefill:
            return
        step_row: TargetRow = row.row
        scorer.check_commit(step_row.commit_keep, step_row.commit_path)
        reach = scorer.committed_len + step_row.commit_keep + len(step_row.commit_path) + len(step_row.tokens)
        if reach > self.max_positions:
            raise SpecdecError(f"the session would exceed {self.max_positions} positions")
        row.reply = functools.partial(verify_answer, scorer, step_row, self.forwarded, row.attached)

    def guess(
        self, session_id: str, commit_keep: int, commit_path: list[int], root_token: int, tree: str
    ) -> Optional[HeadGuesses]:
        """After the last score's commit: the heads' node tokens of `tree` after `root_token`."""
        if self.session(session_id).heads_session is None:
            raise SpecdecError("this session was not reset with heads (heads_kind)")
        check_token_ids([root_token], self.vocab_size, "root_token")
        check_guess_tree(tree)
        op = Guess(
            session_id=session_id, commit_keep=commit_keep, commit_path=commit_path, root_token=root_token, tree=tree
        )
        return self.call(op)

    def guess_after(self, op: Guess) -> Optional[HeadGuesses]:
        scorer = self.session(op.session_id)
        scorer.check_commit(op.commit_keep, op.commit_path)
        scorer.commit_scored(op.commit_keep, op.commit_path)
        return scorer.guess(op.root_token, op.tree)

    def settle_step(self, rows: list[PendingRow], results: list) -> None:
        settle_verdicts(rows, results, self.session)

    def step_of(self, rows: list[TargetRow]) -> TargetStep:
        return TargetStep(rows=rows)

    def step(self, op: TargetStep) -> list[Optional[TargetBlock]]:
        """One forward over the rows of a step: verify blocks (after their commits) and prompt chunks."""
        step = []
        for row in op.rows:
            scorer = self.session(row.session_id)
            if not row.prefill:
                scorer.commit_scored(row.commit_keep, row.commit_path)
            step.append(
                Row(scorer, row.tokens, prefill=row.prefill, tree=default_bank().get(row.tree) if row.tree else None)
            )
        return forward_rows(step)
