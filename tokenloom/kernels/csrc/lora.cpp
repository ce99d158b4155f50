// The mixed-batch LoRA op (tokenloom/kernels/lora_ops.py has the layout and the torch reference):
//   y[t] += scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s]   for every row t whose slot s = row_slots[t] >= 0.
// y, x and scaling are float32; the slots (lora_a, lora_b) float32, bfloat16 or float16 (--lora-dtype), widened
// to float32 as they are loaded, so the sums are float32 whatever the slots hold.
//
// The rows are first grouped by slot (a counting sort of a few dozen ints), then cut into blocks of up to
// ROW_BLOCK rows of one adapter, so every load of A or B serves a whole block:
// - shrink: h[t, r] = scaling[s] * x[t] . lora_a[s, r], a tile of ROW_BLOCK rows x SHRINK_RANKS ranks at a time
//   (each A vector loaded once for the block's rows, each x vector once for the tile's ranks);
// - expand: y[t, o] += sum_r h[t, r] * lora_b[s, r, o], two vectors of outputs for a block's rows at a time
//   (each B vector loaded once for the block), parallel over chunks of the outputs, B's panel of a chunk
//   ([rank, OUT_CHUNK] floats) staying in L1 across the blocks of its adapter.
// A pass smaller than PARALLEL_MIN_MACS runs on the calling thread: a decode step's pass at batch 1 is a few
// thousand multiply-adds, less than waking the other threads costs. Rows whose slot is -1 cost nothing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

using namespace tokenloom_vec;

// Outputs per expand work item: 128 floats keep B's panel at 8 KiB at rank 16 (in L1 with the block's y rows),
// and give a 192-wide k or v projection two items for two threads.
constexpr int64_t OUT_CHUNK = 128;
// Rows of one adapter sharing each A and B load: 4 rows x 4 ranks is 16 accumulators, half the AVX512
// registers; AVX2's 16 registers take 4 x 2.
constexpr int ROW_BLOCK = 4;
constexpr int SHRINK_RANKS = VL == 16 ? 4 : 2;
// Below this many multiply-adds a pass runs inline. Measured on the embedded SmolLM2's shapes (2 threads,
// AVX512, 2026-12-03): at batch 1 (9k multiply-adds a q projection's pass) two threads took 0.88 ms a step for
// the 210 LoRA calls against 0.58 ms on one; at batch 32 (295k) the two threads win.
constexpr int64_t PARALLEL_MIN_MACS = 1 << 17;

