// moelane's CPU weight product: y[p] = x[rows[p]] @ W[slots[p]].T for P (row, slot) pairs, W a pool of S matrices
// [Out, In] at f32, bf16, int8 or int4 (see moelane/kernels/pool.py for the layouts).
//
// Shapes: R activation rows, In columns (C padded columns for int8/int4), S slots, Out output rows, P pairs,
// U distinct slots among the pairs.
//
// Batch invariance: y[p, o] is computed by one tile call (tiles_*.h) whose arithmetic for that (pair, output row)
// depends only on x[rows[p]] and the weight row: the pairs of a slot go through in blocks of up to 4 (a block's rows
// never mix), output rows in groups of 4 (which rows share a tile changes no row's arithmetic: accumulators and the
// final tree are per row; interleaved int8: pairs in blocks of up to 8, rows in blocks of 16, each row in its own
// lane), and every dot product uses the same chunks, accumulators and tree, fixed by In and the layout. Threads
// split work items (slot, block of output rows), never a dot product; so y[p] is the same bits whatever P, the other
// pairs or the thread count.
// Only the headers used (not <torch/extension.h>, which takes ~20 s to compile: docs/kernels.md "Building").
#include <Python.h>  // (first, as Python asks) for the GIL only: the library is loaded into a Python process
//
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "tiles_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "tiles_avx2.h"
#else
#include "tiles_generic.h"
#endif
#include "activations.h"
#include "attention.h"
#include "prefetch.h"

namespace moelane {
namespace {

enum class Kind { F32, BF16, INT8, INT4 };

// Work items: (slot, block of output rows of about `item_bytes` of weights: kMaxItemBytes, or less where the call
// would otherwise have under kItemsPerThread items a thread, never under kMinItemBytes; 512 KiB where 128 KiB was:
// one inflated MoE layer streamed from memory, 2 threads, int8 / int4 / bf16 +3-6%: docs/kernels.md). A tile's 4 rows
// are taken a quarter of the block apart, so each thread reads 4 sequential streams: with short rows (192 columns)
// one stream of consecutive rows left the hardware prefetcher behind (bf16: 16 against 24-26 GB/s; int8: 13 against
// 18-21, 2 threads). Each stream is also prefetched ahead (prefetch.h).
constexpr int64_t kMaxItemBytes = 512 * 1024, kMinItemBytes = 128 * 1024, kItemsPerThread = 8;
constexpr int64_t kItemScaleGroups = 16;  // see item_scales

struct Weights {
  Kind kind;
  int64_t out, cols, group;  // cols: columns per row as stored (padded for int8 / int4)
  int64_t row_bytes, n_groups;  // bytes of codes per row; scales per row
  const uint8_t* data;
  const uint16_t* scales;
  bool interleaved = false;  // int8 in blocks of kBlockRows rows (below)

