// Matmuls against quantized weights in the column-interleaved ("panel") layout, fast at many rows.
//
// Layout (made by tokenloom/kernels/quant.py `interleave`, from the row-major blocks of quant_matmul.cpp),
// for a weight [N, K] with N padded to a multiple of 32 columns (zero weights, scales and mins):
//   qpacked uint8 [N/16, K/32, 16*32*bits/8]: per panel of 16 output columns and 32-value block,
//     8-bit: 8 groups of 64 bytes; group g holds, per column c, the 4 bytes of elements 4g..4g+3 at
//            bytes 4c..4c+3: one 512-bit vector = one 32-bit lane per column, 4 K-values a lane;
//     4-bit: 4 groups of 64 bytes; group g's low nibbles are elements 4g..4g+3 (group g of the 8-bit
//            form), its high nibbles elements 16+4g..16+4g+3 (group g+4).
//     6-bit (8-bit values below 64: Q6_K's, Q5_K's, Q5_0's): the 4-bit form of the values' low nibbles,
//            then 2 vectors of their top 2 bits, one a half block (`load_group8`); 6.75 bits a Q6_K
//            value with K-quant scales against the file's 6.56, where bytes would take 8.75.
//   scales, mins float32 or float16 [N/16, K/block, 16]: one vector of 16 columns per block. float16 when
//     every value is one exactly (GGUF's Q4_0, Q4_1, Q8_0 and Q5_0 keep float16 block scales, and their
//     mins are the scale times -8, -16 or -128): a batch-1 decode step of the embedded model reads 96
//     instead of 115 MiB, and the products are the same bit for bit (each is widened to float32 on load).
//   K-quant form (Q4_K, Q5_K, Q6_K: GGUF's super-blocks of 256 values): scales int8 [N/16, K/block, C, 16],
//     each sub-block's integer scale sc (and, C = 2, its integer min m; C = 1: m = sc), and mins float32
//     [N/16, K/256, 2, 16], each super-block's factors d and dm; the kernels form scale = d * sc and
//     min = dm * m. GGUF's d is a float16 and sc at most 8 bits, so both products are exact in float32: the
//     very floats of the float32 form, at 0.75 bits a value instead of 2 (Q4_K) or 4 (Q6_K).
//
// W4A8 (quant_gemm_a8): the activation's 4 int8 values of a group are broadcast to every lane and
// one vpdpbusd (AVX2: maddubs + madd) adds 4 products to each of 16 (8) columns' int32 sums; after
// each block the sums are scaled by the 16 weight scales as one vector times the activation block's
// scale, and the `min` term is one FMA against the activation block's precomputed sum. No horizontal
// reduction anywhere: a column is a lane.
//
// Exact (quant_gemm): float32 activations; each scale block's part of a row's product is one FMA chain of
// x times the block's q values, then scaled and offset by the block's sum of x times its min (`exact`
// below). At few rows the q values are decoded into registers and used at once; at many each thread
// decodes a column tile (CT = 32 columns) over the whole K once into a float buffer and every row tile
// runs over it. Both do the same FMAs in the same order, so a row's result is the same bits whatever the
// number of rows (batch invariant).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_activations.h"
#include "quant_gemm.h"

namespace {

using tokenloom_quant::QuantizedX;
using tokenloom_quant::quantize_rows;
using tokenloom_quant::XB;

constexpr int PANEL = 16;     // columns a panel (one 512-bit vector of int32 lanes)
constexpr int CT = 32;        // columns a tile; the packed N is padded to a multiple of it
constexpr int64_t MC = 128;   // rows a work unit: x's rows stay in L2 while a tile's weights pass

#if defined(__AVX512F__)
constexpr int VL = 16;
using vf = __m512;
using vi = __m512i;
constexpr int MR_DIRECT = 8;   // rows the exact kernel decodes into registers for
constexpr int MR_TILE = 6;     // rows an exact tile over a decoded buffer: 6 x 2 block chains and their sums
constexpr bool TWO_TILES = true;
constexpr int MR_A8 = 4;     // 4 rows x 2 vectors x (float + int sums)
inline vf fzero() { return _mm512_setzero_ps(); }
inline vf fload(const float* p) { return _mm512_loadu_ps(p); }
inline vf fload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void fstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline void fstore_first(float* p, vf a, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a); }
inline vf fset1(float v) { return _mm512_set1_ps(v); }
inline vf ffma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf cvt(vi a) { return _mm512_cvtepi32_ps(a); }
inline vf fload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vi iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline void istore(uint8_t* p, vi a) { _mm512_storeu_si512(p, a); }
inline vi izero() { return _mm512_setzero_si512(); }
inline vi iset1(int32_t v) { return _mm512_set1_epi32(v); }
inline vi iand(vi a, vi b) { return _mm512_and_si512(a, b); }
template <int S> inline vi isrl32(vi a) { return _mm512_srli_epi32(a, S); }
inline vi isrl16_4(vi a) { return _mm512_srli_epi16(a, 4); }
inline vi isllv32(vi a, int n) { return _mm512_sllv_epi32(a, _mm512_set1_epi32(n)); }
inline vi isrlv32(vi a, int n) { return _mm512_srlv_epi32(a, _mm512_set1_epi32(n)); }
inline vi ior(vi a, vi b) { return _mm512_or_si512(a, b); }
inline vi ibyte_set1(char v) { return _mm512_set1_epi8(v); }
inline vi iselect(vi mask, vi a, vi b) { return _mm512_ternarylogic_epi32(a, b, mask, 0xE4); }  // mask ? a : b, bitwise
#else
constexpr int VL = 8;
using vf = __m256;
using vi = __m256i;
constexpr int MR_DIRECT = 2;   // 16 ymm registers: 2 rows x 4 block chains + their sums + 4 weight vectors
constexpr int MR_TILE = 2;
constexpr bool TWO_TILES = false;  // one tile is already 4 vectors of chains
constexpr int MR_A8 = 2;
inline vf fzero() { return _mm256_setzero_ps(); }
inline vf fload(const float* p) { return _mm256_loadu_ps(p); }
inline vf fload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void fstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline void fstore_first(float* p, vf a, int n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), a);
}
inline vf fset1(float v) { return _mm256_set1_ps(v); }
inline vf ffma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf cvt(vi a) { return _mm256_cvtepi32_ps(a); }
inline vf fload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vi iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void istore(uint8_t* p, vi a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
inline vi izero() { return _mm256_setzero_si256(); }
inline vi iset1(int32_t v) { return _mm256_set1_epi32(v); }
inline vi iand(vi a, vi b) { return _mm256_and_si256(a, b); }
template <int S> inline vi isrl32(vi a) { return _mm256_srli_epi32(a, S); }
inline vi isrl16_4(vi a) { return _mm256_srli_epi16(a, 4); }
inline vi isllv32(vi a, int n) { return _mm256_sllv_epi32(a, _mm256_set1_epi32(n)); }
inline vi isrlv32(vi a, int n) { return _mm256_srlv_epi32(a, _mm256_set1_epi32(n)); }
inline vi ior(vi a, vi b) { return _mm256_or_si256(a, b); }
inline vi ibyte_set1(char v) { return _mm256_set1_epi8(v); }
inline vi iselect(vi mask, vi a, vi b) {
  return _mm256_or_si256(_mm256_and_si256(mask, a), _mm256_andnot_si256(mask, b));
}
#endif

constexpr int NCV = CT / VL;  // vectors a tile row (2 with AVX512, 4 with AVX2)

// acc + the sums of 4 u8*s8 products in each 32-bit lane.
template <int BITS>
inline vi dot4(vi acc, vi w, vi x) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, x);
#elif defined(__AVX512F__)
  const vi ones = _mm512_set1_epi16(1);
  if constexpr (BITS <= 6) return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
  const vi low = _mm512_and_si512(w, _mm512_set1_epi8(0x7F)), top = _mm512_and_si512(w, _mm512_set1_epi8(char(0x80)));
  return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(low, x), ones),
                                                _mm512_madd_epi16(_mm512_maddubs_epi16(top, x), ones)));
#else
  const vi ones = _mm256_set1_epi16(1);
  if constexpr (BITS <= 6) {  // 63 * 127 * 2 fits int16: maddubs does not saturate
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  } else {  // bytes up to 255 would saturate maddubs: the low 7 bits and the top bit apart
    const vi low = _mm256_and_si256(w, _mm256_set1_epi8(0x7F));
    const vi top = _mm256_and_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(low, x), ones),
                                                  _mm256_madd_epi16(_mm256_maddubs_epi16(top, x), ones)));
  }
#endif
}

// Group g + 4 * HALF of a block in the 8-bit form (its lanes' bytes: elements 16 HALF + 4g .. + 3), from an
// 8-bit or a 6-bit block. 6-bit: the low nibbles are the 4-bit form (256 bytes), then two vectors of top bits
// (one for each half of the block), byte j of a lane holding the top 2 bits of its element 16 HALF + 4g + j
// at bits 2g..2g+1: shifted to bits 4..5 and masked, the neighbouring bytes' bits fall outside the mask.
template <int BITS, int HALF>
inline vi load_group8(const uint8_t* base, int g) {
  if constexpr (BITS == 8) {
    return iload(base + (g + 4 * HALF) * 64);
  } else {
    const vi v = iload(base + g * 64), h = iload(base + 256 + HALF * 64);
    const vi low = HALF ? iand(isrl16_4(v), ibyte_set1(0x0F)) : iand(v, ibyte_set1(0x0F));
    const vi top = g < 2 ? isllv32(h, 4 - 2 * g) : isrlv32(h, 2 * g - 4);
    return ior(low, iand(top, ibyte_set1(0x30)));
  }
}

// load_group8 of a 6-bit block with bits 6-7 of each byte left as they fall (its users mask 6 bits): each
// byte's low nibble and top bits taken by one bitwise select, 2-3 vector ops instead of 4-5 (no time
// measurable from it at one row).
template <int HALF>
inline vi load_group6(const uint8_t* base, int g) {
  const vi v = iload(base + g * 64), h = iload(base + 256 + HALF * 64);
  const vi low = HALF ? isrl16_4(v) : v;
  const vi top = g < 2 ? isllv32(h, 4 - 2 * g) : isrlv32(h, 2 * g - 4);
  return iselect(ibyte_set1(0x0F), low, top);
}

// S: how the scales and mins are stored, float or uint16_t (float16 bits).
template <typename S>
struct Packed {
  const uint8_t* q;
  const S* scale;
  const S* min;
  int64_t nbx;         // 32-value blocks along K
  int64_t nsb;         // scale blocks along K (K / block size)
  int64_t block_bytes; // bytes of one (panel, 32-block)

