// Paged attention for decode (one query token per sequence), reading K and V straight from the block
// table: no gather into a contiguous buffer, no padding mask. And the KV cache write of a step.
//
// Layout (tokenloom/model/layers/attention_native.py): kv_cache [2, num_blocks, block_size, kv_heads,
// head_dim], float32 or bfloat16; block_tables int32 [B, max_blocks]; context_lens int32 [B] (tokens
// in the cache, the new one included). Query head h reads KV head h / (heads / kv_heads) (GQA).
//
// Work split: each sequence's attended span [left, context_len) is cut into partitions of PARTITION
// tokens, one task per (sequence, KV head, partition), so a long context spreads over all threads. A
// task computes its partition's scores for every query head of its KV head (K read once for the group),
// the softmax numerator with its own max, and the weighted sum of V; a second pass merges partitions
// (rescaling by exp(max_i - max)). The partition boundaries depend only on the span, never on the batch
// or the thread count, so a sequence's output does not depend on what else is in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

using namespace tokenloom_vec;

// Tokens per task. 128: batch 1 at context 256 with 3 KV heads makes 6 tasks for 2 threads; the merge
// pass costs a few percent at this size (measured with bench_kernels in tests/unit/test_kernels_attention.py).
constexpr int64_t PARTITION = 128;
constexpr int64_t MAX_GROUP_DIM = 8192;  // query heads per KV head x head_dim held in one task's accumulator

template <typename T>
inline vf load_kv(const T* p);
template <>
inline vf load_kv<float>(const float* p) { return vload(p); }
template <>
inline vf load_kv<at::BFloat16>(const at::BFloat16* p) { return vload_bf16(reinterpret_cast<const uint16_t*>(p)); }

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// Tokens ahead whose K or V row is prefetched: past the cache (~10 MB of KV here) the rows of shuffled blocks
// come from memory, and a row's lines requested a few tokens early overlap their latency.
constexpr int64_t PREFETCH_AHEAD = 4;

template <typename T>
inline void prefetch_row(const T* p, int64_t dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// q . k over head_dim, vectorised where head_dim allows it.
template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  int64_t d = 0;
  vf acc = vzero();
  for (; d + VL <= dim; d += VL) acc = vfma(vload(q + d), load_kv<T>(k + d), acc);
  float s = vsum(acc);
  for (; d < dim; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// acc += w * v over head_dim.
template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t dim) {
  int64_t d = 0;
  vf wv = vset1(w);
  for (; d + VL <= dim; d += VL) vstore(acc + d, vfma(wv, load_kv<T>(v + d), vload(acc + d)));
  for (; d < dim; ++d) acc[d] += w * to_float(v[d]);
}

// ---- register-blocked paths for head dims that are a multiple of the vector width ---------------------------
// The generic loops above spend most of their instructions outside the multiply-adds: a horizontal sum per
// (key, query head), and a load and store of the accumulator per value row. Below, one query head at a time:
// its q (and its output accumulator) stay in NV registers for the whole partition; keys are scored 16 at a
// time (AVX512) with one transpose-and-add tree for the 16 sums (~45 instructions instead of 16 horizontal
// sums). Batch invariance is kept: the instruction sequence depends only on the partition's length.
#if defined(__AVX512F__)
// r[i] = sum of v[i]'s 16 lanes, for 16 vectors at once.
inline __m512 reduce16(__m512* v) {
  __m512 t[8];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  __m512 x[4];
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: the lane's sum of 4 consecutive vectors
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44), _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}
#endif

template <typename T, int NV>
inline void score_keys(const float* q, const T* const* rows, int64_t n, float scale, bool prefetch, float* out) {
  vf qv[NV];
  for (int d = 0; d < NV; ++d) qv[d] = vload(q + d * VL);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    if (prefetch)
      for (int64_t j = i + 16; j < std::min<int64_t>(n, i + 32); ++j) prefetch_row(rows[j], NV * VL);
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      vf a = vmul(qv[0], load_kv<T>(rows[i + j]));
      for (int d = 1; d < NV; ++d) a = vfma(qv[d], load_kv<T>(rows[i + j] + d * VL), a);
      acc[j] = a;
    }
    vstore(out + i, vmul(reduce16(acc), vset1(scale)));
  }
#endif
  for (; i < n; ++i) {
    if (prefetch && i + PREFETCH_AHEAD < n) prefetch_row(rows[i + PREFETCH_AHEAD], NV * VL);
    vf a = vmul(qv[0], load_kv<T>(rows[i]));
    for (int d = 1; d < NV; ++d) a = vfma(qv[d], load_kv<T>(rows[i] + d * VL), a);
    out[i] = vsum(a) * scale;
  }
}

