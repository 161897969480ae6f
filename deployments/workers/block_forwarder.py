"""Forwarded blocks on the draft worker's side (run-ahead, specdec_core/loop/run_ahead.py): an ahead
proposal sent straight to the request's target replica beside the Propose answer, as the server
would send it in its next Score (forwarded_blocks.py is the target's side)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Optional

import grpc

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec_core.drafters.drafter_base import ahead_outcome
from specdec_core.loop.run_ahead import next_block
from specdec_core.loop.stage_types import DraftBlock

from ..coordination.wire import as_sent, tensor_to_proto
from ..ingress.auth import SECRET_METADATA

logger = logging.getLogger(__name__)


def forwarded_block(request: pb.ProposeRequest, proposal: DraftBlock) -> pb.ForwardedBlock:
    """The ahead `proposal` (`[guess, block t+1's drafts]`) of a Propose that asks to forward it, as
    the server would use it: block t+1 cut to the request's `max_tokens`, with its sampled drafts'
    probabilities and rows where the target's rule reads them, as its Score sends them."""
    tokens = proposal.tokens.tolist()
    block = next_block(proposal, request.max_tokens)
    forwarded = pb.ForwardedBlock(
        session_id=request.session_id,
        after_length=request.forward.after_length,
        assumed=ahead_outcome(list(request.after_tokens), tokens),
        tokens=[tokens[0], *block.tokens.tolist()],
        tree=block.tree.name if block.tree is not None else "",
        drafts_as_scored=True,
    )
    if block.sampled and request.forward.draft_probs:
        forwarded.draft_token_probs.extend(block.token_probs.tolist())
        forwarded.draft_logits.CopyFrom(tensor_to_proto(as_sent(block.logits)))
    return forwarded


MAX_TARGET_CHANNELS = 16  # target replicas a draft worker keeps a channel to, least recently used dropped


class BlockForwarder:
    """The draft worker's side: sends an ahead proposal to the target replica the server named,
    beside the Propose answer, never holding it up. A failed send costs the target only its
    head start (the server's Score still carries the block), so it is logged, not raised."""

    def __init__(self, secret: Optional[str], deadline_s: float = 10.0):
        self.metadata = [(SECRET_METADATA, secret)] if secret else None
        self.deadline_s = deadline_s
        self.stubs: OrderedDict[str, tuple[grpc.Channel, pb_grpc.TargetStub]] = OrderedDict()
        self.lock = threading.Lock()

    def stub(self, address: str) -> pb_grpc.TargetStub:
        with self.lock:
            if address not in self.stubs:
                channel = grpc.insecure_channel(address)
                self.stubs[address] = (channel, pb_grpc.TargetStub(channel))
                while len(self.stubs) > MAX_TARGET_CHANNELS:
                    self.stubs.popitem(last=False)[1][0].close()
            self.stubs.move_to_end(address)
            return self.stubs[address][1]

    def forward(self, request: pb.ProposeRequest, proposal: DraftBlock) -> None:
        """Send the ahead `proposal` of a Propose that asks it (`forwarded_block`); a failure here is
        logged with its traceback and costs the target only its head start, not the Propose."""
        try:
            block = forwarded_block(request, proposal)
        except Exception:  # noqa: BLE001 - a bug: logged; the server's Score still carries the block
            logger.exception("session %s: its ahead block could not be laid out to forward", request.session_id)
            return
        self.send(request.forward.address, block)

    def send(self, address: str, block: pb.ForwardedBlock) -> None:
        """Send `block` to the target at `address`, not waiting for its answer."""
        try:
            call = self.stub(address).Forward.future(block, timeout=self.deadline_s, metadata=self.metadata)
        except ValueError as error:  # its channel was closed meanwhile (evicted): the block is only lost
            logger.warning("forwarding session %s's block to %s failed: %s", block.session_id, address, error)
            return
        call.add_done_callback(lambda done: self.check(done, block.session_id, address))

    @staticmethod
    def check(call: grpc.Future, session_id: str, address: str) -> None:
        code = call.code()
        if code == grpc.StatusCode.NOT_FOUND:  # the request ended first (its session released)
            logger.debug("forwarded block of session %s came after its release", session_id)
        elif code != grpc.StatusCode.OK:
            logger.warning("forwarding session %s's block to %s failed: %s", session_id, address, code.name)
