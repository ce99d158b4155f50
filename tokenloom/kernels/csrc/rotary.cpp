// Rotary position embedding, rotate-half layout (HF Llama): for each head, with x1, x2 its two halves,
//   out = (x1*cos - x2*sin, x2*cos + x1*sin)
// cos/sin read from the model's tables [max_positions, head_dim/2] at each token's position. q and k in one
// call (they share the positions); they may be strided views into the fused QKV output, the results are
// fresh contiguous [T, heads, head_dim] tensors. One call replaces ~10 torch ops a layer (lookup, chunk,
// four multiplies, two adds, cat, for q and again for k).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "vec_math.h"

namespace {

using namespace tokenloom_vec;

inline void rotate_head(const float* x, const float* c, const float* s, float* out, int64_t half) {
  int64_t i = 0;
  for (; i + VL <= half; i += VL) {
    vf x1 = vload(x + i), x2 = vload(x + half + i), cv = vload(c + i), sv = vload(s + i);
    vstore(out + i, vsub(vmul(x1, cv), vmul(x2, sv)));
    vstore(out + half + i, vadd(vmul(x2, cv), vmul(x1, sv)));
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = x1 * c[i] - x2 * s[i];
    out[half + i] = x2 * c[i] + x1 * s[i];
  }
}

void rotate(const at::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t half, at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1);
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * D, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < H; ++h) rotate_head(xp + t * ts + h * hs, c, s, op + (t * H + h) * D, half);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary_embedding: q [T, heads, head_dim] and k [T, kv_heads, head_dim], head_dim even");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary_embedding: float32 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "rotary_embedding: head_dim must be contiguous");
  const int64_t half = q.size(2) / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos/sin tables must be [max_positions, head_dim/2]");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == q.size(0), "rotary_embedding: one position per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "rotary_embedding: position ", pp[t], " outside the table");
  auto c = cos.contiguous();
  auto s = sin.contiguous();
  auto q_out = at::empty(q.sizes(), q.options());
  auto k_out = at::empty(k.sizes(), k.options());
  rotate(q, pp, c.data_ptr<float>(), s.data_ptr<float>(), half, q_out);
  rotate(k, pp, c.data_ptr<float>(), s.data_ptr<float>(), half, k_out);
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
