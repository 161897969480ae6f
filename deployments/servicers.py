"""The gRPC services of the draft and target workers (`Drafter`, `Target` in
protos/specdec.proto). Each holds per-request sessions (sessions.py) over one model; a Ray actor
(worker.py) hosts one, and tests run them in-process."""

from __future__ import annotations

import functools
import json
import logging
from concurrent import futures
from typing import Any, Callable, Optional, Sequence

import grpc
import torch
from pydantic import ValidationError

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.compact import compact_rows, wire_top_k
from specdec_core.drafters import make_drafter, validate_drafter
from specdec_core.drafters.model import ModelDrafter, propose_together
from specdec_core.errors import SpecdecError, check_token_ids
from specdec_core.frontend import Frontend
from specdec_core.heads import HeadGuesses, Heads
from specdec_core.loader import ModelSpec
from specdec_core.memory import kv_bytes_per_token
from specdec_core.policies import make_policy
from specdec_core.profile import CalibrationSettings, TargetProfile, calibration_progress, measure_profile
from specdec_core.request import MAX_DRAFT_TOKENS
from specdec_core.sampling import SamplingParams
from specdec_core.target import PREFILL_CHUNK, Row, TargetScorer, forward_rows
from specdec_core.topologies import default_bank

from .admission import Admission, Overloaded
from .auth import RequireSecret
from .sessions import SessionTable
from .steps import PendingRow, StepBatcher, WorkerStopping, schedule
from .tensor_parallel import ControlChannel, GroupBroken
from .wire import component_from_proto, prompt_scores_to_proto, sampling_from_proto, tensor_to_proto

logger = logging.getLogger(__name__)

MESSAGE_LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]

# All torch work of a worker process runs on this one thread: every operation on the model
# (the handlers, on gRPC's pool, check their input and hand the work over) and model loading. It
# keeps one forward at a time on the shared model (the target's steps batch sessions), and it
# keeps OpenMP fast: every thread that runs a parallel region owns a team of OpenMP threads, and
# once the teams outnumber the cores libgomp stops spin-waiting, which doubled forward times when
# gRPC's pool threads ran them (docs/performance.md).
TORCH_THREAD = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
HANDLER_THREADS = 256  # handlers mostly wait for the torch thread; one per call in flight
MAX_BATCH_ROWS = 1 << 16


def on_torch_thread(call: Callable[..., Any], *args: Any) -> Any:
    """Run `call` on the torch thread and wait for its result."""
    return schedule(TORCH_THREAD, call, *args).result()


class SessionMissing(LookupError):
    """A call on a session that was released or expired (or died with a restarted worker)."""


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
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker's tensor-parallel group is down")
        except WorkerStopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
        except Exception:  # noqa: BLE001 - logged with the session id; the caller sees INTERNAL
            session_id = getattr(request, "session_id", "")
            logger.exception("%s failed for session %r", handler.__name__, session_id)
            context.abort(grpc.StatusCode.INTERNAL, f"{handler.__name__} failed (session {session_id!r})")

    return wrapper


