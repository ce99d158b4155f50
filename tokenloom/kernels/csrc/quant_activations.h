// Activations quantized to int8 per 32-value block for the W4A8 matmuls (quant_matmul.cpp, quant_gemm.cpp).
//
// Each block gets scale dx = amax/127 and values round(x * 127/amax) (round half to even, as the torch
// reference in tokenloom/kernels/quant.py). Per block the metadata holds dx, dx*sum(q), dx*sum(q[0:16]),
// dx*sum(q[16:32]): the weight's `min` term needs the activation block's sum (per 16-value half for
// 16-value weight blocks), so it is computed once here instead of once per output column.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tokenloom_quant {

constexpr int XB = 32;  // activation block

struct QuantizedX {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> meta;   // [M, K/32, 4]
};

inline void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedX& out) {
  const int64_t nb = K / XB;
  out.q.resize(M * K);
  out.meta.resize(M * nb * 4);
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb;
      const float* src = x + r * K + b * XB;
      float amax = 0.f;
      for (int j = 0; j < XB; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      const float dx = amax / 127.f;
      int8_t* dst = out.q.data() + r * K + b * XB;
      int lo = 0, hi = 0;
      for (int j = 0; j < XB; ++j) {
        const int v = static_cast<int>(std::nearbyint(src[j] * id));
        dst[j] = static_cast<int8_t>(v);
        (j < XB / 2 ? lo : hi) += v;
      }
      float* meta = out.meta.data() + i * 4;
      meta[0] = dx;
      meta[1] = dx * static_cast<float>(lo + hi);
      meta[2] = dx * static_cast<float>(lo);
      meta[3] = dx * static_cast<float>(hi);
    }
  });
}

}  // namespace tokenloom_quant
