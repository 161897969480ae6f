"""Draft and target workers: gRPC services holding per-request sessions (own KV state), keyed
by request id and freed on Release, or after `idle_timeout_s` without a call. The Ray actors
in deployments/app.py host one each; tests run them in-process."""

from __future__ import annotations

import threading
import time
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

from .wire import component_from_proto, sampling_from_proto, tensor_to_proto


class SessionTable:
    """Sessions by id with last-use times; a sweeper thread drops idle ones."""

    def __init__(self, idle_timeout_s: float):
        self.sessions: dict[str, Any] = {}
        self.last_used: dict[str, float] = {}
        self.lock = threading.Lock()
        self.idle_timeout_s = idle_timeout_s
        self.requests = 0
        self.stopped = threading.Event()
        threading.Thread(target=self._sweep, daemon=True).start()

    def put(self, session_id: str, session: Any) -> None:
        with self.lock:
            self.sessions[session_id] = session
            self.last_used[session_id] = time.monotonic()
            self.requests += 1

    def get(self, session_id: str, context: grpc.ServicerContext) -> Any:
        with self.lock:
            session = self.sessions.get(session_id)
            if session is not None:
                self.last_used[session_id] = time.monotonic()
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {session_id!r} (released or expired)")
        return session

    def release(self, session_id: str) -> None:
        with self.lock:
            self.sessions.pop(session_id, None)
            self.last_used.pop(session_id, None)

    def stats(self) -> pb.WorkerStats:
        with self.lock:
            return pb.WorkerStats(sessions=len(self.sessions), requests=self.requests)

    def _sweep(self) -> None:
        while not self.stopped.wait(min(1.0, self.idle_timeout_s / 4)):
            now = time.monotonic()
            with self.lock:
                for session_id in [sid for sid, used in self.last_used.items() if now - used > self.idle_timeout_s]:
                    self.sessions.pop(session_id, None)
                    self.last_used.pop(session_id, None)


def invalid_argument(context: grpc.ServicerContext, call: Callable[[], Any]) -> Any:
    """Run `call`; user errors become INVALID_ARGUMENT with the message, not a crash."""
    try:
        return call()
    except SpecdecError as error:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


# All torch work of a worker process runs on this one thread: the gRPC handlers (it is the
# servers' pool) and model loading. It keeps one forward at a time on the shared model (sessions
# interleave step by step), and it keeps OpenMP fast: every thread that runs a parallel region
# owns a team of OpenMP threads, and once the teams outnumber the cores libgomp stops
# spin-waiting, which made a forward run from gRPC's 8 pool threads take twice as long
# (31 -> 58 ms for a 3-token SmolLM2 verify on 2 cores). Handing each call from a pool thread
# to a torch thread instead costs ~1.5 ms per call.
TORCH_THREAD = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")


def on_torch_thread(call: Callable[..., Any], *args: Any) -> Any:
    """Run `call` on the torch thread from another thread (setup; handlers already run there)."""
    return TORCH_THREAD.submit(call, *args).result()


class SessionServicer:
    """What both workers share: the session table, Release and Stats."""

    def __init__(self, idle_timeout_s: float):
        self.table = SessionTable(idle_timeout_s)

    def Release(self, request, context):
        self.table.release(request.session_id)
        return pb.Empty()

    def Stats(self, request, context):
        return self.table.stats()


class DraftServicer(SessionServicer, pb_grpc.DrafterServicer):
    def __init__(self, draft_model: Optional[torch.nn.Module], idle_timeout_s: float = 120.0):
        super().__init__(idle_timeout_s)
        self.draft_model = draft_model

    def Reset(self, request, context):
        spec = component_from_proto(request.drafter)
        drafter = invalid_argument(context, lambda: make_drafter(spec.name, spec.params, self.draft_model))
        sampling = sampling_from_proto(request.sampling)
        drafter.reset(list(request.prompt_ids), sampling, torch.Generator().manual_seed(sampling.seed + 1))
        self.table.put(request.session_id, (drafter, request.with_logits))
        return pb.Empty()

    def Propose(self, request, context):
        drafter, with_logits = self.table.get(request.session_id, context)
        block = self.commit_and_propose(drafter, list(request.commit_tokens), request.max_tokens)
        reply = pb.DraftReply(tokens=block.tokens.tolist())
        if block.sampled:
            reply.token_probs.extend(block.token_probs.tolist())
        if block.logits is not None and (with_logits or block.sampled):
            reply.logits.CopyFrom(tensor_to_proto(block.logits))
        return reply

    @staticmethod
    def commit_and_propose(drafter, commit_tokens: list[int], max_tokens: int):
        if commit_tokens:
            drafter.commit(commit_tokens)
        return drafter.propose(max_tokens)

    def Commit(self, request, context):
        drafter, _ = self.table.get(request.session_id, context)
        drafter.commit(list(request.new_tokens))
        return pb.Empty()


class TargetServicer(SessionServicer, pb_grpc.TargetServicer):
    def __init__(self, target_model: torch.nn.Module, idle_timeout_s: float = 120.0):
        super().__init__(idle_timeout_s)
        self.target_model = target_model

    def Reset(self, request, context):
        spec = component_from_proto(request.policy)
        policy = invalid_argument(context, lambda: make_policy(spec.name, spec.params))
        scorer = TargetScorer(self.target_model)
        scorer.reset(list(request.prompt_ids), policy, sampling_from_proto(request.sampling))
        self.table.put(request.session_id, scorer)
        return pb.Empty()

    def Score(self, request, context):
        scorer = self.table.get(request.session_id, context)
        return self.commit_and_score(scorer, request.commit_keep, list(request.tokens))

    @staticmethod
    def commit_and_score(scorer: TargetScorer, commit_keep: int, tokens: list[int]) -> pb.ScoreReply:
        if commit_keep > 0:
            scorer.commit(commit_keep)
        block = scorer.score(tokens)
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

    def Commit(self, request, context):
        self.table.get(request.session_id, context).commit(request.num_keep)
        return pb.Empty()


def start_server(servicer: Any, add_to_server: Callable, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, int]:
    """Serve `servicer` on host:port (0 picks a free port), its handlers on the torch thread;
    returns the server and its port."""
    server = grpc.server(
        TORCH_THREAD,
        options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)],
    )
    add_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound
