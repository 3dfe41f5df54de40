// AVX-512 tiles: the dot products of NM (1..4) activation rows with 4 weight rows, one fp32 accumulator per
// (activation row, weight row), reduced by `reduce4`'s fixed tree. tiles_generic.h is the same arithmetic lane for lane
// in plain C++ (it documents the lane layout); both give the same bits where the CPU has FMA.
//
// f32 and bf16: a weight is widened to its exact fp32 value before it meets x (bf16 -> fp32), so each is the same
// fp32 dot product of x with the row: chunk c of 16 columns into lane c % 16 by FMA, in column order. int8 and int4
// multiply codes by the activations' int8 codes (activations.h; `tile_int8`, `tile_int4`), as llama.cpp's Q8_0 and
// Q4_0 do. Scales come as a pointer per tile row: fp32 (widened by the caller) or fp16 (widened here, see
// `tile_scales`).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "activations.h"
#include "prefetch.h"

namespace moelane {
namespace {  // internal linkage: calls are direct (no PLT), and may be inlined

constexpr const char* kIsa = "avx512";

// fp16 scales as fp32, so each group's scale is one broadcast from memory (no shuffle-port work). out needs room for
// n rounded up to 16.
inline void widen_scales(const uint16_t* s, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
  if (i < n) {  // a whole vector stored: a masked store would not forward to the loads that follow
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, s + i)));
  }
}

// A tile's rows of n scales as fp32 in sf: fp16 rows widened into `local` (in the tile's stack frame, so the loop
// addresses them from the stack pointer: no row pointers to hold; rows of 24-256 groups lost 4-7% from L2 to
// pointers), fp32 rows as given.
constexpr int64_t kMaxGroups = 1024;  // scales per row the stack holds (a multiple of 16)
inline void tile_scales(const uint16_t* const* s, int64_t n, float (&local)[4][kMaxGroups], const float** sf) {
  for (int r = 0; r < 4; ++r) {
    widen_scales(s[r], n, local[r]);
    sf[r] = local[r];
  }
}
inline void tile_scales(const float* const* s, int64_t, float (&)[4][kMaxGroups], const float** sf) {
  for (int r = 0; r < 4; ++r) sf[r] = s[r];
}

inline __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_w(const uint16_t* p) {  // bf16 bits -> fp32
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load_w(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load_w(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// The sums of v0..v3's lanes to out[0..3]: per row, s[l] = v[l] + v[l+8], t[l] = s[l] + s[l+4], (t0+t2) + (t1+t3).
inline void reduce4(__m512 v0, __m512 v1, __m512 v2, __m512 v3, float* out) {
  __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  c = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
  c = _mm512_add_ps(c, _mm512_permute_ps(c, 0xB1));
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, c)));
}

template <int NM>
inline void finish(__m512 (&acc)[NM][4], float* out) {
  for (int m = 0; m < NM; ++m) reduce4(acc[m][0], acc[m][1], acc[m][2], acc[m][3], out + 4 * m);
}

// f32 or bf16 rows of n columns; the last chunk masked.
template <int NM, class W>
inline void tile_float(const float* const* xs, const W* const* w, int64_t n, float* out) {
  __m512 acc[NM][4];
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t c = 0;
  const bool ahead = n * static_cast<int64_t>(sizeof(W)) > kPrefetchRowBytes;  // (prefetch.h)
  for (; c + 16 <= n; c += 16) {
    if (ahead && (c * sizeof(W)) % 64 == 0)
      for (int r = 0; r < 4; ++r) prefetch_ahead(w[r] + c);
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load_w(w[r] + c);
    for (int m = 0; m < NM; ++m) {
      __m512 xv = _mm512_loadu_ps(xs[m] + c);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (c < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - c)) - 1);
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load_w(w[r] + c, k);
    for (int m = 0; m < NM; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(k, xs[m] + c);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  finish<NM>(acc, out);
}

// int8 weights against int8 activations (activations.h): per 64-column chunk and lane l, the exact int32 sum of
// its 4 code products (`dot4`), widened to fp32 and weighed by the lane's activation scale x weight scale (one fp32
// multiply), into acc by FMA. One fp16 weight scale per G columns (G in 16, 32, 64: lanes of one, two or four
// groups a chunk); n (padded) a multiple of G; a last chunk of n % 64 columns is read masked. Per 64 weights and
// activation row: the dot, a conversion, the scale multiply and the FMA (the fp32-widening tile took 16 uops for
// 64 weights and a row: docs/kernels.md).
inline __m512i dot4(__m512i corr, __m512i wu, __m512i xq) {  // corr + per lane sum_j wu[4l+j] (u8) * xq[4l+j] (s8)
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(corr, wu, xq);
#else  // the same sums from words: even bytes and odd bytes each as int16, two pmaddwd
  const __m512i w_even = _mm512_and_si512(wu, _mm512_set1_epi16(0xFF)), w_odd = _mm512_srli_epi16(wu, 8);
  const __m512i x_even = _mm512_srai_epi16(_mm512_slli_epi16(xq, 8), 8), x_odd = _mm512_srai_epi16(xq, 8);
  return _mm512_add_epi32(corr, _mm512_add_epi32(_mm512_madd_epi16(w_even, x_even), _mm512_madd_epi16(w_odd, x_odd)));
#endif
}

// The weight scales of chunk k's lanes (lane l: the group of column 64k + 4l), 0 past the row's n_groups.
template <int G>
inline __m512 lane_scales(const float* sf, int64_t k, int64_t n_groups) {
  if constexpr (G == 64) {
    return _mm512_set1_ps(sf[k]);
  } else {
    constexpr int64_t per = 64 / G;
    const __m512i idx = G == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __mmask16 left = static_cast<__mmask16>((1u << std::min(per, n_groups - k * per)) - 1);
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(left, sf + k * per));
  }
}

