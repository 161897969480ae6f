"""A worker whose model is sharded over several ranks (specdec_core/models/parallel.py): rank 0 serves
the gRPC service and, before each operation that touches the model (open a session, score or
propose, release), sends it to the other ranks over a gloo group, so every rank runs the same
forwards in the same order and keeps the same sessions and KV caches. Operations (worker_ops.py)
travel as JSON (nothing is pickled): a length, then the bytes, each a broadcast from rank 0. The
other ranks follow them in `WorkerService.follow`."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from specdec_core.api.errors import GroupBroken

from .worker_ops import Message, operation_from_json


def peer_gone(error: BaseException) -> GroupBroken:
    """The group broken by `error`, a collective's failure on a rank that is gone."""
    return GroupBroken(f"a rank of the group is gone: {error}")


def group_gone(error: BaseException) -> Optional[GroupBroken]:
    """What a failed collective inside an operation stands for where a peer rank is gone (killed
    mid-forward: its all-reduce breaks, not the operation's send): torch.distributed's own errors,
    and the RuntimeErrors of gloo's transport (or GroupBroken itself). None for any other error."""
    if isinstance(error, GroupBroken):
        return error
    if isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo/transport" in str(error)):
        return peer_gone(error)
    return None


class ControlChannel:
    """Rank 0 sends operations; the other ranks receive them, in order."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)

    def send(self, op: Message) -> None:
        payload = torch.frombuffer(bytearray(op.model_dump_json().encode()), dtype=torch.uint8)
        try:
            dist.broadcast(torch.tensor([payload.numel()]), src=0, group=self.group)
            dist.broadcast(payload, src=0, group=self.group)
        except (RuntimeError, dist.DistError) as error:
            raise peer_gone(error) from None  # a broadcast of rank 0's fails only on a gone peer

    def smallest(self, value: float) -> float:
        """The smallest of every rank's `value` (every rank calls it at the same point)."""
        values = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self.group)
        return float(values)

    def receive(self) -> Message:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        return operation_from_json(payload.numpy().tobytes())
