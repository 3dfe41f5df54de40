// The compiled decode step's attention over a pool of KV caches, read in place (docs/kernels.md "Decode attention"):
//
//   out[n, h*G + g] = sum_l p[l] v[l] / (sum_l p[l] + p_sink),  p[l] = exp(s[l] - m), s[l] = scale * q . k[l]
//
// over the keys l < L that mask[n] lets row n see, k / v = k_pool / v_pool [slots[n], h, l], m the largest visible
// score (and the sink's logit, where there is one: gpt-oss), p_sink = exp(sink - m) or 0. Everything in fp32; the
// result is rounded once to the pool's dtype.
//
// Shapes: N rows, Hq query heads, Hkv KV heads, G = Hq / Hkv query heads a KV head, D key dim, Dv value dim, S slots,
// C cache capacity, L keys read (a prefix of the capacity).
//
// Batch invariance: one thread computes a (row, KV head) item whole, its keys in ascending order, skipping the
// masked ones; each score is a dot product in fixed lanes and a fixed tree (dot), each output element a sequential
// sum over the visible keys. So a row's bits depend only on its query, its slot's cache and its mask, not on N, the
// other rows, L past its last visible key, or the thread count.
#include "attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace moelane {
namespace {

constexpr int kLanes = 16;
// Items below this much work (keys x (D + Dv) x G multiply-adds) stay on one thread: waking the team costs more.
constexpr int64_t kParallelWork = 1 << 15;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(at::Half v) { return static_cast<float>(v); }

// 16 fp32 lanes (GCC's and Clang's vector extension: one AVX-512 register, or two or four narrower ones). Arithmetic
// on it is lane by lane, a multiply then an add (-ffp-contract=off), so each lane gets the bits a scalar loop gives.
typedef float F16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t H16 __attribute__((vector_size(32)));

inline F16 load(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline F16 load(const at::BFloat16* p) {  // exact: a bf16 is the top half of its fp32
  H16 h;
  std::memcpy(&h, p, sizeof h);
  const U16 bits = __builtin_convertvector(h, U16) << 16;
  F16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline F16 load(const at::Half* p) {
  float f[kLanes];
  for (int j = 0; j < kLanes; ++j) f[j] = static_cast<float>(p[j]);
  return load(f);
}
// The first n < kLanes elements, zeros after.
template <typename T>
inline F16 load_part(const T* p, int64_t n) {
  float f[kLanes] = {};
  for (int64_t j = 0; j < n; ++j) f[j] = widen(p[j]);
  return load(f);
}

// q . k over d columns: kLanes partial sums in column order (the last chunk zero-padded), then halved in a fixed tree.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  F16 acc = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) acc += load(q + i) * load(k + i);
  if (i < d) acc += load_part(q + i, d - i) * load_part(k + i, d - i);
  float a[kLanes];
  std::memcpy(a, &acc, sizeof a);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) a[j] += a[j + w];
  return a[0];
}

struct Call {
  int64_t n_kv, group, d, d_v, length;
  int64_t k_stride[3], v_stride[3];  // slot, head, position (the last dim is contiguous)
  const float* q;                    // [N, Hq, D] fp32
  const int64_t* slots;              // [N]
  const bool* mask;                  // [N, L]
  const float* sinks;                // [Hq] or nullptr
  float scale;
};

// exp(x) for the softmax, by arithmetic alone (+, *, exact conversions; no FMA: -ffp-contract=off), so a loop over
// many keys vectorises and every key gets the same bits in a vector or in the scalar tail. x = n ln2 + r with n the
// nearest integer to x / ln2 (r within ln2 / 2, ln2 in two parts, Cody and Waite), e^r by its Taylor polynomial to
// r^8 / 8! (truncation under 6e-9 relative), times 2^n built in the exponent bits. Clamped to [-87, 88]: e^-87 is
// about 1.6e-38, a key's share that rounds away against a total of at least 1; NaN goes through as NaN.
inline float exp_softmax(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding then taking it off rounds to an integer
  const float n = (x * 1.44269504f + shift) - shift;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 40320;
  p = p * r + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = (static_cast<uint32_t>(static_cast<int32_t>(n)) + 127u) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Scratch of one thread: the visible keys' positions, per query head their scores, then their shares, each head's
// total share, and its weighted values.
struct Scratch {
  std::vector<int64_t> seen;
  std::vector<float> scores, total, acc;
};

template <typename T>
void attend_item(const Call& c, const T* k_pool, const T* v_pool, T* out, int64_t item, Scratch& w) {
  const int64_t n = item / c.n_kv, h = item % c.n_kv, slot = c.slots[n], G = c.group;
  const T* keys = k_pool + slot * c.k_stride[0] + h * c.k_stride[1];
  const T* values = v_pool + slot * c.v_stride[0] + h * c.v_stride[1];
  const bool* mask = c.mask + n * c.length;
  const float* q = c.q + (n * c.n_kv + h) * G * c.d;
  w.seen.clear();
  for (int64_t l = 0; l < c.length; ++l)
    if (mask[l]) w.seen.push_back(l);
  const int64_t m = static_cast<int64_t>(w.seen.size());
  w.scores.resize(G * m);
  for (int64_t i = 0; i < m; ++i) {
    const T* key = keys + w.seen[i] * c.k_stride[2];
    for (int64_t g = 0; g < G; ++g) w.scores[g * m + i] = dot(q + g * c.d, key, c.d) * c.scale;
  }
  w.total.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    float* s = w.scores.data() + g * m;
    const float sink = c.sinks != nullptr ? c.sinks[h * G + g] : -std::numeric_limits<float>::infinity();
    float top = sink;
    for (int64_t i = 0; i < m; ++i) top = s[i] > top ? s[i] : top;
    for (int64_t i = 0; i < m; ++i) s[i] = exp_softmax(s[i] - top);
    float sum = c.sinks != nullptr ? exp_softmax(sink - top) : 0.0f;
    for (int64_t i = 0; i < m; ++i) sum += s[i];  // in key order
    w.total[g] = sum;
  }
  // out[g, j] = the sum over the visible keys, in key order, of share x value: 64 columns at a time in registers,
  // then 16, then one (the same multiply and add for each element either way).
  w.acc.resize(G * c.d_v);
  const int64_t stride = c.v_stride[2];
  for (int64_t g = 0; g < G; ++g) {
    const float* share = w.scores.data() + g * m;
    float* a = w.acc.data() + g * c.d_v;
    int64_t j = 0;
    for (; j + 4 * kLanes <= c.d_v; j += 4 * kLanes) {
      F16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t i = 0; i < m; ++i) {
        const T* v = values + w.seen[i] * stride + j;
        const F16 p = F16{} + share[i];
        a0 += p * load(v);
        a1 += p * load(v + kLanes);
        a2 += p * load(v + 2 * kLanes);
        a3 += p * load(v + 3 * kLanes);
      }
      std::memcpy(a + j, &a0, sizeof a0);
      std::memcpy(a + j + kLanes, &a1, sizeof a1);
      std::memcpy(a + j + 2 * kLanes, &a2, sizeof a2);
      std::memcpy(a + j + 3 * kLanes, &a3, sizeof a3);
    }
    for (; j + kLanes <= c.d_v; j += kLanes) {
      F16 a0 = {};
      for (int64_t i = 0; i < m; ++i) a0 += (F16{} + share[i]) * load(values + w.seen[i] * stride + j);
      std::memcpy(a + j, &a0, sizeof a0);
    }
    for (; j < c.d_v; ++j) {
      float a0 = 0.0f;
      for (int64_t i = 0; i < m; ++i) a0 += share[i] * widen(values[w.seen[i] * stride + j]);
      a[j] = a0;
    }
  }
  T* o = out + (n * c.n_kv + h) * G * c.d_v;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < c.d_v; ++j) o[g * c.d_v + j] = static_cast<T>(w.acc[g * c.d_v + j] / w.total[g]);
}

