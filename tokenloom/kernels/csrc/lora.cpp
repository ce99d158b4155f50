// The mixed-batch LoRA op (tokenloom/kernels/lora_ops.py has the layout and the torch reference):
//   y[t] += scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s]   for every row t whose slot s = row_slots[t] >= 0.
//
// Two passes, each one at::parallel_for:
// - shrink: h[t, r] = x[t] . lora_a[s, r], one dot product of `in` floats per (row, rank) pair, so a batch-1
//   step still has max_rank independent items to spread over the threads;
// - expand: y[t, chunk] += sum_r (scaling[s] * h[t, r]) * lora_b[s, r, chunk], parallel over chunks of the
//   outputs; inside a chunk every row runs, so the rows of one adapter reuse its B panel
//   ([max_rank, OUT_CHUNK] floats, 16 KiB at rank 16) from cache instead of reading B once per row.
// Rows whose slot is -1 cost nothing. Unlike the reference, rows need not be gathered by slot: the decode
// batch interleaves adapters, and each row reads its own slot's A and B.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

using namespace tokenloom_vec;

// Outputs per expand work item: 256 floats (1 KiB of a row of y; 16 KiB of B at rank 16) keeps B's panel in
// L1 across the rows of one chunk, and still gives a 2048-wide projection 8 items at batch 1.
constexpr int64_t OUT_CHUNK = 256;

float dot(const float* a, const float* b, int64_t n) {
  vf acc0 = vzero(), acc1 = vzero();
  int64_t i = 0;
  for (; i + 2 * VL <= n; i += 2 * VL) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + VL), vload(b + i + VL), acc1);
  }
  for (; i + VL <= n; i += VL) acc0 = vfma(vload(a + i), vload(b + i), acc0);
  float sum = vsum(vadd(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
              const at::Tensor& scaling, const at::Tensor& row_slots) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && lora_a.scalar_type() == at::kFloat &&
                  lora_b.scalar_type() == at::kFloat && scaling.scalar_type() == at::kFloat,
              "lora_add: float32 y, x, lora_a, lora_b, scaling");
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
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < slots, "lora_add: row ", t, " names slot ", slot_of[t], " of ",
                slots);
  const float* xp = x.data_ptr<float>();
  const float* ap = a_c.data_ptr<float>();
  const float* bp = b_c.data_ptr<float>();
  const float* sp = s_c.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);

  // h[t, r], already multiplied by the slot's scaling; rows with no adapter stay unread.
  std::vector<float> h(static_cast<size_t>(rows * rank), 0.0f);
  const int64_t dot_grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(in, 1));
  at::parallel_for(0, rows * rank, dot_grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / rank, r = i % rank;
      const int32_t s = slot_of[t];
      if (s < 0) continue;
      h[i] = sp[s] * dot(xp + t * x_stride, ap + (s * rank + r) * in, in);
    }
  });

  const int64_t chunks = (out + OUT_CHUNK - 1) / OUT_CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t o0 = c * OUT_CHUNK, o1 = std::min(out, o0 + OUT_CHUNK);
      for (int64_t t = 0; t < rows; ++t) {
        const int32_t s = slot_of[t];
        if (s < 0) continue;
        const float* ht = h.data() + t * rank;
        const float* bs = bp + s * rank * out;
        float* yt = yp + t * y_stride;
        int64_t o = o0;
        for (; o + VL <= o1; o += VL) {
          vf acc = vload(yt + o);
          for (int64_t r = 0; r < rank; ++r) acc = vfma(vset1(ht[r]), vload(bs + r * out + o), acc);
          vstore(yt + o, acc);
        }
        for (; o < o1; ++o) {
          float acc = yt[o];
          for (int64_t r = 0; r < rank; ++r) acc += ht[r] * bs[r * out + o];
          yt[o] = acc;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scaling, Tensor row_slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("lora_add", &lora_add); }
