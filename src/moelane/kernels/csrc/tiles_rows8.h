// tiles_avx512.h's 8-row tiles (one activation row, 8 weight rows) for the tile sets without their own (AVX2, plain
// C++): two 4-row tiles, the same arithmetic per row. Included after their tile_int8 and tile_int4.
#pragma once
#include <cstdint>

namespace moelane {
namespace {

template <int G>
inline void tile_int4_rows8(const QRow* x, const uint8_t* const* p, const float* const* s, int64_t n, float* out) {
  const QRow* xs[1] = {x};
  tile_int4<1, G>(xs, p, s, n, out);
  tile_int4<1, G>(xs, p + 4, s + 4, n, out + 4);
}

template <int G>
inline void tile_int8_rows8(const QRow* x, const int8_t* const* q, const float* const* s, int64_t n, float* out) {
  const QRow* xs[1] = {x};
  tile_int8<1, G>(xs, q, s, n, out);
  tile_int8<1, G>(xs, q + 4, s + 4, n, out + 4);
}

}  // namespace
}  // namespace moelane
