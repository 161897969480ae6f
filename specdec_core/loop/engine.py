"""The speculative loop (propose -> score -> verify -> commit/rollback -> stream) and the
in-process engine that runs it over local models."""

from __future__ import annotations

import functools
import json
import time
from typing import Any, AsyncIterator, Callable, Iterator, Optional

import torch

from ..api.logprobs import emitted_log_probs
from ..api.metrics import SpecMetrics
from ..api.output import OutputTracker
from ..api.request import Completion, GenerationRequest, RequestDefaults, StreamChunk
from ..calibration.draft_costs import DraftCosts, cpu_pair, load_draft_costs
from ..calibration.profile_types import CalibrationSettings, TargetProfile
from ..calibration.target_profile import calibration_progress, load_profile, measure_profile
from ..drafters import DraftSource, SuffixCache, make_drafter
from ..heads.contract import Heads
from ..heads.loading import AUTO, load_heads
from ..models.loader import ModelSpec, load_model, load_tokenizer, refuse_draft_only_target
from ..policies.sampled_chains import Check
from ..target.logits_processors import processed_block
from ..target.scorer import TargetScorer
from .frontend import Frontend, PreparedRequest
from .run_ahead import RunAhead, run_now
from .sessions import Decide, DraftSession, Immediate, TargetSession, decide_alone, run_immediately


async def speculative_loop(
    request: PreparedRequest,
    drafter: DraftSession,
    target: TargetSession,
    output: OutputTracker,
    decide: Decide = decide_alone,
) -> AsyncIterator[StreamChunk]:
    """Decode `request` with any drafter/target session pair (local objects here, run without an
    event loop; gRPC proxies in deployments/); the last chunk carries the request's metrics."""
    sampling, policy = request.sampling, request.policy
    verify_rng = sampling.generator("verify")
    metrics = SpecMetrics(counters=dict.fromkeys(policy.counters, 0))
    clock = time.perf_counter()
    prefilled = await target.reset(request.prompt_ids, policy, sampling, request.heads_kind)
    metrics.prefix_cache_queries = prefilled.prefix_cache_queries
    metrics.prefix_cache_hits = prefilled.prefix_cache_hits
    if output.remaining:
        await drafter.reset(request.prompt_ids, sampling)
    metrics.prefill_ms = (time.perf_counter() - clock) * 1e3
    if prefilled.prompt_scores is not None:
        yield output.prompt_chunk(request.prompt_ids, prefilled.prompt_scores)
    last_token = request.prompt_ids[-1]
    # the block length follows the target's load only where it cannot change the output: a
    # sampled or lossy request's tokens depend on its blocks, and must not on its batch companions
    follows_load = policy.lossless and sampling.greedy
    batch_rows = 1
    chunk = output.chunk([], "")  # the last one when nothing is generated (max_tokens 0)
    while output.finish_reason is None:
        clock = time.perf_counter()
        draft = await drafter.propose(min(request.num_draft_tokens, output.remaining - 1), batch_rows)
        if request.grammar is not None:  # no policy, however loose, can accept what the grammar forbids
            draft = request.grammar.within(draft)
        metrics.draft_ms.append((time.perf_counter() - clock) * 1e3)
        clock = time.perf_counter()
        scored = [last_token, *draft.token_ids]
        if draft.tree is None:
            block = await target.score(scored, draft)
        else:
            block = await target.score_tree(scored, draft.tree, draft)
        metrics.target_ms.append((time.perf_counter() - clock) * 1e3)
        metrics.preemptions = block.preemptions
        batch_rows = block.batch_rows if follows_load else 1
        clock = time.perf_counter()
        verdict = block.verdict  # decided by the target beside its rows, by this rule (target/verdicts.py)
        if verdict is None:
            on_device = draft.to(block.logits.device)
            processed = processed_block(block, on_device, sampling, request.prompt_ids, output.token_ids)
            if request.grammar is not None:
                processed = request.grammar.masked(processed, draft)
            processed = output.suppress_early_stops(processed, draft.tree)
            verdict = await decide(Check(policy, on_device, processed, sampling, verify_rng))
        metrics.verify_ms.append((time.perf_counter() - clock) * 1e3)
        new_tokens = [*verdict.kept_tokens(draft), verdict.next_token]
        if verdict.path is None:
            target.commit(verdict.num_accepted + 1)
        else:
            target.commit_path(verdict.path)
        drafter.commit(new_tokens)
        if request.grammar is not None:
            request.grammar.commit(new_tokens)
        metrics.record(draft, verdict)
        last_token = new_tokens[-1]
        log_probs = None
        if sampling.logprobs is not None:  # a tree's accepted path goes on as the chain it is
            scored_path = block if verdict.path is None else block.along(verdict.path)
            log_probs = emitted_log_probs(scored_path, new_tokens, verdict.num_accepted, sampling.logprobs)
        chunk = output.append(new_tokens, log_probs)
        if output.finish_reason is None and (chunk.token_ids or chunk.text):
            yield chunk
    if isinstance(drafter, RunAhead):
        await drafter.settle()
        metrics.run_ahead = drafter.summary()
    chunk.metrics = {
        "policy": {"name": policy.name, "params": json.loads(policy.params.model_dump_json())},
        **metrics.summary(),
        "prompt_tokens": len(request.prompt_ids),
        "completion_tokens": len(output.token_ids),
    }
    yield chunk