template <typename T, int NV>
inline void weigh_values(const float* w, const T* const* rows, int64_t n, bool prefetch, float* out) {
  vf acc[NV];
  for (int d = 0; d < NV; ++d) acc[d] = vzero();
  for (int64_t i = 0; i < n; ++i) {
    if (prefetch && i + PREFETCH_AHEAD < n) prefetch_row(rows[i + PREFETCH_AHEAD], NV * VL);
    const vf wv = vset1(w[i]);
    for (int d = 0; d < NV; ++d) acc[d] = vfma(wv, load_kv<T>(rows[i] + d * VL), acc[d]);
  }
  for (int d = 0; d < NV; ++d) vstore(out + d * VL, acc[d]);
}

// Calls f with std::integral_constant<int, head_dim / VL> when the register-blocked paths have an
// instantiation for head_dim; false when they do not (the generic loops run instead).
template <typename F>
bool with_vectors_per_head(int64_t D, F f) {
  if (D % VL) return false;
  switch (D / VL) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    case 16: f(std::integral_constant<int, 16>{}); return true;
    default: return false;
  }
}

struct Task {
  int64_t seq, kv_head, first, last;  // tokens [first, last)
  int64_t slot;                       // index of this partition's partial result
};

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv_cache, const int32_t* tables, int64_t table_width,
                   const int32_t* lens, double scale_d, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = kv_cache.size(2), KVH = kv_cache.size(3);
  const int64_t G = H / KVH;
  const float scale = static_cast<float>(scale_d);
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + kv_cache.stride(0);
  const int64_t block_stride = kv_cache.stride(1), token_stride = kv_cache.stride(2), head_stride = kv_cache.stride(3);
  const float* q_base = q.data_ptr<float>();
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);

  std::vector<Task> tasks;
  std::vector<int64_t> first_slot(B + 1, 0);  // partitions of sequence b: slots first_slot[b] .. first_slot[b+1]
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    const int64_t left = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t parts = std::max<int64_t>(1, (len - left + PARTITION - 1) / PARTITION);
    first_slot[b + 1] = first_slot[b] + parts;
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t p = 0; p < parts; ++p)
        tasks.push_back({b, h, left + p * PARTITION, std::min(len, left + (p + 1) * PARTITION), first_slot[b] + p});
  }
  // Partial results per (slot, KV head, query in group): D sums, then max and denominator.
  const int64_t rec = D + 2;
  std::vector<float> partial(static_cast<size_t>(first_slot[B] * KVH * G * rec));

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G * PARTITION));
    std::vector<float> acc(static_cast<size_t>(G * D));
    std::vector<const T*> krows(PARTITION), vrows(PARTITION);
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int32_t* table = tables + task.seq * table_width;
      const float* qh = q_base + task.seq * q_seq_stride + task.kv_head * G * q_head_stride;
      const int64_t n = task.last - task.first;
      float* out_rec = partial.data() + ((task.slot * KVH + task.kv_head) * G) * rec;
      if (n <= 0) {  // an empty span (context 0): no keys, zero output
        for (int64_t g = 0; g < G; ++g) {
          std::fill(out_rec + g * rec, out_rec + g * rec + D, 0.0f);
          out_rec[g * rec + D] = -INFINITY;
          out_rec[g * rec + D + 1] = 0.0f;
        }
        continue;
      }
      auto row = [&](const T* base, int64_t pos) {
        return base + table[pos / block_size] * block_stride + (pos % block_size) * token_stride +
               task.kv_head * head_stride;
      };
      for (int64_t i = 0; i < n; ++i) {
        krows[i] = row(k_base, task.first + i);
        vrows[i] = row(v_base, task.first + i);
      }
      const bool blocked = with_vectors_per_head(D, [&](auto nv) {
        for (int64_t g = 0; g < G; ++g)
          score_keys<T, decltype(nv)::value>(qh + g * q_head_stride, krows.data(), n, scale, g == 0,
                                             scores.data() + g * PARTITION);
      });
      if (!blocked) {
        for (int64_t i = 0; i < n; ++i) {
          if (i + PREFETCH_AHEAD < n) prefetch_row(krows[i + PREFETCH_AHEAD], D);
          for (int64_t g = 0; g < G; ++g)
            scores[g * PARTITION + i] = dot<T>(qh + g * q_head_stride, krows[i], D) * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * PARTITION;
        float m = -INFINITY;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
        int64_t i = 0;
        vf mv = vset1(m), sumv = vzero();
        for (; i + VL <= n; i += VL) {
          vf e = vexp(vsub(vload(s + i), mv));
          vstore(s + i, e);
          sumv = vadd(sumv, e);
        }
        float sum = vsum(sumv);
        for (; i < n; ++i) {
          s[i] = sexp(s[i] - m);
          sum += s[i];
        }
        out_rec[g * rec + D] = m;
        out_rec[g * rec + D + 1] = sum;
      }
      if (blocked) {
        with_vectors_per_head(D, [&](auto nv) {
          for (int64_t g = 0; g < G; ++g)
            weigh_values<T, decltype(nv)::value>(scores.data() + g * PARTITION, vrows.data(), n, g == 0,
                                                 acc.data() + g * D);
        });
      } else {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t i = 0; i < n; ++i) {
          if (i + PREFETCH_AHEAD < n) prefetch_row(vrows[i + PREFETCH_AHEAD], D);
          for (int64_t g = 0; g < G; ++g) axpy<T>(acc.data() + g * D, scores[g * PARTITION + i], vrows[i], D);
        }
      }
      for (int64_t g = 0; g < G; ++g) std::copy(acc.data() + g * D, acc.data() + (g + 1) * D, out_rec + g * rec);
    }
  });

  float* out_base = out.data_ptr<float>();
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, kvh = h / G, g = h % G;
      float* o = out_base + b * H * D + h * D;
      float m = -INFINITY;
      for (int64_t s = first_slot[b]; s < first_slot[b + 1]; ++s)
        m = std::max(m, partial[((s * KVH + kvh) * G + g) * rec + D]);
      std::fill(o, o + D, 0.0f);
      float denom = 0.0f;
      for (int64_t s = first_slot[b]; s < first_slot[b + 1]; ++s) {
        const float* r = partial.data() + ((s * KVH + kvh) * G + g) * rec;
        if (r[D + 1] == 0.0f) continue;
        const float w = first_slot[b + 1] - first_slot[b] == 1 ? 1.0f : sexp(r[D] - m);
        denom += w * r[D + 1];
        for (int64_t d = 0; d < D; ++d) o[d] += w * r[d];
      }
      const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "paged_attention_decode: q must be float32 [batch, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention_decode: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(3) == 0,
              "paged_attention_decode: head_dim or head counts of q and kv_cache disagree");
  TORCH_CHECK(q.size(1) / kv_cache.size(3) * q.size(2) <= MAX_GROUP_DIM, "paged_attention_decode: group too large");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_attention_decode: block_tables and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= q.size(0) && context_lens.size(0) >= q.size(0),
              "paged_attention_decode: one block table row and one context length per sequence");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lp[b] >= 0 && (lp[b] + kv_cache.size(2) - 1) / kv_cache.size(2) <= tables.size(1),
                "paged_attention_decode: a context length exceeds its block table");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  if (kv_cache.scalar_type() == at::kFloat) {
    decode_kernel<float>(q, kv_cache, tables.data_ptr<int32_t>(), tables.size(1), lp, scale, window, out);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "paged_attention_decode: kv_cache must be float32 or bfloat16");
    decode_kernel<at::BFloat16>(q, kv_cache, tables.data_ptr<int32_t>(), tables.size(1), lp, scale, window, out);
  }
  return out;
}