  const uint8_t* row(int64_t slot, int64_t r) const { return data + (slot * out + r) * row_bytes; }
  const uint16_t* scale_row(int64_t slot, int64_t r) const { return scales + (slot * out + r) * n_groups; }
  // Interleaved: row r's block (r a multiple of kBlockRows), its codes and its scales.
  const int8_t* block(int64_t slot, int64_t r) const { return reinterpret_cast<const int8_t*>(row(slot, r)); }
  const uint16_t* block_scales(int64_t slot, int64_t r) const { return scale_row(slot, r); }
};

// Interleaved int8 (pool.py): data [S, Out / 16, C / 4, 64], byte 4l + t of [s, b, j] the code of row 16b + l, column
// 4j + t; scales [S, Out / 16, G, 16], [s, b, g, l] row 16b + l's of group g. A block of 16 rows is one contiguous
// stream, and each vector of it holds 4 columns of all 16 rows, so the tile (`tile_int8_rows16`) computes 16 rows'
// dot products in 16 lanes, never reduced across lanes: fewer uops per weight and activation row than the 4-row
// tiles, whose compute bounds a round of many streams (docs/kernels.md "Interleaved int8"). Other bits than the
// row-major int8 pool's (units of G or 32 columns, not lanes of 4), the same whatever the call holds.
constexpr int64_t kBlockRows = 16;

Kind kind_of(const at::Tensor& data) {
  switch (data.scalar_type()) {
    case at::kFloat: return Kind::F32;
    case at::kBFloat16: return Kind::BF16;
    case at::kChar: return Kind::INT8;
    case at::kByte: return Kind::INT4;
    default: break;
  }
  TORCH_CHECK(false, "gather_linear: weights must be float32, bfloat16, int8 or uint8 (int4), got ",
              data.scalar_type());
}

// w with the scales s, whose shape the caller has checked (groups: s.size(2), dividing w.cols): the group they give
// checked against the kind's and x's `in` columns against the padded row.
Weights with_scales(Weights w, const at::Tensor& s, int64_t in) {
  w.n_groups = s.size(2);
  w.group = w.cols / w.n_groups;
  const bool ok = w.kind == Kind::INT8 ? (w.group == 16 || w.group == 32 || w.group == 64)
                                       : (w.group == 16 || w.group == 32);
  TORCH_CHECK(ok, "gather_linear: unsupported group of ", w.group, " columns");
  TORCH_CHECK(in <= w.cols && w.cols - in < w.group, "gather_linear: x has ", in, " columns, the weights ", w.cols,
              " (padded to groups of ", w.group, ")");
  w.scales = reinterpret_cast<const uint16_t*>(s.data_ptr());
  return w;
}

Weights interleaved_of(const at::Tensor& data, const std::optional<at::Tensor>& scales, int64_t in) {
  TORCH_CHECK(data.scalar_type() == at::kChar && data.is_contiguous() && data.size(3) == 4 * kBlockRows,
              "gather_linear: interleaved weights must be a contiguous int8 [S, Out / 16, C / 4, 64]");
  Weights w{Kind::INT8, kBlockRows * data.size(1), 4 * data.size(2), 0, 4 * data.size(2), 0,
            static_cast<const uint8_t*>(data.data_ptr()), nullptr, true};
  TORCH_CHECK(scales.has_value(), "gather_linear: int8 weights need scales");
  const auto& s = *scales;
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == 4 && s.is_contiguous() && s.size(0) == data.size(0) &&
                  s.size(1) == data.size(1) && s.size(3) == kBlockRows && s.size(2) > 0 && w.cols % s.size(2) == 0,
              "gather_linear: interleaved scales must be a contiguous float16 [S, Out / 16, groups, 16] dividing "
              "the row");
  return with_scales(w, s, in);
}

Weights weights_of(const at::Tensor& data, const std::optional<at::Tensor>& scales, int64_t in) {
  if (data.dim() == 4) return interleaved_of(data, scales, in);
  TORCH_CHECK(data.dim() == 3 && data.is_contiguous(), "gather_linear: weights must be a contiguous [S, Out, In]");
  Weights w{kind_of(data), data.size(1), data.size(2), 0, data.size(2) * data.element_size(), 0,
            static_cast<const uint8_t*>(data.data_ptr()), nullptr};
  if (w.kind == Kind::F32 || w.kind == Kind::BF16) {
    TORCH_CHECK(w.cols == in, "gather_linear: x has ", in, " columns, the weights ", w.cols);
    return w;
  }
  if (w.kind == Kind::INT4) w.cols *= 2;
  TORCH_CHECK(scales.has_value(), "gather_linear: int8 / int4 weights need scales");
  const auto& s = *scales;
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == 3 && s.is_contiguous() && s.size(0) == data.size(0) &&
                  s.size(1) == w.out && s.size(2) > 0 && w.cols % s.size(2) == 0,
              "gather_linear: scales must be a contiguous float16 [S, Out, groups] dividing the row");
  return with_scales(w, s, in);
}

