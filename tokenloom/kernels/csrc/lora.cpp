// The mixed-batch LoRA pass (tokenloom/kernels/lora_ops.py has the layout and the torch reference):
//   y[t] += scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s]   for every row t whose slot s = row_slots[t] >= 0.
// y, x and scaling are float32; the slots (lora_a, lora_b) float32, bfloat16 or float16 (--lora-dtype), widened
// to float32 as they are loaded, so the sums are float32 whatever the slots hold.
//
// The rows are grouped by slot once (plan_rows: a counting sort of a few dozen ints; the decoder stack does it
// once a step for its 7 targets a layer), then cut into blocks of up to ROW_BLOCK rows of one adapter, so every
// load of A or B serves a whole block:
// - shrink: h[t, r] = scaling[s] * x[t] . lora_a[s, r], a tile of ROW_BLOCK rows x SHRINK_RANKS ranks at a time
//   (each A vector loaded once for the block's rows, each x vector once for the tile's ranks);
// - expand: sum_r h[t, r] * lora_b[s, r, o], two vectors of outputs for a block's rows at a time (each B vector
//   loaded once for the block).
// The expand sums a rank's two halves apart, each from zero (one half below SPLIT_MIN_RANK), and the row
// becomes (y + first half) + second half. That fixed order lets two schedules give every row the same bits:
// - few rows (a decode step at low concurrency, <= RANK_SPLIT_MAX_ROWS): RankSplitPass, items of (target,
//   half) any thread may claim, writing their sums aside; a layer's q, k and v (or gate and up) go in one
//   pass, and the decoder stack runs the items inside the layer's base matmul (csrc/side_work.h). At batch 1
//   a pass is bound by fetching A and B from memory (the base weights stream through the caches between two
//   layers' adapters), which one thread does at half the rate two do.
// - more rows: per target, the shrink parallel over blocks, the expand over chunks of OUT_CHUNK outputs,
//   B's panel of a chunk ([rank, OUT_CHUNK] floats) staying in L1 across the blocks of its adapter; a pass
//   smaller than PARALLEL_MIN_MACS runs on the calling thread.
// Rows whose slot is -1 cost nothing.
#include "lora.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "vec_math.h"

