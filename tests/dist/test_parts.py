"""The parts of a distributed run that need no second process: placement, the wire format, fingerprints."""

from __future__ import annotations

import itertools

import torch

from moelane.dist.fingerprint import difference
from moelane.dist.placement import Placement
from moelane.dist.wire import (
    Request,
    pack_failure,
    pack_reply,
    pack_request,
    reply_bytes,
    request_bytes,
    unpack_reply,
    unpack_request,
)
from moelane.model.experts import PairBias


def test_placement_splits_every_expert_once_in_contiguous_ranges() -> None:
    for n_experts, world in [(10, 2), (10, 3), (32, 3), (7, 7), (128, 5)]:
        p = Placement(n_experts, world)
        bounds = [p.bounds(r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n_experts
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(bounds))
        owners = p.owners()
        assert owners.tolist() == [r for r, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]


def test_a_request_and_a_reply_read_back_as_written() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype, bias in [(torch.float32, False), (torch.bfloat16, True), (torch.float32, True)]:
        hidden, width, n_rows, n_pairs = 12, 5, 3, 7
        rows = torch.randn(n_rows, hidden, generator=g).to(dtype)
        pair_bias = PairBias(torch.randn(n_pairs, 2 * width).to(dtype), torch.randn(n_pairs, hidden).to(dtype))
        request = Request(rows, torch.randint(0, n_rows, (n_pairs,), generator=g), torch.arange(n_pairs) % 4,
                          pair_bias if bias else None)  # fmt: skip
        blob = pack_request(request)
        assert blob.numel() == request_bytes(n_rows, n_pairs, hidden, width, dtype, bias)
        back = unpack_request(blob, n_rows, n_pairs, hidden, width, dtype, bias)
        assert torch.equal(back.rows, rows) and torch.equal(back.rows_of, request.rows_of)
        assert torch.equal(back.ids, request.ids)
        assert (back.bias is None) == (not bias)
        if back.bias is not None:
            assert torch.equal(back.bias.b13, pair_bias.b13) and torch.equal(back.bias.b2, pair_bias.b2)
        y = torch.randn(n_pairs, hidden, generator=g).to(dtype)
        reply = pack_reply(y)
        assert reply.numel() == reply_bytes(n_pairs, hidden, dtype)
        out = unpack_reply(torch.cat([torch.zeros(4, dtype=torch.uint8), reply])[4:], n_pairs, hidden, dtype)
        assert isinstance(out, torch.Tensor) and torch.equal(out, y)
        failed = unpack_reply(pack_failure("the store is too small", reply.numel()), n_pairs, hidden, dtype)
        assert failed == "the store is too small"


def test_a_difference_is_named() -> None:
    ours = {"torch": "2.13", "config.hidden_size": "48", "compute dtype": "float32"}
    assert difference(ours, dict(ours), 2) is None
    said = difference(ours, {**ours, "config.hidden_size": "32"}, 2)
    assert said == "rank 2 was started with a different model or settings: config.hidden_size is 32 there, 48 on rank 0"