// xs: the activation rows as floats (f32, bf16); qs: as int8 codes (int8, int4).
template <int NM, class S>
void dispatch(const Weights& w, const float* const* xs, const QRow* const* qs, const uint8_t* const* rows,
              const S* const* srows, float* out) {
  switch (w.kind) {
    case Kind::F32: return tile_float<NM>(xs, reinterpret_cast<const float* const*>(rows), w.cols, out);
    case Kind::BF16: return tile_float<NM>(xs, reinterpret_cast<const uint16_t* const*>(rows), w.cols, out);
    case Kind::INT8: {
      auto q = reinterpret_cast<const int8_t* const*>(rows);
      if (w.group == 64) return tile_int8<NM, 64>(qs, q, srows, w.cols, out);
      if (w.group == 32) return tile_int8<NM, 32>(qs, q, srows, w.cols, out);
      return tile_int8<NM, 16>(qs, q, srows, w.cols, out);
    }
    case Kind::INT4:
      if (w.group == 32) return tile_int4<NM, 32>(qs, rows, srows, w.cols, out);
      return tile_int4<NM, 16>(qs, rows, srows, w.cols, out);
  }
}

// Whether a work item's scales are widened to fp32 at once (run_item) rather than a tile's rows by the tile: rows of
// few groups (per tile they cost a masked conversion and a loop each: 192-column rows read from L2, int4 10-14% and
// int8 4-13% slower), or more than a tile's stack holds.
bool item_scales(const Weights& w) {
  return w.scales && (w.n_groups < kItemScaleGroups || w.n_groups > kMaxGroups);
}

// sf: the work item's scales as fp32 from its first row r0 on, where item_scales (else unused).
template <int NM>
void tile(const Weights& w, const float* const* xs, const QRow* const* qs, int64_t slot, const int64_t* r4,
          const float* sf, int64_t r0, float* out) {
  const uint8_t* rows[4];
  for (int r = 0; r < 4; ++r) rows[r] = w.row(slot, r4[r]);
  if (item_scales(w)) {
    const float* srows[4];
    for (int r = 0; r < 4; ++r) srows[r] = sf + (r4[r] - r0) * w.n_groups;
    return dispatch<NM>(w, xs, qs, rows, srows, out);
  }
  const uint16_t* srows[4] = {};
  for (int r = 0; r < 4 && w.scales; ++r) srows[r] = w.scale_row(slot, r4[r]);
  dispatch<NM>(w, xs, qs, rows, srows, out);
}

void run_tile(int nm, const Weights& w, const float* const* xs, const QRow* const* qs, int64_t slot, const int64_t* r4,
              const float* sf, int64_t r0, float* out) {
  switch (nm) {
    case 1: return tile<1>(w, xs, qs, slot, r4, sf, r0, out);
    case 2: return tile<2>(w, xs, qs, slot, r4, sf, r0, out);
    case 3: return tile<3>(w, xs, qs, slot, r4, sf, r0, out);
    default: return tile<4>(w, xs, qs, slot, r4, sf, r0, out);
  }
}

// Whether a slot's pairs take 8-row tiles (`tile8`): its only pair, on short int8 / int4 rows (batch-1 decode), whose
// scales item_scales widens (fewer than kItemScaleGroups).
bool rows8(const Weights& w, int64_t n_pairs) {
  return n_pairs == 1 && w.n_groups < kItemScaleGroups && (w.kind == Kind::INT4 || w.kind == Kind::INT8);
}

// As tile<1> for 8 rows (r8) of a `rows8` slot: the `*_rows8` tiles, each row's arithmetic the 4-row tile's.
void tile8(const Weights& w, const QRow* qx, int64_t slot, const int64_t* r8, const float* sf, int64_t r0,
           float* out) {
  const uint8_t* rows[8];
  const float* srows[8];
  for (int r = 0; r < 8; ++r) {
    rows[r] = w.row(slot, r8[r]);
    srows[r] = sf + (r8[r] - r0) * w.n_groups;
  }
  if (w.kind == Kind::INT4) {
    if (w.group == 32) return tile_int4_rows8<32>(qx, rows, srows, w.cols, out);
    return tile_int4_rows8<16>(qx, rows, srows, w.cols, out);
  }
  auto q = reinterpret_cast<const int8_t* const*>(rows);
  if (w.group == 64) return tile_int8_rows8<64>(qx, q, srows, w.cols, out);
  if (w.group == 32) return tile_int8_rows8<32>(qx, q, srows, w.cols, out);
  tile_int8_rows8<16>(qx, q, srows, w.cols, out);
}

