// Activation rows quantised for int8 and int4 weights (docs/kernels.md, "Integer dot products"): each row cut into
// blocks of 32 columns, each block coded as llama.cpp's Q8_0 codes its activations, d = max |x| / 127 (fp32),
// code = round-half-even(x * (1 / d)) in [-127, 127] (all 0 where d is below the smallest normal float; where d is
// not finite, a NaN or an infinity in the block, the products come out NaN). formats.quantize_activations is the
// same rule in PyTorch, bit for bit on finite rows (tests/kernels).
//
// The tiles read a row in chunks of 16 lanes (the lanes of vpdpbusd), in one of two layouts:
//   Bytes (int8 weights): chunks of 64 columns, lane l holding columns 64k + 4l .. 64k + 4l + 3 (one vector);
//   Nibbles (int4 weights, whose byte j packs columns 2j and 2j + 1): chunks of 128 columns, held as their 64 even
//     columns, then their 64 odd ones (two vectors, which meet a weight chunk's low nibbles and its high nibbles), so
//     lane l holds columns 128k + 8l .. 128k + 8l + 7: the even four in the first vector, the odd four in the second.
// Beside the codes each chunk carries, per lane, the scale of the block its columns lie in and -bias x the sum of its
// codes (the weights meet x unsigned, as code + bias: 128 for int8, 8 for int4's stored nibbles; that term takes the
// bias off again).
#pragma once
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace moelane {
namespace {

constexpr int64_t kBlock = 32;  // columns under one activation scale

enum class Layout { Bytes, Nibbles };  // a chunk's columns and lane order (above)
constexpr int64_t chunk_columns(Layout layout) { return layout == Layout::Bytes ? 64 : 128; }

// One quantised activation row as the integer tiles read it: chunks of codes, and per chunk 16 lanes of scales and
// corrections.
struct QRow {
  const int8_t* q;
  const float* d;
  const int32_t* corr;
};

// One quantised activation row as the interleaved int8 tiles read it (`tile_int8_rows16`): its codes in column
// order (the Bytes layout), and per unit of U columns (U = min(G, 32): the columns under one weight scale and one
// activation scale) the block's scale d and -128 x the sum of the unit's codes (corr).
struct QUnits {
  const int8_t* q;
  const float* d;
  const int32_t* corr;
};

// The 4 codes at p as one int32 word (the interleaved tiles broadcast it to every lane).
inline int32_t codes4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [R, in] quantised over `cols` columns (a multiple of 16, >= in; zero past in), padded to whole chunks.
class QuantisedRows {
 public:
  QuantisedRows(const float* x, int64_t n_rows, int64_t in, int64_t cols, Layout layout)
      : layout_(layout),
        width_(chunk_columns(layout)),
        chunks_((cols + width_ - 1) / width_),
        q_(n_rows * chunks_ * width_, 0),
        d_(n_rows * chunks_ * 16, 0.0f),
        corr_(n_rows * chunks_ * 16, 0) {
    // rows apart on the threads (a w2 call codes every pair's activations: 64 rows of 8192 took ~1 ms on one)
    at::parallel_for(0, n_rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) quantise_row(x + i * in, in, i);
    });
  }

  QRow row(int64_t i) const {
    return {q_.data() + i * chunks_ * width_, d_.data() + i * chunks_ * 16, corr_.data() + i * chunks_ * 16};
  }

  // Row i's scale and correction per unit of `unit` columns (16 or 32, Bytes layout), into d and corr
  // [chunks x 64 / unit] each: the lanes' (4 columns a lane) scale and their corrections summed.
  void units(int64_t i, int64_t unit, float* d, int32_t* corr) const {
    const QRow r = row(i);
    const int64_t lanes = unit / 4;
    for (int64_t u = 0; u < chunks_ * width_ / unit; ++u) {
      d[u] = r.d[u * lanes];
      int32_t sum = 0;
      for (int64_t l = 0; l < lanes; ++l) sum += r.corr[u * lanes + l];
      corr[u] = sum;
    }
  }

  // codes [R, chunks x width] (in the layout's order) and scales [R, chunks x width / 32], for the tests'
  // comparison with formats.py
  const std::vector<int8_t>& codes() const { return q_; }
  std::vector<float> block_scales() const {
    const int64_t per = width_ / kBlock;  // blocks a chunk
    std::vector<float> out(d_.size() / 16 * per);
    for (size_t b = 0; b < out.size(); ++b) out[b] = d_[(b / per) * 16 + (b % per) * (16 / per)];
    return out;
  }

 private:
  // Codes in column order, then per chunk its layout's order; lanes of a chunk's block b are 16 / per apart
  // (per = its blocks: 2 or 4), in order.
  void quantise_row(const float* x, int64_t in, int64_t i) {
    int8_t* q = q_.data() + i * chunks_ * width_;
    float* d = d_.data() + i * chunks_ * 16;
    const int64_t per = width_ / kBlock, lanes = 16 / per;
    for (int64_t b = 0; b * kBlock < in; ++b) {
      const float scale = quantise_block(x + b * kBlock, std::min(kBlock, in - b * kBlock), q + b * kBlock);
      std::fill_n(d + (b / per) * 16 + (b % per) * lanes, lanes, scale);
    }
    int32_t* corr = corr_.data() + i * chunks_ * 16;
    for (int64_t k = 0; k < chunks_; ++k) {
      if (layout_ == Layout::Bytes) {
        lane_sums(q + k * width_, corr + k * 16);
      } else {
        evens_then_odds(q + k * width_);
        nibble_lane_sums(q + k * width_, corr + k * 16);
      }
    }
  }

  // 0 where the block's scale is below the smallest normal float or not finite, else 1 / scale (finite)
  static float inverse(float scale) {
    const bool usable = scale >= std::numeric_limits<float>::min() && scale <= std::numeric_limits<float>::max();
    return usable ? 1.0f / scale : 0.0f;
  }

#if defined(__AVX512F__) && defined(__AVX512BW__)
  // The codes of one block of n <= 32 columns (the rest of its 32 codes stay 0) -> its scale.
  static float quantise_block(const float* x, int64_t n, int8_t* q) {
    const __mmask16 k0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    const __mmask16 k1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
    const __m512 v0 = _mm512_maskz_loadu_ps(k0, x), v1 = _mm512_maskz_loadu_ps(k1, x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    if (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q))
      amax = std::numeric_limits<float>::quiet_NaN();  // as the scalar rule: a NaN, once met, stays
    const float scale = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(inverse(scale));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512 s0 = _mm512_mul_ps(v0, inv), s1 = _mm512_mul_ps(v1, inv);
    // round half to even (the default rounding mode, as nearbyint), NaN (a non-finite x) to 0
    const __m512i c0 = _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(s0, s0, _CMP_ORD_Q), s0);
    const __m512i c1 = _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(s1, s1, _CMP_ORD_Q), s1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                     _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(c0, lo), hi)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                     _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(c1, lo), hi)));
    return scale;
  }

  // corr[l] = -128 x the sum of codes 4l .. 4l + 3 of one Bytes chunk
  static void lane_sums(const int8_t* q, int32_t* corr) {
    const __m512i pairs = _mm512_maddubs_epi16(_mm512_set1_epi8(1), _mm512_loadu_si512(q));
    const __m512i sums = _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
    _mm512_storeu_si512(corr, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7)));
  }

  // One Nibbles chunk's 128 codes in column order -> its 64 even columns, then its 64 odd ones.
  static void evens_then_odds(int8_t* q) {
    const __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi16_epi8(v0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), _mm512_cvtepi16_epi8(v1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64), _mm512_cvtepi16_epi8(_mm512_srli_epi16(v0, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 96), _mm512_cvtepi16_epi8(_mm512_srli_epi16(v1, 8)));
  }

  // corr[l] = -8 x the sum of a Nibbles chunk's lane l codes: bytes 4l .. 4l + 3 of both halves
  static void nibble_lane_sums(const int8_t* q, int32_t* corr) {
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(ones, _mm512_loadu_si512(q)),
                                           _mm512_maddubs_epi16(ones, _mm512_loadu_si512(q + 64)));
    const __m512i sums = _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
    _mm512_storeu_si512(corr, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 3)));
  }