// Chunk k of NR weight rows (codes + 128: wu) against NM activation rows.
template <int NM, int NR, int G>
inline void chunk_int8(__m512 (&acc)[NM][NR], const QRow* const* xs, const __m512i (&wu)[NR], const float* const* sf,
                       int64_t k, int64_t n_groups) {
  __m512 sv[NR];
  for (int r = 0; r < NR; ++r) sv[r] = lane_scales<G>(sf[r], k, n_groups);
  for (int m = 0; m < NM; ++m) {
    const __m512i xq = _mm512_loadu_si512(xs[m]->q + 64 * k), corr = _mm512_loadu_si512(xs[m]->corr + 16 * k);
    const __m512 dv = _mm512_loadu_ps(xs[m]->d + 16 * k);
    for (int r = 0; r < NR; ++r)
      acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot4(corr, wu[r], xq)), _mm512_mul_ps(dv, sv[r]), acc[m][r]);
  }
}

template <int NM, int NR, int G>
inline void rows_int8(__m512 (&acc)[NM][NR], const QRow* const* xs, const int8_t* const* q, const float* const* sf,
                      int64_t n) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  __m512i wu[NR];
  const bool ahead = n > kPrefetchRowBytes;  // (prefetch.h)
  for (; 64 * k + 64 <= n; ++k) {
    if (ahead)
      for (int r = 0; r < NR; ++r) prefetch_ahead(q[r] + 64 * k);
    for (int r = 0; r < NR; ++r) wu[r] = _mm512_xor_si512(_mm512_loadu_si512(q[r] + 64 * k), flip);
    chunk_int8<NM, NR, G>(acc, xs, wu, sf, k, n / G);
  }
  if (64 * k < n) {  // G < 64: zero codes past the row (flipped to 128, they meet zero activation codes)
    const __mmask64 left = (~0ULL) >> (64 - (n - 64 * k));
    for (int r = 0; r < NR; ++r) wu[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(left, q[r] + 64 * k), flip);
    chunk_int8<NM, NR, G>(acc, xs, wu, sf, k, n / G);
  }
}

template <int NM, int G, class S>
inline void tile_int8(const QRow* const* xs, const int8_t* const* q, const S* const* s, int64_t n, float* out) {
  alignas(64) float local[4][kMaxGroups];
  const float* sf[4];
  tile_scales(s, n / G, local, sf);
  __m512 acc[NM][4];
  rows_int8<NM, 4, G>(acc, xs, q, sf, n);
  finish<NM>(acc, out);
}

// int4, tiers' layout (byte j = code 2j | code 2j + 1 << 4, stored + 8: unsigned), one fp16 scale per G columns
// (G in 16, 32), against activations coded in the Nibbles layout (activations.h): a chunk of 128 columns is 64 bytes,
// whose low nibbles meet the chunk's even activation codes and whose high nibbles its odd ones, both into the same
// lanes (lane l: columns 128k + 8l .. + 7, of one group and one activation block), so each lane's two `dot4`s chain
// in int32 before one conversion, scale multiply and FMA. Per 128 weights and activation row: two masks, a shift,
// two dots, the conversion, the multiply and the FMA, and per weight row a permute for the scales (the fp32-widening
// tile took 28 vector uops: docs/kernels.md).
template <int G>
inline __m512 nibble_scales(const float* sf, int64_t k, int64_t n_groups) {  // lane l: the group of 128k + 8l
  constexpr int64_t per = 128 / G;
  const __m512i idx = G == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                              : _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __mmask16 left = static_cast<__mmask16>((1u << std::min(per, n_groups - k * per)) - 1);
  return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(left, sf + k * per));
}

template <int NM, int NR, int G>
inline void chunk_int4(__m512 (&acc)[NM][NR], const QRow* const* xs, const __m512i (&v)[NR], const float* const* sf,
                       int64_t k, int64_t n_groups) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i lo[NR], hi[NR];
  __m512 sv[NR];
  for (int r = 0; r < NR; ++r) {
    lo[r] = _mm512_and_si512(v[r], low4);
    hi[r] = _mm512_and_si512(_mm512_srli_epi16(v[r], 4), low4);
    sv[r] = nibble_scales<G>(sf[r], k, n_groups);
  }
  for (int m = 0; m < NM; ++m) {
    const __m512i even = _mm512_loadu_si512(xs[m]->q + 128 * k), odd = _mm512_loadu_si512(xs[m]->q + 128 * k + 64);
    const __m512i corr = _mm512_loadu_si512(xs[m]->corr + 16 * k);
    const __m512 dv = _mm512_loadu_ps(xs[m]->d + 16 * k);
    for (int r = 0; r < NR; ++r) {
      const __m512i sum = dot4(dot4(corr, lo[r], even), hi[r], odd);
      acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dv, sv[r]), acc[m][r]);
    }
  }
}

