// AVX2 tiles (CPUs with AVX2, FMA and F16C but no AVX-512: Intel client parts, AMD before Zen 4): the arithmetic of
// tiles_avx512.h lane for lane, so the same bits. Each of its 16 fp32 lanes is kept here as two 8-lane halves
// (lanes 0-7, 8-15); a lane's sums run in the same chunk order, and `reduce16` is reduce4's tree: s[l] = v[l] +
// v[l+8], t[l] = s[l] + s[l+4], (t0+t2) + (t1+t3).
//
// int8 and int4 take the exact int32 sum of a lane's code products by another route than vpdpbusd, the same value:
// int8 by vpmaddubsw on |w| and x with w's sign (a pair sums to at most 2 x 128 x 127, no saturation), int4 by
// vpmaddubsw on the stored nibbles (0..15) plus the rows' correction for their bias of 8 (activations.h).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "activations.h"
#include "prefetch.h"

namespace moelane {
namespace {

constexpr const char* kIsa = "avx2";
constexpr int64_t kMaxGroups = 1024;  // as tiles_avx512.h: above it, gather_linear.cpp widens scales per work item

// fp16 scales as fp32 (exact). out needs room for n.
inline void widen_scales(const uint16_t* s, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(s[i]);
}
inline float scale_of(uint16_t h) { return _cvtsh_ss(h); }
inline float scale_of(float s) { return s; }

// One lane set of 16 as two halves.
struct V16 {
  __m256 h[2];
};

inline float reduce16(const V16& v) {
  const __m256 s = _mm256_add_ps(v.h[0], v.h[1]);
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));  // (t0 + t2, t1 + t3)
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

template <int NM>
inline void finish(const V16 (&acc)[NM][4], float* out) {
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < 4; ++r) out[4 * m + r] = reduce16(acc[m][r]);
}

template <int NM>
inline void zero(V16 (&acc)[NM][4]) {
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r].h[0] = acc[m][r].h[1] = _mm256_setzero_ps();
}

inline __m256 load_w(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_w(const uint16_t* p) {  // bf16 bits -> fp32
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// p, or where only `len` < N elements are left in its row, a copy into the zeroed `buf` (AVX2 has no byte-masked
// loads; past the row a zero weight meets a zero activation).
template <class T, int N>
inline const T* padded(const T* p, int64_t len, T (&buf)[N]) {
  if (len >= N) return p;
  std::memset(buf, 0, sizeof(buf));
  std::memcpy(buf, p, len * sizeof(T));
  return buf;
}

// f32 or bf16 rows of n columns: chunk c of 16 columns into lane c % 16 by FMA; the last chunk zero-padded.
// The float tile's register blocking: a tile's 4 x NM x 2 half-lane accumulators would take 8 NM of AVX2's 16 ymm
// registers, so from 2 activation rows on the tile runs in passes of 2 rows and one half (8 accumulators, 4 weight
// vectors), a last single row both halves at once, over spans of kFloatSpan columns (their weights stay in L1 between
// the passes); each accumulator waits in memory between its passes. Branches for the zero-padded last chunk stay out
// of the passes' loops (inside, they cost GCC its registers: every FMA loaded and stored its accumulator). A lane
// still sums its chunks in order by the same FMAs: the bits of one loop over the row.
constexpr int64_t kFloatSpan = 512;

// Prefetch each of 4 weight rows' streams at element `at` (prefetch.h).
template <class T>
inline void ahead_of(const T* const* w, int64_t at) {
  for (int r = 0; r < 4; ++r) prefetch_ahead(w[r] + at);
}

// A pass's accumulators: acc[m][r].h[h0 .. h0 + NH) of P activation rows copied into a local array, which GCC keeps
// in registers through a loop without branches, and back.
template <int P, int NH>
inline void take(V16 (*acc)[4], int h0, __m256 (&a)[P][4][NH]) {
  for (int m = 0; m < P; ++m)
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < NH; ++h) a[m][r][h] = acc[m][r].h[h0 + h];
}
template <int P, int NH>
inline void give(const __m256 (&a)[P][4][NH], int h0, V16 (*acc)[4]) {
  for (int m = 0; m < P; ++m)
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < NH; ++h) acc[m][r].h[h0 + h] = a[m][r][h];
}

