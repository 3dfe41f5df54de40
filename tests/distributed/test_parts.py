"""The parts of a distributed run that need no second process: placement (balanced against the brute-force best
split), the routing counted in a trace, the wire format, fingerprints."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from moelane.dist.fingerprint import difference
from moelane.dist.placement import Placement, share_sizes
from moelane.dist.routing import routing_counts
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
from moelane.errors import InputError
from moelane.model.experts import PairBias

TRACE = Path(__file__).parents[1] / "fixtures" / "traces" / "default.trc"


def test_placement_splits_every_expert_once_in_contiguous_ranges() -> None:
    for n_experts, world in [(10, 2), (10, 3), (32, 3), (7, 7), (128, 5)]:
        p = Placement.contiguous([0, 2], n_experts, world)
        shares = [p.experts(2, r) for r in range(world)]
        assert [e for share in shares for e in share] == list(range(n_experts))
        assert [len(share) for share in shares] == [(r + 1) * n_experts // world - r * n_experts // world
                                                    for r in range(world)]  # fmt: skip
        assert p.owner_ids(0).tolist() == [r for r, share in enumerate(shares) for _ in share]
        assert p.local_ids(0).tolist() == [i for share in shares for i in range(len(share))]


def brute_force_max_load(loads: list[int], world: int) -> int:
    """The least max rank load of any split that gives each rank its contiguous share's number of experts."""
    sizes = sorted(share_sizes(len(loads), world))
    best = sum(loads)
    for owners in itertools.product(range(world), repeat=len(loads)):
        if sorted(owners.count(r) for r in range(world)) == sizes:
            best = min(best, max(sum(n for n, o in zip(loads, owners, strict=True) if o == r) for r in range(world)))
    return best


def test_balanced_placement_is_near_the_best_split_and_holds_the_shares_sizes() -> None:
    rng = random.Random(5)
    for _ in range(60):
        world = rng.choice([2, 3])
        loads = [int(rng.expovariate(0.05)) for _ in range(rng.randint(world, 9))]
        p = Placement.balanced({4: loads}, world)
        per_rank = [sum(loads[e] for e in p.experts(4, r)) for r in range(world)]
        assert [len(p.experts(4, r)) for r in range(world)] == share_sizes(len(loads), world)
        assert max(per_rank) - min(per_rank) <= max(loads), (loads, per_rank)
        assert 3 * max(per_rank) <= 4 * brute_force_max_load(loads, world), (loads, per_rank)


def test_the_shipped_trace_balances_better_than_contiguous_ranges() -> None:
    layers = list(range(6))
    counts = routing_counts(TRACE, layers, 32, 4)
    for world in (2, 3, 4):
        for placement in (Placement.balanced(counts, world), Placement.contiguous(layers, 32, world)):
            spread = [max(loads) - min(loads) for loads in layer_loads(placement, counts)]
            if placement.kind == "balanced":
                assert all(gap <= max(counts[layer]) for gap, layer in zip(spread, layers, strict=True))
                balanced = spread
        assert sum(balanced) < sum(spread)  # (`spread` last: the contiguous ranges')


def layer_loads(placement: Placement, counts: dict[int, list[int]]) -> list[list[int]]:
    return [[sum(counts[layer][e] for e in placement.experts(layer, r)) for r in range(placement.world)]
            for layer in counts]  # fmt: skip


def test_a_bad_or_foreign_trace_is_refused_in_one_line(tmp_path: Path) -> None:
    junk = tmp_path / "junk.trc"
    junk.write_bytes(b"not a trace at all")
    for path, said in [(tmp_path / "none.trc", "no such file"), (junk, "not a moelane trace"),
                       (TRACE, "is of another model: 6 MoE layers of 32 experts, top-4; this model has 2 of 10, "
                        "top-3")]:  # fmt: skip
        with pytest.raises(InputError) as e:
            routing_counts(path, [0, 2], 10, 3)
        assert said in str(e.value) and "\n" not in str(e.value)


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