template <typename T>
void attend_all(const Call& c, const at::Tensor& k_pool, const at::Tensor& v_pool, at::Tensor& out,
                int64_t n_items) {
  const T* k = k_pool.data_ptr<T>();
  const T* v = v_pool.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t work = std::max<int64_t>(1, c.length * (c.d + c.d_v) * c.group);
  at::parallel_for(0, n_items, std::max<int64_t>(1, kParallelWork / work), [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t item = begin; item < end; ++item) attend_item(c, k, v, o, item, w);
  });
}

}  // namespace

at::Tensor attend_cache(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& slots_in, const at::Tensor& mask_in,
                        const std::optional<at::Tensor>& sinks_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_pool.dim() == 4 && v_pool.dim() == 4, "attend_cache: q [N, Hq, D], pools 4-d");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "attend_cache: K and V pools of one dtype");
  TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1, "attend_cache: pools contiguous in their last dim");
  const int64_t n = q_in.size(0), n_heads = q_in.size(1), n_kv = k_pool.size(1);
  TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0 && v_pool.size(1) == n_kv, "attend_cache: heads do not group");
  TORCH_CHECK(q_in.size(2) == k_pool.size(3), "attend_cache: q and K of other head dims");
  TORCH_CHECK(mask_in.dim() == 2 && mask_in.size(0) == n && mask_in.size(1) <= k_pool.size(2) &&
                  mask_in.size(1) <= v_pool.size(2),
              "attend_cache: mask [N, L], L within the capacity");
  TORCH_CHECK(slots_in.dim() == 1 && slots_in.size(0) == n, "attend_cache: slots [N]");
  auto q = q_in.to(at::kFloat).contiguous();
  auto slots = slots_in.to(at::kLong).contiguous();
  auto mask = mask_in.to(at::kBool).contiguous();
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    sinks = sinks_in->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks.numel() == n_heads, "attend_cache: one sink a query head");
  }
  const int64_t n_slots = std::min(k_pool.size(0), v_pool.size(0));
  const int64_t* slot = slots.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(slot, slot + n, [&](int64_t s) { return s >= 0 && s < n_slots; }),
              "attend_cache: a slot outside the pool");
  Call c{n_kv,
         n_heads / n_kv,
         q.size(2),
         v_pool.size(3),
         mask.size(1),
         {k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)},
         {v_pool.stride(0), v_pool.stride(1), v_pool.stride(2)},
         q.data_ptr<float>(),
         slots.data_ptr<int64_t>(),
         mask.data_ptr<bool>(),
         sinks.defined() ? sinks.data_ptr<float>() : nullptr,
         static_cast<float>(scale)};
  auto out = at::empty({n, n_heads, c.d_v}, k_pool.options());
  const int64_t n_items = n * n_kv;
  switch (k_pool.scalar_type()) {
    case at::kFloat: attend_all<float>(c, k_pool, v_pool, out, n_items); break;
    case at::kBFloat16: attend_all<at::BFloat16>(c, k_pool, v_pool, out, n_items); break;
    case at::kHalf: attend_all<at::Half>(c, k_pool, v_pool, out, n_items); break;
    default: TORCH_CHECK(false, "attend_cache: pools must be float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace moelane