// Chunks c0 .. c1 (whole chunks of 16 columns) into acc[m][r].h[h0 .. h0 + NH) for P activation rows; `prefetch`:
// the pass that runs the weight streams ahead (prefetch.h).
template <int P, int NH, class W>
inline void float_pass(const float* const* xs, const W* const* w, int64_t c0, int64_t c1, int h0, bool prefetch,
                       V16 (*acc)[4]) {
  __m256 a[P][4][NH];
  take(acc, h0, a);
  for (int64_t c = c0; c < c1; c += 16) {
    if (prefetch && (c * sizeof(W)) % 64 == 0) ahead_of(w, c);
    for (int h = 0; h < NH; ++h) {
      __m256 wv[4];
      for (int r = 0; r < 4; ++r) wv[r] = load_w(w[r] + c + 8 * (h0 + h));
      for (int m = 0; m < P; ++m) {
        const __m256 xv = _mm256_loadu_ps(xs[m] + c + 8 * (h0 + h));
        for (int r = 0; r < 4; ++r) a[m][r][h] = _mm256_fmadd_ps(xv, wv[r], a[m][r][h]);
      }
    }
  }
  give(a, h0, acc);
}

// The passes of chunks c0 .. c1 for activation rows 0 .. P (P <= 4): pairs of rows a half at a time, a last single
// row both halves at once.
template <int P, class W>
inline void float_span(const float* const* xs, const W* const* w, int64_t c0, int64_t c1, bool ahead,
                       V16 (*acc)[4]) {
  if constexpr (P == 1) {
    float_pass<1, 2>(xs, w, c0, c1, 0, ahead, acc);
  } else {
    float_pass<2, 1>(xs, w, c0, c1, 0, ahead, acc);
    float_pass<2, 1>(xs, w, c0, c1, 1, false, acc);
    if constexpr (P > 2) float_span<P - 2>(xs + 2, w, c0, c1, false, acc + 2);
  }
}

// f32 or bf16 rows of n columns: chunk c of 16 columns into lane c % 16 by FMA; the last chunk zero-padded.
template <int NM, class W>
inline void tile_float(const float* const* xs, const W* const* w, int64_t n, float* out) {
  static_assert(NM >= 1 && NM <= 4, "a tile holds 1 to 4 activation rows");
  V16 acc[NM][4];
  zero<NM>(acc);
  const bool ahead = n * static_cast<int64_t>(sizeof(W)) > kPrefetchRowBytes;  // (prefetch.h)
  const int64_t whole = n / 16 * 16;
  for (int64_t c0 = 0; c0 < whole; c0 += kFloatSpan)
    float_span<NM>(xs, w, c0, std::min(whole, c0 + kFloatSpan), ahead, acc);
  if (whole < n) {
    alignas(32) W wt[4][16];
    alignas(32) float xt[NM][16];
    const W* wp[4];
    const float* xp[NM];
    for (int r = 0; r < 4; ++r) wp[r] = padded(w[r] + whole, n - whole, wt[r]);
    for (int m = 0; m < NM; ++m) xp[m] = padded(xs[m] + whole, n - whole, xt[m]);
    float_span<NM>(xp, wp, 0, 16, false, acc);
  }
  finish<NM>(acc, out);
}

