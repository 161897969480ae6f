"""The gRPC services of the draft and target workers (`Drafter`, `Target` in
protos/specdec.proto): each converts protos to and from its worker service's calls
(draft_service.py, target_service.py) and maps errors to status codes. A Ray actor (worker.py)
hosts one; tests run them in-process."""

from __future__ import annotations

import functools
import logging
import threading
from concurrent import futures
from typing import Any, Callable, Optional

import grpc
from pydantic import ValidationError

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.api.errors import GroupBroken, SpecdecError

from ..coordination.wire import (
    component_from_proto,
    prompt_scores_to_proto,
    sampling_from_proto,
    tensor_to_proto,
    verdict_to_proto,
    wire_tensor,
)
from ..ingress.auth import RequireSecret
from .admission import Overloaded
from .block_forwarder import BlockForwarder
from .draft_service import DraftService
from .forwarded_blocks import ForwardedBlock
from .steps import WorkerStopping
from .target_service import TargetService
from .worker_ops import Release
from .worker_service import SessionMissing

logger = logging.getLogger(__name__)

# a Score answers this long before its deadline at the latest, held where not ready (held_answers.py)
HELD_MARGIN_S = 1.0
MESSAGE_LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
HANDLER_THREADS = 256  # handlers mostly wait for the torch thread; one per call in flight


