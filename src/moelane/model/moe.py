"""The MoE block every family uses: route, record the routing, run the experts through the provider, add the shared
expert, combine.

    weights, ids = router(x, gate)                 # [T, K]: which experts, and how much each counts
    routing.append((ids, weights))                 # for the routing observers, after the pass
    out = run_experts(x, layer, ids, weights, provider, act, expert_bias)
    out = out + shared_gate(x) * shared(x)         # where the family has a shared expert (and gates it)

A family supplies only what differs: its router (`routers.py`, or its own), whether a pair's input is its row scaled
by its weight (Llama 4) rather than its output, the experts' activation and biases (gpt-oss), its shared expert and
that expert's gate (Qwen2-MoE), and the checkpoint's names for all of these (`Names`), under which the block registers
its tensors, so dense weights load with no renaming. The block holds no expert weights: they live in the provider's
pools, and `experts.run_experts` is the one place they are computed.

`route(x)` is the router alone: the pager's look-ahead applies a later block's `route` to an earlier layer's input.

Shape alphabet: T tokens, K top-k, E experts, H hidden, I expert width.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from moelane.model.experts import Act, run_experts, swiglu
from moelane.model.layers import MLP, linear, pointwise
from moelane.model.provider import ExpertProvider
from moelane.model.routers import Gate, Router

Routing = list[tuple[torch.Tensor, torch.Tensor]]  # each MoE layer's (ids, weights) [T, K], in layer order


class Names(NamedTuple):
    """Where the block's tensors are, as the checkpoint names them below the block (dotted paths)."""

    gate: str = "gate"  # the router: its `weight` [E, H], and `bias` [E] when `gate_bias`
    gate_bias: bool = False
    score_bias: str | None = None  # [E], added to the router's scores when choosing (`routers.Gate.score_bias`)
    shared: str = "shared_experts"  # the shared expert, when the block has one
    shared_gate: str | None = None  # its `weight` [1, H]: the shared expert's output times sigmoid(x @ w.T) (Qwen2-MoE)
    expert_bias: tuple[str, str] | None = None  # the experts' biases, b13 [E, 2I] and b2 [E, H] (gpt-oss)


SCORED = Names(score_bias="gate.e_score_correction_bias")  # DeepSeek-V3's: the score bias inside the router


def shared_experts(hidden: int, n_shared: int | None, width: int, bias: bool = False) -> MLP | None:
    """DeepSeek's shared experts: `n_shared` experts of `width` as one always-on MLP (none: None)."""
    return MLP(hidden, n_shared * width, bias) if n_shared else None


def place(module: nn.Module, path: str, value: nn.Module | torch.Tensor) -> None:
    """Register `value` (a module, a parameter or a buffer) at the dotted `path` below `module`, with empty modules
    on the way where there are none yet."""
    *owners, name = path.split(".")
    for owner in owners:
        if not isinstance(getattr(module, owner, None), nn.Module):
            module.add_module(owner, nn.Module())
        module = module.get_submodule(owner)
    setattr(module, name, value)


def at(module: nn.Module, path: str) -> Any:
    """The module, parameter or buffer at the dotted `path` below `module`."""
    found: Any = module
    for name in path.split("."):
        found = getattr(found, name)
    return found


class MoeBlock(nn.Module):
    """Routed experts, and an always-on shared expert where `shared` is given."""

    def __init__(
        self,
        hidden: int,
        n_experts: int,
        router: Router,
        *,
        names: Names = Names(),
        shared: nn.Module | None = None,
        act: Act = swiglu,
        expert_width: int = 0,
        scale_inputs: bool = False,
        score_bias_shape: tuple[int, ...] | None = None,
    ) -> None:
        """`expert_width`: for the experts' biases only; `scale_inputs`: each pair's input is its row times its
        weight, and the outputs are summed unweighted (Llama 4); `score_bias_shape`: where the checkpoint stores the
        score bias otherwise than [E] (ERNIE: [1, E])."""
        super().__init__()
        # (the router is `rule` here: "router" and "gate" are checkpoints' names of the block's tensors)
        self.rule, self.names, self.act, self.scale_inputs = router, names, act, scale_inputs
        place(self, f"{names.gate}.weight", nn.Parameter(torch.zeros(n_experts, hidden)))
        if names.gate_bias:
            place(self, f"{names.gate}.bias", nn.Parameter(torch.zeros(n_experts)))
        if names.score_bias is not None:
            place(self, names.score_bias, nn.Buffer(torch.zeros(score_bias_shape or (n_experts,))))
        self.has_shared = shared is not None
        if shared is not None:
            place(self, names.shared, shared)
        if names.shared_gate is not None:
            place(self, f"{names.shared_gate}.weight", nn.Parameter(torch.zeros(1, hidden)))
        if names.expert_bias is not None:
            b13, b2 = names.expert_bias
            place(self, b13, nn.Parameter(torch.zeros(n_experts, 2 * expert_width)))
            place(self, b2, nn.Parameter(torch.zeros(n_experts, hidden)))

    def gate_tensors(self) -> Gate:
        names = self.names
        bias = at(self, f"{names.gate}.bias") if names.gate_bias else None
        score_bias = None if names.score_bias is None else at(self, names.score_bias)
        return Gate(at(self, f"{names.gate}.weight"), bias, score_bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [T, H] -> (weights, ids) [T, K]."""
        return self.rule(x, self.gate_tensors())

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        """x [T, H] -> [T, H]; appends this layer's (ids, weights) to `routing`."""
        weights, ids = self.route(x)  # [T, K]
        routing.append((ids, weights))
        inputs = x
        if self.scale_inputs:
            inputs = x[:, None, :] * weights.to(x.dtype)[..., None]  # [T, K, H]: each pair's own input
            weights = torch.ones_like(weights)
        bias = None if self.names.expert_bias is None else (at(self, self.names.expert_bias[0]),
                                                            at(self, self.names.expert_bias[1]))  # fmt: skip
        out = run_experts(inputs, layer, ids, weights, provider, self.act, bias)
        if not self.has_shared:
            return out
        shared: torch.Tensor = at(self, self.names.shared)(x)
        if self.names.shared_gate is not None:
            shared = pointwise(torch.sigmoid, linear(x, at(self, f"{self.names.shared_gate}.weight"))) * shared
        return out + shared