// Per lane l of 8: the exact sum of w[4l+j] * x[4l+j] (w any int8, x in [-127, 127]).
inline __m256i dot_int8(__m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// Per lane l of 8: the exact sum of u[4l+j] * x[4l+j] (u in 0..15, x in [-127, 127]).
inline __m256i dot_nibbles(__m256i u, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// The scales of a half chunk's 8 lanes, which cover `span` columns from `first` (32 for int8, 64 for int4) in equal
// shares of one to four groups; 0 past the row's n_groups (`tail`: the last chunk, which may reach past them; a whole
// chunk never does).
template <int G, int span, bool tail, class S>
inline __m256 half_scales(const S* s, int64_t first, int64_t n_groups) {
  constexpr int per = span / G < 1 ? 1 : span / G;
  static_assert(per == 1 || per == 2 || per == 4, "a half chunk holds 1, 2 or 4 groups");
  float g[per];
  for (int i = 0; i < per; ++i) {
    const int64_t index = first / G + i;
    g[i] = !tail || index < n_groups ? scale_of(s[index]) : 0.0f;
  }
  if constexpr (per == 1) return _mm256_set1_ps(g[0]);
  else if constexpr (per == 2) return _mm256_setr_m128(_mm_set1_ps(g[0]), _mm_set1_ps(g[1]));
  else return _mm256_setr_ps(g[0], g[0], g[1], g[1], g[2], g[2], g[3], g[3]);
}

// The integer tiles' loops, as the float tile's (above): the accumulators copied into a local array for a loop
// without branches over whole chunks, and the last partial chunk after it, with only the halves (32 bytes of each
// weight row) that hold columns; a half cut short by n is copied into a zeroed buffer. A half past the row is
// skipped: its lanes' codes are 0 (activations.h), so it would add +0 to each accumulator, and an accumulator that
// starts at +0 is never -0 (round to nearest gives +0 for x + (-x)): skipping it leaves the same bits (the AVX-512
// tiles add those zero lanes).

// Chunks k0 .. k1 of int8 rows (64 columns a chunk), halves 0 .. NH; chunk k of row r at w[r] + step x k.
template <int NM, int G, int NH, bool tail, class S>
inline void int8_chunks(const QRow* const* xs, const int8_t* const* w, int64_t step, const S* const* s, int64_t k0,
                        int64_t k1, int64_t n_groups, bool prefetch, V16 (*acc)[4]) {
  __m256 a[NM][4][NH];
  take(acc, 0, a);
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch) ahead_of(w, step * k);
    for (int h = 0; h < NH; ++h) {
      __m256i wv[4];
      __m256 sv[4];
      for (int r = 0; r < 4; ++r) {
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + step * k + 32 * h));
        sv[r] = half_scales<G, 32, tail>(s[r], 64 * k + 32 * h, n_groups);
      }
      for (int m = 0; m < NM; ++m) {
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[m]->q + 64 * k + 32 * h));
        const __m256 dv = _mm256_loadu_ps(xs[m]->d + 16 * k + 8 * h);
        for (int r = 0; r < 4; ++r) {
          const __m256 sum = _mm256_cvtepi32_ps(dot_int8(wv[r], xq));
          a[m][r][h] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dv, sv[r]), a[m][r][h]);
        }
      }
    }
  }
  give(a, 0, acc);
}

// Chunks k0 .. k1 of int4 rows (128 columns, 64 bytes a chunk), halves 0 .. NH; chunk k of row r at p[r] + step x k.
template <int NM, int G, int NH, bool tail, class S>
inline void int4_chunks(const QRow* const* xs, const uint8_t* const* p, int64_t step, const S* const* s, int64_t k0,
                        int64_t k1, int64_t n_groups, bool prefetch, V16 (*acc)[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 a[NM][4][NH];
  take(acc, 0, a);
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch) ahead_of(p, step * k);
    for (int h = 0; h < NH; ++h) {
      __m256i even[NM], odd[NM], corr[NM];
      __m256 dv[NM];
      for (int m = 0; m < NM; ++m) {
        const int8_t* x = xs[m]->q + 128 * k + 32 * h;
        even[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        odd[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64));
        corr[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[m]->corr + 16 * k + 8 * h));
        dv[m] = _mm256_loadu_ps(xs[m]->d + 16 * k + 8 * h);
      }
      for (int r = 0; r < 4; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[r] + step * k + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256 sv = half_scales<G, 64, tail>(s[r], 128 * k + 64 * h, n_groups);
        for (int m = 0; m < NM; ++m) {
          const __m256i both = _mm256_add_epi32(dot_nibbles(lo, even[m]), dot_nibbles(hi, odd[m]));
          const __m256i sum = _mm256_add_epi32(corr[m], both);
          a[m][r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dv[m], sv), a[m][r][h]);
        }
      }
    }
  }
  give(a, 0, acc);
}

// An integer tile over rows of `row_bytes` bytes (whole chunks of 64, then the last partial chunk's halves that hold
// columns, above); chunks(Halves<NH>, std::bool_constant<tail>, weight rows, step, k0, k1, prefetch, acc) runs its
// kind's `*_chunks<NM, G, NH, tail>`.
template <int NH>
using Halves = std::integral_constant<int, NH>;

template <int NM, class T, class Chunks>
inline void integer_tile(const T* const* w, int64_t row_bytes, bool ahead, Chunks chunks, float* out) {
  V16 acc[NM][4];
  zero<NM>(acc);
  const int64_t whole = row_bytes / 64, left = row_bytes - 64 * whole;
  chunks(Halves<2>{}, std::false_type{}, w, 64, 0, whole, ahead, acc);
  const T* hp[4];
  if (left > 0 && left <= 32) {
    alignas(32) T tail[4][32];
    for (int r = 0; r < 4; ++r) hp[r] = padded(w[r] + 64 * whole, left, tail[r]);
    chunks(Halves<1>{}, std::true_type{}, hp, 0, whole, whole + 1, false, acc);
  } else if (left > 32) {
    alignas(32) T tail[4][64];
    for (int r = 0; r < 4; ++r) hp[r] = padded(w[r] + 64 * whole, left, tail[r]);
    chunks(Halves<2>{}, std::true_type{}, hp, 0, whole, whole + 1, false, acc);
  }
  finish<NM>(acc, out);
}

