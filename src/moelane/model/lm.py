"""`LM`: a loaded model with its tokenizer and expert provider, and the passes everything else is built on.

- `forward(rows)`: one batched pass over rows of several streams, each with its own KV cache; row results are
  batch-invariant (docs/batch-invariance.md). Observers get the pass's routing afterwards.
- `logits(ids)`: logits of a fresh sequence.
- `generate` / `stream` / `generate_ids`: one stream, prefill in chunks then one token per pass (compiled when asked).

The compiled decode step is one graph for any number of rows of generated tokens (one stream's next token, or the
rows of many streams and their drafts), of any cache capacity: rows, pool slots and capacity are symbols of the
graph, so its kernels, and every row's bits, are the same whatever shares the call (docs/batch-invariance.md). The
row count is an unbacked symbol: a backed one is specialised to 1 for a lone row, which compiles another graph whose
bits differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import os
import secrets
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from moelane.errors import InputError, MoelaneError, integer
from moelane.model.attention import Batch, PoolPart, reach, row_slots
from moelane.model.cache import KVCache, KVPool, Rows
from moelane.model.checkpoint import ExpertHandle
from moelane.model.config import Config
from moelane.model.decoder import Decoder
from moelane.model.exported import AheadOrCompiled, ExportedStep
from moelane.model.family import Family
from moelane.model.footprint import Footprint, footprint
from moelane.model.provider import ExpertProvider, HostSide, ResidentProvider, RoutingObserver, RoutingRecord
from moelane.model.sampling import SamplingParams, sample
from moelane.model.tokenizer import Detokenizer, StopFilter, Tokenizer

log = logging.getLogger(__name__)
CACHE_BUCKET = 256  # KV capacities are rounded up to this, so streams' caches often share one (batched attention)
STEP_ROWS = 16  # the most rows one call of the compiled decode step takes; more are split over calls
STEP_POOLS = 2  # the most pools (cache capacities) one call reads: a graph per count, each compiled by `warm_up`


def decode_step(model: Decoder, provider: ExpertProvider, parts: list[tuple[torch.Tensor, KVPool, torch.Tensor]]
                ) -> torch.Tensor:  # fmt: skip
    """The decode step: per pool (cache capacity), its rows [n, 3] (each row's token, position and cache slot in the
    pool) and the cache positions they read (`arange(reach)`) -> logits [N, vocab], the parts' rows in order."""
    rows = parts[0][0] if len(parts) == 1 else torch.cat([r for r, _, _ in parts])
    tokens, positions, slots = rows.unbind(1)
    pooled = tuple(PoolPart(r.shape[0], pool, keys) for r, pool, keys in parts)
    batch = Batch(((0, rows.shape[0]),), (), positions, slots=slots, parts=pooled)
    hidden = model(tokens, batch, provider, [])
    return model.logits(hidden)


def mark_symbolic(parts: list[tuple[torch.Tensor, KVPool, torch.Tensor]]) -> None:
    """Mark the step's inputs for torch.compile: the pools' slots and capacity dynamic, and the row count and reach
    unbacked, so the graph is never specialised to the row count (one row included) or the reach it is traced or
    called with."""
    for part, pool, keys in parts:
        pool.mark_dynamic()
        torch._dynamo.decorators.mark_unbacked(part, 0)
        torch._dynamo.decorators.mark_unbacked(keys, 0)