def checked(handler: Callable) -> Callable:
    """A handler whose bad input (SpecdecError, a field out of range) is INVALID_ARGUMENT and whose
    bugs are INTERNAL with a short message (the traceback is logged here, never sent)."""

    @functools.wraps(handler)
    def wrapper(self, request, context):
        try:
            return handler(self, request, context)
        except (SpecdecError, ValidationError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except SessionMissing as error:
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except Overloaded as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the worker is at capacity: {error}")
        except GroupBroken as error:
            logger.error("%s: %s", handler.__name__, error)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's group of ranks is down")
        except WorkerStopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
        except Exception:  # noqa: BLE001 - logged with the session id; the caller sees INTERNAL
            session_id = getattr(request, "session_id", "")
            logger.exception("%s failed for session %r", handler.__name__, session_id)
            context.abort(grpc.StatusCode.INTERNAL, f"{handler.__name__} failed (session {session_id!r})")

    return wrapper


class SessionServicer:
    """What both services answer alike: Release and Stats."""

    def __init__(self, service: Any):
        self.service = service

    @checked
    def Release(self, request, context):
        self.service.call(Release(session_id=request.session_id, commit_tokens=list(request.commit_tokens)))
        return pb.Empty()

    @checked
    def Stats(self, request, context):
        return pb.WorkerStats(**self.service.stats())


class DraftServicer(SessionServicer, pb_grpc.DrafterServicer):
    service: DraftService

    def __init__(self, service: DraftService, secret: Optional[str] = None):
        """`secret`: the workers' shared secret, sent with the blocks forwarded to a target."""
        super().__init__(service)
        self.forwarder = BlockForwarder(secret)

    @checked
    def Reset(self, request, context):
        drafter, sampling = component_from_proto(request.drafter), sampling_from_proto(request.sampling)
        self.service.reset(request.session_id, list(request.prompt_ids), drafter, sampling, request.with_logits)
        return pb.Empty()

    @checked
    def Propose(self, request, context):
        block, with_logits = self.service.propose(
            request.session_id,
            request.max_tokens,
            list(request.commit_tokens),
            request.batch_rows,
            list(request.after_tokens),
        )
        reply = pb.DraftReply(tokens=block.tokens.tolist(), tree=block.tree.name if block.tree is not None else "")
        if request.HasField("forward") and request.after_tokens and block.num_tokens > 1:
            self.forwarder.forward(request, block)
        if block.sampled:
            reply.token_probs.extend(block.token_probs.tolist())
        if block.logits is not None and (with_logits or block.sampled):
            reply.logits.CopyFrom(tensor_to_proto(block.logits))
        return reply


class TargetServicer(SessionServicer, pb_grpc.TargetServicer):
    service: TargetService

    @checked
    def Profile(self, request, context):
        profile, heads = self.service.profile, self.service.heads
        return pb.TargetProfileReply(
            profile_json=profile.model_dump_json() if profile else "",
            heads={kind: held.num_heads for kind, held in heads.items()},
            device_type=self.service.target_model.device.type,
        )

    @checked
    def Reset(self, request, context):
        policy, sampling = component_from_proto(request.policy), sampling_from_proto(request.sampling)
        prefilled = self.service.reset(
            request.session_id,
            list(request.prompt_ids),
            policy,
            sampling,
            request.heads_kind or None,
            request.takes_forwarded,
            list(request.stop_ids) if request.decides_verdicts else None,
        )
        scores = prefilled.prompt_scores
        return pb.TargetResetReply(
            prompt=prompt_scores_to_proto(scores) if scores is not None else None,
            prefix_cache_queries=prefilled.prefix_cache_queries,
            prefix_cache_hits=prefilled.prefix_cache_hits,
            decides_verdicts=prefilled.decides_verdicts,
            takes_forwarded=self.service.forwarded.takes(request.session_id),
        )

    @checked
    def Score(self, request, context):
        remaining = context.time_remaining()  # a call without a deadline has years left
        wait_s = None if remaining is None else min(max(remaining - HELD_MARGIN_S, 0.0), threading.TIMEOUT_MAX)
        if request.awaits_held:
            scored = self.service.score_held(request.session_id, wait_s)
        else:
            tokens, commit_path = list(request.tokens), list(request.commit_path)
            scored = self.service.score(
                request.session_id,
                tokens,
                request.commit_keep,
                commit_path,
                request.tree,
                wait_s,
                list(request.draft_token_probs),
                wire_tensor(request, "draft_logits"),
            )
        if scored is None:
            return pb.ScoreReply(held=True)
        block = scored.block
        reply = pb.ScoreReply(
            vocab_size=block.vocab_size,
            step_rows=block.batch_rows,
            forwarded=scored.forwarded,
            preemptions=block.preemptions,
        )
        if block.verdict is not None:
            reply.verdict.CopyFrom(verdict_to_proto(block.verdict))
        elif scored.top_ids is None:
            reply.logits.CopyFrom(tensor_to_proto(block.logits))
        else:
            reply.top_ids.CopyFrom(tensor_to_proto(scored.top_ids))
            reply.top_log_probs.CopyFrom(tensor_to_proto(scored.top_log_probs))
        for name, tensor in block.features.items():
            reply.features[name].CopyFrom(tensor_to_proto(tensor))
        if block.token_log_probs is not None:
            reply.token_log_probs.CopyFrom(tensor_to_proto(block.token_log_probs))
        return reply

    @checked
    def Forward(self, request, context):
        block = ForwardedBlock(
            request.after_length,
            list(request.assumed),
            list(request.tokens),
            request.tree,
            drafts_as_scored=request.drafts_as_scored,
        )
        logits = wire_tensor(request, "draft_logits")
        self.service.forward(request.session_id, block, list(request.draft_token_probs), logits)
        return pb.Empty()

    @checked
    def Heads(self, request, context):
        guesses = self.service.guess(
            request.session_id, request.commit_keep, list(request.commit_path), request.root_token, request.tree
        )
        if guesses is None:
            return pb.HeadsReply()
        return pb.HeadsReply(
            tokens=tensor_to_proto(guesses.tokens),
            node_probs=guesses.node_probs.tolist(),
            top_probs=guesses.top_probs.tolist(),
            root_prob=guesses.root_prob,
            tree=guesses.tree.name,
        )


def start_server(
    servicer: Any, add_to_server: Callable, host: str = "127.0.0.1", port: int = 0, secret: Optional[str] = None
) -> tuple[grpc.Server, int]:
    """Serve `servicer` on host:port (0 picks a free port) to callers that hold `secret` (when
    given); returns the server and its port."""
    interceptors = [RequireSecret(secret)] if secret else []
    handlers = futures.ThreadPoolExecutor(max_workers=HANDLER_THREADS, thread_name_prefix="grpc-handler")
    server = grpc.server(handlers, interceptors=interceptors, options=MESSAGE_LIMITS)
    add_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound
