// Portable tiles (no AVX-512): the arithmetic of tiles_avx512.h lane for lane, in plain C++ that the compiler may
// vectorise (it never reassociates: the build passes -ffp-contract=off and no -ffast-math).
//
// Lane layout of one dot product x . w over n columns: 16 lanes; chunk c (columns 16c .. 16c+15) meets lane l with
// column 16c + l, acc[l] = fma(x, w, acc[l]) in chunk order (a missing column counts as x = w = 0). The row's sum is
// the fixed tree s[l] = acc[l] + acc[l+8], t[l] = s[l] + s[l+4], (t0 + t2) + (t1 + t3). Without hardware FMA, fma
// is a multiply then an add: other bits than the AVX-512 build, still the same for a row whatever else is in the
// call. int8 and int4 have their own lane layouts (integer dot products of 4 columns a lane: tile_int8, tile_int4).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "activations.h"

namespace moelane {
namespace {

constexpr const char* kIsa = "generic";

inline float fma_lane(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7F800000u | (man << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

inline void widen_scales(const uint16_t* s, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(s[i]);
}

constexpr int64_t kMaxGroups = 1024;  // as tiles_avx512.h: above it, gather_linear.cpp widens scales per work item
inline float scale_of(uint16_t h) { return half_to_float(h); }
inline float scale_of(float s) { return s; }

inline float widen(float w) { return w; }
inline float widen(uint16_t bf16) { return bits_to_float(static_cast<uint32_t>(bf16) << 16); }

inline float reduce16(const float* v) {
  float s[8], t[4];
  for (int l = 0; l < 8; ++l) s[l] = v[l] + v[l + 8];
  for (int l = 0; l < 4; ++l) t[l] = s[l] + s[l + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// One chunk: acc[m][r][l] = fma(x[m][l], w[r][l], acc[m][r][l]).
template <int NM>
inline void chunk(float (&acc)[NM][4][16], const float (&xv)[NM][16], const float (&wv)[4][16]) {
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < 16; ++l) acc[m][r][l] = fma_lane(xv[m][l], wv[r][l], acc[m][r][l]);
}

template <int NM>
inline void load_x(float (&xv)[NM][16], const float* const* xs, int64_t c, int len) {
  for (int m = 0; m < NM; ++m)
    for (int l = 0; l < 16; ++l) xv[m][l] = l < len ? xs[m][c + l] : 0.0f;
}

template <int NM>
inline void finish(const float (&acc)[NM][4][16], float* out) {
  for (int m = 0; m < NM; ++m)
    for (int r = 0; r < 4; ++r) out[4 * m + r] = reduce16(acc[m][r]);
}

template <int NM, class W>
inline void tile_float(const float* const* xs, const W* const* w, int64_t n, float* out) {
  float acc[NM][4][16] = {};
  float xv[NM][16], wv[4][16];
  for (int64_t c = 0; c < n; c += 16) {
    const int len = static_cast<int>(std::min<int64_t>(16, n - c));
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < 16; ++l) wv[r][l] = l < len ? widen(w[r][c + l]) : 0.0f;
    load_x<NM>(xv, xs, c, len);
    chunk<NM>(acc, xv, wv);
  }
  finish<NM>(acc, out);
}

// int8 against the activations' int8 codes (activations.h): chunk k of 64 columns meets lane l with columns
// 64k + 4l .. 64k + 4l + 3, whose code products sum exactly (int32); acc[l] = fma(float(sum), d * sw, acc[l]) with d
// the lanes' activation scale and sw their weight group's scale (0 past the row's last group), in chunk order.
template <int NM, int G, class S>
inline void tile_int8(const QRow* const* xs, const int8_t* const* q, const S* const* s, int64_t n, float* out) {
  float acc[NM][4][16] = {};
  for (int64_t k = 0; 64 * k < n; ++k)
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < 16; ++l) {
        const int64_t c = 64 * k + 4 * l;
        const float sw = c < n ? scale_of(s[r][c / G]) : 0.0f;
        for (int m = 0; m < NM; ++m) {
          int32_t sum = 0;
          for (int j = 0; j < 4 && c + j < n; ++j) sum += q[r][c + j] * xs[m]->q[c + j];
          acc[m][r][l] = fma_lane(static_cast<float>(sum), xs[m]->d[16 * k + l] * sw, acc[m][r][l]);
        }
      }
  finish<NM>(acc, out);
}

// int4 against the activations' int8 codes in the Nibbles layout (activations.h): chunk k of 128 columns meets lane
// l with columns 128k + 8l .. 128k + 8l + 7 (bytes 64k + 4l .. + 3; each even column's code in the chunk's first 64,
// each odd one's in its second); the exact int32 sum of (nibble - 8) x code, then as tile_int8.
template <int NM, int G, class S>
inline void tile_int4(const QRow* const* xs, const uint8_t* const* p, const S* const* s, int64_t n, float* out) {
  float acc[NM][4][16] = {};
  for (int64_t k = 0; 128 * k < n; ++k)
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < 16; ++l) {
        const int64_t first = 128 * k + 8 * l;  // the lane's first column
        const float sw = first < n ? scale_of(s[r][first / G]) : 0.0f;
        for (int m = 0; m < NM; ++m) {
          int32_t sum = 0;
          for (int j = 0; j < 8 && first + j < n; ++j) {
            const uint8_t byte = p[r][(first + j) / 2];
            sum += ((j % 2 ? byte >> 4 : byte & 15) - 8) * xs[m]->q[128 * k + 64 * (j % 2) + 4 * l + j / 2];
          }
          acc[m][r][l] = fma_lane(static_cast<float>(sum), xs[m]->d[16 * k + l] * sw, acc[m][r][l]);
        }
      }
  finish<NM>(acc, out);
}

// Interleaved int8 (tiles_avx512.h's tile_int8_rows16): 16 weight rows in a block, per 4 columns j their codes at
// w[64j + 4r .. + 3] (row r); per unit u of U = min(G, 32) columns, row r's exact int32 sum of code products, then
// acc[r] = fma(float(sum), sw * d, acc[r]), unit by unit (sw: row r's group scale, d: the unit's activation scale).
template <int NM, int G>
inline void tile_int8_rows16(const QUnits* const* xs, const int8_t* w, const uint16_t* s, int64_t n_units,
                             float* const* out) {
  constexpr int U = G < 32 ? G : 32, per_group = G / U;
  float acc[NM][16] = {};
  for (int64_t u = 0; u < n_units; ++u)
    for (int r = 0; r < 16; ++r) {
      const float sw = half_to_float(s[(u / per_group) * 16 + r]);
      for (int m = 0; m < NM; ++m) {
        int32_t sum = 0;
        for (int c = 0; c < U; ++c) sum += w[(u * U + c) / 4 * 64 + 4 * r + c % 4] * xs[m]->q[u * U + c];
        acc[m][r] = fma_lane(static_cast<float>(sum), sw * xs[m]->d[u], acc[m][r]);
      }
    }
  for (int m = 0; m < NM; ++m) std::copy(acc[m], acc[m] + 16, out[m]);
}

}  // namespace
}  // namespace moelane

#include "tiles_rows8.h"