class SessionServicer:
    """What both workers share: the session table, input checks, Release and Stats. Every token
    id, size and setting a worker receives is checked here as well as at the server, so a direct
    caller can neither crash a worker nor read past its vocabulary or cache.

    A handler checks its input, then `run`s an operation (a JSON-able dict) that `apply` carries
    out on the model, on the torch thread. In a tensor-parallel group (tensor_parallel.py) rank 0
    sends each operation to the other ranks first, which `apply` it too; its expired sessions are
    released on them."""

    def __init__(
        self,
        target_config: Any,
        idle_timeout_s: float,
        channel: Optional[ControlChannel] = None,
        admission: Optional[Admission] = None,
        model: Optional[torch.nn.Module] = None,
        batch_window_s: float = 0.005,
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        """`target_config`: the target model's config (the ids are the target's); `channel`: rank
        0's link to the other ranks of its group; `admission`: rank 0's, which reserves the KV
        bytes of `model` (this rank's shard of it) for every position a session can reach.
        The calls of different sessions share steps (steps.py): rank 0's batcher decides each
        step and sends it to the other ranks as one operation."""
        self.vocab_size = target_config.vocab_size
        self.max_positions = getattr(target_config, "max_position_embeddings", 1 << 20)
        self.channel = channel
        self.admission = admission
        self.kv_bytes_per_token = 0.0
        if model is not None:  # the KV cache holds activations: the embeddings' dtype
            tp_size = channel.size if channel is not None else 1
            width = model.get_input_embeddings().weight.element_size()
            self.kv_bytes_per_token = kv_bytes_per_token(model.config, tp_size, width)
        self.table = SessionTable(idle_timeout_s, self.on_expire)
        self.batcher = StepBatcher(
            TORCH_THREAD,
            run_step=lambda rows: self.run({"op": "step", "rows": rows}),
            check_row=self.check_row,
            open_sessions=self.sessions_in_steps,
            window_s=batch_window_s,
            chunk=prefill_chunk,
        )

    def sessions_in_steps(self) -> int:
        """How many rows a full step holds: a step waits (`batch_window_ms`) for that many."""
        return self.table.counts()[0]

    def on_expire(self, session_id: str) -> None:
        if self.admission is not None:
            self.admission.release(session_id)
        if self.channel is not None:  # sends keep their order with the operations on the torch thread
            TORCH_THREAD.submit(self.channel.send, {"op": "release", "session_id": session_id})

    def open_session(
        self, session_id: str, prompt_ids: list[int], sampling: SamplingParams, op: dict, extra_bytes_per_token=0.0
    ) -> Any:
        """Admit a session (reserving KV memory for the most it can reach, plus what it keeps per
        position beside the model's cache, `extra_bytes_per_token`), then `run` the op that opens
        it; a failed open frees its reservation."""
        max_len = self.max_len(prompt_ids, sampling)
        if self.admission is not None:
            self.admission.admit(session_id, max_len * (self.kv_bytes_per_token + extra_bytes_per_token))
        try:
            return self.call(op)
        except BaseException:
            if self.admission is not None:
                self.admission.release(session_id)
            raise

    def max_len(self, prompt_ids: list[int], sampling: SamplingParams) -> int:
        """The positions a session can fill: its prompt, its tokens, one block of drafts (a
        request of open length: the context)."""
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else self.max_positions
        return min(len(prompt_ids) + max_tokens + MAX_DRAFT_TOKENS + 1, self.max_positions)

    def call(self, op: dict) -> Any:
        """`run` an operation on the torch thread and wait for its result (a handler's way)."""
        return on_torch_thread(self.run, op)

    def run(self, op: dict) -> Any:
        if self.channel is not None:
            self.channel.send(op)
        return self.apply(op)

    def apply(self, op: dict) -> Any:
        """Carry out an operation (`op["op"]` names the method `op_<name>`, the rest its arguments)."""
        name, arguments = op["op"], {key: value for key, value in op.items() if key != "op"}
        return getattr(self, f"op_{name}")(**arguments)

    def op_release(self, session_id: str) -> None:
        self.table.release(session_id)
        if self.admission is not None:
            self.admission.release(session_id)

    def session(self, session_id: str) -> Any:
        session = self.table.get(session_id)
        if session is None:
            raise SessionMissing(f"no session {session_id!r} (released or expired)")
        return session

    def check_tokens(self, tokens: Sequence[int], param: str, min_count: int, max_count: int) -> list[int]:
        if not min_count <= len(tokens) <= max_count:
            raise SpecdecError(f"{param} must hold {min_count} to {max_count} tokens, got {len(tokens)}")
        check_token_ids(tokens, self.vocab_size, param)
        return list(tokens)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        return self.check_tokens(prompt_ids, "prompt_ids", 1, self.max_positions - 1)

    @checked
    def Release(self, request, context):
        self.call({"op": "release", "session_id": request.session_id})
        return pb.Empty()

    @checked
    def Stats(self, request, context):
        sessions, requests = self.table.counts()
        reserved = self.admission.reserved_bytes if self.admission is not None else 0.0
        return pb.WorkerStats(
            sessions=sessions,
            requests=requests,
            kv_reserved_bytes=reserved,
            steps=self.batcher.steps,
            step_rows=self.batcher.rows,
        )

    def check_row(self, row: PendingRow) -> None:
        """What a row may do given its session's state (on the torch thread, before its step);
        raises for a row that may not run, and may set the row's `reply`."""
        raise NotImplementedError


class DraftServicer(SessionServicer, pb_grpc.DrafterServicer):
    """Propose calls of different sessions share steps: the draft-model forwards of their
    proposals run in lockstep (`propose_together`)."""

    def __init__(
        self,
        draft_model: Optional[torch.nn.Module],
        target_config: Any,
        idle_timeout_s: float = 120.0,
        channel: Optional[ControlChannel] = None,
        admission: Optional[Admission] = None,
        batch_window_s: float = 0.005,
    ):
        super().__init__(target_config, idle_timeout_s, channel, admission, draft_model, batch_window_s)
        self.draft_model = draft_model

    @checked
    def Reset(self, request, context):
        spec = component_from_proto(request.drafter)
        validate_drafter(spec.name, spec.params)
        prompt_ids, sampling = self.check_prompt(request.prompt_ids), sampling_from_proto(request.sampling).seeded()
        op = {
            "op": "reset",
            "session_id": request.session_id,
            "prompt_ids": prompt_ids,
            "drafter": spec.model_dump(),
            "sampling": sampling.model_dump(),
            "with_logits": request.with_logits,
        }
        self.open_session(request.session_id, prompt_ids, sampling, op)
        return pb.Empty()

    def op_reset(
        self, session_id: str, prompt_ids: list[int], drafter: dict, sampling: dict, with_logits: bool
    ) -> None:
        drafter_session = make_drafter(drafter["name"], drafter["params"], self.draft_model)
        drafter_session.reset(prompt_ids, SamplingParams(**sampling))
        self.table.put(session_id, (drafter_session, with_logits))

    @checked
    def Propose(self, request, context):
        self.session(request.session_id)
        if not 0 <= request.max_tokens <= MAX_DRAFT_TOKENS:
            raise SpecdecError(f"max_tokens must lie in [0, {MAX_DRAFT_TOKENS}]")
        commit_tokens = self.check_tokens(request.commit_tokens, "commit_tokens", 0, MAX_DRAFT_TOKENS + 1)
        if not 0 <= request.batch_rows <= MAX_BATCH_ROWS:
            raise SpecdecError(f"batch_rows must lie in [0, {MAX_BATCH_ROWS}]")
        batch_rows = max(1, request.batch_rows)
        future = self.batcher.submit(
            request.session_id, max_tokens=request.max_tokens, commit_tokens=commit_tokens, batch_rows=batch_rows
        )
        return future.result()

    def sessions_in_steps(self) -> int:
        # only chain model drafters share a step's forwards: a lookup row never waits for companions
        return self.table.count(lambda session: isinstance(session[0], ModelDrafter))

    def check_row(self, row: PendingRow) -> None:
        _, with_logits = self.session(row.session_id)
        row.reply = functools.partial(self.reply, with_logits)

    @staticmethod
    def reply(with_logits: bool, block) -> pb.DraftReply:
        reply = pb.DraftReply(tokens=block.tokens.tolist(), tree=block.tree.name if block.tree is not None else "")
        if block.sampled:
            reply.token_probs.extend(block.token_probs.tolist())
        if block.logits is not None and (with_logits or block.sampled):
            reply.logits.CopyFrom(tensor_to_proto(block.logits))
        return reply

    def op_step(self, rows: list[dict]) -> list:
        """One step over the rows' proposals (after their commits): model drafters' forwards in
        lockstep, the others on their own."""
        drafters, proposals = [], []
        for row in rows:
            drafter_session, _ = self.session(row["session_id"])
            if row["commit_tokens"]:
                drafter_session.commit(row["commit_tokens"])
            drafters.append(drafter_session)
            if isinstance(drafter_session, ModelDrafter):
                proposals.append(drafter_session.drafting(row["max_tokens"], row["batch_rows"]))
        blocks = iter(propose_together(self.draft_model, proposals) if proposals else ())
        return [
            next(blocks) if isinstance(drafter, ModelDrafter) else drafter.propose(row["max_tokens"], row["batch_rows"])
            for drafter, row in zip(drafters, rows)
        ]


class TargetServicer(SessionServicer, pb_grpc.TargetServicer):
    """Score calls and prompt chunks of different sessions share forwards (`forward_rows`)."""

    def __init__(
        self,
        target_model: torch.nn.Module,
        idle_timeout_s: float = 120.0,
        profile: Optional[TargetProfile] = None,
        channel: Optional[ControlChannel] = None,
        batch_window_s: float = 0.005,
        prefill_chunk: int = PREFILL_CHUNK,
        admission: Optional[Admission] = None,
        heads: Optional[Heads] = None,
    ):
        """`profile`: the target's, measured at load (the defaults of policies that need one);
        `heads`: its multi-token heads (drafter `heads`), on its device."""
        super().__init__(
            target_model.config, idle_timeout_s, channel, admission, target_model, batch_window_s, prefill_chunk
        )
        self.target_model = target_model
        self.profile = profile
        self.heads = heads

    @checked
    def Profile(self, request, context):
        return pb.TargetProfileReply(
            profile_json=self.profile.model_dump_json() if self.profile else "",
            num_heads=self.heads.num_heads if self.heads is not None else 0,
        )

    @checked
    def Reset(self, request, context):
        spec = component_from_proto(request.policy)
        policy = make_policy(spec.name, spec.params)
        if policy.needs_profile:
            policy = policy.for_target(self.profile)
        prompt_ids, sampling = self.check_prompt(request.prompt_ids), sampling_from_proto(request.sampling).seeded()
        if request.with_heads and self.heads is None:
            raise SpecdecError("this target has no multi-token heads")
        op = {
            "op": "reset",
            "session_id": request.session_id,
            "prompt_ids": prompt_ids,
            "policy": {"name": policy.name, "params": json.loads(policy.params.model_dump_json())},
            "sampling": sampling.model_dump(),
            "with_heads": request.with_heads,
        }
        heads_bytes = self.heads.cache_bytes_per_token() if request.with_heads else 0.0
        prefill = self.open_session(request.session_id, prompt_ids, sampling, op, heads_bytes)
        if prefill:
            self.batcher.submit(request.session_id, tokens=prefill, prefill=True).result()
        scores = self.session(request.session_id).prompt_scores()
        return pb.TargetResetReply(prompt=prompt_scores_to_proto(scores) if scores is not None else None)

    def op_measure_profile(self, spec: dict, settings: dict) -> TargetProfile:
        """Measure the target's profile (every rank of a group runs the same forwards)."""
        model_spec = ModelSpec(**spec)
        frontend = Frontend.from_spec(model_spec)
        progress = calibration_progress(model_spec.source)
        self.profile = measure_profile(self.target_model, frontend, CalibrationSettings(**settings), progress)
        return self.profile

    def op_reset(
        self, session_id: str, prompt_ids: list[int], policy: dict, sampling: dict, with_heads: bool
    ) -> list[int]:
        """Open the session; returns the prompt tokens to prefill (in steps)."""
        scorer = TargetScorer(self.target_model, self.heads)
        policy_object = make_policy(policy["name"], policy["params"])
        prefill = scorer.start(prompt_ids, policy_object, SamplingParams(**sampling), with_heads)
        self.table.put(session_id, scorer)
        return prefill

    @checked
    def Score(self, request, context):
        tokens = self.check_tokens(request.tokens, "tokens", 1, MAX_DRAFT_TOKENS + 1)  # [last, drafts]
        if request.tree:
            tree = known_tree(request.tree)
            if len(tokens) != tree.num_nodes + 1:
                raise SpecdecError(f"tree {tree.name!r} takes {tree.num_nodes + 1} tokens (root and nodes)")
        future = self.batcher.submit(
            request.session_id,
            tokens=tokens,
            prefill=False,
            commit_keep=request.commit_keep,
            commit_path=list(request.commit_path),
            tree=request.tree,
        )
        return future.result()

    def check_row(self, row: PendingRow) -> None:
        scorer = self.session(row.session_id)
        if row.prefill:
            return
        commit_keep, commit_path, tokens = row.fields["commit_keep"], row.fields["commit_path"], row.fields["tokens"]
        self.check_commit(scorer, commit_keep, commit_path)
        if scorer.committed_len + commit_keep + len(commit_path) + len(tokens) > self.max_positions:
            raise SpecdecError(f"the session would exceed {self.max_positions} positions")
        row.reply = functools.partial(self.reply, scorer)

    @staticmethod
    def check_commit(scorer: TargetScorer, commit_keep: int, commit_path: Sequence[int]) -> None:
        """A commit of the last Score's tokens: at most those, or a root-first path of its tree."""
        if not 0 <= commit_keep <= scorer.num_scored:
            raise SpecdecError(f"commit_keep must lie in [0, {scorer.num_scored}] (the tokens last scored)")
        if commit_path:
            tree = scorer.scored_tree
            parents = tree.parents.tolist() if tree is not None else []
            if (
                commit_keep
                or not tree
                or commit_path[0] != 0
                or any(
                    not 0 < node < len(parents) or parents[node] != parent
                    for parent, node in zip(commit_path, commit_path[1:])
                )
            ):
                raise SpecdecError("commit_path must be a root-first path of the tree last scored")

    def reply(self, scorer: TargetScorer, block) -> pb.ScoreReply:
        """The compact answer to a Score call (on the torch thread: it computes top-k rows)."""
        reply = pb.ScoreReply(vocab_size=block.vocab_size, step_rows=block.batch_rows)
        # a top-k row with its stop tokens masked would be flat where they led: ship it whole
        top_k = None if scorer.within_min_tokens() else wire_top_k(scorer.policy, scorer.sampling)
        if top_k is None:
            reply.logits.CopyFrom(tensor_to_proto(block.logits))
        else:
            ids, log_probs = compact_rows(block.logits, top_k)
            reply.top_ids.CopyFrom(tensor_to_proto(ids))
            reply.top_log_probs.CopyFrom(tensor_to_proto(log_probs))
        for name, tensor in block.features.items():
            reply.features[name].CopyFrom(tensor_to_proto(tensor))
        if block.token_log_probs is not None:
            reply.token_log_probs.CopyFrom(tensor_to_proto(block.token_log_probs))
        return reply

    @checked
    def Heads(self, request, context):
        if self.session(request.session_id).heads_session is None:
            raise SpecdecError("this session was not reset with_heads")
        check_token_ids([request.root_token], self.vocab_size, "root_token")
        if request.tree not in default_bank():
            raise SpecdecError(f"unknown tree {request.tree!r}")
        op = {
            "op": "guess",
            "session_id": request.session_id,
            "commit_keep": request.commit_keep,
            "commit_path": list(request.commit_path),
            "root_token": request.root_token,
            "tree": request.tree,
        }
        guesses = self.call(op)
        if guesses is None:
            return pb.HeadsReply()
        return pb.HeadsReply(
            tokens=tensor_to_proto(guesses.tokens),
            top_probs=guesses.top_probs.tolist(),
            root_prob=guesses.root_prob,
            tree=guesses.tree.name,
        )

    def op_guess(
        self, session_id: str, commit_keep: int, commit_path: list[int], root_token: int, tree: str
    ) -> Optional[HeadGuesses]:
        """Apply the last Score's commit, then the heads' guesses after it."""
        scorer = self.session(session_id)
        self.check_commit(scorer, commit_keep, commit_path)
        self.apply_commit(scorer, commit_keep, commit_path)
        return scorer.guess(root_token, tree)

    @staticmethod
    def apply_commit(scorer: TargetScorer, commit_keep: int, commit_path: Sequence[int]) -> None:
        if commit_keep:
            scorer.commit(commit_keep)
        if commit_path:
            scorer.commit_path(commit_path)
        scorer.num_scored, scorer.scored_tree = 0, None  # committed once

    def op_step(self, rows: list[dict]) -> list:
        """One forward over the rows of a step: verify blocks (after their commits) and prompt chunks."""
        step = []
        for row in rows:
            scorer = self.session(row["session_id"])
            if not row["prefill"]:
                self.apply_commit(scorer, row["commit_keep"], row["commit_path"])
            tree = known_tree(row["tree"]) if row.get("tree") else None
            step.append(Row(scorer, row["tokens"], prefill=row["prefill"], tree=tree))
        return forward_rows(step)


def known_tree(name: str):
    """A named tree (specdec_core/topologies.py); an unknown name is the caller's error."""
    try:
        return default_bank().get(name)
    except KeyError as error:
        raise SpecdecError(str(error.args[0])) from None


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
