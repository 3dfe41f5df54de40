"""Attention over per-stream KV caches: the `Attention` module, and the functions that write each row's K/V into its
stream's cache and attend over it.

Batch invariance (docs/batch-invariance.md): a row's numbers must not depend on which other rows share the pass.
Attention runs per stream over that stream's static cache as far as the pass reaches (`reach`), with each KV head's
query rows packed into whole tiles of `layers.TILE` (`pack_queries`), and its projections go through `layers.linear`.
The compiled decode step instead writes and reads any rows' caches in their pool (`attend_pooled`), where every row
meets the same kernels whatever the row count. Nothing here takes a Python scalar from a tensor, so a decode step
compiles whole.

Shape alphabet: N rows in the pass, n rows of one stream, H hidden, Hq/Hkv heads, D head dim, C cache capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, cast

import torch
import torch.nn.functional as F
from torch import nn

from moelane import kernels
from moelane.kernels import Pool, hugepages
from moelane.model.cache import KVCache, KVPool
from moelane.model.config import Config
from moelane.model.layers import TILE, RMSNorm, linear, linear_parts, pad_rows
from moelane.model.rope import apply_rope

# Attention reads a cache only up to `reach`: the rows' last position rounded up to a multiple of REACH.
REACH = 512
KEY_BLOCK = 256  # attention weighs values in blocks of this many keys (`weigh_values`)


def reach(end: int, capacity: int) -> int:
    """How many positions of a cache of `capacity` attention reads for rows that end before `end`: `end` rounded up
    to a multiple of REACH, at most the capacity, so a step costs what the stream's length costs, not its capacity.

    A row's bits do not depend on how far its call reads: keys past a row's position are masked, their probabilities
    are exact zeros, and zeros at the end of a reduction change none of its partial sums. That holds as long as every
    length meets the same kernel: MKL's product over the keys takes another path below 384 keys (measured here, fp32,
    AVX-512 and AVX2 paths alike), hence whole blocks of 512, and below that only the capacity itself (256), which
    never changes for a stream. Tested bit for bit against calls that read further (eager and compiled)."""
    return min(capacity, -(-end // REACH) * REACH)


@dataclass(frozen=True, slots=True)
class Window:
    """Which keys before its own a row may see, beyond causality: the last `size` positions up to its own (a
    sliding window: Mixtral, Qwen's and gpt-oss's sliding layers), or, when `chunked`, only those of its own chunk of
    `size` positions, chunks starting at multiples of `size` (Llama 4's chunked attention)."""

    size: int
    chunked: bool = False

    def first(self, positions: torch.Tensor) -> torch.Tensor:
        """The first key position rows at `positions` see (any shape, elementwise)."""
        return positions - positions % self.size if self.chunked else positions - (self.size - 1)


def visible(key_pos: torch.Tensor, row_pos: torch.Tensor, window: Window | None) -> torch.Tensor:
    """Which keys each row sees: key_pos [L] against row_pos [..., R] -> [..., R, L], causal and within `window`."""
    mask = key_pos <= row_pos[..., None]
    return mask if window is None else mask & (key_pos >= window.first(row_pos)[..., None])


@dataclass(frozen=True, slots=True)
class PoolPart:
    """Consecutive rows of the compiled decode step whose caches are slots of one pool: how many (a symbol in the
    step's graph), the pool, and the key positions they read (`arange(reach)` of that pool's capacity)."""

    rows: Any
    pool: KVPool
    keys: torch.Tensor


@dataclass(frozen=True, slots=True)
class Batch:
    """How the rows of one forward pass split into streams.

    `spans[i]` is (first row, row count) of stream i; `caches[i]` its KV cache; positions [N] absolute positions;
    `ends[i]` the position after stream i's last row; `slots` [N] each row's cache slot in its pool. The compiled
    decode step gives `parts` (its rows by pool, in row order) and `slots` instead of caches.
    """

    spans: tuple[tuple[int, int], ...]
    caches: tuple[KVCache, ...]
    positions: torch.Tensor
    ends: tuple[int, ...] = ()
    slots: torch.Tensor | None = None
    parts: tuple[PoolPart, ...] = ()

    def by_part(self, *rows: torch.Tensor) -> list[tuple[PoolPart, tuple[torch.Tensor, ...]]]:
        """The compiled step's row tensors ([N, ...] each) cut into its parts' rows, with each part."""
        if len(self.parts) == 1:
            return [(self.parts[0], rows)]
        sizes = [part.rows for part in self.parts]
        cut = [torch.split(t, sizes) for t in rows]
        return [(part, tuple(c[i] for c in cut)) for i, part in enumerate(self.parts)]

    def per_part(self, fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
        """`fn(part, *its rows)` for each of the compiled step's parts (`by_part`), the results in row order."""
        outs = [fn(part, *cut) for part, cut in self.by_part(*rows)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def pack_queries(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Query rows [..., n, Hq, D] -> [..., Hkv, M, D]: for each KV head, the rows of its query heads (row by row, the
    group's heads within a row), zero-padded to whole tiles: M = n * group rounded up to TILE."""
    *lead, n, n_heads, d = q.shape
    group = n_heads // n_kv
    return pad_rows(q.reshape(*lead, n, n_kv, group, d).transpose(-4, -3).reshape(*lead, n_kv, n * group, d))


def packed_positions(positions: torch.Tensor, group: int, rows: int, length: int) -> torch.Tensor:
    """The positions of the first `rows` packed query rows (`pack_queries`), [..., n] -> [..., rows]: each row's
    position repeated for its group's heads; rows past them (another stream's, in a shared call) see all `length`
    keys, so none is all -inf."""
    packed = positions.repeat_interleave(group, dim=-1)
    return F.pad(packed, (0, rows - packed.shape[-1]), value=length - 1)


def unpack(out: torch.Tensor, n: int, group: int) -> torch.Tensor:
    """Packed output rows [..., Hkv, M, Dv] -> [..., n, Hq, Dv] (`pack_queries` undone, pad rows dropped)."""
    *lead, n_kv, _, d_v = out.shape
    rows = out[..., : n * group, :].reshape(*lead, n_kv, n, group, d_v)
    return rows.transpose(-4, -3).reshape(*lead, n, n_kv * group, d_v)


def with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys and a sink per row (gpt-oss): a learnt logit that takes its share of the probability
    and adds nothing to the output. scores [..., L] scaled and masked, in the compute dtype; sinks broadcast to
    [..., 1] -> fp32 probabilities [..., L]. The row's maximum is taken off in the compute dtype, as transformers
    does (in bf16 that rounds), then the softmax runs in fp32.

    The sink goes first, so each key keeps its place in the softmax's reductions however far the call reads (the
    keys past a row's position, masked to exact zeros, then still come last: `reach`)."""
    logits = torch.cat([sinks.to(scores.dtype).expand(*scores.shape[:-1], 1), scores], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits.float(), dim=-1)[..., 1:]


def attend_tiles(
    qp: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_pos: torch.Tensor,
    scale: float,
    window: Window | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batched products of `attend_group`: qp [B, Hkv, M, D] (packed query rows, M a whole number of tiles),
    k/v [B, Hkv, L, D/Dv], row_pos [B, R] (the positions of the first R packed rows, the real ones) -> [B, Hkv, M, Dv].

    The query heads sharing a KV head are rows of one matrix, so K/V are never copied per head, and a decode row
    costs one tile of rows per KV head, not one per query head. Only the first R rows are masked and softmaxed (row
    by row, so the other rows change no bits); the pad rows' probabilities are zeros for the second product, which
    needs the whole tile again. Scaled in the compute dtype, then fp32: the same roundings as transformers' eager
    attention in bf16. `sinks` [Hkv, group]: each query head's sink logit (`with_sinks`)."""
    b, n_kv, m, d = qp.shape
    length, real = k.shape[2], row_pos.shape[1]
    scores = torch.matmul(qp.reshape(b * n_kv, m, d), k.reshape(b * n_kv, length, d).transpose(1, 2))
    scores = scores.view(b, n_kv, m, length)[:, :, :real] * scale
    mask = visible(torch.arange(length, device=qp.device), row_pos, window)  # [B, R, L]
    if sinks is None:
        probs = torch.softmax(scores.float().masked_fill(~mask[:, None], float("-inf")), dim=-1).to(v.dtype)
    else:  # packed row r of KV head j is query head j * group + r % group
        sink_rows = sinks.repeat(1, real // sinks.shape[1])[None, :, :, None]
        probs = with_sinks(scores.masked_fill(~mask[:, None], float("-inf")), sink_rows).to(v.dtype)
    if real < m:
        probs = F.pad(probs, (0, 0, 0, m - real))  # [B, Hkv, M, L]
    return weigh_values(probs.reshape(b * n_kv, m, length), v.reshape(b * n_kv, length, -1)).view(b, n_kv, m, -1)


def weigh_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [G, M, L] x values [G, L, Dv] -> [G, M, Dv], reduced over the keys in blocks of KEY_BLOCK: one product
    of a fixed shape per block, the blocks then summed in order. A product over all L keys at once takes other
    kernels (other partial sums) for other lengths on some CPUs (measured on an AVX-512/AMX Xeon: L = 512 against
    768 or more differed with every key past 300 masked), so a row's bits would depend on how far its call reads;
    blocks of one shape meet one kernel, and the blocks past a row's position are exact zeros added last."""
    g, m, length = probs.shape
    extra = -length % KEY_BLOCK
    if extra:  # (a cache whose capacity is not a whole number of blocks: the context cap of a small model)
        probs, values = F.pad(probs, (0, extra)), F.pad(values, (0, 0, 0, extra))
    n_blocks = (length + extra) // KEY_BLOCK
    if n_blocks == 1:
        return torch.bmm(probs, values)
    # (in fp32, so a half-precision product is rounded once, as one product over all keys rounds it)
    blocks = torch.matmul(
        probs.float().view(g, m, n_blocks, KEY_BLOCK).transpose(1, 2),
        values.float().reshape(g, n_blocks, KEY_BLOCK, -1),
    )  # [G, blocks, M, Dv]
    return blocks.sum(dim=1).to(values.dtype)


class Attention(nn.Module):
    """Grouped-query attention with optional q/k RMSNorm (Qwen3, OLMoE), q/k/v bias (Qwen2), o bias (Llama),
    q/k/v clipping (OLMoE `clip_qkv`), a `Window` (an int: a sliding window, as Mixtral's and Qwen's sliding layers;
    Llama 4's chunks), partial rotary embeddings (GLM: only the first `rotary_dim` dims of each head) and attention
    sinks (gpt-oss: a learnt logit per query head in every softmax, `with_sinks`)."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm: str | None = None,
        eps: float = 1e-6,
        o_bias: bool = False,
        clip: float | None = None,
        window: int | Window | None = None,
        rotary_dim: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=o_bias)
        self.clip, self.window = clip, Window(window) if isinstance(window, int) else window
        self.qk_norm = qk_norm
        if qk_norm == "head":  # Qwen3: per head
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        elif qk_norm == "full":  # OLMoE: over all heads
            self.q_norm, self.k_norm = RMSNorm(n_heads * head_dim, eps), RMSNorm(n_kv_heads * head_dim, eps)
        self.scale = head_dim**-0.5
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.qkv: Pool | None = None  # q, k and v's rows in one kernel pool (`fuse_projections`), and their views
        self._qkv_views: tuple[Pool, ...] = ()

    def fuse_projections(self) -> bool:
        """Read q, k and v through one kernel pool where all three are pools of one kind and width (`model/weights.py`):
        one product a step where there were three, x coded once for int8 / int4, and each output row the same bits,
        since a row's arithmetic does not depend on which rows share the call (moelane.kernels). q/k/v_proj keep views
        of its rows, so nothing is held twice. -> whether they were fused."""
        weights: list[object] = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        parts = [p for p in weights if isinstance(p, Pool)]
        if self.qkv is not None or len(parts) != 3:
            return False
        first = parts[0]
        shape = (first.kind, first.in_features, first.n_slots, first.data.shape[2], first.data.device)
        if any((p.kind, p.in_features, p.n_slots, p.data.shape[2], p.data.device) != shape for p in parts):
            return False
        data = hugepages.cat([p.data for p in parts], dim=1)  # (streamed every pass: kernels/hugepages.py)
        scales = None if first.scales is None else torch.cat([cast(torch.Tensor, p.scales) for p in parts], dim=1)
        self.qkv = Pool(first.kind, data, scales, first.in_features)
        views, start = [], 0
        for proj, part in zip((self.q_proj, self.k_proj, self.v_proj), parts, strict=True):
            end = start + part.out_features
            rows = Pool(first.kind, data[:, start:end], None if scales is None else scales[:, start:end],
                        first.in_features)  # fmt: skip
            proj.weight = rows  # type: ignore[assignment]
            views.append(rows)
            start = end
        self._qkv_views = tuple(views)
        return True

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [N, heads x head dim] of the rows x: one product where `fuse_projections` joined them."""
        q_proj, k_proj, v_proj = self.q_proj, self.k_proj, self.v_proj
        # (a projection given another weight since, as tests swap in references, is read on its own again)
        weights: tuple[object, ...] = (q_proj.weight, k_proj.weight, v_proj.weight)
        views = self._qkv_views
        if not views or any(w is not v for w, v in zip(weights, views, strict=True)):
            return linear(x, q_proj.weight, q_proj.bias), linear(x, k_proj.weight, k_proj.bias), \
                linear(x, v_proj.weight, v_proj.bias)  # fmt: skip
        parts = [(cast(Pool, p.weight).out_features, p.bias) for p in (q_proj, k_proj, v_proj)]
        q, k, v = linear_parts(x, cast(Pool, self.qkv), parts)
        return q, k, v

    @classmethod
    def of(cls, config: Config, **options: Any) -> Self:
        """Attention of the config's sizes (hidden, heads, KV heads, head width) and norm eps, with `options`."""
        sizes = (config.hidden_size, config.num_attention_heads, config.n_kv_heads, config.head_size)
        return cls(*sizes, **{"eps": config.rms_norm_eps, **options})

    def forward(
        self, x: torch.Tensor, layer: int, batch: Batch, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip), v.clamp(-self.clip, self.clip)
        q = q.view(n, self.n_heads, self.head_dim)
        k = k.view(n, self.n_kv_heads, self.head_dim)
        v = v.view(n, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, k, *rope)
        sinks = None if self.sinks is None else self.sinks.view(self.n_kv_heads, -1)
        out = attend_streams(q, k, v, layer, batch, self.scale, self.window, sinks)
        return linear(out.reshape(n, self.n_heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys [rows, heads, dim] turned by the rotary embedding (a family with another layout, or
        with more to do at this step, overrides it)."""
        if self.rotary_dim == self.head_dim:
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        r = self.rotary_dim  # partial rotary (GLM): the first rotary_dim dims of each head turn, Llama-style halves
        return (torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], dim=-1),
                torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], dim=-1))  # fmt: skip


def attend_streams(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    batch: Batch,
    scale: float,
    window: Window | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write each stream's new K/V into its cache, then attend over the cache up to `reach`: streams whose caches
    are slots of one pool and whose packed query rows (`pack_queries`) come to the same tiles go through one batched
    call (`attend_group`). q [N, Hq, D], k/v [N, Hkv, D]; sinks [Hkv, group] (`with_sinks`) or None."""
    if batch.parts and batch.slots is not None:  # the compiled decode step: each pool's rows apart, in row order

        def pooled(
            part: PoolPart, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, at: torch.Tensor
        ) -> torch.Tensor:
            k_pool, v_pool = part.pool.k[layer], part.pool.v[layer]
            return attend_pooled(q, k, v, k_pool, v_pool, slots, at, part.keys, scale, window, sinks)

        return batch.per_part(pooled, q, k, v, batch.slots, batch.positions)
    write_rows(layer, batch, k, v)
    counts = [n for _, n in batch.spans]
    if uniform(batch):  # one stream, or equal row counts and one pool (a decode round): no per-stream slicing
        return attend_group(q, batch.positions, counts, batch.caches, max(batch.ends), layer, scale, window, sinks)
    group = q.shape[1] // k.shape[1]
    groups: dict[tuple[KVPool, int], list[int]] = {}
    for i, (n, cache) in enumerate(zip(counts, batch.caches, strict=True)):
        groups.setdefault((cache.pool, -(-n * group // TILE)), []).append(i)
    out: torch.Tensor | None = None
    for members in groups.values():
        rows = torch.cat([torch.arange(batch.spans[i][0], sum(batch.spans[i])) for i in members])
        result = attend_group(q[rows], batch.positions[rows], [counts[i] for i in members],
                              [batch.caches[i] for i in members], max(batch.ends[i] for i in members), layer, scale,
                              window, sinks)  # fmt: skip
        if out is None:
            out = result.new_empty(q.shape[0], *result.shape[1:])
        out[rows] = result
    assert out is not None
    return out


def attend_group(
    q: torch.Tensor,
    positions: torch.Tensor,
    counts: list[int],
    caches: Sequence[KVCache],
    end: int,
    layer: int,
    scale: float,
    window: Window | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of B streams whose caches are slots of one pool and whose packed query rows (`pack_queries`) come
    to the same tiles: q [N, Hq, D] (stream i's `counts[i]` rows, stream after stream), positions [N] -> [N, Hq, Dv].
    Each stream's packed rows meet its own K/V, read to the reach of `end`, in one batched matrix product over
    B x Hkv matrices of the same shapes as alone, so a stream's numbers do not depend on B (tested bit for bit).
    When the streams hold a run of consecutive slots, their caches are read in place instead of gathered."""
    pool, b, n = caches[0].pool, len(caches), counts[0]
    n_kv = pool.shapes[layer][0]
    group = q.shape[1] // n_kv
    r = reach(end, pool.capacity)
    even = all(m == n for m in counts)
    if even:
        qp = pack_queries(q.view(b, n, *q.shape[1:]), n_kv)  # [B, Hkv, M, D]
        row_pos = packed_positions(positions.view(b, n), group, n * group, r)
    else:
        qp = torch.stack([pack_queries(x, n_kv) for x in q.split_with_sizes(counts)])
        real = max(counts) * group
        row_pos = torch.stack([packed_positions(p, group, real, r) for p in positions.split_with_sizes(counts)])
    slots = [c.slot for c in caches]
    run = slot_run(slots)
    if run is None:
        at = torch.tensor(slots)
        tiles = attend_tiles(qp, pool.k[layer][at, :, :r], pool.v[layer][at, :, :r], row_pos, scale, window, sinks)
    else:  # a run of the pool's slots: their caches read in place, in slot order
        lo, order = run
        k_run, v_run = pool.k[layer][lo : lo + b, :, :r], pool.v[layer][lo : lo + b, :, :r]
        if order is None:
            tiles = attend_tiles(qp, k_run, v_run, row_pos, scale, window, sinks)
        else:
            tiles = attend_tiles(qp[order], k_run, v_run, row_pos[order], scale, window, sinks)[order.argsort()]
    if even:
        return unpack(tiles, n, group).reshape(b * n, q.shape[1], -1)
    return torch.cat([unpack(t, m, group) for t, m in zip(tiles, counts, strict=True)])


def attend_pooled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    key_pos: torch.Tensor,
    scale: float,
    window: Window | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The compiled decode step's attention: row i writes its K/V at (slots[i], positions[i]) of the pool, then
    attends over its slot's cache at `key_pos` (`arange(reach)`: every row of the call reads as far), keys up to its
    own position. Rows of one stream (a token and its drafts) see each other's K/V, since every write comes first.

    q [N, Hq, D]; k/v [N, Hkv, D]; k_pool/v_pool [S, Hkv, C, D/Dv]; slots, positions [N]; key_pos [L] ->
    [N, Hq, Dv]. On a CPU with moelane's kernels built, `kernels.attend_cache` reads each row's keys and values in
    place, one thread a (row, KV head) in key order (docs/kernels.md "Decode attention"). Elsewhere each row's slot
    is gathered at key_pos and its query heads sharing a KV head meet that head's keys in one matrix of a batched
    product, [group, D] x [D, L], the same kernel for every row whatever N and L are. Either way no row's numbers
    depend on the others (`reach`)."""
    n, n_heads, d = q.shape
    n_kv, d_v, length = k_pool.shape[1], v_pool.shape[3], key_pos.shape[0]
    # a reach is never 1 (a cache holds at least a bucket): said, so the compiler never asks (it would, of L == 1)
    torch._check(length > 1)  # type: ignore[no-untyped-call]
    group = n_heads // n_kv
    k_pool[slots, :, positions] = k.to(k_pool.dtype)
    v_pool[slots, :, positions] = v.to(v_pool.dtype)
    if kernels.attends_in_place(q.device):  # the cache read in place (csrc/attention.cpp)
        mask = visible(key_pos, positions, window)  # [N, L]: key_pos is arange(L)
        return kernels.attend_cache(q, k_pool, v_pool, slots, mask, None if sinks is None else sinks.reshape(-1),
                                    scale)  # fmt: skip
    # each row's slot, read at key_pos only: [N, Hkv, L, D]
    # One KV head (multi-query attention) is read without its head dim: inductor cannot lower a product over a
    # gather whose size-1 dim sits beside the unbacked key length (it needs that length to lay the gather out).
    if n_kv == 1:
        at1 = (slots[:, None], key_pos[None, :])
        keys, values = k_pool[:, 0][at1], v_pool[:, 0][at1]
    else:
        at = (slots[:, None, None], torch.arange(n_kv, device=q.device)[None, :, None], key_pos[None, None, :])
        keys = k_pool[at].reshape(n * n_kv, length, d)
        values = v_pool[at].reshape(n * n_kv, length, d_v)
    # (reshaped in steps that split or merge one dim at a time: the compiler then needs no guess about N's size)
    q_rows = q.view(n, n_kv, group, d).reshape(n * n_kv, group, d)
    scores = torch.bmm(q_rows, keys.transpose(1, 2))  # [N * Hkv, group, L]
    scores = scores * scale
    mask = visible(key_pos, positions, window)  # [N, L]
    mask = mask[:, None, :].expand(n, n_kv, length).reshape(n * n_kv, 1, length)
    if sinks is None:
        probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(values.dtype)
    else:  # [Hkv, group] -> one per (row, KV head) matrix row
        sink_rows = sinks[None].expand(n, n_kv, group).reshape(n * n_kv, group, 1)
        probs = with_sinks(scores.masked_fill(~mask, float("-inf")), sink_rows).to(values.dtype)
    return torch.bmm(probs, values).view(n, n_kv, group, d_v).reshape(n, n_heads, d_v)


def row_slots(caches: Sequence[KVCache], spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Each row's cache slot in its pool, [N]: stream i's slot repeated for its rows (`Batch.slots`)."""
    return torch.tensor([c.slot for c in caches]).repeat_interleave(torch.tensor([n for _, n in spans]))


def write_rows(layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
    """Every row's new K/V [N, Hkv, D] into its stream's cache at its position: one copy per pool (K, then V), not
    one per stream."""
    by_pool: dict[KVPool, list[int]] = {}
    for i, cache in enumerate(batch.caches):
        by_pool.setdefault(cache.pool, []).append(i)
    slots = batch.slots if batch.slots is not None else row_slots(batch.caches, batch.spans)  # (a batch made by hand)
    for pool, members in by_pool.items():
        if len(members) == len(batch.caches):
            pool.write(layer, slots, batch.positions, k, v)
        else:
            rows = torch.cat([torch.arange(batch.spans[i][0], sum(batch.spans[i])) for i in members])
            pool.write(layer, slots[rows], batch.positions[rows], k[rows], v[rows])


def slot_run(slots: list[int]) -> tuple[int, torch.Tensor | None] | None:
    """(first slot, the streams in slot order or None if already) when the streams' slots of one pool are a run of
    consecutive slots, which attention can then read in place instead of gathering copies."""
    lo = min(slots)
    if max(slots) - lo != len(slots) - 1:
        return None  # (slots of one pool are distinct, so a span of len - 1 is a run)
    if all(slot == lo + i for i, slot in enumerate(slots)):
        return lo, None
    return lo, torch.tensor(sorted(range(len(slots)), key=slots.__getitem__))


def uniform(batch: Batch) -> bool:
    """Whether every stream of the pass has the same row count and cache pool (one attention group)."""
    n, pool = batch.spans[0][1], batch.caches[0].pool
    return all(m == n for _, m in batch.spans) and all(c.pool is pool for c in batch.caches)