namespace tokenloom_lora {
namespace {

using namespace tokenloom_vec;

// Outputs per expand work item: 128 floats keep B's panel at 8 KiB at rank 16 (in L1 with the block's y rows),
// and give a 192-wide k or v projection two items for two threads.
constexpr int64_t OUT_CHUNK = 128;
// Rows of one adapter sharing each A and B load: 4 rows x 4 ranks is 16 accumulators, half the AVX512
// registers; AVX2's 16 registers take 4 x 2.
constexpr int ROW_BLOCK = 4;
constexpr int SHRINK_RANKS = VL == 16 ? 4 : 2;
// Block schedule: below this many multiply-adds a pass runs inline (batch 32 on the embedded SmolLM2's q
// projection is 295k and gains from two threads, 2026-12-03).
constexpr int64_t PARALLEL_MIN_MACS = 1 << 17;
// Up to this many adapter rows take the rank-split schedule: one or two blocks leave the block-parallel
// shrink on one thread.
constexpr int64_t RANK_SPLIT_MAX_ROWS = 8;
constexpr int64_t SPLIT_MIN_RANK = 8;

inline int64_t split_of(int64_t rank) { return rank >= SPLIT_MIN_RANK ? rank / 2 : rank; }

// One slot element (float, bfloat16 or float16) as float32: a vector of VL, or one.
inline vf load_w(const float* p) { return vload(p); }
inline vf load_w(const at::BFloat16* p) { return vload_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline vf load_w(const at::Half* p) { return vload_f16(reinterpret_cast<const uint16_t*>(p)); }
template <typename W>
inline float scalar_w(W v) { return static_cast<float>(v); }

// h[n * hs + r + j] = scale * x_n . a[r + j] for the tile's R ranks from r.
template <typename W, int N, int R>
inline void shrink_tile(const float* const* xs, const W* a, int64_t in, float scale, float* h, int64_t hs, int64_t r) {
  vf acc[N][R];
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < R; ++j) acc[n][j] = vzero();
  int64_t i = 0;
  for (; i + VL <= in; i += VL) {
    vf av[R];
    for (int j = 0; j < R; ++j) av[j] = load_w(a + (r + j) * in + i);
    for (int n = 0; n < N; ++n) {
      const vf xv = vload(xs[n] + i);
      for (int j = 0; j < R; ++j) acc[n][j] = vfma(xv, av[j], acc[n][j]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < R; ++j) {
      float sum = vsum(acc[n][j]);
      for (int64_t k = i; k < in; ++k) sum += xs[n][k] * scalar_w(a[(r + j) * in + k]);
      h[n * hs + r + j] = scale * sum;
    }
}

template <typename W, int N>
void shrink_block(const float* const* xs, const W* a, int64_t in, float scale, float* h, int64_t hs, int64_t r0,
                  int64_t r1) {
  int64_t r = r0;
  for (; r + SHRINK_RANKS <= r1; r += SHRINK_RANKS) shrink_tile<W, N, SHRINK_RANKS>(xs, a, in, scale, h, hs, r);
  for (; r < r1; ++r) shrink_tile<W, N, 1>(xs, a, in, scale, h, hs, r);
}

// Outputs [o0, o1) of rows n: d[n][o] = (accumulate ? d[n][o] : 0) + sum over ranks [r0, r1) of
// h[n * hs + r] * b[r * out + o], where output o of row n lives at dst[n][o - shift].
template <typename W, int N>
void expand_block(float* const* dst, int64_t shift, bool accumulate, const float* h, int64_t hs, const W* b,
                  int64_t out, int64_t r0, int64_t r1, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + 2 * VL <= o1; o += 2 * VL) {
    vf acc[N][2];
    for (int n = 0; n < N; ++n) {
      acc[n][0] = accumulate ? vload(dst[n] + (o - shift)) : vzero();
      acc[n][1] = accumulate ? vload(dst[n] + (o - shift) + VL) : vzero();
    }
    for (int64_t r = r0; r < r1; ++r) {
      const vf b0 = load_w(b + r * out + o), b1 = load_w(b + r * out + o + VL);
      for (int n = 0; n < N; ++n) {
        const vf hv = vset1(h[n * hs + r]);
        acc[n][0] = vfma(hv, b0, acc[n][0]);
        acc[n][1] = vfma(hv, b1, acc[n][1]);
      }
    }
    for (int n = 0; n < N; ++n) {
      vstore(dst[n] + (o - shift), acc[n][0]);
      vstore(dst[n] + (o - shift) + VL, acc[n][1]);
    }
  }
  for (; o + VL <= o1; o += VL) {
    vf acc[N];
    for (int n = 0; n < N; ++n) acc[n] = accumulate ? vload(dst[n] + (o - shift)) : vzero();
    for (int64_t r = r0; r < r1; ++r) {
      const vf bv = load_w(b + r * out + o);
      for (int n = 0; n < N; ++n) acc[n] = vfma(vset1(h[n * hs + r]), bv, acc[n]);
    }
    for (int n = 0; n < N; ++n) vstore(dst[n] + (o - shift), acc[n]);
  }
  for (; o < o1; ++o)
    for (int n = 0; n < N; ++n) {
      float acc = accumulate ? dst[n][o - shift] : 0.0f;
      for (int64_t r = r0; r < r1; ++r) acc += h[n * hs + r] * scalar_w(b[r * out + o]);
      dst[n][o - shift] = acc;
    }
}

// The block's shrink and expand for its row count, 1..ROW_BLOCK.
template <typename W>
void shrink_rows(int rows, const float* const* xs, const W* a, int64_t in, float scale, float* h, int64_t hs,
                 int64_t r0, int64_t r1) {
  switch (rows) {
    case 1: shrink_block<W, 1>(xs, a, in, scale, h, hs, r0, r1); break;
    case 2: shrink_block<W, 2>(xs, a, in, scale, h, hs, r0, r1); break;
    case 3: shrink_block<W, 3>(xs, a, in, scale, h, hs, r0, r1); break;
    default: shrink_block<W, 4>(xs, a, in, scale, h, hs, r0, r1); break;
  }
}

template <typename W>
void expand_rows(int rows, float* const* dst, int64_t shift, bool accumulate, const float* h, int64_t hs, const W* b,
                 int64_t out, int64_t r0, int64_t r1, int64_t o0, int64_t o1) {
  switch (rows) {
    case 1: expand_block<W, 1>(dst, shift, accumulate, h, hs, b, out, r0, r1, o0, o1); break;
    case 2: expand_block<W, 2>(dst, shift, accumulate, h, hs, b, out, r0, r1, o0, o1); break;
    case 3: expand_block<W, 3>(dst, shift, accumulate, h, hs, b, out, r0, r1, o0, o1); break;
    default: expand_block<W, 4>(dst, shift, accumulate, h, hs, b, out, r0, r1, o0, o1); break;
  }
}

// dst[o] += add[o]
void add_row(float* dst, const float* add, int64_t n) {
  int64_t o = 0;
  for (; o + VL <= n; o += VL) vstore(dst + o, vadd(vload(dst + o), vload(add + o)));
  for (; o < n; ++o) dst[o] += add[o];
}

// Calls f with a null pointer of the slots' element type.
template <typename F>
void with_slot_type(at::ScalarType dtype, F f) {
  if (dtype == at::kFloat)
    f(static_cast<const float*>(nullptr));
  else if (dtype == at::kBFloat16)
    f(static_cast<const at::BFloat16*>(nullptr));
  else
    f(static_cast<const at::Half*>(nullptr));
}

// Rank-split schedule, one item: ranks [r0, r1) of target t for every planned row, summed from zero into
// `sums` [used, out] (row p of the slot-sorted order at p * out).
template <typename W>
void split_item(const RowPlan& plan, const Target& t, const float* x, int64_t x_stride, const float* scaling,
                int64_t r0, int64_t r1, float* h, float* sums) {
  const W* a = static_cast<const W*>(t.a);
  const W* b = static_cast<const W*>(t.b);
  for (const Block& blk : plan.blocks) {
    const float* xs[ROW_BLOCK];
    float* dst[ROW_BLOCK];
    for (int n = 0; n < blk.rows; ++n) {
      xs[n] = x + plan.order[blk.first + n] * x_stride;
      dst[n] = sums + (blk.first + n) * t.out;
    }
    float* hb = h + blk.first * t.rank;
    shrink_rows<W>(blk.rows, xs, a + blk.slot * t.rank * t.in, t.in, scaling[blk.slot], hb, t.rank, r0, r1);
    const W* bs = b + blk.slot * t.rank * t.out;
    for (int64_t o0 = 0; o0 < t.out; o0 += OUT_CHUNK)
      expand_rows<W>(blk.rows, dst, 0, false, hb, t.rank, bs, t.out, r0, r1, o0, std::min(t.out, o0 + OUT_CHUNK));
  }
}

int64_t grain_for(int64_t items, int64_t macs) { return macs < PARALLEL_MIN_MACS ? std::max<int64_t>(items, 1) : 1; }

// Block schedule for one target: the shrink parallel over blocks, the expand over chunks of outputs.
template <typename W>
void add_blocks(RowPlan& plan, const Target& t, const float* x, int64_t x_stride, const float* scaling) {
  const W* a = static_cast<const W*>(t.a);
  const W* b = static_cast<const W*>(t.b);
  const int64_t used = static_cast<int64_t>(plan.order.size()), num_blocks = static_cast<int64_t>(plan.blocks.size());
  const int64_t rank = t.rank, split = split_of(rank);
  plan.scratch.resize(static_cast<size_t>(used * rank));
  float* h = plan.scratch.data();
  at::parallel_for(0, num_blocks, grain_for(num_blocks, used * rank * t.in), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const Block& blk = plan.blocks[k];
      const float* xs[ROW_BLOCK];
      for (int n = 0; n < blk.rows; ++n) xs[n] = x + plan.order[blk.first + n] * x_stride;
      shrink_rows<W>(blk.rows, xs, a + blk.slot * rank * t.in, t.in, scaling[blk.slot], h + blk.first * rank, rank,
                     0, rank);
    }
  });
  const int64_t chunks = (t.out + OUT_CHUNK - 1) / OUT_CHUNK;
  at::parallel_for(0, chunks, grain_for(chunks, used * rank * t.out), [&](int64_t begin, int64_t end) {
    // Each half's sums for a block's rows over one chunk (output o at o - o0), then (y + first) + second.
    float first[ROW_BLOCK][OUT_CHUNK], second[ROW_BLOCK][OUT_CHUNK];
    float* firsts[ROW_BLOCK] = {first[0], first[1], first[2], first[3]};
    float* seconds[ROW_BLOCK] = {second[0], second[1], second[2], second[3]};
    for (int64_t c = begin; c < end; ++c) {
      const int64_t o0 = c * OUT_CHUNK, o1 = std::min(t.out, o0 + OUT_CHUNK);
      for (const Block& blk : plan.blocks) {
        const float* hb = h + blk.first * rank;
        const W* bs = b + blk.slot * rank * t.out;
        expand_rows<W>(blk.rows, firsts, o0, false, hb, rank, bs, t.out, 0, split, o0, o1);
        if (split < rank) expand_rows<W>(blk.rows, seconds, o0, false, hb, rank, bs, t.out, split, rank, o0, o1);
        for (int n = 0; n < blk.rows; ++n) {
          float* y = t.y + plan.order[blk.first + n] * t.y_stride + o0;
          add_row(y, firsts[n], o1 - o0);
          if (split < rank) add_row(y, seconds[n], o1 - o0);
        }
      }
    }
  });
}

}  // namespace

