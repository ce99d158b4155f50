// Matmuls against block-quantized weights kept in their repacked GGUF form (tokenloom/kernels/quant.py).
//
// Weight format (made by tokenloom/model/loader/gguf_repack.py), for a weight [N, K]:
//   bits 4: qweight uint8 [N, K/2]; per 32-element block 16 bytes, byte j holds element j (low nibble)
//           and element 16+j (high nibble), as GGUF's Q4_0/Q4_1 do. Block size 32.
//   bits 8: qweight uint8 [N, K], one byte an element. Block size 32 or 16 (Q6_K's sub-blocks).
//   scales, mins: float32 [N, K/block]; the weight is w = fma(q, scale, min) (q unsigned).
//
// Two paths:
//   quant_matmul     (exact): float32 x times the weight dequantized in registers, float32 FMAs.
//   quant_matmul_a8  (W4A8):  x quantized to int8 per 32-value block (scale amax/127), integer dot
//                             products (vpdpbusd with AVX512-VNNI, maddubs with AVX2), float scaling.
// Both compute every output row with the same instruction sequence whatever the number of rows,
// so a sequence's result does not depend on what else is in the batch (scalar sums are explicit
// std::fma: GCC's default -ffp-contract=fast would fuse them differently per instantiation).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quant_activations.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vset1(float v) { return _mm512_set1_ps(v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf u8_to_f(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 32 nibbles -> 2 vectors of elements 0..15, 16..31.
inline void nibbles_to_f(const uint8_t* p, vf* out) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
  out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#else
constexpr int VL = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vset1(float v) { return _mm256_set1_ps(v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf u8_to_f(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 32 nibbles -> 4 vectors of elements 0..7, 8..15, 16..23, 24..31.
inline void nibbles_to_f(const uint8_t* p, vf* out) {
  __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i lo = _mm256_set1_epi32(0xF);
  out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, lo));
  out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
  out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}
#endif

// One block of one weight row, dequantized into BS/VL vectors: w = fma(q, scale, min).
template <int BITS, int BS>
inline void decode_block(const uint8_t* q, float scale, float min, vf* w) {
  constexpr int VPB = BS / VL;
  const vf d = vset1(scale), m = vset1(min);
  if constexpr (BITS == 4) {
    nibbles_to_f(q, w);
  } else {
    for (int v = 0; v < VPB; ++v) w[v] = u8_to_f(q + v * VL);
  }
  for (int v = 0; v < VPB; ++v) w[v] = vfma(w[v], d, m);
}

struct Weight {
  const uint8_t* q;
  const float* scale;
  const float* min;
  int64_t q_stride;  // bytes per weight row
  int64_t blocks;    // blocks per weight row
};

// MR rows of x times NC weight rows; every (row, column) pair runs the same FMA sequence for any MR, NC.
template <int BITS, int BS, int MR, int NC>
void tile_exact(const float* x, int64_t ldx, const Weight& w, int64_t n0, float* out, int64_t ldo) {
  constexpr int VPB = BS / VL;
  constexpr int QB = BS * BITS / 8;  // bytes per block
  vf acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
  for (int64_t b = 0; b < w.blocks; ++b) {
    vf wv[NC][VPB];
    for (int c = 0; c < NC; ++c) {
      const int64_t row = n0 + c;
      decode_block<BITS, BS>(w.q + row * w.q_stride + b * QB, w.scale[row * w.blocks + b],
                             w.min[row * w.blocks + b], wv[c]);
    }
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * ldx + b * BS;
      for (int v = 0; v < VPB; ++v) {
        const vf xv = vload(xr + v * VL);
        for (int c = 0; c < NC; ++c) acc[r][c] = vfma(wv[c][v], xv, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[r * ldo + n0 + c] = vsum(acc[r][c]);
}

// ---- W4A8: activations as int8 per 32-value block (quant_activations.h) --------------------------
using tokenloom_quant::QuantizedX;
using tokenloom_quant::quantize_rows;
using tokenloom_quant::XB;

// 32 weight values as unsigned bytes, in element order.
template <int BITS>
inline __m256i load_w8(const uint8_t* q) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0xF));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0xF));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  }
}

// Sum of u8 * s8 products in 8 int32 lanes, 4 consecutive elements a lane.
template <int BITS>
inline __m256i dot_u8s8(__m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {  // 15 * 127 * 2 fits int16: maddubs does not saturate
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  } else {  // bytes up to 255 would saturate maddubs: split into the low 7 bits and the top bit
    const __m256i low = _mm256_and_si256(w, _mm256_set1_epi8(0x7F));
    const __m256i top = _mm256_and_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(low, x), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(top, x), ones));
  }
#endif
}

