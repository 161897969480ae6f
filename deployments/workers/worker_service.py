"""What a worker does with its model, apart from the wire: per-request sessions (session_table.py), the
checks of everything a caller sends, KV admission, and the operations (worker_ops.py) that touch
the model, run on the one torch thread. The gRPC servicers (servicers.py) convert protos to and
from these calls; a tensor-parallel group's rank 0 sends each operation to its other ranks first,
which `apply` it too (tensor_parallel.py). An operation that fails on one rank but may not have on
another leaves the ranks' sessions and caches apart: that group is broken, and Serve rebuilds it."""

from __future__ import annotations

import logging
import os
from concurrent import futures
from typing import Any, Callable, Optional, Sequence

import torch
from pydantic import ValidationError

from specdec_core.api.errors import GroupBroken, SpecdecError, check_token_ids
from specdec_core.api.request import session_positions
from specdec_core.api.sampling import SamplingParams
from specdec_core.planning.memory import kv_bytes_per_token
from specdec_core.runtime.batching import fix_pool, kv_cache_dtype
from specdec_core.runtime.kv_pool import BLOCK_SIZE, KVPoolExhausted, blocks_for
from specdec_core.runtime.model_runner import runner_of
from specdec_core.target.scorer import PREFILL_CHUNK

from .admission import Admission
from .session_table import SessionTable
from .steps import PendingRow, StepBatcher, schedule
from .tensor_parallel import ControlChannel, group_gone
from .worker_ops import Message, Release

logger = logging.getLogger(__name__)

# All torch work of a worker process runs on this one thread: every operation on the model
# (the handlers, on gRPC's pool, check their input and hand the work over) and model loading. It
# keeps one forward at a time on the shared model (the target's steps batch sessions), and it
# keeps OpenMP fast: every thread that runs a parallel region owns a team of OpenMP threads, and
# once the teams outnumber the cores libgomp stops spin-waiting, which doubled forward times when
# gRPC's pool threads ran them (docs/architecture.md, "Why the CPU kernels").
TORCH_THREAD = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
MAX_BATCH_ROWS = 1 << 16


def on_torch_thread(call: Callable[..., Any], *args: Any) -> Any:
    """Run `call` on the torch thread and wait for its result."""
    return schedule(TORCH_THREAD, call, *args).result()


class SessionMissing(LookupError):
    """A call on a session that was released or expired (or died with a restarted worker)."""

    def __init__(self, session_id: str):
        super().__init__(f"no session {session_id!r} (released or expired)")


# What an operation raises alike on every rank of a group: errors that follow from the operation
# and from what every rank holds alike (its sessions, its pool), so its ranks stay in step. Any
# other failure (out of memory, a graph that failed to record, a bug) may have struck one rank
# only, after which the ranks' sessions and caches may differ.
ALIKE_ON_EVERY_RANK = (SpecdecError, SessionMissing, KVPoolExhausted, ValidationError)
FAILED_ALONE_EXIT = 70  # a follower's exit status after such a failure (EX_SOFTWARE)


