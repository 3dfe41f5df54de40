"""The store under every MoE family: greedy tokens at half the expert bytes equal the all-resident run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import FAMILY_CONFIGS, check_pages_as_resident, random_model

MOE_FAMILIES = [f for f in FAMILY_CONFIGS if f not in ("qwen3", "llama")]  # (the dense draft families: no experts)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_family_pages_with_identical_tokens(family: str, tmp_path: Path) -> None:
    check_pages_as_resident(random_model(family, tmp_path / family), list(range(3, 30)))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_look_ahead_routes_as_the_next_layer_does(family: str, tmp_path: Path) -> None:
    """Every MoE family's look-ahead applies the next MoE layer's own router (softmax or sigmoid scores, router and
    score biases, expert groups): given the input that layer gets, it predicts exactly the experts the layer routes
    to. Before, only plain linear gates were applied, and the biased routers (GLM, DeepSeek-V3, gpt-oss, LFM2) were
    skipped or read without their biases."""
    import torch

    import moelane
    from moelane.pager.live.prefetch import next_gates

    lm = moelane.load(random_model(family, tmp_path / family))
    layers = list(lm.moe_layers)
    gates = next_gates(lm, layers)
    assert sorted(gates) == layers[:-1]
    x = torch.randn(5, lm.model.model.embed_tokens.weight.shape[1], generator=torch.Generator().manual_seed(0))
    for layer, (nxt, route) in gates.items():
        routing: list = []
        lm.model.model.layers[nxt].mlp(x, nxt, lm.provider, routing)
        assert torch.equal(route(x)[1], routing[0][0]), (layer, nxt)
