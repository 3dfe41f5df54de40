"""The seam between model math and expert residency.

The MoE block routes first (top-k expert ids and gate weights per token), then asks an `ExpertProvider` where the
routed experts' weights are: the provider owns pools of stacked weight tensors and maps expert ids to pool slots; the
block gathers weights by slot. Model code never knows where an expert lives or how it got there.

- `ResidentProvider` holds every expert, in one pool per layer at one precision tier: the slot of expert e is e, so
  `slots` is the identity and the decode step compiles whole with no graph break.
- The pager's store implements the same protocol with a smaller pool; its `slots` call (make these experts resident,
  return their slots) is where compiled code hands back to Python (`host_side`). It also has `slots_staged`
  (optional in the protocol): the slots at once, a mask of the pairs whose experts are still loading, and a `wait`
  to call before computing those, so eager dispatch computes the resident experts while the misses load.

- A provider whose experts live in other processes (`moelane.dist`) has `pair_outputs(rows, rows_of, layer, ids,
  act, bias)` (optional in the protocol): each pair's expert output, computed wherever its expert is, which eager
  `experts.run_experts` then sums as it sums its own (`experts.pair_outputs`).

Routing decisions reach observers (the trace recorder, the planner) after each forward pass as a `RoutingRecord`, so
the hot path itself carries no callbacks.

Pools (`TierPool`): a provider holds its experts in one pool per precision tier (`pools(layer)`, ascending `first`);
slot numbers are global, pool p holding slots `p.first ..< p.first + S_p`, and every slot `slots` returns falls in
exactly one pool. Each pool stacks S experts' matrices (I expert width, H hidden; per matrix [Out, In]: w13 is
[2I, H], gate rows then up rows as `F.linear` weights, w2 is [H, I], the down projection) in its tier's format:
    native  data [S, Out, In] in the compute dtype; no scales
    int8    codes int8 [S, Out, In_p], scales float16 [S, Out, G]: weight = code * scale of its group; on the CPU,
            where Out is a multiple of 16, interleaved: codes [S, Out / 16, In_p / 4, 64], scales [S, Out / 16, G, 16]
            (the same values, 16 rows a block: `moelane.kernels.pool`)
    int4    codes uint8 [S, Out, In_p / 2] (two a byte, low nibble first, each stored + 8), scales float16 [S, Out, G]
where a group is `In_p / G` weights of a row and In_p is In zero-padded to whole groups: exactly what
`moelane.pager.live.tiers.quantize` writes for each matrix (docs/pager.md, "Precision tiers").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import torch

from moelane import kernels
from moelane.kernels import Pool, hugepages
from moelane.kernels.pool import BLOCK_ROWS
from moelane.model.checkpoint import ExpertHandle, read_expert

Fn = TypeVar("Fn", bound=Callable[..., Any])


def host_side(fn: Fn) -> Fn:
    """`fn` run as plain Python even inside a compiled decode step (a graph break there): a provider's residency
    check and its hooks read ids, take locks and do I/O, none of which belongs in a graph. For use once compiling is
    enabled: it loads the compiler (~70 MB), which a process that never compiles should not pay."""
    disable: Any = torch.compiler.disable  # (untyped)
    return cast(Fn, disable(fn))


TIER_KINDS = ("native", "int8", "int4")  # by precision tier: 0 the compute dtype, then the quantised tiers


class TierPool(NamedTuple):
    """One precision tier's pool: its slot 0 is the provider's slot `first`; kind "native" | "int8" | "int4".
    `kernel`: the same tensors as the kernels' pools (w13's, w2's), where the kernels' extension serves
    (`tier_pool`)."""

    first: int
    kind: str
    w13: tuple[torch.Tensor, torch.Tensor | None]  # (data, scales or None)
    w2: tuple[torch.Tensor, torch.Tensor | None]
    kernel: tuple[Pool, Pool] | None = None

    @property
    def n_slots(self) -> int:
        return int(self.w13[0].shape[0])

    @property
    def width(self) -> int:
        """I, the experts' width: half w13's rows (held in blocks of 16 where int8 is interleaved, kernels/pool.py)."""
        data = self.w13[0]
        return int(data.shape[1] * (BLOCK_ROWS if data.dim() == 4 else 1)) // 2


def tier_pool(
    first: int,
    kind: str,
    w13: tuple[torch.Tensor, torch.Tensor | None],
    w2: tuple[torch.Tensor, torch.Tensor | None],
    dims: tuple[int, int],
) -> TierPool:
    """A pool with its kernels' view (no copy) where the extension serves: then `experts.run_experts` computes from
    its bytes as they are (`moelane.kernels`). dims: (H, I), the input widths of w13 and w2 (quantised rows are
    padded to whole groups, so their stored length does not say)."""
    dtype = w13[0].dtype
    usable = dtype in kernels.FLOAT_KINDS or dtype in (torch.int8, torch.uint8)
    if not usable or not kernels.serves(w13[0].device):
        return TierPool(first, kind, w13, w2)
    name = kernels.FLOAT_KINDS.get(dtype, kind)
    pools = tuple(Pool(name, data, scales, n_in) for (data, scales), n_in in zip((w13, w2), dims, strict=True))
    return TierPool(first, kind, w13, w2, (pools[0], pools[1]))


class HostSide:
    """A provider as the compiled decode step sees it: the same pools, its `slots` run as plain Python."""

    def __init__(self, provider: ExpertProvider) -> None:
        self.pools = provider.pools
        self.weights = provider.weights
        self.slots = host_side(provider.slots)


class ExpertProvider(Protocol):
    """Where the experts' weights are. `layer` is the decoder layer index of a MoE layer."""

    def pools(self, layer: int) -> tuple[TierPool, ...]:
        """Every tier's pool the layer's experts may be in, ascending `first` (see the module docstring)."""
        ...

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pool tensors `(w13 [S, 2I, H], w2 [S, H, I])` in the compute dtype, for a provider whose only
        pool is native and starts at slot 0 (others raise ValueError)."""
        ...

    def slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """Make the routed experts resident and return their pool slots (same shape as `expert_ids`)."""
        ...


class ResidentProvider:
    """Every expert resident, one pool per layer at one tier (`kind`): pool slot == expert id. `from_handles` loads
    every expert up front in the compute dtype; `moelane.pager.live.build.resident_at_tier` builds one at a
    quantised tier from its tier file."""

    def __init__(self, pools: dict[int, TierPool]) -> None:
        if any(p.first != 0 for p in pools.values()) or len({p.kind for p in pools.values()}) > 1:
            raise ValueError("a resident provider holds each layer's experts in one pool of one kind, from slot 0")
        self._pools = pools
        self.kind = next(iter(pools.values())).kind if pools else "native"

    @classmethod
    def from_handles(
        cls,
        handles: dict[int, list[ExpertHandle]],
        dtype: torch.dtype,
        progress: bool = False,
        device: torch.device | None = None,
    ) -> ResidentProvider:
        """Every expert read in `dtype` and held on `device` (None: the CPU), a layer's experts stacked at a time."""
        from tqdm import tqdm

        pools: dict[int, TierPool] = {}
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
                if device is not None and device.type != "cpu":
                    w13, w2 = torch.stack(w13s).to(device), torch.stack(w2s).to(device)
                else:  # (in huge-page memory: every pass streams these bytes, kernels/hugepages.py)
                    w13 = torch.stack(w13s, out=hugepages.empty((len(w13s), *w13s[0].shape), w13s[0].dtype))
                    w2 = torch.stack(w2s, out=hugepages.empty((len(w2s), *w2s[0].shape), w2s[0].dtype))
                pools[layer] = tier_pool(0, "native", (w13, None), (w2, None), (w2.shape[1], w2.shape[2]))
        return cls(pools)

    def pools(self, layer: int) -> tuple[TierPool, ...]:
        return (self._pools[layer],)

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return native_weights(self.pools(layer))

    def slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        return expert_ids


def native_weights(pools: tuple[TierPool, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weights(layer)` of a provider whose only pool is native from slot 0; ValueError for any other."""
    if len(pools) != 1 or pools[0].kind != "native" or pools[0].first != 0:
        kinds = ", ".join(f"{p.kind} from slot {p.first}" for p in pools)
        raise ValueError(f"weights() needs one native pool from slot 0; this provider holds {kinds}: use pools()")
    return pools[0].w13[0], pools[0].w2[0]


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