class WorkerService:
    """What both workers share: the session table, input checks, admission, release and stats.
    Every token id, size and setting a worker receives is checked here as well as at the server,
    so a direct caller can neither crash a worker nor read past its vocabulary or cache. A call
    checks its input, then `run`s an operation that `apply` carries out on the torch thread."""

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
        0's link to the other ranks of its group; `admission`: this rank's KV budget, the size
        of its pool, allocated once; rank 0 admits by it, reserving the KV bytes of `model` (this
        rank's shard of it) for every position a session can reach.
        The calls of different sessions share steps (steps.py): rank 0's batcher decides each
        step and sends it to the other ranks as one operation."""
        self.vocab_size = target_config.vocab_size
        self.max_positions = getattr(target_config, "max_position_embeddings", 1 << 20)
        self.channel = channel
        self.admission = admission
        # set: why this rank's group can serve no more (its health check fails: Serve rebuilds it)
        self.broken: Optional[str] = None
        self.kv_bytes_per_token = 0.0
        if model is not None:
            # this rank's share of the KV heads: its stage's tp ranks, alike on every rank of the group
            # (every rank's pool then holds as many blocks, so a full pool is full on all of them)
            width = kv_cache_dtype(model).itemsize
            self.kv_bytes_per_token = kv_bytes_per_token(model.config, runner_of(model.model).tp_ranks, width)
            if admission is not None and admission.budget_bytes is not None:
                fix_pool(model, admission.budget_bytes, self.kv_bytes_per_token)
        self.table = SessionTable(idle_timeout_s, self.on_expire)
        self.batcher = StepBatcher(
            TORCH_THREAD,
            run_step=lambda rows: self.run(self.step_of(rows)),
            check_row=self.check_row,
            open_sessions=self.sessions_in_steps,
            window_s=batch_window_s,
            chunk=prefill_chunk,
            settle=self.settle_step,
        )
        self.operations: dict[type, Callable[[Any], Any]] = {Release: self.release}

    def sessions_in_steps(self) -> int:
        """How many rows a full step holds: a step waits (`batch_window_ms`) for that many."""
        return self.table.counts()[0]

    def on_expire(self, session_id: str) -> None:
        if self.admission is not None:
            self.admission.release(session_id)
        TORCH_THREAD.submit(self.expired, session_id)

    def expired(self, session_id: str) -> None:
        """On the torch thread, in order with the operations: the other ranks release it too
        (unless the group is broken: they may be waiting in another operation's collective)."""
        if self.channel is not None and self.broken is None:
            self.channel.send(Release(session_id=session_id))

    def open_session(self, op: Message, extra_bytes_per_token: float = 0.0) -> Any:
        """Admit the session `op` opens (reserving KV memory for the most it can reach, plus what
        it keeps per position beside the model's cache), then `run` `op`; a failed open frees
        its reservation. A broken group opens none (GroupBroken, not a full budget)."""
        self.check_unbroken()
        max_len = self.max_len(op.prompt_ids, op.sampling)
        if self.admission is not None:
            self.admission.admit(op.session_id, max_len * (self.kv_bytes_per_token + extra_bytes_per_token))
        try:
            return self.call(op)
        except BaseException:
            if self.admission is not None:
                self.admission.release(op.session_id)
            raise

    def max_len(self, prompt_ids: list[int], sampling: SamplingParams) -> int:
        """The positions a session can fill (`session_positions`; a request of open length: the
        context), in whole blocks of the KV pool: what its cache can take from it."""
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else self.max_positions
        positions = min(session_positions(len(prompt_ids), max_tokens), self.max_positions)
        return blocks_for(positions, BLOCK_SIZE) * BLOCK_SIZE

    def call(self, op: Message) -> Any:
        """`run` an operation on the torch thread and wait for its result (a handler's way)."""
        return on_torch_thread(self.run, op)

    def run(self, op: Message) -> Any:
        """Carry out `op` here and, first, have the group's other ranks carry it out (rank 0). An
        operation that fails as it would on every rank (`ALIKE_ON_EVERY_RANK`) is the caller's
        error; any other failure breaks the group: its ranks may no longer hold the same state,
        so it runs nothing more (the operation's caller gets the error, later ones GroupBroken)."""
        if self.channel is None:
            return self.apply(op)
        self.check_unbroken()
        try:
            self.channel.send(op)
            return self.apply(op)
        except ALIKE_ON_EVERY_RANK:
            raise
        except Exception as error:
            gone = group_gone(error)
            if self.broken is None:  # the first cause (an operation inside this one may have set it)
                self.broken = str(gone or f"operation {op.op} failed on rank 0, maybe alone: {error!r}")
            if gone is not None:  # a collective inside it, where a peer died or left meanwhile
                raise gone from None
            raise

    def check_unbroken(self) -> None:
        """Raises GroupBroken where this rank's group can serve no more (its health check's test)."""
        if self.broken is not None:
            raise GroupBroken(self.broken)

    def follow(self, channel: ControlChannel) -> None:
        """A rank other than 0: apply every operation rank 0 sends until the group breaks (rank 0
        is gone). One that fails here as it may not have on rank 0 ends this rank's process
        (`FAILED_ALONE_EXIT`): rank 0 may wait on it in a collective, which only the end of its
        connections breaks (a group's are held by the model's device mesh: destroying or aborting
        the group leaves them open), and Serve's health check finds the rank gone."""
        while True:
            try:
                op = channel.receive()  # one this rank cannot read leaves it out of step
            except Exception as error:  # noqa: BLE001 - stop_following logs it
                return self.stop_following(error)
            try:
                self.apply(op)
            except ALIKE_ON_EVERY_RANK as error:  # rank 0 met the same error on the same op and answered it
                logger.info("operation %s failed on this rank as on rank 0: %s", op.op, error)
            except Exception as error:  # noqa: BLE001 - stop_following logs it
                return self.stop_following(error)

    def stop_following(self, error: Exception) -> None:
        """A follower's end: where the group is gone (rank 0 or a peer), marked broken (its health
        check fails, and Serve rebuilds the group); else it is out of step, and its process ends."""
        gone = group_gone(error)
        if gone is not None:
            logger.warning("the group broke: %s", error)
            self.broken = str(gone)
            return
        logger.error("this rank failed alone, maybe: it ends", exc_info=error)
        logging.shutdown()
        os._exit(FAILED_ALONE_EXIT)

    def apply(self, op: Message) -> Any:
        """Carry out an operation on this rank's model (on the torch thread)."""
        return self.operations[type(op)](op)

    def release(self, op: Release) -> None:
        self.table.release(op.session_id)
        if self.admission is not None:
            self.admission.release(op.session_id)

    def session(self, session_id: str) -> Any:
        session = self.table.get(session_id)
        if session is None:
            raise SessionMissing(session_id)
        return session

    def check_tokens(self, tokens: Sequence[int], param: str, min_count: int, max_count: int) -> list[int]:
        if not min_count <= len(tokens) <= max_count:
            raise SpecdecError(f"{param} must hold {min_count} to {max_count} tokens, got {len(tokens)}")
        check_token_ids(tokens, self.vocab_size, param)
        return list(tokens)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        return self.check_tokens(prompt_ids, "prompt_ids", 1, self.max_positions - 1)

    def stats(self) -> dict:
        sessions, requests = self.table.counts()
        reserved = self.admission.reserved_bytes if self.admission is not None else 0.0
        return {
            "sessions": sessions,
            "requests": requests,
            "kv_reserved_bytes": reserved,
            "steps": self.batcher.steps,
            "step_rows": self.batcher.rows,
            "step_seconds": self.batcher.step_seconds,
        }

    def step_of(self, rows: list) -> Message:
        """The operation of one step over `rows`."""
        raise NotImplementedError

    def settle_step(self, rows: list[PendingRow], results: list) -> None:
        """What a step's rows decide together from its results before they are answered (`StepBatcher`)."""

    def check_row(self, row: PendingRow) -> None:
        """What a row may do given its session's state (on the torch thread, before its step);
        raises for a row that may not run, and may set the row's `reply`."""
        raise NotImplementedError