RowPlan plan_rows(const at::Tensor& row_slots, int64_t slots) {
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.dim() == 1, "lora: int32 row_slots [rows]");
  const at::Tensor slots_c = row_slots.contiguous();
  const int32_t* slot_of = slots_c.data_ptr<int32_t>();
  RowPlan plan;
  plan.rows = row_slots.size(0);
  plan.slots = slots;
  std::vector<int64_t> count(static_cast<size_t>(slots) + 1, 0);
  for (int64_t t = 0; t < plan.rows; ++t) {
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < slots, "lora: row ", t, " names slot ", slot_of[t], " of ", slots);
    if (slot_of[t] >= 0) ++count[slot_of[t] + 1];
  }
  for (int64_t s = 0; s < slots; ++s) count[s + 1] += count[s];
  plan.order.resize(static_cast<size_t>(count[slots]));
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < plan.rows; ++t)
    if (slot_of[t] >= 0) plan.order[next[slot_of[t]]++] = static_cast<int32_t>(t);
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t p = count[s]; p < count[s + 1]; p += ROW_BLOCK)
      plan.blocks.push_back({static_cast<int32_t>(s), static_cast<int32_t>(p),
                             static_cast<int32_t>(std::min<int64_t>(ROW_BLOCK, count[s + 1] - p))});
  return plan;
}