  // The scales and mins of scale block `sb` of `panel`, VL lanes from `lane0`.
  template <int BS>
  inline void scale_min(int64_t panel, int64_t sb, int lane0, vf& s, vf& m) const {
    const int64_t at = (panel * nsb + sb) * PANEL + lane0;
    s = fload(scale + at), m = fload(min + at);
  }
};

// The K-quant form: integer sub-block scales (and mins) times float32 super-block factors.
constexpr int SUPER = 256;  // values a super-block

struct KPacked {
  const uint8_t* q;
  const int8_t* sub;    // [panels, nsb, C, 16]
  const float* factor;  // [panels, K/256, 2, 16]: d, dm
  int64_t nbx;
  int64_t nsb;
  int64_t block_bytes;
  int64_t c;            // sub-block integers a lane: 2 (sc, m) or 1 (m = sc)

  template <int BS>
  inline void scale_min(int64_t panel, int64_t sb, int lane0, vf& s, vf& m) const {
    constexpr int per_super = SUPER / BS;
    const int8_t* i = sub + (panel * nsb + sb) * c * PANEL + lane0;
    const float* f = factor + (panel * (nsb / per_super) + sb / per_super) * 2 * PANEL + lane0;
    const vf sc = fload_i8(i);
    s = fmul(fload(f), sc);
    m = fmul(fload(f + PANEL), c == 1 ? sc : fload_i8(i + PANEL));
  }
};

// Where vector `cv` of column tile `t` starts: its panel and its byte / lane offset inside the panel.
inline int64_t panel_of(int64_t t, int cv) { return t * (CT / PANEL) + cv * VL / PANEL; }
inline int lane0_of(int cv) { return (cv * VL) % PANEL; }

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void store_cols(float* out, vf a, int64_t col, int64_t n) {
  if (col + VL <= n) fstore(out, a);
  else if (col < n) fstore_first(out, a, static_cast<int>(n - col));
}

