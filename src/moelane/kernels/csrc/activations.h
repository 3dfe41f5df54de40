// Activation rows quantised for int8 weights (docs/kernels.md, "int8: integer dot products"): each row cut into
// blocks of 32 columns, each block coded as llama.cpp's Q8_0 codes its activations, d = max |x| / 127 (fp32),
// code = round-half-even(x * (1 / d)) in [-127, 127] (all 0 where d is below the smallest normal float; where d is
// not finite, a NaN or an infinity in the block, the products come out NaN). formats.quantize_activations is the same rule in PyTorch, bit
// for bit on finite rows (tests/kernels).
//
// The tiles read a row as 64-column chunks, lane l of chunk k holding columns 64k + 4l .. 64k + 4l + 3 (the layout
// of vpdpbusd), so beside the codes each chunk carries, per lane, the scale of the block its columns lie in and
// -128 x the sum of its 4 codes (the weights meet x as code + 128, unsigned; that term takes the 128 off again).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace moelane {
namespace {

constexpr int64_t kBlock = 32;  // columns under one activation scale
constexpr int64_t kChunk = 64;  // columns of one vpdpbusd

// One quantised activation row as the int8 tiles read it: chunks of codes, and per chunk 16 lanes of scales and
// corrections.
struct QRow {
  const int8_t* q;
  const float* d;
  const int32_t* corr;
};

// Rows [R, in] quantised over `cols` columns (a multiple of 16, >= in; zero past in), padded to whole chunks.
class QuantisedRows {
 public:
  QuantisedRows(const float* x, int64_t n_rows, int64_t in, int64_t cols)
      : chunks_((cols + kChunk - 1) / kChunk),
        q_(n_rows * chunks_ * kChunk, 0),
        d_(n_rows * chunks_ * 16, 0.0f),
        corr_(n_rows * chunks_ * 16, 0) {
    for (int64_t i = 0; i < n_rows; ++i) quantise_row(x + i * in, in, i);
  }

  QRow row(int64_t i) const {
    return {q_.data() + i * chunks_ * kChunk, d_.data() + i * chunks_ * 16, corr_.data() + i * chunks_ * 16};
  }

  // codes [R, chunks * 64] and scales [R, chunks * 2], for the tests' comparison with formats.py
  const std::vector<int8_t>& codes() const { return q_; }
  std::vector<float> block_scales() const {
    std::vector<float> out(d_.size() / 8);
    for (size_t b = 0; b < out.size(); ++b) out[b] = d_[b * 8];
    return out;
  }

 private:
  void quantise_row(const float* x, int64_t in, int64_t i) {
    int8_t* q = q_.data() + i * chunks_ * kChunk;
    float* d = d_.data() + i * chunks_ * 16;
    int32_t* corr = corr_.data() + i * chunks_ * 16;
    for (int64_t b = 0; b * kBlock < std::min(in, chunks_ * kChunk); ++b) {
      const int64_t c0 = b * kBlock, c1 = std::min(in, c0 + kBlock);
      float amax = 0.0f;  // NaN, once met, stays
      for (int64_t c = c0; c < c1; ++c) {
        const float a = std::fabs(x[c]);
        if (a > amax || a != a) amax = a;
      }
      const float scale = amax / 127.0f;
      const bool usable = scale >= std::numeric_limits<float>::min() && scale <= std::numeric_limits<float>::max();
      const float inv = usable ? 1.0f / scale : 0.0f;  // finite: scale is normal
      for (int64_t c = c0; c < c1; ++c) {
        const float v = std::nearbyint(x[c] * inv);  // NaN only where x is not finite
        q[c] = v == v ? static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, v))) : 0;
      }
      for (int l = 0; l < 8; ++l) d[(b / 2) * 16 + (b % 2) * 8 + l] = scale;
    }
    for (int64_t k = 0; k < chunks_; ++k)
      for (int l = 0; l < 16; ++l) {
        int32_t sum = 0;
        for (int j = 0; j < 4; ++j) sum += q[k * kChunk + 4 * l + j];
        corr[k * 16 + l] = -128 * sum;
      }
  }

  int64_t chunks_;
  std::vector<int8_t> q_;
  std::vector<float> d_;
  std::vector<int32_t> corr_;
};

}  // namespace
}  // namespace moelane