def token_id_list(token_ids: Iterable[int], vocab_size: int, max_context: int) -> list[int]:
    """A prompt's token ids as a list of ints (numpy and 0-d tensor integers too), or InputError: text, floats, an
    empty prompt, ids outside [0, vocab_size), or more than the context holds with room for one new token."""
    if isinstance(token_ids, str | bytes):
        raise InputError("token ids must be integers, not text (encode the text with the model's tokenizer)")
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise InputError("token ids must be integers") from None
    if not ids:
        raise InputError("empty prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InputError(f"token id out of range for a vocabulary of {vocab_size}")
    if len(ids) + 1 > max_context:
        raise InputError(f"prompt of {len(ids)} tokens does not fit the context of {max_context}")
    return ids


class LM:
    def __init__(
        self,
        folder: Path,
        config: Config,
        family: Family[Any],
        model: Decoder,
        tokenizer: Tokenizer,
        expert_handles: dict[int, list[ExpertHandle]],
        provider: ExpertProvider,
        dtype: torch.dtype,
    ) -> None:
        self.folder, self.config, self.family, self.model = folder, config, family, model
        self.tokenizer, self.expert_handles, self.provider, self.dtype = tokenizer, expert_handles, provider, dtype
        self.args = Args(config)
        # Where the model computes (`moelane.device`): its weights, KV pools and experts are there; passes return
        # logits on the CPU, where sampling and the lanes read them.
        self.device = next(model.parameters()).device
        self.moe_layers: list[int] = list(model.moe_layers)
        self.observers: list[RoutingObserver] = []
        self.eos_ids = tokenizer.eos_ids
        self.vocab_size = self.args.vocab_size
        self.max_context = self.args.max_position_embeddings
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._step_rows = STEP_ROWS
        self._step_provider: ExpertProvider = provider
        self.prefill_chunk = 256  # rows per prefill pass; a small expert pool may need fewer
        self.memory: Any = None  # the memory limit, minimum and expert budget `moelane.load` found (MemoryReport)
        self._pools: dict[int, KVPool] = {}  # by capacity
        # Held by every pass and by cache allocation: a pool that grows replaces its tensors, which must not happen
        # while a pass writes into them.
        self._lock = threading.RLock()
        self._closed = False

    # ---- passes -------------------------------------------------------------------------------------------------

    def new_cache(self, capacity: int) -> KVCache:
        """A cache of `capacity` positions: a slot of the pool of that capacity (given back when collected)."""
        if capacity > self.max_context:
            raise InputError(f"a cache of {capacity} positions exceeds the model's context of {self.max_context}")
        with self._lock:
            pool = self._pools.get(capacity)
            if pool is None:
                for unused in [c for c, p in self._pools.items() if p.n_taken == 0]:
                    del self._pools[unused]
                pool = KVPool(self.model.cache_shapes(), capacity, self.dtype, self.device)
                self._pools[capacity] = pool
            return KVCache(pool)

    def footprint(self) -> Footprint | None:
        """What a pass reads (`moelane.model.footprint`), by which the lanes engine prices its rounds."""
        return footprint(self)

    def max_pass_rows(self) -> int | None:
        """Most rows one pass may hold (None: no limit). A pager's expert pool must hold every expert one MoE layer's
        rows route to at once; with a small budget that limits passes (prefill chunks, lanes rounds)."""
        limit = getattr(self.provider, "max_rows", None)
        return int(limit(self.args.num_experts_per_tok)) if callable(limit) else None

    def capacity_for(self, n_prompt: int, max_tokens: int) -> int:
        """The capacity of `cache_for`'s cache: prompt and reply rounded up to a bucket (so streams often share one)."""
        if n_prompt >= self.max_context:
            raise InputError(f"prompt of {n_prompt} tokens does not fit the model's context of {self.max_context}")
        return min(-(-(n_prompt + max_tokens) // CACHE_BUCKET) * CACHE_BUCKET, self.max_context)

    def cache_for(self, n_prompt: int, max_tokens: int) -> KVCache:
        """A cache for a prompt and its reply, of `capacity_for` positions."""
        return self.new_cache(self.capacity_for(n_prompt, max_tokens))

    @torch.no_grad()
    def forward(self, rows: list[Rows], phase: str | None = None, last_only: bool = False) -> list[torch.Tensor]:
        """One pass over several streams' rows -> logits [n_i, vocab] per stream (only the last row's if
        `last_only`). With the decode step compiled, `decode` rows (generated tokens) run through it, all streams'
        together, exactly as a one-stream decode does; the other rows share one eager pass."""
        if self._closed:
            raise MoelaneError("this model was closed (LM.close); load it again to use it")
        if any(t < 0 or t >= self.vocab_size for r in rows for t in r.token_ids):
            raise InputError(f"token id out of range for a vocabulary of {self.vocab_size}")
        with self._lock:
            # zero each cache as far as this pass may read it (its capacity's furthest row sets the reach)
            furthest: dict[int, int] = {}
            for r in rows:
                furthest[r.cache.capacity] = max(furthest.get(r.cache.capacity, 0), r.end)
            for r in rows:
                r.cache.pool.prepare(r.cache.slot, reach(furthest[r.cache.capacity], r.cache.capacity))
            if self.compiled and any(r.decode for r in rows):
                # (a cache of one position is read at a reach of 1, which the step's graph rules out: eager)
                rows = [dataclasses.replace(r, decode=False) if r.cache.capacity < 2 else r for r in rows]
                return self._forward_split(rows, phase, last_only)
            return self._forward_eager(rows, phase, last_only)

    def _forward_eager(self, rows: list[Rows], phase: str | None, last_only: bool) -> list[torch.Tensor]:
        device = self.device
        tokens = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(r.start, r.end) for r in rows]).to(device)
        spans, first = [], 0
        for r in rows:
            spans.append((first, len(r.token_ids)))
            first += len(r.token_ids)
        caches = tuple(r.cache for r in rows)
        slots = row_slots(caches, spans).to(device)
        batch = Batch(tuple(spans), caches, positions, tuple(r.end for r in rows), slots=slots)
        routing: list[tuple[torch.Tensor, torch.Tensor]] = []
        hidden = self.model(tokens, batch, self.provider, routing)
        if self.observers:
            self._notify(routing, rows, phase)
        if last_only:
            picked = hidden[torch.tensor([f + n - 1 for f, n in spans], device=device)]
            return list(torch.split(self.model.logits(picked).cpu(), 1))
        return list(torch.split(self.model.logits(hidden).cpu(), [n for _, n in spans]))

    def _forward_split(self, rows: list[Rows], phase: str | None, last_only: bool) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(rows)
        rest = [i for i, r in enumerate(rows) if not r.decode]
        if rest:
            for i, logits in zip(rest, self._forward_eager([rows[i] for i in rest], phase, last_only), strict=True):
                out[i] = logits
        decode = [i for i, r in enumerate(rows) if r.decode]
        for i, logits in zip(decode, self._decode([rows[i] for i in decode]), strict=True):
            out[i] = logits[-1:] if last_only else logits
        return cast(list[torch.Tensor], out)

    def _decode(self, rows: list[Rows]) -> list[torch.Tensor]:
        """Generated rows through the compiled step -> logits [n_i, vocab] per stream. Rows of caches of different
        capacities (pools) share a call, up to STEP_POOLS pools and STEP_ROWS rows a call, so a round reads each
        routed expert once (each pool's rows attend apart: `attention.PoolPart`). A stream's rows may span two
        calls: the first writes the K/V the second reads."""
        if not rows:  # (a pass whose decode rows all went eager: caches of one position)
            return []
        by_pool: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_pool.setdefault(id(r.cache.pool), []).append(i)
        flat = [(i, t, rows[i].start + j) for members in by_pool.values() for i in members
                for j, t in enumerate(rows[i].token_ids)]  # fmt: skip
        calls: list[list[tuple[int, int, int]]] = []
        pools: list[set[int]] = []  # each call's pools
        for row in flat:
            pool = id(rows[row[0]].cache.pool)
            if (
                not calls
                or len(calls[-1]) == self._step_rows
                or (pool not in pools[-1] and len(pools[-1]) == STEP_POOLS)
            ):
                calls.append([])
                pools.append(set())
            calls[-1].append(row)
            pools[-1].add(pool)
        outs = [self._decode_call(rows, call) for call in calls]
        logits = (outs[0] if len(outs) == 1 else torch.cat(outs)).cpu()
        out: list[torch.Tensor | None] = [None] * len(rows)
        first = 0
        for i in (i for members in by_pool.values() for i in members):  # (flat's order)
            out[i] = logits[first : first + len(rows[i].token_ids)]
            first += len(rows[i].token_ids)
        return cast(list[torch.Tensor], out)

    def _decode_call(self, rows: list[Rows], call: list[tuple[int, int, int]]) -> torch.Tensor:
        """One call of the compiled step over `call`'s rows ((stream, token, position), grouped by pool) -> logits
        [len(call), vocab]."""
        assert self._compiled is not None
        parts: list[tuple[torch.Tensor, KVPool, torch.Tensor]] = []
        for _, group in itertools.groupby(call, key=lambda row: id(rows[row[0]].cache.pool)):
            members = list(group)
            cache = rows[members[0][0]].cache
            part = torch.tensor([(t, position, rows[i].cache.slot) for i, t, position in members], device=self.device)
            keys = torch.arange(reach(max(position for _, _, position in members) + 1, cache.pool.capacity),
                                device=self.device)  # fmt: skip
            parts.append((part, cache.pool, keys))
        if not isinstance(self._compiled, AheadOrCompiled):  # (the exported step marks them if it falls back)
            mark_symbolic(parts)
        logits: torch.Tensor = self._compiled(parts)
        return logits

    def _notify(self, routing: list[tuple[torch.Tensor, torch.Tensor]], rows: list[Rows], phase: str | None) -> None:
        if phase is None:
            phase = "decode" if all(len(r.token_ids) == 1 for r in rows) else "prefill" if len(rows) == 1 else "mixed"
        stream_ids = tuple(r.stream_id for r in rows for _ in r.token_ids)
        if routing:  # (observers read the routing on the CPU)
            ids = torch.stack([i for i, _ in routing]).cpu()
            weights = torch.stack([w for _, w in routing]).float().cpu()
        else:
            ids = torch.zeros(0, len(stream_ids), 0, dtype=torch.long)
            weights = ids.float()
        record = RoutingRecord(ids, weights, phase, stream_ids)
        for observer in self.observers:
            observer.observe(record)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] of a fresh sequence (up to the whole context)."""
        ids = token_id_list(token_ids, self.vocab_size, self.max_context + 1)
        cache = self.cache_for(len(ids), 0)
        return self.forward([Rows(cache, ids, 0)])[0]

    # ---- one stream ---------------------------------------------------------------------------------------------

    def enable_compile(self, cuda_graphs: bool = False, ahead: bool | None = None) -> None:
        """Compile the decode step whole (fullgraph): one graph for every row count, pool size and cache capacity,
        compiled at its first call. `cuda_graphs` (on a CUDA device; a trial, docs/accelerator.md): Inductor records
        CUDA graphs of the step (`mode="reduce-overhead"`'s), one per input shape it meets.

        `ahead` (default: on, unless the environment sets `MOELANE_STEP=dynamo`): with every expert resident on the
        CPU, the step is exported and compiled ahead of time instead (`moelane.model.exported`), one library per
        pool count, which skips Dynamo's and Inductor's Python on each call; where that fails, torch.compile's."""
        # All experts resident: one graph. A pager's store hands back to Python at its residency check.
        whole = isinstance(self.provider, ResidentProvider)
        if ahead is None:
            ahead = os.environ.get("MOELANE_STEP", "exported") != "dynamo"
        # The modules never change after load, so their guards are skipped: checking them on every step cost ~20% of
        # a 115M model's decode here. Tensor shapes and the provider are still guarded.
        options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # Inductor's wrapper asserts every input's and extern op output's sizes, strides and alignment on each call
        # (~170 asserts a step on the inflated model); Dynamo's guards already hold the inputs to the compiled
        # shapes, and the op's fake gives its output's. Without them the 115M model's int4 decode went 343 -> 359
        # tok/s (docs/kernels.md).
        options |= {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
        if cuda_graphs:
            options["triton.cudagraphs"] = True
        # Dynamo keeps its graphs on the code object, and with module guards skipped it cannot tell two LMs of the
        # same tensor shapes apart (another family's graph was run: KeyError inside). So each LM compiles a copy of
        # the step's code, which holds only its own graphs. Static shapes, except the row count and the pool
        # dimensions that `_decode` and `KVPool` mark.
        step = types.FunctionType(LM._decode_step.__code__.replace(), LM._decode_step.__globals__, "_decode_step")
        self._compiled = torch.compile(types.MethodType(step, self), fullgraph=whole, dynamic=False, options=options)
        if ahead and whole and not cuda_graphs and self.device.type == "cpu":
            exported = ExportedStep(decode_step, self.model, self.provider, self.model.cache_shapes(), self.dtype,
                                    self.device, STEP_ROWS, self.max_context)  # fmt: skip
            self._compiled = AheadOrCompiled(exported, self._compiled, mark_symbolic)
        # Past a graph break the row count is the next graph's input, which Dynamo specialises (one graph, other
        # bits, per count): with a pager's store, rows go through one at a time, as a lone stream's do.
        self._step_rows = STEP_ROWS if whole else 1
        self._step_provider = self.provider if whole else HostSide(self.provider)

    def close(self) -> None:
        """Release what the expert provider holds (an expert store's threads and files); the LM is not used after
        (a pass then raises MoelaneError)."""
        self._closed = True
        close = getattr(self.provider, "close", None)
        if close is not None:
            close()

    def disable_compile(self) -> None:
        """Run every pass eagerly again."""
        self._compiled = None

    @property
    def compile_enabled(self) -> bool:
        return self._compiled is not None

    @property
    def compiled(self) -> bool:
        """Whether decode rows run compiled (enabled, and no routing observer needs the eager pass)."""
        return self._compiled is not None and not self.observers

    def warm_up(self, n_prompt: int, max_tokens: int, pools: int = 1) -> bool:
        """Compile the decode step (one graph for every row count and cache size, and one for each number of pools
        a call reads, up to `pools`: a server's rounds mix cache capacities) before anything is timed. Where it cannot
        be compiled (no C++ compiler for PyTorch's inductor, a platform or a model shape the compiler fails on), say
        so in one line and run eagerly: the same tokens, more slowly. -> whether it compiled."""
        if self._compiled is None:
            return False
        try:
            self.step(0, 0, self.cache_for(n_prompt, min(max_tokens, self.max_context - n_prompt)))
            capacities = range(CACHE_BUCKET, self.max_context + 1, CACHE_BUCKET)[: min(pools, STEP_POOLS)]
            if len(capacities) > 1:
                caches = [self.new_cache(c) for c in capacities]
                self.forward([Rows(c, [0], 0, decode=True) for c in caches], phase="decode")
        except Exception as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            log.warning("running eagerly: compiling the decode step failed (%s)", reason)
            self.disable_compile()
            return False
        return True

    def _decode_step(self, parts: list[tuple[torch.Tensor, KVPool, torch.Tensor]]) -> torch.Tensor:
        return decode_step(self.model, self._step_provider, parts)

    @torch.no_grad()
    def step(self, token: int, position: int, cache: KVCache) -> torch.Tensor:
        """Feed one token at `position`; logits [vocab] for the next. Compiled when enabled and nobody observes."""
        return self.forward([Rows(cache, [token], position, decode=True)], phase="decode")[0][0]

    def generate_ids(
        self,
        prompt_ids: list[int],
        max_tokens: int = 256,
        params: SamplingParams | None = None,
        prefill_chunk: int | None = None,
        stop_ids: frozenset[int] | None = None,
    ) -> Iterator[int]:
        """Token ids of the reply, one at a time; ends at an EOS id (not yielded) or after `max_tokens`. Its
        arguments are checked when it is called (InputError), not at the first token."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams (moelane.model.sampling), got {type(params).__name__}")
        try:
            params.check_vocab(self.vocab_size)
        except ValueError as e:
            raise InputError(str(e)) from None
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=secrets.randbits(62))
        max_tokens = whole_number("max_tokens", max_tokens)
        prefill_chunk = self.prefill_chunk if prefill_chunk is None else whole_number("prefill_chunk", prefill_chunk)
        prompt_ids = token_id_list(prompt_ids, self.vocab_size, self.max_context)
        max_tokens = min(max_tokens, self.max_context - len(prompt_ids))
        stop_ids = self.eos_ids if stop_ids is None else frozenset(stop_ids)
        return self._generate_ids(prompt_ids, max_tokens, params, prefill_chunk, stop_ids)

    def _generate_ids(
        self, prompt_ids: list[int], max_tokens: int, params: SamplingParams, chunk: int, stop_ids: frozenset[int]
    ) -> Iterator[int]:
        cache = self.cache_for(len(prompt_ids), max_tokens)
        with torch.no_grad():
            for start in range(0, len(prompt_ids), chunk):
                rows = Rows(cache, prompt_ids[start : start + chunk], start)
                logits = self.forward([rows], phase="prefill", last_only=True)[0][0]
        position, reply = len(prompt_ids), list[int]()
        for i in range(max_tokens):
            token = sample(logits, params, position, reply)
            if token in stop_ids:
                return
            yield token
            reply.append(token)
            if i + 1 < max_tokens:
                logits = self.step(token, position, cache)
            position += 1

    def stream(
        self,
        prompt: str,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
    ) -> Iterator[str]:
        """Text pieces of the reply as they are produced, cut before the first stop string. A character cut off by
        `max_tokens` ends it as U+FFFD, as `moelane run` prints it."""
        if not isinstance(prompt, str):
            raise InputError(f"prompt must be text (a str), got {type(prompt).__name__}; token ids go to generate_ids")
        stops_list = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops_list, list | tuple) or not all(isinstance(s, str) for s in stops_list):
            raise InputError(f"stop must be a string or a list of strings, got {stop!r}")
        params = sampling_params(temperature, top_p, top_k, seed)
        detok, stops = Detokenizer(self.tokenizer), StopFilter(list(stops_list))
        for token in self.generate_ids(self.tokenizer.encode_prompt(prompt, self.max_context), max_tokens, params):
            if piece := stops.push(detok.push([token])):
                yield piece
            if stops.stopped:
                return
        if tail := stops.push(detok.flush()) + stops.flush():
            yield tail

    def generate(self, prompt: str, **kwargs: Any) -> str:
        """The whole reply as text (same settings as `stream`)."""
        return "".join(self.stream(prompt, **kwargs))


def whole_number(name: str, value: object) -> int:
    """`value` as an int >= 1 (numpy and 0-d tensor integers too), or InputError naming it: not a float that
    happens to be whole, nor a bool."""
    try:
        n = integer(name, value)
    except ValueError:
        raise InputError(f"{name} must be an integer >= 1, got {value!r}") from None
    if n < 1:
        raise InputError(f"{name} must be >= 1, got {n}")
    return int(n)


def sampling_params(temperature: float, top_p: float, top_k: int, seed: int | None, **adjust: Any) -> SamplingParams:
    """Checked sampling settings (`adjust`: logit_bias, presence_penalty, frequency_penalty); InputError if bad."""
    try:
        return SamplingParams(temperature, top_p, top_k, seed, **adjust)
    except ValueError as e:
        raise InputError(str(e)) from None


class Args:
    """The config fields every family has, under one spelling (what the pager and the benchmarks read)."""

    def __init__(self, config: Config) -> None:
        self.model_type: str = config.model_type
        self.vocab_size: int = config.vocab_size
        self.hidden_size: int = config.hidden_size
        self.num_hidden_layers: int = config.num_hidden_layers
        self.num_experts: int = config.n_experts
        self.num_experts_per_tok: int = config.top_k or 0
        self.max_position_embeddings: int = config.max_position_embeddings