// Pairs of one slot: order[first .. first + count) are their pair indices, ascending.
struct SlotPairs {
  int64_t slot, first, count;
};

// What every work item reads: the pairs grouped by slot, each pair's activation row, the output.
struct Plan {
  std::vector<int64_t> order, rows;
  std::vector<SlotPairs> groups;
  const float* x;  // activation rows as the float tiles read them, ldx apart
  int64_t ldx;
  std::vector<QRow> q;  // activation rows as the integer tiles read them (int8 and int4 weights only)
  float* y;  // [P, Out]
  std::vector<QUnits> units;  // activation rows as the interleaved tiles read them (interleaved int8 only)
  std::vector<float> unit_d;
  std::vector<int32_t> unit_corr;
};

// Output rows r0 .. r1 of one slot for all its pairs: the rows' scales widened to fp32 at once into sf (a buffer the
// thread reuses) where item_scales, then tiles of 4 rows a quarter of the block apart, pairs in blocks of up to 4.
// A slot's only pair on short quantised rows (batch-1 decode: `rows8`) takes tiles of 8 rows an eighth apart instead
// (`tile8`: each row's arithmetic the 4-row tile's; from L2 the inflated model's 192-column int4 rows went from 9.3
// to 11.1 GB/s a core: docs/kernels.md).
void run_item(const Weights& w, const Plan& plan, const SlotPairs& g, int64_t r0, int64_t r1, std::vector<float>& sf) {
  if (item_scales(w)) {
    sf.resize((r1 - r0) * w.n_groups + 16);  // widen_scales may store a whole vector past the end
    widen_scales(w.scale_row(g.slot, r0), (r1 - r0) * w.n_groups, sf.data());
  }
  const float* xs[4];
  const QRow* qs[4] = {};
  int64_t trows[8];
  float out[16];
  const bool eight = rows8(w, g.count);
  const int tile_rows = eight ? 8 : 4;
  const int64_t n_tiles = (r1 - r0 + tile_rows - 1) / tile_rows;
  for (int64_t t = 0; t < n_tiles; ++t) {
    int nr = 0;  // tile rows r0 + t + k * n_tiles that exist; the others repeat the first (results dropped)
    for (int k = 0; k < tile_rows; ++k) {
      const int64_t r = r0 + t + k * n_tiles;
      if (r < r1) nr = k + 1;
      trows[k] = r < r1 ? r : trows[0];
    }
    if (w.row_bytes <= kPrefetchRowBytes && (kPrefetch || w.kind == Kind::INT4))  // (prefetch.h)
      for (int k = 0; k < tile_rows; ++k)
        for (int64_t b = 0; b < w.row_bytes; b += 64) prefetch_line(w.row(g.slot, trows[k]) + b);
    if (eight) {
      const int64_t xrow = plan.rows[plan.order[g.first]];
      tile8(w, &plan.q[xrow], g.slot, trows, sf.data(), r0, out);
      float* yrow = plan.y + plan.order[g.first] * w.out;
      for (int k = 0; k < nr; ++k) yrow[trows[k]] = out[k];
      continue;
    }
    for (int64_t m0 = 0; m0 < g.count; m0 += 4) {
      const int nm = static_cast<int>(std::min<int64_t>(4, g.count - m0));
      for (int m = 0; m < nm; ++m) {
        const int64_t xrow = plan.rows[plan.order[g.first + m0 + m]];
        xs[m] = plan.x + xrow * plan.ldx;
        if (!plan.q.empty()) qs[m] = &plan.q[xrow];
      }
      run_tile(nm, w, xs, qs, g.slot, trows, sf.data(), r0, out);
      for (int m = 0; m < nm; ++m) {
        float* yrow = plan.y + plan.order[g.first + m0 + m] * w.out;
        for (int k = 0; k < nr; ++k) yrow[trows[k]] = out[4 * m + k];
      }
    }
  }
}

