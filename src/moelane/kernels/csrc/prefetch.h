// How the products run ahead of their weight streams. A thread reads a tile's rows as separate sequential streams
// (gather_linear.cpp: 4 or 8 rows a block apart), and the hardware prefetcher alone falls behind them: it stops at
// every 4 KiB page and ramps up again. So each stream is also prefetched kPrefetchBytes ahead:
// - rows of at most kPrefetchRowBytes, per tile, all of the row kPrefetchBytes ahead (gather_linear.cpp `run_item`;
//   int8 192-column rows +15%, 2 KiB against 4 KiB +3-5%, docs/kernels.md);
// - longer rows, inside the tile, one line a row per 64-byte chunk (tiles_avx512.h): one MoE layer streamed from
//   memory, 2 threads, +2-7% on the inflated model's 8 KiB w2 rows, +10-19% on Qwen3-30B-A3B's 2 KiB w13 rows
//   (`bench/kernel_ab.py`, docs/kernels.md). A whole long row prefetched per tile lost up to 20% (a burst a tile).
// Built with MOELANE_NO_PREFETCH (kernels/build.py: AMD CPUs with AVX-512, Zen 4 on) only the AVX-512 tiles' int4
// products (`prefetch_line`) and the interleaved int8 tile (`prefetch_block`) prefetch; the others use
// `prefetch_ahead`, the AVX2 tiles' int4 too, built there for tests only. There the software prefetches 2 KiB ahead
// cost f32 / bf16 / row-major int8 5-22% of a streamed MoE layer, where int4's, with twice int8's arithmetic a byte,
// measured 0.95-1.03x without (docs/kernels.md). The interleaved int8 tile reads one stream of 16-row blocks; 8 KiB
// ahead it ran 1.13-1.33x faster than without (2 KiB: 1.04-1.08x; 12-16 KiB as 8), where the row-major tiles' 4
// streams gained nothing that far ahead (docs/kernels.md). Prefetches change no result bits.
#pragma once
#include <cstdint>

namespace moelane {

constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kPrefetchRowBytes = 768;
#ifdef MOELANE_NO_PREFETCH
constexpr bool kPrefetch = false;
constexpr int64_t kBlockPrefetchBytes = 8192;
#else
constexpr bool kPrefetch = true;
constexpr int64_t kBlockPrefetchBytes = kPrefetchBytes;
#endif

// The line `Ahead` bytes past p, into all cache levels (as _MM_HINT_T0).
template <int64_t Ahead = kPrefetchBytes>
inline void prefetch_line(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + Ahead, 0, 3);
}

// prefetch_line where this build prefetches.
inline void prefetch_ahead(const void* p) {
  if constexpr (kPrefetch) prefetch_line(p);
}

// The line kBlockPrefetchBytes past p, in every build: the interleaved int8 tile's stream of blocks.
inline void prefetch_block(const void* p) { prefetch_line<kBlockPrefetchBytes>(p); }

}  // namespace moelane
