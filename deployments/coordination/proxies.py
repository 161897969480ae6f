"""gRPC proxies that satisfy specdec_core's `TargetSession` and `DraftSession`, so the served
engine runs `speculative_loop` unchanged, on the coordinator's event loop (grpc.aio stubs). A
step costs one round trip per worker: `commit` is held and sent with the next Propose / Score
(with the heads drafter, on the target's next Heads call, a second round trip to the target).
Every call carries a deadline.

Errors: a worker that is gone or late (UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND for a session
that expired or died with its worker, or CANCELLED: a stopping server's answer to the calls it
holds, grpc/grpc#41785; our own cancellation is asyncio's, never a status) or full
(RESOURCE_EXHAUSTED) turns the draft side into target-only decoding (counted) and the target
side into `WorkerUnavailable` (full: `WorkerOverloaded`). INVALID_ARGUMENT is the user's error
(`SpecdecError`). Any other status is a bug in the worker and propagates as the RpcError."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import grpc
import torch

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.api.errors import SpecdecError
from specdec_core.api.request import ComponentSpec
from specdec_core.api.sampling import SamplingParams
from specdec_core.drafters import DraftSource, drafter_source
from specdec_core.heads.contract import HeadGuesses
from specdec_core.loop.stage_types import DraftBlock, Prefilled, TargetBlock
from specdec_core.policies import AcceptancePolicy
from specdec_core.target.compact import expand_rows
from specdec_core.trees.topologies import default_bank
from specdec_core.trees.tree import Topology

from ..ingress.error_replies import WorkerOverloaded, WorkerUnavailable
from .wire import (
    as_sent,
    component_to_proto,
    prompt_scores_from_proto,
    sampling_to_proto,
    tensor_from_proto,
    tensor_to_proto,
    verdict_from_proto,
)

logger = logging.getLogger(__name__)

GONE_OR_LATE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.CANCELLED,
)
# a reset prefills the prompt: allow it this many step deadlines
RESET_DEADLINES = 10


def classify(error: grpc.RpcError, role: str) -> Exception:
    """The exception a failed worker call stands for (see the module docstring)."""
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return SpecdecError(error.details())
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerOverloaded(f"{role} worker at capacity: {error.details()}")
    if error.code() in GONE_OR_LATE:
        return WorkerUnavailable(f"{role} worker {error.code().name.lower()}: {error.details()}")
    return error


class RemoteTarget:
    """A target session on a target worker."""

    def __init__(self, stub: pb_grpc.TargetStub, session_id: str, deadline_s: float):
        self.stub = stub
        self.session_id = session_id
        self.deadline_s = deadline_s
        self.bytes_received = 0
        self.full_rows_bytes = 0  # what full fp32 rows would have cost
        self.pending_keep = 0  # a commit not yet sent: it rides on the next Score
        self.pending_path: list[int] = []  # likewise after a tree
        self.asks_forwarded = False  # at Reset: the draft worker forwards ahead blocks here (run_ahead.py)
        self.takes_forwarded = False  # the target's Reset reply: it takes them (asked, or deciding verdicts)
        # set: the target decides the verdicts (target/verdicts.py), these held back in min_tokens
        self.verdict_stop_ids: Optional[list[int]] = None
        self.decides_verdicts = False  # whether its Reset said it will
        self.sends_draft_probs = False  # decides_verdicts by a rule that reads a sampled draft's p_d, rows
        self.forwarded_blocks = 0  # Scores answered from them

    async def reset(
        self,
        prompt_ids: Sequence[int],
        policy: AcceptancePolicy,
        sampling: SamplingParams,
        heads_kind: Optional[str] = None,
    ) -> Prefilled:
        request = pb.TargetReset(
            session_id=self.session_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling_to_proto(sampling),
            policy=component_to_proto(ComponentSpec(name=policy.name, params=policy.params.model_dump())),
            heads_kind=heads_kind or "",
            takes_forwarded=self.asks_forwarded,
            decides_verdicts=self.verdict_stop_ids is not None,
            stop_ids=self.verdict_stop_ids or [],
        )
        try:
            reply = await self.stub.Reset(request, timeout=self.deadline_s * RESET_DEADLINES)
        except grpc.RpcError as error:
            raise classify(error, "target") from None
        scores = prompt_scores_from_proto(reply.prompt) if reply.HasField("prompt") else None
        # an older target leaves it unset: the server decides from the rows, as before
        self.decides_verdicts = reply.decides_verdicts
        self.takes_forwarded = self.asks_forwarded or reply.takes_forwarded  # (an older target's reply: unset)
        self.sends_draft_probs = reply.decides_verdicts and policy.reads_draft_probs
        return Prefilled(scores, reply.prefix_cache_queries, reply.prefix_cache_hits, reply.decides_verdicts)

    async def score(self, tokens: Sequence[int], draft: Optional[DraftBlock] = None, tree: Optional[Topology] = None):
        request = pb.ScoreRequest(
            session_id=self.session_id,
            tokens=list(tokens),
            commit_keep=self.pending_keep,
            commit_path=self.pending_path,
            tree=tree.name if tree is not None else "",
        )
        if self.sends_draft_probs and draft is not None and draft.sampled:
            request.draft_token_probs.extend(draft.token_probs.tolist())
            request.draft_logits.CopyFrom(tensor_to_proto(as_sent(draft.logits)))
        try:
            reply = await self.stub.Score(request, timeout=self.deadline_s)
            # Held: the session waits for KV blocks (preempted) and its stream pauses, for as long
            # as the pool's older sessions take, as vLLM's preempted requests do. The worker holds
            # only while its scheduler says the session waits, so a hung or gone worker still
            # fails the next call's deadline; the client's leaving cancels the wait.
            while reply.held:
                held = pb.ScoreRequest(session_id=self.session_id, awaits_held=True)
                reply = await self.stub.Score(held, timeout=self.deadline_s)
        except grpc.RpcError as error:
            raise classify(error, "target") from None
        self.pending_keep, self.pending_path = 0, []
        self.forwarded_blocks += reply.forwarded
        self.bytes_received += reply.ByteSize()
        self.full_rows_bytes += len(tokens) * reply.vocab_size * 4
        if reply.HasField("verdict"):  # decided on the target: no rows travel
            return TargetBlock(
                logits=torch.zeros(0, reply.vocab_size),
                batch_rows=max(1, reply.step_rows),
                preemptions=reply.preemptions,
                verdict=verdict_from_proto(reply.verdict, len(tokens) - 1),
            )
        if reply.HasField("logits"):
            logits = tensor_from_proto(reply.logits)
        else:
            logits = expand_rows(
                tensor_from_proto(reply.top_ids), tensor_from_proto(reply.top_log_probs), reply.vocab_size
            )
        features = {name: tensor_from_proto(tensor) for name, tensor in reply.features.items()}
        token_log_probs = tensor_from_proto(reply.token_log_probs) if reply.HasField("token_log_probs") else None
        return TargetBlock(
            logits=logits,
            features=features,
            token_log_probs=token_log_probs,
            batch_rows=max(1, reply.step_rows),
            preemptions=reply.preemptions,
        )

    async def score_tree(self, tokens: Sequence[int], tree: Topology, draft: Optional[DraftBlock] = None):
        return await self.score(tokens, draft, tree)

    def commit(self, num_keep: int) -> None:
        self.pending_keep = num_keep

    def commit_path(self, nodes: Sequence[int]) -> None:
        self.pending_path = list(nodes)

    async def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        """The heads' node tokens (the heads drafter's source); the held commit rides on this call."""
        request = pb.HeadsRequest(
            session_id=self.session_id,
            root_token=root_token,
            tree=tree,
            commit_keep=self.pending_keep,
            commit_path=self.pending_path,
        )
        try:
            reply = await self.stub.Heads(request, timeout=self.deadline_s)
        except grpc.RpcError as error:
            raise classify(error, "target") from None
        self.pending_keep, self.pending_path = 0, []
        self.bytes_received += reply.ByteSize()
        if not reply.HasField("tokens"):
            return None
        topology = default_bank().get(reply.tree)
        tokens, node_probs = tensor_from_proto(reply.tokens), torch.tensor(list(reply.node_probs))
        if tokens.shape != (topology.num_nodes,) or node_probs.shape != tokens.shape:
            raise RuntimeError(
                f"the target's heads sent {len(tokens)} tokens and {len(node_probs)} probabilities "
                f"for tree {reply.tree!r}"
            )
        return HeadGuesses(topology, tokens, node_probs, torch.tensor(list(reply.top_probs)), reply.root_prob)

    async def release(self) -> None:
        await release(self.stub, self.session_id, self.deadline_s, "target")


class RemoteDrafter:
    """A drafter session on a draft worker; proposes nothing once the worker is gone or late.
    Drafter `none` opens no session there: target-only decoding makes no draft calls at all."""

    def __init__(
        self,
        stub: Optional[pb_grpc.DrafterStub],
        session_id: str,
        spec: ComponentSpec,
        with_logits: bool,
        deadline_s: float,
    ):
        """`stub`: the draft worker replica's (set before `reset` where the drafter is remote)."""
        self.stub = stub
        self.session_id = session_id
        self.spec = spec
        self.with_logits = with_logits
        self.deadline_s = deadline_s
        self.failed: Optional[str] = None
        self.remote = drafter_source(spec.name) is not DraftSource.NOTHING
        self.bytes_received = 0
        self.pending_tokens: list[int] = []  # committed, not yet sent: they ride on the next Propose
        self.forward_to: Optional[tuple[str, RemoteTarget]] = None  # run-ahead: where ahead blocks go, if taken
        self.length = 0  # the sequence's tokens: the prompt and those committed

    def _fall_back(self, error: grpc.RpcError) -> None:
        cause = classify(error, "draft")
        if not isinstance(cause, WorkerUnavailable):
            raise cause from None
        self.fall_back(str(cause))

    def fall_back(self, why: str) -> None:
        """The draft worker is gone or late: the request goes on target-only."""
        self.failed = why
        logger.warning("request %s continues target-only: %s", self.session_id, why)

    async def reset(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.length = len(prompt_ids)
        if self.failed or not self.remote:
            return
        request = pb.DraftReset(
            session_id=self.session_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling_to_proto(sampling),
            drafter=component_to_proto(self.spec),
            with_logits=self.with_logits,
        )
        try:
            await self.stub.Reset(request, timeout=self.deadline_s * RESET_DEADLINES)
        except grpc.RpcError as error:
            self._fall_back(error)

    async def propose(self, max_tokens: int, batch_rows: int = 1, after: Sequence[int] = ()) -> DraftBlock:
        if self.failed or not self.remote or max_tokens <= 0:
            return DraftBlock.empty()
        # sent now: a commit made while this call is out (run-ahead) rides on the next one
        sent, self.pending_tokens = self.pending_tokens, []
        request = pb.ProposeRequest(
            session_id=self.session_id,
            max_tokens=max_tokens,
            commit_tokens=sent,
            batch_rows=batch_rows,
            after_tokens=list(after),
        )
        if after and self.forward_to is not None and self.forward_to[1].takes_forwarded:
            address, target = self.forward_to
            forward = pb.ForwardTo(address=address, after_length=self.length, draft_probs=target.sends_draft_probs)
            request.forward.CopyFrom(forward)
        try:
            reply = await self.stub.Propose(request, timeout=self.deadline_s)
        except grpc.RpcError as error:
            self._fall_back(error)
            return DraftBlock.empty()
        self.bytes_received += reply.ByteSize()
        logits = tensor_from_proto(reply.logits) if reply.HasField("logits") else None
        token_probs = torch.tensor(list(reply.token_probs)) if reply.token_probs else None
        tree = default_bank().get(reply.tree) if reply.tree else None
        return DraftBlock(torch.tensor(list(reply.tokens), dtype=torch.long), logits, token_probs, tree)

    def commit(self, new_tokens: Sequence[int]) -> None:
        self.pending_tokens.extend(new_tokens)
        self.length += len(new_tokens)

    async def release(self) -> None:
        """Free the session, with the tokens committed since the last Propose: the drafter learns
        the whole answer (suffix decoding's shared trees keep it)."""
        if self.remote and not self.failed:
            await release(self.stub, self.session_id, self.deadline_s, "draft", self.pending_tokens)


async def release(stub, session_id: str, deadline_s: float, role: str, commit_tokens: Sequence[int] = ()) -> None:
    """Free a session; a worker that cannot be reached frees it on its idle timeout instead."""
    try:
        await stub.Release(pb.SessionRef(session_id=session_id, commit_tokens=commit_tokens), timeout=deadline_s)
    except grpc.RpcError as error:
        logger.warning("releasing %s session %s failed: %s", role, session_id, error.code().name)