inline float hsum256(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int BITS, int BS, int MR, int NC>
void tile_a8(const int8_t* xq, const float* xmeta, int64_t K, const Weight& w, int64_t n0, float* out,
             int64_t ldo) {
  constexpr int QB = XB * BITS / 8;  // weight bytes per activation block
  const int64_t nbx = K / XB;
  __m256 acc[MR][NC];
  float accm[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps(), accm[r][c] = 0.f;
  for (int64_t b = 0; b < nbx; ++b) {
    __m256i wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = load_w8<BITS>(w.q + (n0 + c) * w.q_stride + b * QB);
    for (int r = 0; r < MR; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * XB));
      const float* meta = xmeta + (r * nbx + b) * 4;
      for (int c = 0; c < NC; ++c) {
        const __m256 isum = _mm256_cvtepi32_ps(dot_u8s8<BITS>(wv[c], xv));
        const int64_t row = n0 + c;
        if constexpr (BS == 32) {
          acc[r][c] = _mm256_fmadd_ps(isum, _mm256_set1_ps(w.scale[row * w.blocks + b] * meta[0]), acc[r][c]);
          accm[r][c] = std::fma(w.min[row * w.blocks + b], meta[1], accm[r][c]);
        } else {  // two 16-element weight blocks: lanes 0..3 and 4..7
          const float* s = w.scale + row * w.blocks + 2 * b;
          const float* m = w.min + row * w.blocks + 2 * b;
          const __m256 d = _mm256_set_m128(_mm_set1_ps(s[1] * meta[0]), _mm_set1_ps(s[0] * meta[0]));
          acc[r][c] = _mm256_fmadd_ps(isum, d, acc[r][c]);
          accm[r][c] = std::fma(m[1], meta[3], std::fma(m[0], meta[2], accm[r][c]));
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[r * ldo + n0 + c] = hsum256(acc[r][c]) + accm[r][c];
}

// Four columns at once: their block sums are reduced together (hadd) and scaled as one 4-lane vector, so
// the per-block float work is shared by the four columns instead of repeated for each.
template <int BITS, int BS, int MR>
void tile_a8_x4(const int8_t* xq, const float* xmeta, int64_t K, const Weight& w, int64_t n0, float* out,
                int64_t ldo) {
  constexpr int QB = XB * BITS / 8;
  const int64_t nbx = K / XB;
  __m128 acc[MR], accm[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm_setzero_ps(), accm[r] = _mm_setzero_ps();
  const int64_t nb = w.blocks;
  auto col4 = [&](const float* base, int64_t i) {
    return _mm_setr_ps(base[n0 * nb + i], base[(n0 + 1) * nb + i], base[(n0 + 2) * nb + i], base[(n0 + 3) * nb + i]);
  };
  for (int64_t b = 0; b < nbx; ++b) {
    __m256i wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = load_w8<BITS>(w.q + (n0 + c) * w.q_stride + b * QB);
    __m128 d0, d1, m0, m1;
    if constexpr (BS == 32) {
      d0 = col4(w.scale, b), m0 = col4(w.min, b);
      d1 = m1 = d0;
    } else {
      d0 = col4(w.scale, 2 * b), d1 = col4(w.scale, 2 * b + 1);
      m0 = col4(w.min, 2 * b), m1 = col4(w.min, 2 * b + 1);
    }
    for (int r = 0; r < MR; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * XB));
      const float* meta = xmeta + (r * nbx + b) * 4;
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(dot_u8s8<BITS>(wv[0], xv), dot_u8s8<BITS>(wv[1], xv)),
                                          _mm256_hadd_epi32(dot_u8s8<BITS>(wv[2], xv), dot_u8s8<BITS>(wv[3], xv)));
      // low 128 bits: each column's sum over elements 0..15; high: over 16..31
      const __m128 lo = _mm_cvtepi32_ps(_mm256_castsi256_si128(h));
      const __m128 hi = _mm_cvtepi32_ps(_mm256_extracti128_si256(h, 1));
      const __m128 dx = _mm_set1_ps(meta[0]);
      if constexpr (BS == 32) {
        acc[r] = _mm_fmadd_ps(_mm_add_ps(lo, hi), _mm_mul_ps(d0, dx), acc[r]);
        accm[r] = _mm_fmadd_ps(m0, _mm_set1_ps(meta[1]), accm[r]);
      } else {
        acc[r] = _mm_fmadd_ps(hi, _mm_mul_ps(d1, dx), _mm_fmadd_ps(lo, _mm_mul_ps(d0, dx), acc[r]));
        accm[r] = _mm_fmadd_ps(m1, _mm_set1_ps(meta[3]), _mm_fmadd_ps(m0, _mm_set1_ps(meta[2]), accm[r]));
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm_storeu_ps(out + r * ldo + n0, _mm_add_ps(acc[r], accm[r]));
}

// ---- driver --------------------------------------------------------------------------------------
constexpr int MR = 4;        // rows a tile
constexpr int NC = 4;        // weight rows (output columns) a tile
constexpr int64_t MC = 64;   // rows whose activations stay in cache while a thread's columns pass over them

template <typename Tile4x4, typename Tile1x4, typename Tile4x1, typename Tile1x1>
void run_tiles(int64_t M, int64_t N, Tile4x4 t44, Tile1x4 t14, Tile4x1 t41, Tile1x1 t11) {
  const int64_t tiles = (N + NC - 1) / NC;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * NC, n_end = std::min(N, end * NC);
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t m_end = std::min(M, m0 + MC);
      int64_t n = n_begin;
      for (; n + NC <= n_end; n += NC) {
        int64_t m = m0;
        for (; m + MR <= m_end; m += MR) t44(m, n);
        for (; m < m_end; ++m) t14(m, n);
      }
      for (; n < n_end; ++n) {
        int64_t m = m0;
        for (; m + MR <= m_end; m += MR) t41(m, n);
        for (; m < m_end; ++m) t11(m, n);
      }
    }
  });
}

Weight check_weight(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t K,
                    int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(block == 32 || (block == 16 && bits == 8), "quant_matmul: unsupported block size ", block,
              " for ", bits, "-bit weights");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "quant_matmul: qweight must be a contiguous uint8 [N, K*bits/8] tensor");
  TORCH_CHECK(K % 32 == 0, "quant_matmul: K must be a multiple of 32, got ", K);
  TORCH_CHECK(qweight.size(1) == K * bits / 8, "quant_matmul: qweight holds ", qweight.size(1),
              " bytes a row, x has K=", K);
  const int64_t N = qweight.size(0), nb = K / block;
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == nb,
                "quant_matmul: scales and mins must be contiguous float32 [N, K/block]");
  }
  return Weight{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), qweight.size(1), nb};
}

