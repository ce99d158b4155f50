// RMSNorm and the fused residual-add + RMSNorm (tokenloom/kernels/layer_ops.py has the torch references).
//
//   rms_norm(x, w)          = w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, r, w)   = (rms_norm(x + r, w), x + r)
//
// The add-and-norm pair replaces three to five torch ops a layer boundary (add, pow, mean, rsqrt, two
// multiplies) with one call that reads each row once. float32 rows; the last dim is the normalised one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "vec_math.h"

namespace {

using namespace tokenloom_vec;

// Rows per task: below ~32k elements one thread does the whole call (a parallel region costs more).
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  vf acc = vzero();
  int64_t i = 0;
  for (; i + VL <= n; i += VL) {
    vf v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  float ss = vsum(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  vf rv = vset1(r);
  i = 0;
  for (; i + VL <= n; i += VL) vstore(out + i, vmul(vload(w + i), vmul(vload(x + i), rv)));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, op, ": float32 only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": weight must be [hidden] matching x's last dim");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  auto xc = x.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat,
              "add_rms_norm: residual must match x");
  auto xc = x.contiguous();
  auto rc = residual.contiguous();
  auto w = weight.contiguous();
  auto sum = at::empty_like(xc);
  auto out = at::empty_like(xc);
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  const float* xp = xc.data_ptr<float>();
  const float* rp = rc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* a = xp + r * n;
      const float* b = rp + r * n;
      float* s = sp + r * n;
      int64_t i = 0;
      for (; i + VL <= n; i += VL) vstore(s + i, vadd(vload(a + i), vload(b + i)));
      for (; i < n; ++i) s[i] = a[i] + b[i];
      norm_row(s, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