bool takes_rank_split(const RowPlan& plan) {
  return !plan.order.empty() && static_cast<int64_t>(plan.order.size()) <= RANK_SPLIT_MAX_ROWS;
}

RankSplitPass::RankSplitPass(RowPlan& plan, const Target* targets, int64_t count, const float* x, int64_t x_stride,
                             const float* scaling)
    : tokenloom_side::SideWork(2 * count), plan_(plan), targets_(targets, targets + count), x_(x),
      x_stride_(x_stride), scaling_(scaling) {
  // Per target: h [used, rank], then the two halves' sums, each [used, out].
  const int64_t used = static_cast<int64_t>(plan.order.size());
  offsets_.assign(static_cast<size_t>(count) + 1, 0);
  for (int64_t k = 0; k < count; ++k) offsets_[k + 1] = offsets_[k] + used * (targets[k].rank + 2 * targets[k].out);
  plan.scratch.resize(static_cast<size_t>(offsets_[count]));
}

// Item i: target i % count, half i / count: the first halves are claimed first, the second halves after.
void RankSplitPass::run_item(int64_t i) {
  const int64_t count = static_cast<int64_t>(targets_.size()), used = static_cast<int64_t>(plan_.order.size());
  const Target& t = targets_[i % count];
  const int64_t split = split_of(t.rank), second = i / count;
  if (second && split == t.rank) return;
  float* h = plan_.scratch.data() + offsets_[i % count];
  float* sums = h + used * t.rank + second * used * t.out;
  with_slot_type(t.dtype, [&](auto tag) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    split_item<W>(plan_, t, x_, x_stride_, scaling_, second ? split : 0, second ? t.rank : split, h, sums);
  });
}