#elif defined(__AVX2__)
  // The scalar rule below in 8-lane vectors, the same codes and scales: x * inv rounds alike, and vcvtps2dq rounds
  // in the current rounding mode, as nearbyint (half to even by default). The scalar loop took 0.8x the products'
  // own time in int8 w2 calls of 8 rows of 8,192 columns on an AVX2 EPYC (docs/kernels.md "Activation codes on
  // AVX2").
  static float quantise_block(const float* x, int64_t n, int8_t* q) {
    __m256 v[4];
    for (int k = 0; k < 4; ++k) {
      const int64_t left = n - 8 * k;
      if (left >= 8) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
      } else {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const int count = static_cast<int>(std::max<int64_t>(left, 0));
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes);
        v[k] = _mm256_maskload_ps(x + 8 * k, keep);  // 0 past the block's n columns (no read there)
      }
    }
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      top = _mm256_max_ps(top, _mm256_and_ps(v[k], magnitude));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
    if (_mm256_movemask_ps(nan)) amax = std::numeric_limits<float>::quiet_NaN();  // a NaN, once met, stays
    const float scale = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(inverse(scale));
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i c[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 s = _mm256_mul_ps(v[k], inv);
      const __m256i code = _mm256_cvtps_epi32(s);  // a NaN (a non-finite x) gives 0x80000000: masked to 0 below
      const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_ORD_Q));
      c[k] = _mm256_and_si256(_mm256_min_epi32(_mm256_max_epi32(code, lo), hi), ordered);
    }
    // packs interleave the 128-bit halves: words (c0 lo, c1 lo, c0 hi, c1 hi), bytes likewise; the permute restores
    // column order
    const __m256i words01 = _mm256_packs_epi32(c[0], c[1]), words23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i bytes = _mm256_packs_epi16(words01, words23);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return scale;
  }

  // corr[l] = -128 x the sum of codes 4l .. 4l + 3 of one Bytes chunk
  static void lane_sums(const int8_t* q, int32_t* corr) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * h));
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + 8 * h),
                          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7)));
    }
  }

  // One Nibbles chunk's 128 codes in column order -> its 64 even columns, then its 64 odd ones.
  static void evens_then_odds(int8_t* q) {
    // per 128-bit half: its 8 even bytes, then its 8 odd ones; then the halves' evens together, their odds together
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,  //
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i v[4];
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_permute4x64_epi64(
          _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * k)), split), 0xD8);
    for (int k = 0; k < 2; ++k) {  // v[2k]: evens then odds of columns 64k .. 64k + 31; v[2k + 1]: of the next 32
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * k),
                          _mm256_permute2x128_si256(v[2 * k], v[2 * k + 1], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 + 32 * k),
                          _mm256_permute2x128_si256(v[2 * k], v[2 * k + 1], 0x31));
    }
  }

  // corr[l] = -8 x the sum of a Nibbles chunk's lane l codes: bytes 4l .. 4l + 3 of both halves
  static void nibble_lane_sums(const int8_t* q, int32_t* corr) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {
      const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * h));
      const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 + 32 * h));
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(ones8, even), _mm256_maddubs_epi16(ones8, odd));
      const __m256i sums = _mm256_madd_epi16(pairs, ones16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + 8 * h),
                          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 3)));
    }
  }