// kv_cache[0] and [1] at flat token slot slot_mapping[t] <- key[t], value[t] (converted to the cache dtype,
// rounding to nearest even for bfloat16). key, value: [T, kv_heads, head_dim], rows may be strided
// (views into the fused QKV output).
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv_cache: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat, "write_kv_cache: float32 key/value");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4) &&
                  value.sizes() == key.sizes(),
              "write_kv_cache: key/value must be [tokens, kv_heads, head_dim] matching the cache");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "write_kv_cache: each token's heads must be contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == key.size(0), "write_kv_cache: one slot per token");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  const int64_t capacity = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "write_kv_cache: slot ", sp[t], " outside the cache");
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const int64_t half = kv_cache.stride(0);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ks = kp + t * key.stride(0);
      const float* vs = vp + t * value.stride(0);
      if (kv_cache.scalar_type() == at::kFloat) {
        float* base = kv_cache.data_ptr<float>() + sp[t] * row;
        std::copy(ks, ks + row, base);
        std::copy(vs, vs + row, base + half);
      } else {
        uint16_t* base = reinterpret_cast<uint16_t*>(kv_cache.data_ptr<at::BFloat16>()) + sp[t] * row;
        for (int64_t i = 0; i < row; ++i) base[i] = float_to_bf16(ks[i]);
        for (int64_t i = 0; i < row; ++i) base[half + i] = float_to_bf16(vs[i]);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("paged_attention_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale, "
        "int window) -> Tensor");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("write_kv_cache", &write_kv_cache);
}
