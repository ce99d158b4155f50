// Small SIMD helpers shared by the fused kernels (attention, norms, rotary, activation): one float
// vector type per ISA (AVX512: 16 lanes, AVX2: 8), bfloat16 <-> float32, float16 -> float32, and a vector exp.
//
// exp: Cody-Waite range reduction (x = n*ln2 + r) and a degree-6 polynomial for e^r (the Cephes
// coefficients), within 2 ulp of expf over the float range; below -87.3 it returns 0. Used by softmax
// and SiLU, whose torch references call Sleef's expf (1 ulp): results agree to a few 1e-7 relative.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenloom_vec {

#if defined(__AVX512F__)
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float v) { return _mm512_set1_ps(v); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
// VL bfloat16 values -> float32 (a bfloat16 is the high half of a float32).
inline vf vload_bf16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// VL int8 values -> float32 (exact).
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// VL float16 values -> float32.
inline vf vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf vexp(vf x) {
  const vf lo = vset1(-87.3365447505f);
  vf xc = _mm512_max_ps(_mm512_min_ps(x, vset1(88.3762626647949f)), lo);
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(xc, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, vset1(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.9875691500E-4f);
  p = vfma(p, r, vset1(1.3981999507E-3f));
  p = vfma(p, r, vset1(8.3334519073E-3f));
  p = vfma(p, r, vset1(4.1665795894E-2f));
  p = vfma(p, r, vset1(1.6666665459E-1f));
  p = vfma(p, r, vset1(5.0000001201E-1f));
  p = vfma(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, vset1(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  vf out = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  return _mm512_mask_mov_ps(out, under, vzero());
}
#else
constexpr int VL = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float v) { return _mm256_set1_ps(v); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vload_bf16(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vexp(vf x) {
  const vf lo = vset1(-87.3365447505f);
  vf xc = _mm256_max_ps(_mm256_min_ps(x, vset1(88.3762626647949f)), lo);
  vf n = _mm256_round_ps(_mm256_mul_ps(xc, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm256_fnmadd_ps(n, vset1(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.9875691500E-4f);
  p = vfma(p, r, vset1(1.3981999507E-3f));
  p = vfma(p, r, vset1(8.3334519073E-3f));
  p = vfma(p, r, vset1(4.1665795894E-2f));
  p = vfma(p, r, vset1(1.6666665459E-1f));
  p = vfma(p, r, vset1(5.0000001201E-1f));
  p = vfma(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, vset1(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  vf out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(out, _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
}
#endif

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN stays NaN).
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// The 8-bit KV cache (tokenloom/kernels/kv_int8.py): a row of D int8 values, then its float32 scale.
constexpr int64_t KV_SCALE_BYTES = 4;

inline float int8_row_scale(const int8_t* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, sizeof(float));
  return s;
}

// x[0..dim) -> dim int8 values round(x / scale) and the scale amax / 127 after them, as kv_int8.quantize_rows.
inline void quantize_int8_row(const float* x, int64_t dim, int8_t* row) {
  float amax = 0.0f;
  for (int64_t d = 0; d < dim; ++d) amax = std::fmax(amax, std::fabs(x[d]));
  const float scale = amax / 127.0f;
  for (int64_t d = 0; d < dim; ++d) {
    const float v = scale > 0.0f ? std::nearbyint(x[d] / scale) : 0.0f;
    row[d] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, v)));
  }
  std::memcpy(row + dim, &scale, sizeof(float));
}

// Scalar exp for the tails of rows, the same formula as vexp so a row's lanes agree.
inline float sexp(float x) {
  if (x < -87.3365447505f) return 0.0f;
  float xc = std::fmin(x, 88.3762626647949f);
  float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = std::fma(-n, 0.693359375f, xc);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500E-4f;
  p = std::fma(p, r, 1.3981999507E-3f);
  p = std::fma(p, r, 8.3334519073E-3f);
  p = std::fma(p, r, 4.1665795894E-2f);
  p = std::fma(p, r, 1.6666665459E-1f);
  p = std::fma(p, r, 5.0000001201E-1f);
  p = std::fma(p, r * r, r + 1.0f);
  return std::ldexp(p, static_cast<int>(n));
}

}  // namespace tokenloom_vec