class SpeculativeEngine:
    """Speculative decoding in one process over a target (and optional draft) model."""

    def __init__(
        self,
        target_model: torch.nn.Module,
        tokenizer: Any = None,
        draft_model: Optional[torch.nn.Module] = None,
        defaults: Optional[RequestDefaults] = None,
        profile: Optional[Callable[[torch.nn.Module, Frontend], TargetProfile]] = None,
        heads: Optional[dict[str, Heads]] = None,
        draft_costs: Optional[DraftCosts] = None,
        suffixes: Optional[SuffixCache] = None,
    ):
        """`profile(target_model, frontend)` gives the target's profile (calibration/target_profile.py), on first need
        only; by default it is measured then, which needs a tokenizer (without one there is none).
        `heads`: the target's multi-token heads by kind (drafters `heads`, `eagle3`), on its device.
        `draft_costs`: the draft model's prices measured on this machine (draft_costs.py), the
        model drafters' defaults; None: their built-in ones."""
        self.target_model = target_model
        self.draft_model = draft_model
        self.heads = heads or {}
        self.make_drafter = make_drafter  # gpu-report puts a measurement-only drafter here
        self.suffixes = suffixes if suffixes is not None else SuffixCache()
        generation_config = getattr(target_model, "generation_config", None)
        self.frontend = Frontend(tokenizer, target_model.config, generation_config, defaults)
        self.frontend.heads = lambda: {kind: held.num_heads for kind, held in self.heads.items()}
        self.frontend.target_device = lambda: target_model.device.type
        self.frontend.draft_costs = lambda: draft_costs
        if profile is None and tokenizer is not None:
            profile = lambda model, frontend: measure_profile(model, frontend, CalibrationSettings())  # noqa: E731
        if profile is not None:
            self.frontend.profile = functools.cache(lambda: profile(target_model, self.frontend))

    @classmethod
    def from_specs(
        cls, target: ModelSpec, draft: Optional[ModelSpec] = None, heads: Optional[str] = AUTO
    ) -> "SpeculativeEngine":
        """The engine of a target and a draft spec, and the target's heads (`load_heads`); the
        target's profile is read from the cache, or measured and cached on first need, and so
        are the draft's costs where both models run on the CPU."""
        refuse_draft_only_target(target)
        progress = calibration_progress(target.source)
        target_model = load_model(target)
        draft_model = load_model(draft) if draft else None
        costs = load_draft_costs(target, draft, target_model, draft_model) if cpu_pair(target, draft) else None
        return cls(
            target_model,
            load_tokenizer(target),
            draft_model,
            profile=lambda model, frontend: load_profile(target, model, frontend, CalibrationSettings(), progress),
            heads=load_heads(heads, target.source, target_model),
            draft_costs=costs,
        )

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        """Validates `request` now (SpecdecError), then decodes it as the iterator is consumed."""
        prepared = self.frontend.prepare(request)
        drafter, target = self.sessions(prepared)
        return run_immediately(speculative_loop(prepared, drafter, target, self.frontend.output(prepared)))

    def sessions(
        self,
        prepared: PreparedRequest,
        target_session: Callable = Immediate,
        draft_session: Callable = Immediate,
        run_ahead: bool = True,
    ) -> tuple[DraftSession, TargetSession]:
        """A request's drafter and target sessions over the local models; `target_session` and
        `draft_session` put each local object behind the loop's calls (lockstep.py batches them,
        with `run_ahead` False: a proposal outside its rounds would hold one up)."""
        target = target_session(TargetScorer(self.target_model, self.heads))
        spec = prepared.drafter
        drafter = self.make_drafter(spec.name, spec.params, self.draft_model, target, self.suffixes)
        if prepared.grammar is not None and drafter.follows_grammar:  # its own copy, following its commits
            drafter.follow_grammar(prepared.grammar.fork())
        # a drafter of the target's heads asks the target session itself: it is a session already
        if drafter.drafts_from is DraftSource.TARGET_HEADS:
            return drafter, target
        if prepared.run_ahead and run_ahead:  # in process nothing runs beside the target: the same tokens, no gain
            return RunAhead(draft_session(drafter), run_now), target
        return draft_session(drafter), target

    def complete(self, request: GenerationRequest) -> Completion:
        return Completion.from_chunks(list(self.stream(request)))
