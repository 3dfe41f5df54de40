"""The seam between model math and expert residency.

The MoE block routes first (top-k expert ids and gate weights per token), then asks an `ExpertProvider` where the
routed experts' weights are: the provider owns one pool of stacked weight tensors per MoE layer and maps expert ids to
pool slots; the block gathers weights by slot. Model code never knows where an expert lives or how it got there.

- `ResidentProvider` holds every expert: the slot of expert e is e, so `slots` is the identity and the decode step
  compiles whole with no graph break.
- The pager's store implements the same protocol with a smaller pool; its `slots` call (make these experts resident,
  return their slots) is where compiled code hands back to Python (`host_side`). It also has `slots_staged`
  (optional in the protocol): the slots at once, a mask of the pairs whose experts are still loading, and a `wait`
  to call before computing those, so eager dispatch computes the resident experts while the misses load.

Routing decisions reach observers (the trace recorder, the planner) after each forward pass as a `RoutingRecord`, so
the hot path itself carries no callbacks.

Pool layout, per MoE layer (S slots, I expert width, H hidden):
    w13: [S, 2I, H]  gate rows then up rows, as `F.linear` weights
    w2:  [S, H, I]   down projection
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import torch

from moelane.model.checkpoint import ExpertHandle, read_expert

Fn = TypeVar("Fn", bound=Callable[..., Any])


def host_side(fn: Fn) -> Fn:
    """`fn` run as plain Python even inside a compiled decode step (a graph break there): a provider's residency
    check and its hooks read ids, take locks and do I/O, none of which belongs in a graph. For use once compiling is
    enabled: it loads the compiler (~70 MB), which a process that never compiles should not pay."""
    disable: Any = torch.compiler.disable  # (untyped)
    return cast(Fn, disable(fn))


class HostSide:
    """A provider as the compiled decode step sees it: the same pools, its `slots` run as plain Python."""

    def __init__(self, provider: ExpertProvider) -> None:
        self.weights = provider.weights
        self.slots = host_side(provider.slots)


class ExpertProvider(Protocol):
    """Where the experts' weights are. `layer` is the decoder layer index of a MoE layer."""

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pool tensors `(w13 [S, 2I, H], w2 [S, H, I])`, in the compute dtype."""
        ...

    def slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """Make the routed experts resident and return their pool slots (same shape as `expert_ids`)."""
        ...


class ResidentProvider:
    """Every expert resident: pool slot == expert id. Loads all experts up front."""

    def __init__(self, pools: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._pools = pools

    @classmethod
    def from_handles(
        cls, handles: dict[int, list[ExpertHandle]], dtype: torch.dtype, progress: bool = False
    ) -> ResidentProvider:
        from tqdm import tqdm

        pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        total = sum(len(v) for v in handles.values())
        with tqdm(
            total=total, desc="loading experts", unit="expert", disable=not progress, leave=False, delay=1.0
        ) as bar:
            for layer, experts in handles.items():
                w13s, w2s = [], []
                for handle in experts:
                    w13, w2 = read_expert(handle, dtype)
                    w13s.append(w13)
                    w2s.append(w2)
                    bar.update(1)
                pools[layer] = (torch.stack(w13s), torch.stack(w2s))
        return cls(pools)

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pools[layer]

    def slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        return expert_ids


@dataclass(frozen=True, slots=True)
class RoutingRecord:
    """Routing of one forward pass (one segment), handed to observers after the pass.

    expert_ids: [L, T, K] int (L MoE layers in `moe_layers` order, T tokens, K top-k)
    weights:    [L, T, K] float gate weights as applied
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor
    phase: str  # "prefill", "decode" or "mixed"
    stream_ids: tuple[int, ...] = field(default=())  # one per token row


class RoutingObserver(Protocol):
    def observe(self, record: RoutingRecord) -> None: ...