template <int G>
void run_tile16(int nm, const QUnits* const* xs, const int8_t* w, const uint16_t* s, int64_t n_units,
                float* const* out) {
  switch (nm) {
    case 1: return tile_int8_rows16<1, G>(xs, w, s, n_units, out);
    case 2: return tile_int8_rows16<2, G>(xs, w, s, n_units, out);
    case 3: return tile_int8_rows16<3, G>(xs, w, s, n_units, out);
    case 4: return tile_int8_rows16<4, G>(xs, w, s, n_units, out);
    case 5: return tile_int8_rows16<5, G>(xs, w, s, n_units, out);
    case 6: return tile_int8_rows16<6, G>(xs, w, s, n_units, out);
    case 7: return tile_int8_rows16<7, G>(xs, w, s, n_units, out);
    default: return tile_int8_rows16<8, G>(xs, w, s, n_units, out);
  }
}

// Output rows r0 .. r1 (whole blocks) of one slot of interleaved int8 for all its pairs: block by block, the pairs
// in groups of up to 8 (a group's rows never mix: each lane's arithmetic is its own row's).
void run_blocks(const Weights& w, const Plan& plan, const SlotPairs& g, int64_t r0, int64_t r1) {
  const int64_t unit = std::min<int64_t>(w.group, 32), n_units = w.cols / unit;
  const QUnits* xs[8];
  float* outs[8];
  for (int64_t r = r0; r < r1; r += kBlockRows) {
    const int8_t* block = w.block(g.slot, r);
    const uint16_t* scales = w.block_scales(g.slot, r);
    for (int64_t m0 = 0; m0 < g.count; m0 += 8) {
      const int nm = static_cast<int>(std::min<int64_t>(8, g.count - m0));
      for (int m = 0; m < nm; ++m) {
        const int64_t pair = plan.order[g.first + m0 + m];
        xs[m] = &plan.units[plan.rows[pair]];
        outs[m] = plan.y + pair * w.out + r;
      }
      if (w.group == 64) run_tile16<64>(nm, xs, block, scales, n_units, outs);
      else if (w.group == 32) run_tile16<32>(nm, xs, block, scales, n_units, outs);
      else run_tile16<16>(nm, xs, block, scales, n_units, outs);
    }
  }
}

std::vector<int64_t> indices(const std::optional<at::Tensor>& t, int64_t n, int64_t fill_arange, int64_t bound,
                             const char* what) {
  std::vector<int64_t> out(n);
  if (!t.has_value()) {
    for (int64_t i = 0; i < n; ++i) out[i] = fill_arange ? i : 0;
  } else {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->numel() == n,
                "gather_linear: ", what, " must be int64 [P]");
    auto c = t->contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    std::copy(p, p + n, out.begin());
  }
  for (int64_t v : out) TORCH_CHECK(v >= 0 && v < bound, "gather_linear: ", what, " index ", v, " out of range");
  return out;
}

}  // namespace