at::Tensor flat_input(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_matmul: x must be float32");
  return x.reshape({-1, x.size(-1)}).contiguous();
}

at::Tensor output_for(const at::Tensor& x, int64_t N, int64_t M) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return at::empty({M, N}, x.options()).view(sizes);
}

template <int BITS, int BS>
void exact_impl(const at::Tensor& x2, const Weight& w, float* out, int64_t N) {
  const float* x = x2.data_ptr<float>();
  const int64_t M = x2.size(0), K = x2.size(1);
  run_tiles(
      M, N, [&](int64_t m, int64_t n) { tile_exact<BITS, BS, MR, NC>(x + m * K, K, w, n, out + m * N, N); },
      [&](int64_t m, int64_t n) { tile_exact<BITS, BS, 1, NC>(x + m * K, K, w, n, out + m * N, N); },
      [&](int64_t m, int64_t n) { tile_exact<BITS, BS, MR, 1>(x + m * K, K, w, n, out + m * N, N); },
      [&](int64_t m, int64_t n) { tile_exact<BITS, BS, 1, 1>(x + m * K, K, w, n, out + m * N, N); });
}

template <int BITS, int BS>
void a8_impl(const QuantizedX& xq, int64_t M, int64_t K, const Weight& w, float* out, int64_t N) {
  const int64_t nbx = K / XB;
  const int8_t* q = xq.q.data();
  const float* meta = xq.meta.data();
  run_tiles(
      M, N,
      [&](int64_t m, int64_t n) { tile_a8_x4<BITS, BS, MR>(q + m * K, meta + m * nbx * 4, K, w, n, out + m * N, N); },
      [&](int64_t m, int64_t n) { tile_a8_x4<BITS, BS, 1>(q + m * K, meta + m * nbx * 4, K, w, n, out + m * N, N); },
      [&](int64_t m, int64_t n) { tile_a8<BITS, BS, MR, 1>(q + m * K, meta + m * nbx * 4, K, w, n, out + m * N, N); },
      [&](int64_t m, int64_t n) { tile_a8<BITS, BS, 1, 1>(q + m * K, meta + m * nbx * 4, K, w, n, out + m * N, N); });
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t bits, int64_t block) {
  const at::Tensor x2 = flat_input(x);
  const int64_t M = x2.size(0), K = x2.size(1), N = qweight.size(0);
  const Weight w = check_weight(qweight, scales, mins, K, bits, block);
  at::Tensor out = output_for(x, N, M);
  if (M == 0) return out;
  float* o = out.data_ptr<float>();
  if (bits == 4) exact_impl<4, 32>(x2, w, o, N);
  else if (block == 32) exact_impl<8, 32>(x2, w, o, N);
  else exact_impl<8, 16>(x2, w, o, N);
  return out;
}

at::Tensor quant_matmul_a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t bits, int64_t block) {
  const at::Tensor x2 = flat_input(x);
  const int64_t M = x2.size(0), K = x2.size(1), N = qweight.size(0);
  const Weight w = check_weight(qweight, scales, mins, K, bits, block);
  at::Tensor out = output_for(x, N, M);
  if (M == 0) return out;
  QuantizedX xq;
  quantize_rows(x2.data_ptr<float>(), M, K, xq);
  float* o = out.data_ptr<float>();
  if (bits == 4) a8_impl<4, 32>(xq, M, K, w, o, N);
  else if (block == 32) a8_impl<8, 32>(xq, M, K, w, o, N);
  else a8_impl<8, 16>(xq, M, K, w, o, N);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("quant_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, int block_size) -> Tensor");
  m.def("quant_matmul_a8(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("quant_matmul", &quant_matmul);
  m.impl("quant_matmul_a8", &quant_matmul_a8);
}