// One slot element (float, bfloat16 or float16) as float32: a vector of VL, or one.
inline vf load_w(const float* p) { return vload(p); }
inline vf load_w(const at::BFloat16* p) { return vload_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline vf load_w(const at::Half* p) { return vload_f16(reinterpret_cast<const uint16_t*>(p)); }
template <typename W>
inline float scalar_w(W v) { return static_cast<float>(v); }

struct Block {
  int32_t slot;
  int32_t first;  // index into the slot-sorted row order
  int32_t rows;
};

template <typename W, int N, int R>
inline void shrink_tile(const float* const* xs, const W* a, int64_t in, float scale, float* h, int64_t rank,
                        int64_t r0) {
  vf acc[N][R];
  for (int n = 0; n < N; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = vzero();
  int64_t i = 0;
  for (; i + VL <= in; i += VL) {
    vf av[R];
    for (int r = 0; r < R; ++r) av[r] = load_w(a + (r0 + r) * in + i);
    for (int n = 0; n < N; ++n) {
      const vf xv = vload(xs[n] + i);
      for (int r = 0; r < R; ++r) acc[n][r] = vfma(xv, av[r], acc[n][r]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int r = 0; r < R; ++r) {
      float sum = vsum(acc[n][r]);
      for (int64_t j = i; j < in; ++j) sum += xs[n][j] * scalar_w(a[(r0 + r) * in + j]);
      h[n * rank + r0 + r] = scale * sum;
    }
}

template <typename W, int N>
void shrink_block(const float* const* xs, const W* a, int64_t in, float scale, float* h, int64_t rank) {
  int64_t r = 0;
  for (; r + SHRINK_RANKS <= rank; r += SHRINK_RANKS) shrink_tile<W, N, SHRINK_RANKS>(xs, a, in, scale, h, rank, r);
  for (; r < rank; ++r) shrink_tile<W, N, 1>(xs, a, in, scale, h, rank, r);
}

template <typename W, int N>
void expand_block(float* const* ys, const float* h, const W* b, int64_t out, int64_t rank, int64_t o0,
                  int64_t o1) {
  int64_t o = o0;
  for (; o + 2 * VL <= o1; o += 2 * VL) {
    vf acc[N][2];
    for (int n = 0; n < N; ++n) {
      acc[n][0] = vload(ys[n] + o);
      acc[n][1] = vload(ys[n] + o + VL);
    }
    for (int64_t r = 0; r < rank; ++r) {
      const vf b0 = load_w(b + r * out + o), b1 = load_w(b + r * out + o + VL);
      for (int n = 0; n < N; ++n) {
        const vf hv = vset1(h[n * rank + r]);
        acc[n][0] = vfma(hv, b0, acc[n][0]);
        acc[n][1] = vfma(hv, b1, acc[n][1]);
      }
    }
    for (int n = 0; n < N; ++n) {
      vstore(ys[n] + o, acc[n][0]);
      vstore(ys[n] + o + VL, acc[n][1]);
    }
  }
  for (; o + VL <= o1; o += VL) {
    vf acc[N];
    for (int n = 0; n < N; ++n) acc[n] = vload(ys[n] + o);
    for (int64_t r = 0; r < rank; ++r) {
      const vf bv = load_w(b + r * out + o);
      for (int n = 0; n < N; ++n) acc[n] = vfma(vset1(h[n * rank + r]), bv, acc[n]);
    }
    for (int n = 0; n < N; ++n) vstore(ys[n] + o, acc[n]);
  }
  for (; o < o1; ++o)
    for (int n = 0; n < N; ++n) {
      float acc = ys[n][o];
      for (int64_t r = 0; r < rank; ++r) acc += h[n * rank + r] * scalar_w(b[r * out + o]);
      ys[n][o] = acc;
    }
}

// The block's shrink and expand for its row count, 1..ROW_BLOCK.
template <typename W>
void shrink_rows(int rows, const float* const* xs, const W* a, int64_t in, float scale, float* h, int64_t rank) {
  switch (rows) {
    case 1: shrink_block<W, 1>(xs, a, in, scale, h, rank); break;
    case 2: shrink_block<W, 2>(xs, a, in, scale, h, rank); break;
    case 3: shrink_block<W, 3>(xs, a, in, scale, h, rank); break;
    default: shrink_block<W, 4>(xs, a, in, scale, h, rank); break;
  }
}

template <typename W>
void expand_rows(int rows, float* const* ys, const float* h, const W* b, int64_t out, int64_t rank, int64_t o0,
                 int64_t o1) {
  switch (rows) {
    case 1: expand_block<W, 1>(ys, h, b, out, rank, o0, o1); break;
    case 2: expand_block<W, 2>(ys, h, b, out, rank, o0, o1); break;
    case 3: expand_block<W, 3>(ys, h, b, out, rank, o0, o1); break;
    default: expand_block<W, 4>(ys, h, b, out, rank, o0, o1); break;
  }
}

int64_t grain_for(int64_t items, int64_t macs) { return macs < PARALLEL_MIN_MACS ? std::max<int64_t>(items, 1) : 1; }

// Both passes over the blocks, the slots' elements of type W.
template <typename W>
void add_deltas(float* yp, int64_t y_stride, const float* xp, int64_t x_stride, const W* ap, const W* bp,
                const float* sp, const std::vector<int32_t>& order, const std::vector<Block>& blocks, int64_t in,
                int64_t out, int64_t rank) {
  const int64_t used = static_cast<int64_t>(order.size()), num_blocks = static_cast<int64_t>(blocks.size());
  // h[p, r] for the p-th row of the sorted order, already multiplied by its slot's scaling.
  std::vector<float> h(static_cast<size_t>(used * rank));
  at::parallel_for(0, num_blocks, grain_for(num_blocks, used * rank * in), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const Block& blk = blocks[k];
      const float* xs[ROW_BLOCK];
      for (int n = 0; n < blk.rows; ++n) xs[n] = xp + order[blk.first + n] * x_stride;
      shrink_rows<W>(blk.rows, xs, ap + blk.slot * rank * in, in, sp[blk.slot], h.data() + blk.first * rank, rank);
    }
  });
  const int64_t chunks = (out + OUT_CHUNK - 1) / OUT_CHUNK;
  at::parallel_for(0, chunks, grain_for(chunks, used * rank * out), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t o0 = c * OUT_CHUNK, o1 = std::min(out, o0 + OUT_CHUNK);
      for (const Block& blk : blocks) {
        float* ys[ROW_BLOCK];
        for (int n = 0; n < blk.rows; ++n) ys[n] = yp + order[blk.first + n] * y_stride;
        expand_rows<W>(blk.rows, ys, h.data() + blk.first * rank, bp + blk.slot * rank * out, out, rank, o0, o1);
      }
    }
  });
}

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
  auto a_c = lora_a.contiguous(), b_c = lora_b.contiguous(), s_c = scaling.contiguous(),
       slots_c = row_slots.contiguous();
  const int32_t* slot_of = slots_c.data_ptr<int32_t>();

  // Rows grouped by slot (stable), base rows dropped; then blocks of up to ROW_BLOCK rows of one slot.
  std::vector<int64_t> count(static_cast<size_t>(slots) + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < slots, "lora_add: row ", t, " names slot ", slot_of[t], " of ",
                slots);
    if (slot_of[t] >= 0) ++count[slot_of[t] + 1];
  }
  for (int64_t s = 0; s < slots; ++s) count[s + 1] += count[s];
  if (count[slots] == 0) return;
  std::vector<int32_t> order(static_cast<size_t>(count[slots]));
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t t = 0; t < rows; ++t)
      if (slot_of[t] >= 0) order[next[slot_of[t]]++] = static_cast<int32_t>(t);
  }
  std::vector<Block> blocks;
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t p = count[s]; p < count[s + 1]; p += ROW_BLOCK)
      blocks.push_back({static_cast<int32_t>(s), static_cast<int32_t>(p),
                        static_cast<int32_t>(std::min<int64_t>(ROW_BLOCK, count[s + 1] - p))});

  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* sp = s_c.data_ptr<float>();
  if (w == at::kFloat)
    add_deltas(yp, y.stride(0), xp, x.stride(0), a_c.data_ptr<float>(), b_c.data_ptr<float>(), sp, order, blocks, in,
               out, rank);
  else if (w == at::kBFloat16)
    add_deltas(yp, y.stride(0), xp, x.stride(0), a_c.data_ptr<at::BFloat16>(), b_c.data_ptr<at::BFloat16>(), sp,
               order, blocks, in, out, rank);
  else
    add_deltas(yp, y.stride(0), xp, x.stride(0), a_c.data_ptr<at::Half>(), b_c.data_ptr<at::Half>(), sp, order,
               blocks, in, out, rank);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scaling, Tensor row_slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("lora_add", &lora_add); }