template <int NM, int NR, int G>
inline void rows_int4(__m512 (&acc)[NM][NR], const QRow* const* xs, const uint8_t* const* p, const float* const* sf,
                      int64_t n) {
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  __m512i v[NR];
  const bool ahead = n / 2 > kPrefetchRowBytes;  // (prefetch.h)
  for (; 128 * k + 128 <= n; ++k) {
    if (ahead)
      for (int r = 0; r < NR; ++r) prefetch_line(p[r] + 64 * k);
    for (int r = 0; r < NR; ++r) v[r] = _mm512_loadu_si512(p[r] + 64 * k);
    chunk_int4<NM, NR, G>(acc, xs, v, sf, k, n / G);
  }
  if (128 * k < n) {  // 16 .. 112 columns left: nibbles past the row read as 0 and meet zero activation codes
    const __mmask64 left = (~0ULL) >> (64 - (n - 128 * k) / 2);
    for (int r = 0; r < NR; ++r) v[r] = _mm512_maskz_loadu_epi8(left, p[r] + 64 * k);
    chunk_int4<NM, NR, G>(acc, xs, v, sf, k, n / G);
  }
}

template <int NM, int G, class S>
inline void tile_int4(const QRow* const* xs, const uint8_t* const* p, const S* const* s, int64_t n, float* out) {
  alignas(64) float local[4][kMaxGroups];
  const float* sf[4];
  tile_scales(s, n / G, local, sf);
  __m512 acc[NM][4];
  rows_int4<NM, 4, G>(acc, xs, p, sf, n);
  finish<NM>(acc, out);
}

// tile_int4 at one activation row for 8 weight rows (rows of few groups): each row's arithmetic exactly tile_int4's,
// with twice the independent work between reductions.
template <int G>
inline void tile_int4_rows8(const QRow* x, const uint8_t* const* p, const float* const* s, int64_t n, float* out) {
  const QRow* xs[1] = {x};
  __m512 acc[1][8];
  rows_int4<1, 8, G>(acc, xs, p, s, n);
  reduce4(acc[0][0], acc[0][1], acc[0][2], acc[0][3], out);
  reduce4(acc[0][4], acc[0][5], acc[0][6], acc[0][7], out + 4);
}

// tile_int8 at one activation row for 8 weight rows (rows of few groups): each row's arithmetic exactly tile_int8's.
template <int G>
inline void tile_int8_rows8(const QRow* x, const int8_t* const* q, const float* const* s, int64_t n, float* out) {
  const QRow* xs[1] = {x};
  __m512 acc[1][8];
  rows_int8<1, 8, G>(acc, xs, q, s, n);
  reduce4(acc[0][0], acc[0][1], acc[0][2], acc[0][3], out);
  reduce4(acc[0][4], acc[0][5], acc[0][6], acc[0][7], out + 4);
}

// Interleaved int8 (gather_linear.cpp, "Interleaved int8"): a block of 16 weight rows stored as, per 4 columns, the
// 16 rows' 4 codes (64 bytes: lane l is row l), and per group the 16 rows' fp16 scales. Each lane is one row's dot
// product: per unit of U = min(G, 32) columns, the exact int32 sum of its U / 4 `dot4`s (the activations' 4 codes
// broadcast to every lane), converted and weighed by the unit's activation scale x the row's weight scale, into acc
// by FMA, unit by unit. Per 64 weights and activation row: one dot; per unit: a conversion, a multiply and an FMA;
// no reduction across lanes (the 4-row tiles: 4 uops per 64 weights and row, then a tree).
template <int NM, int G>
inline void tile_int8_rows16(const QUnits* const* xs, const int8_t* w, const uint16_t* s, int64_t n_units,
                             float* const* out) {
  constexpr int U = G < 32 ? G : 32, J = U / 4, per_group = G / U;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NM];
  for (int m = 0; m < NM; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t u = 0; u < n_units; ++u, w += 64 * J) {
    for (int j = 0; j < J; ++j) prefetch_block(w + 64 * j);
    __m512i wu[J];
    for (int j = 0; j < J; ++j) wu[j] = _mm512_xor_si512(_mm512_loadu_si512(w + 64 * j), flip);
    const __m512 sv =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (u / per_group) * 16)));
    for (int m = 0; m < NM; ++m) {
      const int8_t* xq = xs[m]->q + U * u;
      __m512i sum = _mm512_set1_epi32(xs[m]->corr[u]);
      for (int j = 0; j < J; ++j) sum = dot4(sum, wu[j], _mm512_set1_epi32(codes4(xq + 4 * j)));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sv, _mm512_set1_ps(xs[m]->d[u])), acc[m]);
    }
  }
  for (int m = 0; m < NM; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

}  // namespace
}  // namespace moelane