// int8 weights against int8 activations (activations.h, Layout::Bytes): per 64-column chunk k and lane l (columns
// 64k + 4l .. + 3) the exact int32 sum, converted and weighed by the lane's activation scale x weight scale, into acc
// by FMA, as tiles_avx512.h's tile_int8.
template <int NM, int G, class S>
inline void tile_int8(const QRow* const* xs, const int8_t* const* q, const S* const* s, int64_t n, float* out) {
  const int64_t n_groups = n / G;
  integer_tile<NM>(
      q, n, n > kPrefetchRowBytes,  // (prefetch.h)
      [&](auto halves, auto tail, const int8_t* const* w, int64_t step, int64_t k0, int64_t k1, bool prefetch,
          V16 (*acc)[4]) {
        int8_chunks<NM, G, decltype(halves)::value, decltype(tail)::value>(xs, w, step, s, k0, k1, n_groups, prefetch,
                                                                           acc);
      },
      out);
}

// int4 (tiers' layout, stored + 8) against activations in the Nibbles layout (activations.h): per 128-column chunk
// k, 64 bytes whose low nibbles meet the chunk's even codes and whose high nibbles its odd ones, lane l (bytes 4l ..
// + 3, columns 128k + 8l .. + 7) summing both plus its correction in int32, as tiles_avx512.h's tile_int4 (a padded
// half's zero nibbles meet zero codes).
template <int NM, int G, class S>
inline void tile_int4(const QRow* const* xs, const uint8_t* const* p, const S* const* s, int64_t n, float* out) {
  const int64_t n_groups = n / G;
  integer_tile<NM>(
      p, n / 2, n / 2 > kPrefetchRowBytes,  // (prefetch.h)
      [&](auto halves, auto tail, const uint8_t* const* w, int64_t step, int64_t k0, int64_t k1, bool prefetch,
          V16 (*acc)[4]) {
        int4_chunks<NM, G, decltype(halves)::value, decltype(tail)::value>(xs, w, step, s, k0, k1, n_groups, prefetch,
                                                                           acc);
      },
      out);
}

// Interleaved int8 (tiles_avx512.h's tile_int8_rows16): a block's 16 rows as two halves of 8 lanes (rows 0-7: bytes
// 0-31 of each 64, rows 8-15: bytes 32-63), each lane's unit sums exact (`dot_int8` with the 4 activation codes
// broadcast), then as tile_int8_rows16 there: the same bits.
template <int NM, int G>
inline void tile_int8_rows16(const QUnits* const* xs, const int8_t* w, const uint16_t* s, int64_t n_units,
                             float* const* out) {
  constexpr int U = G < 32 ? G : 32, J = U / 4, per_group = G / U;
  V16 acc[NM];
  for (int m = 0; m < NM; ++m) acc[m].h[0] = acc[m].h[1] = _mm256_setzero_ps();
  for (int64_t u = 0; u < n_units; ++u, w += 64 * J) {
    for (int j = 0; j < J; ++j) prefetch_ahead(w + 64 * j);
    for (int h = 0; h < 2; ++h) {
      __m256i wv[J];
      for (int j = 0; j < J; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * h));
      const __m256 sv =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + (u / per_group) * 16 + 8 * h)));
      for (int m = 0; m < NM; ++m) {
        const int8_t* xq = xs[m]->q + U * u;
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < J; ++j)
          sum = _mm256_add_epi32(sum, dot_int8(wv[j], _mm256_set1_epi32(codes4(xq + 4 * j))));
        acc[m].h[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sv, _mm256_set1_ps(xs[m]->d[u])),
                                      acc[m].h[h]);
      }
    }
  }
  for (int m = 0; m < NM; ++m) {
    _mm256_storeu_ps(out[m], acc[m].h[0]);
    _mm256_storeu_ps(out[m] + 8, acc[m].h[1]);
  }
}

}  // namespace
}  // namespace moelane

#include "tiles_rows8.h"
