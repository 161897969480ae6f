"""Tensors on the wire (deployments/coordination/wire.py): every dtype round-trips exactly; bf16
travels in its own two bytes an entry and arrives as float32."""

from __future__ import annotations

import pytest
import torch

from deployments.checks import served_rows
from deployments.coordination.wire import as_sent, tensor_from_proto, tensor_to_proto
from protos import specdec_pb2 as pb


def through_the_wire(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`tensor` after the wire (served_rows.through_the_wire), and its message's data bytes."""
    return served_rows.through_the_wire(tensor), len(tensor_to_proto(tensor).data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.int32, torch.bool])
def test_a_tensor_round_trips_exactly(dtype):
    tensor = (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    received, size = through_the_wire(tensor)
    assert received.dtype == dtype and torch.equal(received, tensor)
    assert size == tensor.numel() * tensor.element_size()


def test_bf16_rows_travel_in_two_bytes_and_arrive_as_their_float32_values():
    """A GPU target's bf16 logits, extremes included: half of float32's bytes, the same values."""
    rows = torch.randn(9, 1000, generator=torch.Generator().manual_seed(1)).mul(30).to(torch.bfloat16)
    rows[0, :4] = torch.tensor([float("-inf"), float("inf"), 3.3895e38, -1e-38])
    received, size = through_the_wire(rows)
    assert size == rows.numel() * 2
    assert received.dtype == torch.float32 and torch.equal(received, rows.float())


def test_rows_relayed_go_on_in_the_dtype_they_came_in():
    """The server relays a draft's rows to the target (`as_sent`): bf16 rows it received as float32
    go on as bf16 (two bytes an entry), exactly; rows that were float32 stay float32."""
    rows = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2)).mul(30)
    came_as_bf16, _ = through_the_wire(rows.to(torch.bfloat16))
    relayed, size = through_the_wire(as_sent(came_as_bf16))
    assert size == rows.numel() * 2 and torch.equal(relayed, came_as_bf16)
    relayed, size = through_the_wire(as_sent(rows))
    assert size == rows.numel() * 4 and torch.equal(relayed, rows)


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported tensor dtype"):
        tensor_from_proto(pb.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8))


def test_served_rows_costs_each_wire_dtype_and_both_warps():
    """`specdec served-rows`'s table (timings are reported, not checked): bf16 takes half the
    bytes, and the nucleus is reported as the warp keeps it."""
    rows = torch.randn(9, 5000, generator=torch.Generator().manual_seed(2)) * 6
    costs = served_rows.row_costs(rows, temperature=0.8, top_p=0.9, repeats=1)
    assert [cost["dtype"] for cost in costs] == ["float32", "bfloat16"]
    assert costs[0]["MB"] == round(9 * 5000 * 4 / 1e6, 2) and costs[1]["MB"] == round(9 * 5000 * 2 / 1e6, 2)
    assert {"wire ms", "warp ms", "warp ms, full sort"} <= costs[0].keys()
    low, high = map(int, costs[0]["nucleus tokens"].split("-"))
    assert 1 <= low <= high < 256
