// A stand-alone prototype, not part of moelane: int8 weight rows against NM activation rows, two ways, timed side
// by side (docs/kernels.md, "Activations quantised to int8").
//   A: moelane's int8 tile as it is (tiles_avx512.h): each code widened to its exact fp32 value (vpmovsxbd,
//      vcvtdq2ps, times its fp16 scale), then one FMA per activation row: fp32 activations, exact weights.
//   B: llama.cpp's Q8_0 x Q8_0 way: each activation row quantised to int8 per 32 columns (scale = max |x| / 127),
//      codes + 128 against the row's codes by vpdpbusd (64 products a uop), the 128 taken off per block, the int32
//      sums widened and weighed by weight scale x row scale.
// Weights from L2 (one matrix, repeated: the kernel's compute bound) or streamed (many matrices). Prints the weight
// bytes' GB/s of each, B's speed over A's, and B's largest error relative to A's largest result.
//
//   g++ -O3 -march=native -ffp-contract=off -o /tmp/int8_act bench/int8_activation_tile.cpp   (AVX512-VNNI)
//   /tmp/int8_act COLUMNS ROWS MATRICES NM      e.g. 192 256 1 2  (L2), 2048 64 1 4, 2048 64 2000 1 (streamed)
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

template <int NM>
void tile_a(const float* const* xs, const int8_t* const* q, const float* const* sf, int64_t n, float* out) {
  __m512 acc[NM][4];
  for (int m = 0; m < NM; ++m) for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < n / 64; ++g) {
    __m512 sv[4];
    for (int r = 0; r < 4; ++r) sv[r] = _mm512_set1_ps(sf[r][g]);
    for (int k = 0; k < 4; ++k) {
      const int64_t c = g * 64 + 16 * k;
      __m512 wv[4];
      for (int r = 0; r < 4; ++r) {
        __m128i b = _mm_loadu_si128((const __m128i*)(q[r] + c));
        wv[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), sv[r]);
      }
      for (int m = 0; m < NM; ++m) {
        __m512 xv = _mm512_loadu_ps(xs[m] + c);
        for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < NM; ++m) for (int r = 0; r < 4; ++r) out[4 * m + r] = hsum(acc[m][r]);
}

// Quantised activation rows: qx int8 [n], dx per 32 (fp32), c128[m][g64] = vector with -128*sum(qx of each 32-half)
struct QX {
  std::vector<int8_t> q; std::vector<float> d;  // d per 32
};
QX quantise(const float* x, int64_t n) {
  QX o; o.q.resize(n); o.d.resize(n / 32);
  for (int64_t b = 0; b < n / 32; ++b) {
    float amax = 0; for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    float d = amax / 127.f; o.d[b] = d; float id = d ? 1.f / d : 0.f;
    for (int i = 0; i < 32; ++i) o.q[b * 32 + i] = (int8_t)std::lrintf(x[b * 32 + i] * id);
  }
  return o;
}

// per 64 codes of a weight row: lanes 0-7 belong to x block 2g, lanes 8-15 to block 2g+1.
template <int NM>
void tile_b(const QX* const* xs, const int8_t* const* q, const float* const* sf, const __m512* const* dxv,
            const __m512i* const* corr, int64_t n, float* out) {
  __m512 acc[NM][4];
  for (int m = 0; m < NM; ++m) for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int64_t g = 0; g < n / 64; ++g) {
    __m512i wu[4];
    for (int r = 0; r < 4; ++r) wu[r] = _mm512_xor_si512(_mm512_loadu_si512(q[r] + g * 64), flip);
    for (int m = 0; m < NM; ++m) {
      const __m512i xq = _mm512_loadu_si512(xs[m]->q.data() + g * 64);
      const __m512 d = dxv[m][g];
      for (int r = 0; r < 4; ++r) {
        __m512i s = _mm512_dpbusd_epi32(corr[m][g], wu[r], xq);
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(sf[r][g])), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < NM; ++m) for (int r = 0; r < 4; ++r) out[4 * m + r] = hsum(acc[m][r]);
}

int main(int argc, char** argv) {
  const int64_t n = atoi(argv[1]);  // columns
  const int64_t rows = atoi(argv[2]);  // weight rows in a matrix
  const int64_t mats = atoi(argv[3]);  // matrices (1: from L2; many: streamed)
  const int nm = atoi(argv[4]);
  const int64_t total = rows * mats;
  std::vector<int8_t> w(total * n); std::vector<float> s(total * (n / 64));
  srand(1); for (auto& v : w) v = (int8_t)(rand() % 255 - 127); for (auto& v : s) v = 0.001f * (1 + rand() % 100);
  std::vector<std::vector<float>> x(nm, std::vector<float>(n)); for (auto& r : x) for (auto& v : r) v = (rand() % 2001 - 1000) / 1000.f;
  std::vector<QX> qx; for (auto& r : x) qx.push_back(quantise(r.data(), n));
  std::vector<std::vector<__m512>> dxv(nm, std::vector<__m512>(n / 64)); std::vector<std::vector<__m512i>> corr(nm, std::vector<__m512i>(n / 64));
  for (int m = 0; m < nm; ++m) for (int64_t g = 0; g < n / 64; ++g) {
    float a = qx[m].d[2 * g], b = qx[m].d[2 * g + 1];
    dxv[m][g] = _mm512_setr_ps(a,a,a,a,a,a,a,a,b,b,b,b,b,b,b,b);
    alignas(64) int32_t c[16];
    for (int l = 0; l < 16; ++l) { int32_t sum = 0; for (int i = 0; i < 4; ++i) sum += qx[m].q[g * 64 + 4 * l + i]; c[l] = -128 * sum; }
    corr[m][g] = _mm512_load_si512(c);
  }
  std::vector<float> out(16);
  const float* xp[4]; const QX* qp[4]; const __m512* dp[4]; const __m512i* cp[4];
  for (int m = 0; m < nm; ++m) { xp[m] = x[m].data(); qp[m] = &qx[m]; dp[m] = dxv[m].data(); cp[m] = corr[m].data(); }
  double best[2] = {1e9, 1e9}; double err = 0, ref = 0;
  for (int rep = 0; rep < 40; ++rep) for (int which = 0; which < 2; ++which) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t mt = 0; mt < mats; ++mt) for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int8_t* q[4]; const float* sf[4];
      for (int r = 0; r < 4; ++r) { int64_t row = mt * rows + r0 + r; q[r] = w.data() + row * n; sf[r] = s.data() + row * (n / 64); }
      float o[16];
      if (which == 0) { switch (nm) { case 1: tile_a<1>(xp, q, sf, n, o); break; case 2: tile_a<2>(xp, q, sf, n, o); break; default: tile_a<4>(xp, q, sf, n, o); } }
      else { switch (nm) { case 1: tile_b<1>(qp, q, sf, dp, cp, n, o); break; case 2: tile_b<2>(qp, q, sf, dp, cp, n, o); break; default: tile_b<4>(qp, q, sf, dp, cp, n, o); } }
      if (rep == 0 && mt == 0 && r0 == 0) { if (which == 0) std::memcpy(out.data(), o, sizeof o); else { for (int i = 0; i < 4 * nm; ++i) { err = std::max(err, (double)std::fabs(o[i] - out[i])); ref = std::max(ref, (double)std::fabs(out[i])); } } }
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best[which] = std::min(best[which], dt);
  }
  double bytes = (double)total * (n + n / 64 * 2);
  printf("n=%ld rows=%ld mats=%ld nm=%d  A %.2f GB/s  B %.2f GB/s  B/A %.2f  rel_err %.4f\n", n, rows, mats, nm,
         bytes / best[0] / 1e9, bytes / best[1] / 1e9, best[0] / best[1], err / ref);
}