// ---- W4A8 -------------------------------------------------------------------------------------------
template <int BITS, int BS, int MR, typename W>
void a8_tile(const int8_t* xq, const float* xmeta, int64_t K, const W& w, int64_t t, float* out, int64_t ldo,
             int64_t n) {
  vf acc[MR][NCV];
  for (int r = 0; r < MR; ++r)
    for (int cv = 0; cv < NCV; ++cv) acc[r][cv] = fzero();
  const vi nib = ibyte_set1(0x0F);
  for (int64_t b = 0; b < w.nbx; ++b) {
    vi slo[MR][NCV], shi[MR][NCV];  // int sums over elements 0..15 and 16..31 (one sum when BS is 32)
    for (int r = 0; r < MR; ++r)
      for (int cv = 0; cv < NCV; ++cv) slo[r][cv] = izero(), shi[r][cv] = izero();
    for (int g = 0; g < 4; ++g) {
      vi wl[NCV], wh[NCV];
      for (int cv = 0; cv < NCV; ++cv) {
        const uint8_t* base = w.q + (panel_of(t, cv) * w.nbx + b) * w.block_bytes + lane0_of(cv) * 4;
        if constexpr (BITS == 4) {
          const vi v = iload(base + g * 64);
          wl[cv] = iand(v, nib);
          wh[cv] = iand(isrl16_4(v), nib);
        } else {
          wl[cv] = load_group8<BITS, 0>(base, g);
          wh[cv] = load_group8<BITS, 1>(base, g);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = xq + r * K + b * XB + 4 * g;
        const vi xl = iset1(load_i32(xr)), xh = iset1(load_i32(xr + 16));
        for (int cv = 0; cv < NCV; ++cv) {
          if constexpr (BS == 32) {
            slo[r][cv] = dot4<BITS>(dot4<BITS>(slo[r][cv], wl[cv], xl), wh[cv], xh);
          } else {
            slo[r][cv] = dot4<BITS>(slo[r][cv], wl[cv], xl);
            shi[r][cv] = dot4<BITS>(shi[r][cv], wh[cv], xh);
          }
        }
      }
    }
    for (int cv = 0; cv < NCV; ++cv) {
      vf s0, m0, s1, m1;
      w.template scale_min<BS>(panel_of(t, cv), b * (32 / BS), lane0_of(cv), s0, m0);
      if constexpr (BS == 16) w.template scale_min<BS>(panel_of(t, cv), 2 * b + 1, lane0_of(cv), s1, m1);
      for (int r = 0; r < MR; ++r) {
        const float* meta = xmeta + (r * w.nbx + b) * 4;
        const vf dx = fset1(meta[0]);
        if constexpr (BS == 32) {
          acc[r][cv] = ffma(cvt(slo[r][cv]), fmul(s0, dx), acc[r][cv]);
          acc[r][cv] = ffma(m0, fset1(meta[1]), acc[r][cv]);
        } else {
          acc[r][cv] = ffma(cvt(slo[r][cv]), fmul(s0, dx), acc[r][cv]);
          acc[r][cv] = ffma(cvt(shi[r][cv]), fmul(s1, dx), acc[r][cv]);
          acc[r][cv] = ffma(m0, fset1(meta[2]), acc[r][cv]);
          acc[r][cv] = ffma(m1, fset1(meta[3]), acc[r][cv]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int cv = 0; cv < NCV; ++cv) store_cols(out + r * ldo + t * CT + cv * VL, acc[r][cv], t * CT + cv * VL, n);
}

// ---- exact -------------------------------------------------------------------------------------------
// Each scale block's part of a product is factored as llama.cpp's integer dot products are:
//   acc = fma(xsum, min, fma(p, scale, acc)),  p = x[k0] q[k0] + ... + x[k1] q[k1] (an FMA chain in K order),
// with xsum the block's sum of x. One FMA a weight value, where dequantizing first (fma(q, scale, min),
// then fma(x, w, acc)) takes two: the one-row kernel is bound by its vector work, and a Q4_K weight in L3
// took 0.70-0.86 ns per 16 values with two, 0.53-0.65 with one (one thread, AMD EPYC Zen 4, 2026-12-03).
// Every path below does these very FMAs in this order, so a row's bits do not depend on how many rows came
// with it.

// Each row's sums of x over each scale block, in K order (the `min` term's factor), one function for every
// path so that the sums are the same floats.
void block_sums(const float* x, int64_t M, int64_t K, int BS, std::vector<float>& out) {
  const int64_t nsb = K / BS;
  out.resize(M * nsb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      float sum = 0.0f;
      for (int i = 0; i < BS; ++i) sum += x[r * K + sb * BS + i];
      out[r * nsb + sb] = sum;
    }
}

// The running sums of an MR x NV-vector tile: in registers where they fit beside the block chains (NV of each
// row's, the weight vectors and a broadcast), else in L1, where they are touched once a scale block.
#if defined(__AVX512F__)
constexpr int VREGS = 32;
#else
constexpr int VREGS = 16;
#endif
template <int MR, int NV>
struct TileSums {
  static constexpr bool in_regs = 2 * MR * NV + NV + 1 <= VREGS;
  vf regs[in_regs ? MR : 1][NV];
  alignas(64) float mem[in_regs ? 1 : MR][NV * VL];

  TileSums() {
    for (int r = 0; r < MR; ++r)
      for (int cv = 0; cv < NV; ++cv) {
        if constexpr (in_regs) regs[r][cv] = fzero();
        else fstore(mem[r] + cv * VL, fzero());
      }
  }
  // The block's chain p with its scale, then the block's sum of x with its min.
  inline void add(int r, int cv, vf p, vf scale, vf xsum, vf min) {
    if constexpr (in_regs) regs[r][cv] = ffma(xsum, min, ffma(p, scale, regs[r][cv]));
    else fstore(mem[r] + cv * VL, ffma(xsum, min, ffma(p, scale, fload(mem[r] + cv * VL))));
  }
  inline vf get(int r, int cv) const {
    if constexpr (in_regs) return regs[r][cv];
    else return fload(mem[r] + cv * VL);
  }
};

// Column tile t of the whole weight, decoded: qbuf[k * CT + c] = q as a float, and each scale block's scales
// and mins, sbuf / mbuf[sb * CT + c].
template <int BITS, int BS, typename W>
void decode_tile(const W& w, int64_t t, float* qbuf, float* sbuf, float* mbuf) {
  const vi nib = iset1(0x0F), byte = iset1(0xFF);
  for (int64_t b = 0; b < w.nbx; ++b) {
    for (int cv = 0; cv < NCV; ++cv) {
      const uint8_t* base = w.q + (panel_of(t, cv) * w.nbx + b) * w.block_bytes + lane0_of(cv) * 4;
      for (int h = 0; h < 32 / BS; ++h) {
        vf s, m;
        w.template scale_min<BS>(panel_of(t, cv), b * (32 / BS) + h, lane0_of(cv), s, m);
        fstore(sbuf + (b * (32 / BS) + h) * CT + cv * VL, s);
        fstore(mbuf + (b * (32 / BS) + h) * CT + cv * VL, m);
      }
      float* dst = qbuf + b * 32 * CT + cv * VL;
      for (int g = 0; g < 4; ++g) {
        vi lo[4], hi[4];  // byte j of each lane: element 4g+j (lo) and 16+4g+j (hi)
        if constexpr (BITS == 4) {
          const vi v = iload(base + g * 64);
          lo[0] = iand(v, nib), hi[0] = iand(isrl32<4>(v), nib);
          lo[1] = iand(isrl32<8>(v), nib), hi[1] = iand(isrl32<12>(v), nib);
          lo[2] = iand(isrl32<16>(v), nib), hi[2] = iand(isrl32<20>(v), nib);
          lo[3] = iand(isrl32<24>(v), nib), hi[3] = isrl32<28>(v);
        } else {
          const vi vl = load_group8<BITS, 0>(base, g), vh = load_group8<BITS, 1>(base, g);
          lo[0] = iand(vl, byte), hi[0] = iand(vh, byte);
          lo[1] = iand(isrl32<8>(vl), byte), hi[1] = iand(isrl32<8>(vh), byte);
          lo[2] = iand(isrl32<16>(vl), byte), hi[2] = iand(isrl32<16>(vh), byte);
          lo[3] = isrl32<24>(vl), hi[3] = isrl32<24>(vh);
        }
        for (int j = 0; j < 4; ++j) {
          fstore(dst + (4 * g + j) * CT, cvt(lo[j]));
          fstore(dst + (16 + 4 * g + j) * CT, cvt(hi[j]));
        }
      }
    }
  }
}

template <typename F>
inline void unroll4(F&& f) {
  f(std::integral_constant<int, 0>{}), f(std::integral_constant<int, 1>{});
  f(std::integral_constant<int, 2>{}), f(std::integral_constant<int, 3>{});
}

// Byte J of each lane of a group (element 16 HALF + 4g + J of the block; 4-bit: its nibble) as an int32
// times 2^shift_of(BITS, HALF, J): its bits masked where they are, one vector op instead of a shift and a
// mask. The kernel multiplies it by x times 2^-shift (prescaled): both factors exact, so the product is
// x q exactly and the FMA rounds as the many-row path's does, bit for bit. A lane's top nibble (4-bit)
// or top byte (8-bit) is shifted down instead: masked in place it would not stay a positive int32.
constexpr int shift_of(int bits, int half, int j) {
  if (bits == 4) return 8 * j + 4 * half == 28 ? 0 : 8 * j + 4 * half;
  return bits == 6 || j < 3 ? 8 * j : 0;
}
template <int BITS, int HALF, int J>
inline vi element_scaled(vi v) {
  constexpr int shift = shift_of(BITS, HALF, J);
  if constexpr (BITS == 4) {
    if constexpr (8 * J + 4 * HALF == 28) return isrl32<28>(v);
    else return iand(v, iset1(0x0F << shift));
  } else {
    if constexpr (BITS == 6) return iand(v, iset1(0x3F << shift));  // q 2^24 < 2^30 stays a positive int32
    else if constexpr (J == 3) return isrl32<24>(v);
    else return iand(v, iset1(0xFF << shift));
  }
}

// x with each value times 2^-shift_of its place in its 32-value block: exact for |x| >= 2^-102 (float32's
// smallest normal times 2^24, the largest shift), which every activation of a model that is not 0 is.
template <int BITS>
void prescaled(const float* x, int64_t M, int64_t K, std::vector<float>& out) {
  float factor[32];
  for (int i = 0; i < 32; ++i) factor[i] = 1.0f / float(1u << shift_of(BITS, i / 16, i % 4));
  out.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) out[i] = x[i] * factor[i % 32];
}

// Few rows (at most MR_DIRECT): each block decoded into registers and used at once, no buffer. `xs` is x
// prescaled<BITS>, `xsum` its block_sums (of x itself).
template <int BITS, int BS, int MR, int NV, typename W>
void exact_tile_direct(const float* xs, const float* xsum, int64_t K, const W& w, int64_t t, float* out, int64_t ldo,
                       int64_t n) {
  TileSums<MR, NV> acc;
  for (int64_t b = 0; b < w.nbx; ++b) {
    const uint8_t* base[NV];
    vf s[2][NV], m[2][NV];
    for (int cv = 0; cv < NV; ++cv) {
      base[cv] = w.q + (panel_of(t, cv) * w.nbx + b) * w.block_bytes + lane0_of(cv) * 4;
      w.template scale_min<BS>(panel_of(t, cv), b * (32 / BS), lane0_of(cv), s[0][cv], m[0][cv]);
      if constexpr (BS == 16) w.template scale_min<BS>(panel_of(t, cv), 2 * b + 1, lane0_of(cv), s[1][cv], m[1][cv]);
      else s[1][cv] = s[0][cv], m[1][cv] = m[0][cv];
    }
    vf p[MR][NV];
    auto half = [&](auto h) {
      constexpr int HALF = decltype(h)::value;
      if constexpr (HALF == 0 || BS == 16)
        for (int r = 0; r < MR; ++r)
          for (int cv = 0; cv < NV; ++cv) p[r][cv] = fzero();
      auto group = [&](int g) {
        vi v[NV];
        for (int cv = 0; cv < NV; ++cv) {
          if constexpr (BITS == 4) v[cv] = iload(base[cv] + g * 64);
          else if constexpr (BITS == 6) v[cv] = load_group6<HALF>(base[cv], g);
          else v[cv] = load_group8<BITS, HALF>(base[cv], g);
        }
        unroll4([&](auto j) {
          constexpr int J = decltype(j)::value;
          vf qv[NV];
          for (int cv = 0; cv < NV; ++cv) qv[cv] = cvt(element_scaled<BITS, HALF, J>(v[cv]));
          const int64_t k = b * 32 + 16 * HALF + 4 * g + J;
          for (int r = 0; r < MR; ++r) {
            const vf xb = fset1(xs[r * K + k]);
            for (int cv = 0; cv < NV; ++cv) p[r][cv] = ffma(xb, qv[cv], p[r][cv]);
          }
        });
      };
      // 6-bit: the groups unrolled, so each one's top-bit shifts are immediates: 3% less time at one row on an
      // L2-resident Q6_K weight (AMD EPYC, 2026-12-03; none measurable from memory); 4-bit groups gained
      // nothing from it and stay a loop.
      if constexpr (BITS == 6) unroll4([&](auto g) { group(decltype(g)::value); });
      else for (int g = 0; g < 4; ++g) group(g);
      if constexpr (HALF == 1 || BS == 16) {
        const int64_t sb = b * (32 / BS) + (BS == 16 ? HALF : 0);
        for (int r = 0; r < MR; ++r) {
          const vf xm = fset1(xsum[r * w.nsb + sb]);
          for (int cv = 0; cv < NV; ++cv) acc.add(r, cv, p[r][cv], s[HALF][cv], xm, m[HALF][cv]);
        }
      }
    };
    half(std::integral_constant<int, 0>{});
    half(std::integral_constant<int, 1>{});
  }
  for (int r = 0; r < MR; ++r)
    for (int cv = 0; cv < NV; ++cv) store_cols(out + r * ldo + t * CT + cv * VL, acc.get(r, cv), t * CT + cv * VL, n);
}

// Many rows over a decoded tile (decode_tile): the same chains, FMAs and order as exact_tile_direct.
template <int MR, int BS>
void exact_tile(const float* x, const float* xsum, int64_t K, const float* qbuf, const float* sbuf, const float* mbuf,
                int64_t t, float* out, int64_t ldo, int64_t n) {
  const int64_t nsb = K / BS;
  TileSums<MR, NCV> acc;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    vf p[MR][NCV];
    for (int r = 0; r < MR; ++r)
      for (int cv = 0; cv < NCV; ++cv) p[r][cv] = fzero();
    for (int64_t k = sb * BS; k < (sb + 1) * BS; ++k) {
      vf wv[NCV];
      for (int cv = 0; cv < NCV; ++cv) wv[cv] = fload(qbuf + k * CT + cv * VL);
      for (int r = 0; r < MR; ++r) {
        const vf xb = fset1(x[r * K + k]);
        for (int cv = 0; cv < NCV; ++cv) p[r][cv] = ffma(xb, wv[cv], p[r][cv]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const vf xm = fset1(xsum[r * nsb + sb]);
      for (int cv = 0; cv < NCV; ++cv)
        acc.add(r, cv, p[r][cv], fload(sbuf + sb * CT + cv * VL), xm, fload(mbuf + sb * CT + cv * VL));
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int cv = 0; cv < NCV; ++cv) store_cols(out + r * ldo + t * CT + cv * VL, acc.get(r, cv), t * CT + cv * VL, n);
}

// ---- driver ------------------------------------------------------------------------------------------
// f(std::integral_constant<int, R>) for R = rows (1..MAX).
template <int MAX, typename F>
inline void with_rows(int rows, F&& f) {
  if constexpr (MAX >= 1) {
    if (rows == MAX) f(std::integral_constant<int, MAX>{});
    else with_rows<MAX - 1>(rows, f);
  }
}

// The side work handed to the matmul running on this thread (quant_gemm_with), taken by its first region.
thread_local tokenloom_side::SideWork* pending_side = nullptr;

// at::parallel_for, with the pending side work claimed by each of the region's threads before its range.
template <typename F>
void parallel_tiles(int64_t begin, int64_t end, int64_t grain, const F& f) {
  tokenloom_side::SideWork* side = pending_side;
  pending_side = nullptr;
  if (!side) return at::parallel_for(begin, end, grain, f);
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    side->run();
    f(b, e);
  });
}

// Work units: (column tile, chunk of MC rows), tile-major so a thread prepares each of its tiles once
// (`prepare(t, state)`, on a per-thread `state` from `make_state()`).
template <int MR, typename MakeState, typename Prepare, typename Tile>
void run_units(int64_t M, int64_t tiles, MakeState make_state, Prepare prepare, Tile tile) {
  const int64_t chunks = (M + MC - 1) / MC;
  parallel_tiles(0, tiles * chunks, 1, [&](int64_t u0, int64_t u1) {
    auto state = make_state();
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t = u / chunks, m_end = std::min(M, (u % chunks + 1) * MC);
      prepare(t, state);
      int64_t m = (u % chunks) * MC;
      for (; m + MR <= m_end; m += MR) tile(std::integral_constant<int, MR>{}, m, t, state);
      if (m < m_end) with_rows<MR - 1>(static_cast<int>(m_end - m), [&](auto rows) { tile(rows, m, t, state); });
    }
  });
}

void check_packed(const at::Tensor& x2, const at::Tensor& qpacked, const at::Tensor& scales,
                  const at::Tensor& mins, int64_t n, int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "quant_gemm: bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(block == 32 || (block == 16 && bits != 4), "quant_gemm: unsupported block size ", block, " for ",
              bits, "-bit weights");
  const int64_t K = x2.size(1);
  TORCH_CHECK(K % 32 == 0, "quant_gemm: K must be a multiple of 32, got ", K);
  const int64_t block_bytes = PANEL * 32 * bits / 8;
  TORCH_CHECK(qpacked.scalar_type() == at::kByte && qpacked.dim() == 3 && qpacked.is_contiguous() &&
                  qpacked.size(0) % (CT / PANEL) == 0 && qpacked.size(1) == K / 32 && qpacked.size(2) == block_bytes,
              "quant_gemm: qpacked must be a contiguous uint8 [panels (even), K/32, ", block_bytes, "] tensor, got ",
              qpacked.sizes(), " for K=", K);
  const int64_t panels = qpacked.size(0);
  TORCH_CHECK(n > panels * PANEL - CT && n <= panels * PANEL, "quant_gemm: n=", n, " does not fit ", panels,
              " panels");
  if (scales.scalar_type() == at::kChar) {  // the K-quant form
    TORCH_CHECK(K % SUPER == 0, "quant_gemm: K-quant scales need K a multiple of ", SUPER, ", got ", K);
    TORCH_CHECK(scales.is_contiguous() && scales.dim() == 4 && scales.size(0) == panels &&
                    scales.size(1) == K / block && (scales.size(2) == 1 || scales.size(2) == 2) &&
                    scales.size(3) == PANEL,
                "quant_gemm: int8 scales must be a contiguous [panels, K/block, 1 or 2, 16] tensor, got ",
                scales.sizes());
    TORCH_CHECK(mins.scalar_type() == at::kFloat && mins.is_contiguous() && mins.dim() == 4 &&
                    mins.size(0) == panels && mins.size(1) == K / SUPER && mins.size(2) == 2 &&
                    mins.size(3) == PANEL,
                "quant_gemm: with int8 scales, mins must be the float32 super-block factors [panels, K/256, 2, 16]"
                ", got ", mins.scalar_type(), " ", mins.sizes());
    return;
  }
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  mins.scalar_type() == scales.scalar_type(),
              "quant_gemm: scales and mins must be both float32 or both float16 (or int8 and float32)");
  for (const at::Tensor* s : {&scales, &mins}) {
    TORCH_CHECK(s->is_contiguous() && s->dim() == 3 && s->size(0) == panels && s->size(1) == K / block &&
                    s->size(2) == PANEL,
                "quant_gemm: scales and mins must be contiguous [panels, K/block, 16] tensors");
  }
}

// f(Packed<S>) for the type the scales are stored in, f(KPacked) for the K-quant form.
template <typename F>
void with_packed(const at::Tensor& x2, const at::Tensor& qpacked, const at::Tensor& scales, const at::Tensor& mins,
                 int64_t bits, int64_t block, F&& f) {
  const int64_t K = x2.size(1), block_bytes = PANEL * 32 * bits / 8;
  const uint8_t* q = qpacked.data_ptr<uint8_t>();
  if (scales.scalar_type() == at::kChar) {
    f(KPacked{q, scales.data_ptr<int8_t>(), mins.data_ptr<float>(), K / 32, K / block, block_bytes, scales.size(2)});
  } else if (scales.scalar_type() == at::kHalf) {
    f(Packed<uint16_t>{q, reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                       reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), K / 32, K / block, block_bytes});
  } else {
    f(Packed<float>{q, scales.data_ptr<float>(), mins.data_ptr<float>(), K / 32, K / block, block_bytes});
  }
}

