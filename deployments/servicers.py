"""The gRPC services of the draft and target workers (`Drafter`, `Target` in
protos/specdec.proto). Each holds per-request sessions (sessions.py) over one model; a Ray actor
(worker.py) hosts one, and tests run them in-process."""

from __future__ import annotations

from concurrent import futures
from typing import Any, Callable, Optional

import grpc
import torch

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.compact import compact_rows
from specdec_core.drafters import make_drafter
from specdec_core.errors import SpecdecError
from specdec_core.policies import make_policy
from specdec_core.target import TargetScorer

from .sessions import SessionTable
from .wire import component_from_proto, sampling_from_proto, tensor_to_proto

MESSAGE_LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]

# All torch work of a worker process runs on this one thread: the gRPC handlers (it is the
# server's pool) and model loading. It keeps one forward at a time on the shared model (sessions
# interleave step by step), and it keeps OpenMP fast: every thread that runs a parallel region
# owns a team of OpenMP threads, and once the teams outnumber the cores libgomp stops
# spin-waiting, which doubled forward times when gRPC's pool threads ran them
# (docs/performance.md).
TORCH_THREAD = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")


def on_torch_thread(call: Callable[..., Any], *args: Any) -> Any:
    """Run `call` on the torch thread from another thread (setup; handlers already run there)."""
    return TORCH_THREAD.submit(call, *args).result()


class SessionServicer:
    """What both workers share: the session table, Release and Stats."""

    def __init__(self, idle_timeout_s: float):
        self.table = SessionTable(idle_timeout_s)

    def session(self, session_id: str, context: grpc.ServicerContext) -> Any:
        session = self.table.get(session_id)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {session_id!r} (released or expired)")
        return session

    @staticmethod
    def build(context: grpc.ServicerContext, make: Callable[[], Any]) -> Any:
        """`make()`, with a user error (unknown policy, bad parameters) as INVALID_ARGUMENT."""
        try:
            return make()
        except SpecdecError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    def Release(self, request, context):
        self.table.release(request.session_id)
        return pb.Empty()

    def Stats(self, request, context):
        sessions, requests = self.table.counts()
        return pb.WorkerStats(sessions=sessions, requests=requests)


class DraftServicer(SessionServicer, pb_grpc.DrafterServicer):
    def __init__(self, draft_model: Optional[torch.nn.Module], idle_timeout_s: float = 120.0):
        super().__init__(idle_timeout_s)
        self.draft_model = draft_model

    def Reset(self, request, context):
        spec = component_from_proto(request.drafter)
        drafter = self.build(context, lambda: make_drafter(spec.name, spec.params, self.draft_model))
        drafter.reset(list(request.prompt_ids), sampling_from_proto(request.sampling))
        self.table.put(request.session_id, (drafter, request.with_logits))
        return pb.Empty()

    def Propose(self, request, context):
        drafter, with_logits = self.session(request.session_id, context)
        if request.commit_tokens:
            drafter.commit(list(request.commit_tokens))
        block = drafter.propose(request.max_tokens)
        reply = pb.DraftReply(tokens=block.tokens.tolist())
        if block.sampled:
            reply.token_probs.extend(block.token_probs.tolist())
        if block.logits is not None and (with_logits or block.sampled):
            reply.logits.CopyFrom(tensor_to_proto(block.logits))
        return reply


class TargetServicer(SessionServicer, pb_grpc.TargetServicer):
    def __init__(self, target_model: torch.nn.Module, idle_timeout_s: float = 120.0):
        super().__init__(idle_timeout_s)
        self.target_model = target_model

    def Reset(self, request, context):
        spec = component_from_proto(request.policy)
        policy = self.build(context, lambda: make_policy(spec.name, spec.params))
        scorer = TargetScorer(self.target_model)
        scorer.reset(list(request.prompt_ids), policy, sampling_from_proto(request.sampling))
        self.table.put(request.session_id, scorer)
        return pb.Empty()

    def Score(self, request, context):
        scorer = self.session(request.session_id, context)
        if request.commit_keep > 0:
            scorer.commit(request.commit_keep)
        block = scorer.score(list(request.tokens))
        reply = pb.ScoreReply(vocab_size=block.vocab_size)
        top_k = scorer.policy.wire_top_k(scorer.sampling)
        if top_k is None:
            reply.logits.CopyFrom(tensor_to_proto(block.logits))
        else:
            ids, log_probs = compact_rows(block.logits, top_k)
            reply.top_ids.CopyFrom(tensor_to_proto(ids))
            reply.top_log_probs.CopyFrom(tensor_to_proto(log_probs))
        for name, tensor in block.features.items():
            reply.features[name].CopyFrom(tensor_to_proto(tensor))
        return reply


def start_server(
    servicer: Any, add_to_server: Callable, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.Server, int]:
    """Serve `servicer` on host:port (0 picks a free port), its handlers on the torch thread;
    returns the server and its port."""
    server = grpc.server(TORCH_THREAD, options=MESSAGE_LIMITS)
    add_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound
