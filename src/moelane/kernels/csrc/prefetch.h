// How the products run ahead of their weight streams. A thread reads a tile's rows as separate sequential streams
// (gather_linear.cpp: 4 or 8 rows a block apart), and the hardware prefetcher alone falls behind them: it stops at
// every 4 KiB page and ramps up again. So each stream is also prefetched kPrefetchBytes ahead:
// - rows of at most kPrefetchRowBytes, per tile, all of the row kPrefetchBytes ahead (gather_linear.cpp `run_item`;
//   int8 192-column rows +15%, 2 KiB against 4 KiB +3-5%, docs/kernels.md);
// - longer rows, inside the tile, one line a row per 64-byte chunk (tiles_avx512.h): one MoE layer streamed from
//   memory, 2 threads, +2-7% on the inflated model's 8 KiB w2 rows, +10-19% on Qwen3-30B-A3B's 2 KiB w13 rows
//   (`bench/kernel_ab.py`, docs/kernels.md). A whole long row prefetched per tile lost up to 20% (a burst a tile).
// Prefetches change no result bits.
#pragma once
#include <cstdint>

namespace moelane {

constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kPrefetchRowBytes = 768;

}  // namespace moelane