at::Tensor output_for(const at::Tensor& x, int64_t M, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return at::empty({M, n}, x.options()).view(sizes);
}

struct DecodedTile {
  std::vector<float> qbuf;        // [K, CT]
  std::vector<float> sbuf, mbuf;  // [K / BS, CT]
  int64_t tile = -1;
};

template <int BITS, int BS, typename W>
void exact_impl(const float* x, int64_t M, int64_t K, const W& w, int64_t tiles, float* out, int64_t n) {
  std::vector<float> xsum;
  block_sums(x, M, K, BS, xsum);
  if (M <= MR_DIRECT) {  // decoding into registers beats a buffer written and read back once
    std::vector<float> xs;
    prescaled<BITS>(x, M, K, xs);
    if (M <= 2 && TWO_TILES) {  // two tiles at once: 2 x NCV chains, where a row alone would wait on the FMA latency
      parallel_tiles(0, (tiles + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t t = 2 * p0; t < std::min(tiles, 2 * p1); t += 2)
          with_rows<2>(static_cast<int>(M), [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            if (t + 1 < tiles) exact_tile_direct<BITS, BS, R, 2 * NCV>(xs.data(), xsum.data(), K, w, t, out, n, n);
            else exact_tile_direct<BITS, BS, R, NCV>(xs.data(), xsum.data(), K, w, t, out, n, n);
          });
      });
      return;
    }
    parallel_tiles(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        with_rows<MR_DIRECT>(static_cast<int>(M), [&](auto rows) {
          exact_tile_direct<BITS, BS, decltype(rows)::value, NCV>(xs.data(), xsum.data(), K, w, t, out, n, n);
        });
    });
    return;
  }
  const int64_t nsb = K / BS;
  run_units<MR_TILE>(
      M, tiles,
      [&] {
        return DecodedTile{std::vector<float>(K * CT), std::vector<float>(nsb * CT), std::vector<float>(nsb * CT)};
      },
      [&](int64_t t, DecodedTile& s) {
        if (s.tile != t) decode_tile<BITS, BS>(w, t, s.qbuf.data(), s.sbuf.data(), s.mbuf.data()), s.tile = t;
      },
      [&](auto rows, int64_t m, int64_t t, DecodedTile& s) {
        exact_tile<decltype(rows)::value, BS>(x + m * K, xsum.data() + m * nsb, K, s.qbuf.data(), s.sbuf.data(),
                                             s.mbuf.data(), t, out + m * n, n, n);
      });
}

// One column tile of a 6-bit weight widened to the 8-bit form (its 2 panels), with the weight's scales:
// at many rows the W4A8 tiles then read bytes instead of rebuilding them from the 6-bit form for every
// MR_A8 rows (a batch-16 decode step of a 1B Q4_K_M took 116 instead of 104 ms before this).
template <typename W>
struct WidenedTile {
  std::vector<uint8_t> bytes;  // [CT / PANEL, nbx, 512]
  const W* w;
  int64_t tile = -1;
  int64_t nbx, nsb, block_bytes = PANEL * 32;
  const uint8_t* q;

  template <int BS>
  inline void scale_min(int64_t panel, int64_t sb, int lane0, vf& s, vf& m) const {
    w->template scale_min<BS>(tile * (CT / PANEL) + panel, sb, lane0, s, m);
  }

  void widen(int64_t t) {
    tile = t, q = bytes.data();
    for (int p = 0; p < CT / PANEL; ++p)
      for (int64_t b = 0; b < nbx; ++b) {
        const uint8_t* src = w->q + ((t * (CT / PANEL) + p) * nbx + b) * w->block_bytes;
        uint8_t* dst = bytes.data() + (p * nbx + b) * block_bytes;
        for (int c = 0; c < PANEL * 4; c += VL * 4)  // VL lanes of 4 bytes a load
          for (int g = 0; g < 4; ++g) {
            istore(dst + g * 64 + c, load_group8<6, 0>(src + c, g));
            istore(dst + (g + 4) * 64 + c, load_group8<6, 1>(src + c, g));
          }
      }
  }
};

template <int BITS, int BS, typename W>
void a8_impl(const QuantizedX& xq, int64_t M, int64_t K, const W& w, int64_t tiles, float* out, int64_t n) {
  if constexpr (BITS == 6) {
    if (M > MR_A8) {
      run_units<MR_A8>(
          M, tiles,
          [&] { return WidenedTile<W>{std::vector<uint8_t>(CT / PANEL * w.nbx * PANEL * 32), &w, -1, w.nbx, w.nsb}; },
          [](int64_t t, WidenedTile<W>& s) {
            if (s.tile != t) s.widen(t);
          },
          [&](auto rows, int64_t m, int64_t t, WidenedTile<W>& s) {
            a8_tile<8, BS, decltype(rows)::value>(xq.q.data() + m * K, xq.meta.data() + m * w.nbx * 4, K, s, 0,
                                                  out + m * n + t * CT, n, n - t * CT);
          });
      return;
    }
  }
  run_units<MR_A8>(
      M, tiles, [] { return 0; }, [](int64_t, int) {},
      [&](auto rows, int64_t m, int64_t t, int) {
        a8_tile<BITS, BS, decltype(rows)::value>(xq.q.data() + m * K, xq.meta.data() + m * w.nbx * 4, K, w, t,
                                                 out + m * n, n, n);
      });
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& qpacked, const at::Tensor& scales,
                      const at::Tensor& mins, int64_t n, int64_t bits, int64_t block) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_gemm: x must be float32");
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  check_packed(x2, qpacked, scales, mins, n, bits, block);
  const int64_t M = x2.size(0), K = x2.size(1), tiles = qpacked.size(0) * PANEL / CT;
  at::Tensor out = output_for(x, M, n);
  if (M == 0) return out;
  const float* xp = x2.data_ptr<float>();
  float* o = out.data_ptr<float>();
  with_packed(x2, qpacked, scales, mins, bits, block, [&](const auto& w) {
    if (bits == 4) exact_impl<4, 32>(xp, M, K, w, tiles, o, n);
    else if (bits == 6 && block == 32) exact_impl<6, 32>(xp, M, K, w, tiles, o, n);
    else if (bits == 6) exact_impl<6, 16>(xp, M, K, w, tiles, o, n);
    else if (block == 32) exact_impl<8, 32>(xp, M, K, w, tiles, o, n);
    else exact_impl<8, 16>(xp, M, K, w, tiles, o, n);
  });
  return out;
}

at::Tensor quant_gemm_a8(const at::Tensor& x, const at::Tensor& qpacked, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t n, int64_t bits, int64_t block) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_gemm_a8: x must be float32");
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  check_packed(x2, qpacked, scales, mins, n, bits, block);
  const int64_t M = x2.size(0), K = x2.size(1), tiles = qpacked.size(0) * PANEL / CT;
  at::Tensor out = output_for(x, M, n);
  if (M == 0) return out;
  QuantizedX xq;
  quantize_rows(x2.data_ptr<float>(), M, K, xq);
  float* o = out.data_ptr<float>();
  with_packed(x2, qpacked, scales, mins, bits, block, [&](const auto& w) {
    if (bits == 4) a8_impl<4, 32>(xq, M, K, w, tiles, o, n);
    else if (bits == 6 && block == 32) a8_impl<6, 32>(xq, M, K, w, tiles, o, n);
    else if (bits == 6) a8_impl<6, 16>(xq, M, K, w, tiles, o, n);
    else if (block == 32) a8_impl<8, 32>(xq, M, K, w, tiles, o, n);
    else a8_impl<8, 16>(xq, M, K, w, tiles, o, n);
  });
  return out;
}

}  // namespace

namespace tokenloom_gemm {

at::Tensor quant_gemm_with(const at::Tensor& x, const at::Tensor& qpacked, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t n, int64_t bits, int64_t block, bool int8_activations,
                           tokenloom_side::SideWork* side) {
  pending_side = side;
  try {
    at::Tensor out = int8_activations ? quant_gemm_a8(x, qpacked, scales, mins, n, bits, block)
                                      : quant_gemm(x, qpacked, scales, mins, n, bits, block);
    pending_side = nullptr;
    return out;
  } catch (...) {
    pending_side = nullptr;
    throw;
  }
}

}  // namespace tokenloom_gemm

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("quant_gemm(Tensor x, Tensor qpacked, Tensor scales, Tensor mins, int n, int bits, int block_size) -> Tensor");
  m.def("quant_gemm_a8(Tensor x, Tensor qpacked, Tensor scales, Tensor mins, int n, int bits, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("quant_gemm", &quant_gemm);
  m.impl("quant_gemm_a8", &quant_gemm_a8);
}