at::Tensor gather_linear(const at::Tensor& x_in, const std::optional<at::Tensor>& rows_in,
                         const std::optional<at::Tensor>& slots_in, const at::Tensor& data,
                         const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "gather_linear: x must be float32 [R, In]");
  auto x = x_in.contiguous();
  const int64_t n_rows = x.size(0), in = x.size(1);
  const Weights w = weights_of(data, scales, in);
  const int64_t n_pairs = rows_in.has_value() ? rows_in->numel() : n_rows;
  auto rows = indices(rows_in, n_pairs, 1, n_rows, "rows");
  const auto slots = indices(slots_in, n_pairs, 0, data.size(0), "slots");
  auto y = at::empty({n_pairs, w.out}, x.options());
  if (n_pairs == 0 || w.out == 0) return y;

  Plan plan{std::vector<int64_t>(n_pairs), std::move(rows), {}, nullptr, 0, {}, y.data_ptr<float>()};
  std::iota(plan.order.begin(), plan.order.end(), 0);
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t b) { return slots[a] < slots[b]; });
  for (int64_t i = 0; i < n_pairs; ++i) {
    const int64_t slot = slots[plan.order[i]];
    if (plan.groups.empty() || slot != plan.groups.back().slot) plan.groups.push_back({slot, i, 0});
    ++plan.groups.back().count;
  }
  plan.x = x.data_ptr<float>();
  plan.ldx = in;
  std::optional<QuantisedRows> xq;
  if (w.kind == Kind::INT8 || w.kind == Kind::INT4) {
    xq.emplace(x.data_ptr<float>(), n_rows, in, w.cols, w.kind == Kind::INT4 ? Layout::Nibbles : Layout::Bytes);
    for (int64_t i = 0; i < n_rows; ++i) plan.q.push_back(xq->row(i));
  }
  if (w.interleaved) {
    const int64_t unit = std::min<int64_t>(w.group, 32), per_row = (w.cols + 63) / 64 * 64 / unit;
    plan.unit_d.resize(n_rows * per_row);
    plan.unit_corr.resize(n_rows * per_row);
    for (int64_t i = 0; i < n_rows; ++i) {
      xq->units(i, unit, plan.unit_d.data() + i * per_row, plan.unit_corr.data() + i * per_row);
      plan.units.push_back({plan.q[i].q, plan.unit_d.data() + i * per_row, plan.unit_corr.data() + i * per_row});
    }
  }

  const int64_t row_bytes = std::max<int64_t>(1, w.row_bytes);
  const int64_t call_bytes = static_cast<int64_t>(plan.groups.size()) * w.out * row_bytes;
  const int64_t item_bytes =
      std::clamp(call_bytes / (kItemsPerThread * at::get_num_threads()), kMinItemBytes, kMaxItemBytes);
  const int64_t tile_rows = w.interleaved ? kBlockRows : 4;  // an item holds whole tiles (whole blocks)
  const int64_t per_item = std::max<int64_t>(tile_rows, item_bytes / row_bytes / tile_rows * tile_rows);
  const int64_t n_blocks = (w.out + per_item - 1) / per_item;
  // Each thread takes the items of its own contiguous share in order (sequential weight streams, as a fixed split
  // reads them), and when its share is done takes the items left in the others' shares. So a thread whose core is
  // taken for a while (the store's reader threads share the cores) does not hold up the call: the others finish its
  // share (a fixed split cost paged decode ~1.2x with 2 cores). Which thread computes an item changes none of its
  // bits.
  const int64_t n_items = static_cast<int64_t>(plan.groups.size()) * n_blocks;
  const int64_t n_shares = std::max<int64_t>(1, std::min<int64_t>(n_items, at::get_num_threads()));
  std::vector<std::atomic<int64_t>> next(n_shares);
  for (int64_t t = 0; t < n_shares; ++t) next[t] = t * n_items / n_shares;
  at::parallel_for(0, n_shares, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sf;
    for (int64_t own = begin; own < end; ++own) {
      for (int64_t k = 0; k < n_shares; ++k) {
        const int64_t t = (own + k) % n_shares, stop = (t + 1) * n_items / n_shares;
        for (int64_t item; (item = next[t].fetch_add(1, std::memory_order_relaxed)) < stop;) {
          const int64_t r0 = (item % n_blocks) * per_item;
          if (w.interleaved) run_blocks(w, plan, plan.groups[item / n_blocks], r0, std::min(w.out, r0 + per_item));
          else run_item(w, plan, plan.groups[item / n_blocks], r0, std::min(w.out, r0 + per_item), sf);
        }
      }
    }
  });
  return y;
}