void RankSplitPass::finish(const Target* outputs) {
  run();
  const int64_t used = static_cast<int64_t>(plan_.order.size());
  for (size_t k = 0; k < targets_.size(); ++k) {
    const Target& t = targets_[k];
    const float* first = plan_.scratch.data() + offsets_[k] + used * t.rank;
    const bool has_second = split_of(t.rank) < t.rank;
    for (int64_t p = 0; p < used; ++p) {
      float* y = outputs[k].y + plan_.order[p] * outputs[k].y_stride;
      add_row(y, first + p * t.out, t.out);
      if (has_second) add_row(y, first + (used + p) * t.out, t.out);
    }
  }
}

void add_targets(RowPlan& plan, const Target* targets, int64_t count, const float* x, int64_t x_stride,
                 const float* scaling) {
  if (plan.order.empty() || count == 0) return;
  TORCH_CHECK(count <= MAX_PASS_TARGETS, "lora: a pass takes at most ", MAX_PASS_TARGETS, " targets");
  if (takes_rank_split(plan)) {
    RankSplitPass pass(plan, targets, count, x, x_stride, scaling);
    at::parallel_for(0, 2 * count, 1, [&](int64_t, int64_t) { pass.run(); });
    pass.finish(targets);
    return;
  }
  for (int64_t k = 0; k < count; ++k)
    with_slot_type(targets[k].dtype, [&](auto tag) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
      add_blocks<W>(plan, targets[k], x, x_stride, scaling);
    });
}

}  // namespace tokenloom_lora

namespace {

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& scaling, const at::Tensor& row_slots) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && scaling.scalar_type() == at::kFloat,
              "lora_add: float32 y, x, scaling");
  const auto w = lora_a.scalar_type();
  TORCH_CHECK((w == at::kFloat || w == at::kBFloat16 || w == at::kHalf) && lora_b.scalar_type() == w,
              "lora_add: lora_a and lora_b both float32, bfloat16 or float16");
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.dim() == 1, "lora_add: int32 row_slots [rows]");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3 && scaling.dim() == 1,
              "lora_add: y [rows, out], x [rows, in], lora_a [slots, rank, in], lora_b [slots, rank, out]");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t slots = lora_a.size(0), rank = lora_a.size(1);
  TORCH_CHECK(y.size(0) == rows && row_slots.size(0) == rows, "lora_add: y, x and row_slots differ in rows");
  TORCH_CHECK(lora_a.size(2) == in && lora_b.size(0) == slots && lora_b.size(1) == rank && lora_b.size(2) == out &&
                  scaling.size(0) == slots,
              "lora_add: lora_a [slots, rank, in], lora_b [slots, rank, out], scaling [slots] do not fit x and y");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "lora_add: y and x need unit column stride");
  if (rows == 0 || rank == 0 || out == 0) return;
  const at::Tensor a_c = lora_a.contiguous(), b_c = lora_b.contiguous(), s_c = scaling.contiguous();
  tokenloom_lora::RowPlan plan = tokenloom_lora::plan_rows(row_slots, slots);
  const tokenloom_lora::Target target{y.data_ptr<float>(), y.stride(0), a_c.data_ptr(), b_c.data_ptr(), w, in, out,
                                      rank};
  tokenloom_lora::add_targets(plan, &target, 1, x.data_ptr<float>(), x.stride(0), s_c.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scaling, Tensor row_slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("lora_add", &lora_add); }