#else
  static float quantise_block(const float* x, int64_t n, int8_t* q) {
    float amax = 0.0f;  // NaN, once met, stays
    for (int64_t c = 0; c < n; ++c) {
      const float a = std::fabs(x[c]);
      if (a > amax || a != a) amax = a;
    }
    const float scale = amax / 127.0f, inv = inverse(scale);
    for (int64_t c = 0; c < n; ++c) {
      const float v = std::nearbyint(x[c] * inv);  // NaN only where x is not finite
      q[c] = v == v ? static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, v))) : 0;
    }
    return scale;
  }

  static void lane_sums(const int8_t* q, int32_t* corr) {
    for (int l = 0; l < 16; ++l) {
      int32_t sum = 0;
      for (int j = 0; j < 4; ++j) sum += q[4 * l + j];
      corr[l] = -128 * sum;
    }
  }

  static void evens_then_odds(int8_t* q) {
    int8_t t[128];
    for (int c = 0; c < 128; ++c) t[(c % 2) * 64 + c / 2] = q[c];
    std::copy(t, t + 128, q);
  }

  static void nibble_lane_sums(const int8_t* q, int32_t* corr) {
    for (int l = 0; l < 16; ++l) {
      int32_t sum = 0;
      for (int j = 0; j < 4; ++j) sum += q[4 * l + j] + q[64 + 4 * l + j];
      corr[l] = -8 * sum;
    }
  }
#endif

  Layout layout_;
  int64_t width_;  // columns a chunk
  int64_t chunks_;
  std::vector<int8_t> q_;
  std::vector<float> d_;
  std::vector<int32_t> corr_;
};

}  // namespace
}  // namespace moelane
