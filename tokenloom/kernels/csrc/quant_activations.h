// Activations quantized to int8 per 32-value block for the W4A8 matmuls (quant_matmul.cpp, quant_gemm.cpp).
//
// Each block gets scale dx = amax/127 and values round(x * 127/amax) (round half to even, as the torch
// reference in tokenloom/kernels/quant.py). Per block the metadata holds dx, dx*sum(q), dx*sum(q[0:16]),
// dx*sum(q[16:32]): the weight's `min` term needs the activation block's sum (per 16-value half for
// 16-value weight blocks), so it is computed once here instead of once per output column.
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>

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

// One block: q[j] = round_half_even(src[j] * (127 / amax)) (a vector conversion rounds as nearbyint under
// the default MXCSR), and its metadata. Vectorized because the scalar loop showed at many rows: a W4A8
// matmul of 512 x 1536 activations by a 32-column weight (mostly quantization) took 760 us with it, 423
// us with this (one thread, load average ~6).
inline void quantize_block(const float* src, int8_t* dst, float* meta) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qb));
  const int lo = _mm512_reduce_add_epi32(qa), hi = _mm512_reduce_add_epi32(qb);
#else
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(src + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  alignas(32) int32_t q[32];
  for (int i = 0; i < 4; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))));
  int lo = 0, hi = 0;
  for (int j = 0; j < XB; ++j) {
    dst[j] = static_cast<int8_t>(q[j]);
    (j < XB / 2 ? lo : hi) += q[j];
  }
#endif
  const float dx = amax / 127.f;
  meta[0] = dx;
  meta[1] = dx * static_cast<float>(lo + hi);
  meta[2] = dx * static_cast<float>(lo);
  meta[3] = dx * static_cast<float>(hi);
}

inline void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedX& out) {
  const int64_t nb = K / XB;
  out.q.resize(M * K);
  out.meta.resize(M * nb * 4);
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb;
      quantize_block(x + r * K + b * XB, out.q.data() + r * K + b * XB, out.meta.data() + i * 4);
    }
  });
}

}  // namespace tokenloom_quant