// x [R, In] f32 as the integer tiles read it -> (codes int8 [R, C], scales f32 [R, C / 32]), C = In padded to whole
// chunks, the codes in int8's layout or (nibbles) int4's: for the tests, against formats.quantize_activations.
std::tuple<at::Tensor, at::Tensor> quantise_rows(const at::Tensor& x_in, bool nibbles) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "quantise_rows: x must be float32 [R, In]");
  auto x = x_in.contiguous();
  const Layout layout = nibbles ? Layout::Nibbles : Layout::Bytes;
  const int64_t n_rows = x.size(0), in = x.size(1), width = chunk_columns(layout);
  const int64_t cols = (in + width - 1) / width * width;
  const QuantisedRows xq(x.data_ptr<float>(), n_rows, in, cols, layout);
  auto codes = at::empty({n_rows, cols}, at::kChar);
  auto scales = at::empty({n_rows, cols / kBlock}, at::kFloat);
  std::copy(xq.codes().begin(), xq.codes().end(), codes.data_ptr<int8_t>());
  const auto d = xq.block_scales();
  std::copy(d.begin(), d.end(), scales.data_ptr<float>());
  return {codes, scales};
}

// The ops' CPU kernels registered with the dispatcher from C++ (register_cpu): compiled code's op calls then go
// from the dispatcher straight to C++, not through a Python kernel (~2 us a call; the 115M model's int4 decode
// +4%, docs/kernels.md). They override op.py's Python kernel while registered, and dropping the registration
// restores it (the fallback for tests). Each releases the GIL when its caller holds it: other Python threads (the
// store's readers, the server) run while a product streams weights.
namespace {

// Overriding op.py's kernel is the design, not a mistake to warn the user about.
struct Quiet : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// The GIL released for its lifetime where this thread held it (a compiled step's wrapper calls ops holding it).
class WithoutGil {
 public:
  WithoutGil() : saved_(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~WithoutGil() {
    if (saved_) PyEval_RestoreThread(saved_);
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* saved_;
};

at::Tensor gather_linear_kernel(const at::Tensor& x, const std::optional<at::Tensor>& rows,
                                const std::optional<at::Tensor>& slots, const at::Tensor& data,
                                const std::optional<at::Tensor>& scales) {
  WithoutGil no_gil;
  return gather_linear(x, rows, slots, data, scales);
}

at::Tensor attend_cache_kernel(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                               const at::Tensor& slots, const at::Tensor& mask,
                               const std::optional<at::Tensor>& sinks, double scale) {
  WithoutGil no_gil;
  return attend_cache(q, k_pool, v_pool, slots, mask, sinks, scale);
}

// Registered while it exists (a Library unregisters what it holds when deleted). Never deleted at exit: the
// dispatcher may be gone by then.
torch::Library* cpu_kernels = nullptr;

void register_cpu(bool on) {
  if (!on) {
    delete cpu_kernels;
    cpu_kernels = nullptr;
    return;
  }
  if (cpu_kernels) return;
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  cpu_kernels = new torch::Library(torch::Library::IMPL, "moelane", c10::DispatchKey::CPU, __FILE__, __LINE__);
  cpu_kernels->impl("gather_linear", TORCH_FN(gather_linear_kernel));
  cpu_kernels->impl("attend_cache", TORCH_FN(attend_cache_kernel));
}

std::string isa() { return kIsa; }

}  // namespace

}  // namespace moelane

// Python reaches this library through its own operator namespace, torch.ops.<TORCH_EXTENSION_NAME> (one per build:
// two builds, as bench/kernel_ab.py loads, never collide), loaded by torch.ops.load_library (kernels/build.py).
// (LIBRARY expands the name before TORCH_LIBRARY pastes it.)
#define LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("gather_linear(Tensor x, Tensor? rows, Tensor? slots, Tensor data, Tensor? scales) -> Tensor",
        &moelane::gather_linear_kernel);
  m.def("attend_cache(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor mask, Tensor? sinks, "
        "float scale) -> Tensor",
        &moelane::attend_cache_kernel);
  m.def("quantise_rows(Tensor x, bool nibbles=False) -> (Tensor, Tensor)", &moelane::quantise_rows);
  m.def("register_cpu(bool on) -> ()", &moelane::register_cpu);
  m.def("isa() -> str", &moelane::isa);
}
