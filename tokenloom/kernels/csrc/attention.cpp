// Paged attention for decode (one query token per sequence), reading K and V straight from the block
// table: no gather into a contiguous buffer, no padding mask. And the KV cache write of a step.
//
// Layout (tokenloom/model/layers/attention_native.py): kv_cache [2, num_blocks, block_size, kv_heads,
// head_dim], float32 or bfloat16, or int8 rows of head_dim values and a float32 scale (head_dim + 4 bytes,
// tokenloom/kernels/kv_int8.py; a row's scale multiplies its dot products and its softmax weights); block_tables int32 [B, max_blocks]; context_lens int32 [B] (tokens
// in the cache, the new one included). Query head h reads KV head h / (heads / kv_heads) (GQA).
//
// Work split: each sequence's attended span [left, context_len) is cut into partitions of PARTITION
// tokens; a task is one (sequence, partition) with all of its KV heads, or one KV head of it when there
// are too few partitions to keep the threads busy (heads_per_task_for). A task walks its partition a
// segment of 16 tokens (a cache block) at a time, every head of the task per segment, so it reads each
// block front to back (a token's heads are adjacent). Per KV head it scores the keys for the whole GQA
// group (each K row widened once, then the G query heads dot it from L1), takes the softmax numerator
// with its own max, and adds up V for the group (each V row loaded once for the G heads); a second pass
// merges partitions (rescaling by exp(max_i - max)). The partition boundaries depend only on the span,
// never on the batch or the thread count, and every (sequence, head, partition) runs the same arithmetic
// whichever task holds it, so a sequence's output does not depend on what else is in the batch.
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

// Tokens per partition. 128: batch 1 at context 256 makes two tasks (all 3 KV heads each), one per thread;
// the merge pass costs a few percent at this size (python -m tokenloom.bench.fused_kernels).
constexpr int64_t PARTITION = 128;
constexpr int64_t MAX_GROUP_DIM = 8192;  // query heads per KV head x head_dim held in one task's accumulator

template <typename T>
inline vf load_kv(const T* p);
template <>
inline vf load_kv<float>(const float* p) { return vload(p); }
template <>
inline vf load_kv<at::BFloat16>(const at::BFloat16* p) { return vload_bf16(reinterpret_cast<const uint16_t*>(p)); }
template <>
inline vf load_kv<int8_t>(const int8_t* p) { return vload_i8(p); }

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

// The factor a row's values carry: its scale in the 8-bit cache, none (1) in a float cache.
template <typename T>
inline float row_scale(const T* row, int64_t dim) {
  if constexpr (std::is_same_v<T, int8_t>) return int8_row_scale(row, dim);
  return 1.0f;
}

// Elements of a cached row: head_dim, and the scale's bytes in the 8-bit cache.
template <typename T>
constexpr int64_t row_elements(int64_t dim) {
  return std::is_same_v<T, int8_t> ? dim + KV_SCALE_BYTES : dim;
}

// Keys per segment: a task walks its partition 16 tokens at a time (a block of the cache when the span
// starts on a block edge), every KV head of the task per segment, so it reads each block front to back.
constexpr int64_t SEGMENT = 16;

// A row's cache lines requested into L2 ahead of use. Into L2, not L1: a task's rows for the next segment and
// for the value pass (up to ~100 KB in flight) would evict each other from a 32 KB L1, and L1 prefetches
// hold its few miss buffers. Batch 32 at context ~285 (bfloat16, one thread, K/V from memory): T1 hints
// took 0.57x the time of T0 hints, and T0 for the next segment's keys with T1 for the values 0.83x
// (scripts/bench_decode_attention_ab.py; PERFORMANCE.md, "Decode attention: ...").
template <typename T>
inline void prefetch_row_to_l2(const T* p, int64_t dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// q . k over head_dim, vectorised where head_dim allows it.
template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  int64_t d = 0;
  vf acc = vzero();
  for (; d + VL <= dim; d += VL) acc = vfma(vload(q + d), load_kv<T>(k + d), acc);
  float s = vsum(acc);
  for (; d < dim; ++d) s += q[d] * to_float(k[d]);
  if constexpr (std::is_same_v<T, int8_t>) s *= row_scale(k, dim);
  return s;
}

// acc += w * v over head_dim.
template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t dim) {
  if constexpr (std::is_same_v<T, int8_t>) w *= row_scale(v, dim);
  int64_t d = 0;
  vf wv = vset1(w);
  for (; d + VL <= dim; d += VL) vstore(acc + d, vfma(wv, load_kv<T>(v + d), vload(acc + d)));
  for (; d < dim; ++d) acc[d] += w * to_float(v[d]);
}

// ---- register-blocked paths for head dims that are a multiple of the vector width ---------------------------
// The generic loops above spend most of their instructions outside the multiply-adds: a horizontal sum per
// (key, query head), and a load and store of the accumulator per value row. Below, a query head's q stays in
// NV registers while it scores a segment, 16 keys at a time (AVX512) with one transpose-and-add tree for the
// 16 sums; the value pass keeps a chunk of the group's output accumulators in registers. Batch invariance is
// kept: the instruction sequence depends only on the partition's length.
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

// The value pass takes a GQA group's query heads in chunks: each V row is loaded (and widened) once for the
// chunk instead of once per query head. A chunk is as large as the accumulators allow: GC x NV output
// vectors in registers beside the NV of the row (AVX512 has 32 registers, AVX2 16).
#if defined(__AVX512F__)
constexpr int ACC_REGISTERS = 16;
#else
constexpr int ACC_REGISTERS = 8;
#endif
constexpr int MAX_CHUNK = 4;
constexpr int chunk_heads(int nv) { return nv >= ACC_REGISTERS ? 1 : std::min(MAX_CHUNK, ACC_REGISTERS / nv); }

// out[i] = scale * q . k_i for one query head over up to a segment's keys (float32 rows): q stays in NV
// registers; with AVX512, 16 keys are scored at once and their 16 sums reduced by one transpose-and-add
// tree (~45 instructions instead of 16 horizontal sums).
template <int NV>
inline void score_keys(const float* q, const float* const* rows, int64_t n, float scale, float* out) {
  vf qv[NV];
  for (int d = 0; d < NV; ++d) qv[d] = vload(q + d * VL);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      vf a = vmul(qv[0], vload(rows[i + j]));
      for (int d = 1; d < NV; ++d) a = vfma(qv[d], vload(rows[i + j] + d * VL), a);
      acc[j] = a;
    }
    vstore(out + i, vmul(reduce16(acc), vset1(scale)));
  }
#endif
  for (; i < n; ++i) {
    vf a = vmul(qv[0], vload(rows[i]));
    for (int d = 1; d < NV; ++d) a = vfma(qv[d], vload(rows[i] + d * VL), a);
    out[i] = vsum(a) * scale;
  }
}

// scores[g * PARTITION + i] for the G query heads of one KV head over a segment's keys (rows[i] + off).
// Each key row is read from the cache once: a bfloat16 row is widened into `stage` (float32, exact), an int8
// row widened and multiplied by its scale, and the G heads then score the segment from L1, each with the same
// instructions as a head alone.
template <typename T, int NV>
inline void score_segment(const float* q, int64_t q_stride, int64_t G, const T* const* rows, int64_t off, int64_t n,
                          float scale, float* stage, float* scores) {
  const float* keys[SEGMENT];
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      keys[i] = rows[i] + off;
    } else if constexpr (std::is_same_v<T, int8_t>) {
      float* dst = stage + i * NV * VL;
      const vf sv = vset1(row_scale(rows[i] + off, NV * VL));
      for (int d = 0; d < NV; ++d) vstore(dst + d * VL, vmul(load_kv<T>(rows[i] + off + d * VL), sv));
      keys[i] = dst;
    } else {
      float* dst = stage + i * NV * VL;
      for (int d = 0; d < NV; ++d) vstore(dst + d * VL, load_kv<T>(rows[i] + off + d * VL));
      keys[i] = dst;
    }
  }
  for (int64_t g = 0; g < G; ++g) score_keys<NV>(q + g * q_stride, keys, n, scale, scores + g * PARTITION);
}

// out[g * D ...] += sum_i w[g * PARTITION + i] * v_i for the GC query heads (values at rows[i] + off),
// accumulated in token order: segment after segment, the same sums as one pass over the partition. An int8
// row's scale multiplies its weight, so the row itself is only widened.
template <typename T, int NV, int GC>
inline void weigh_values(const float* w, const T* const* rows, int64_t off, int64_t n, float* out) {
  vf acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int d = 0; d < NV; ++d) acc[g][d] = vload(out + g * NV * VL + d * VL);
  for (int64_t i = 0; i < n; ++i) {
    vf v[NV];
    for (int d = 0; d < NV; ++d) v[d] = load_kv<T>(rows[i] + off + d * VL);
    const float rs = row_scale(rows[i] + off, NV * VL);
    for (int g = 0; g < GC; ++g) {
      const vf wv = vset1(std::is_same_v<T, int8_t> ? w[g * PARTITION + i] * rs : w[g * PARTITION + i]);
      for (int d = 0; d < NV; ++d) acc[g][d] = vfma(wv, v[d], acc[g][d]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int d = 0; d < NV; ++d) vstore(out + g * NV * VL + d * VL, acc[g][d]);
}

// Calls f(integral_constant<int, head_dim / VL>) when the register-blocked paths have an instantiation
// for head_dim; false when they do not (the generic loops run instead).
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

// Runs f(g0, integral_constant<int, heads>) over the group's query heads in chunks of at most CH heads.
template <int CH, typename F>
void over_chunks(int64_t G, F f) {
  int64_t g = 0;
  for (; g + CH <= G; g += CH) f(g, std::integral_constant<int, CH>{});
  const int64_t rest = G - g;  // fewer than CH heads left
  if constexpr (CH > 1) {
    if (rest == 1) f(g, std::integral_constant<int, 1>{});
  }
  if constexpr (CH > 2) {
    if (rest == 2) f(g, std::integral_constant<int, 2>{});
  }
  if constexpr (CH > 3) {
    if (rest == 3) f(g, std::integral_constant<int, 3>{});
  }
}

// KV heads per task: all of a sequence's heads in one task when there are enough (sequence, partition)
// pairs to keep the threads busy (a token's heads are adjacent in the cache, so one task then streams
// whole blocks), else one head per task so a single short sequence still spreads over the threads.
// Either way each (sequence, head, partition) runs the same arithmetic, so results do not change.
inline int64_t heads_per_task_for(int64_t partitions, int64_t kv_heads, int64_t threads) {
  const int64_t grouped_load = (partitions + threads - 1) / threads * kv_heads;
  const int64_t split_load = (partitions * kv_heads + threads - 1) / threads;
  return partitions >= 4 * threads || grouped_load == split_load ? kv_heads : 1;
}

struct Task {
  int64_t seq, first, last;      // tokens [first, last)
  int64_t slot;                  // index of this partition's partial result
  int64_t head_begin, head_end;  // KV heads
  int64_t segments() const { return std::max<int64_t>(0, (last - first + SEGMENT - 1) / SEGMENT); }
};

// Where a task's K and V rows lie, for its first KV head (its other heads follow, head_stride apart).
template <typename T>
struct RowFinder {
  const T* k_base;
  const T* v_base;
  const int32_t* tables;
  int64_t table_width, block_size, block_stride, token_stride, head_stride;
  // rows[i] = the K (V) row of token task.first + i, walking the block table (no division per token).
  void fill(const Task& task, int64_t n, const T** krows, const T** vrows) const {
    const int32_t* table = tables + task.seq * table_width;
    const int64_t v_offset = v_base - k_base;
    int64_t block = task.first / block_size, in_block = task.first % block_size;
    const T* block_row = k_base + table[block] * block_stride + task.head_begin * head_stride;
    for (int64_t i = 0; i < n; ++i) {
      krows[i] = block_row + in_block * token_stride;
      vrows[i] = krows[i] + v_offset;
      if (++in_block == block_size && i + 1 < n) {
        in_block = 0;
        block_row = k_base + table[++block] * block_stride + task.head_begin * head_stride;
      }
    }
  }
};

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv_cache, const int32_t* tables, int64_t table_width,
                   const int32_t* lens, double scale_d, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = kv_cache.size(2), KVH = kv_cache.size(3);
  const int64_t G = H / KVH;
  const float scale = static_cast<float>(scale_d);
  const T* k_base = kv_cache.data_ptr<T>();
  const RowFinder<T> rows_of{k_base, k_base + kv_cache.stride(0), tables, table_width, block_size,
                             kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)};
  const int64_t head_stride = kv_cache.stride(3);
  const float* q_base = q.data_ptr<float>();
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);

  std::vector<int64_t> first_slot(B + 1, 0);  // partitions of sequence b: slots first_slot[b] .. first_slot[b+1]
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    const int64_t left = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    first_slot[b + 1] = first_slot[b] + std::max<int64_t>(1, (len - left + PARTITION - 1) / PARTITION);
  }
  const int64_t heads_per_task = heads_per_task_for(first_slot[B], KVH, at::get_num_threads());
  std::vector<Task> tasks;
  tasks.reserve(first_slot[B] * ((KVH + heads_per_task - 1) / heads_per_task));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    const int64_t left = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t h = 0; h < KVH; h += heads_per_task)
      for (int64_t p = 0; p < first_slot[b + 1] - first_slot[b]; ++p)
        tasks.push_back({b, left + p * PARTITION, std::min(len, left + (p + 1) * PARTITION), first_slot[b] + p, h,
                         std::min(KVH, h + heads_per_task)});
  }
  // Partial results per (slot, KV head, query in group): D sums, then max and denominator.
  const int64_t rec = D + 2;
  std::vector<float> partial(static_cast<size_t>(first_slot[B] * KVH * G * rec));

  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(KVH * G * PARTITION));  // [head in task][g][token]
    std::vector<float> acc(static_cast<size_t>(KVH * G * D));             // [head in task][g][D]
    std::vector<const T*> krows(PARTITION), vrows(PARTITION);
    std::vector<float> stage(static_cast<size_t>(SEGMENT * D));  // a segment's key rows widened to float32
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t n = task.last - task.first, heads = task.head_end - task.head_begin;
      const float* q_task = q_base + task.seq * q_seq_stride + task.head_begin * G * q_head_stride;
      float* rec_task = partial.data() + ((task.slot * KVH + task.head_begin) * G) * rec;
      if (n <= 0) {  // an empty span (context 0): no keys, zero output
        for (int64_t g = 0; g < heads * G; ++g) {
          std::fill(rec_task + g * rec, rec_task + g * rec + D, 0.0f);
          rec_task[g * rec + D] = -INFINITY;
          rec_task[g * rec + D + 1] = 0.0f;
        }
        continue;
      }
      rows_of.fill(task, n, krows.data(), vrows.data());
      const int64_t segs = task.segments();
      for (int64_t seg = 0; seg < segs; ++seg) {
        const int64_t i0 = seg * SEGMENT, m = std::min(SEGMENT, n - i0);
        for (int64_t h = 0; h < heads; ++h) {
          // The next segment's keys and this segment's values start coming from memory while these keys are scored.
          for (int64_t i = i0 + SEGMENT; i < std::min(n, i0 + 2 * SEGMENT); ++i)
            prefetch_row_to_l2(krows[i] + h * head_stride, row_elements<T>(D));
          for (int64_t i = i0; i < i0 + m; ++i) prefetch_row_to_l2(vrows[i] + h * head_stride, row_elements<T>(D));
          const float* qh = q_task + h * G * q_head_stride;
          float* sh = scores.data() + h * G * PARTITION + i0;
          const bool blocked = with_vectors_per_head(D, [&](auto nv) {
            score_segment<T, decltype(nv)::value>(qh, q_head_stride, G, krows.data() + i0, h * head_stride, m, scale,
                                                  stage.data(), sh);
          });
          if (!blocked)
            for (int64_t i = 0; i < m; ++i)
              for (int64_t g = 0; g < G; ++g)
                sh[g * PARTITION + i] = dot<T>(qh + g * q_head_stride, krows[i0 + i] + h * head_stride, D) * scale;
        }
      }
      for (int64_t hg = 0; hg < heads * G; ++hg) {
        float* s = scores.data() + hg * PARTITION;
        int64_t i = 0;
        vf mxv = vset1(-INFINITY);
        for (; i + VL <= n; i += VL) mxv = vmax(mxv, vload(s + i));
        float mx = vhmax(mxv);
        for (; i < n; ++i) mx = std::max(mx, s[i]);
        i = 0;
        vf mv = vset1(mx), sumv = vzero();
        for (; i + VL <= n; i += VL) {
          vf e = vexp(vsub(vload(s + i), mv));
          vstore(s + i, e);
          sumv = vadd(sumv, e);
        }
        float sum = vsum(sumv);
        for (; i < n; ++i) {
          s[i] = sexp(s[i] - mx);
          sum += s[i];
        }
        rec_task[hg * rec + D] = mx;
        rec_task[hg * rec + D + 1] = sum;
      }
      std::fill(acc.begin(), acc.begin() + heads * G * D, 0.0f);
      for (int64_t seg = 0; seg < segs; ++seg) {
        const int64_t i0 = seg * SEGMENT, m = std::min(SEGMENT, n - i0);
        for (int64_t h = 0; h < heads; ++h) {
          const float* wh = scores.data() + h * G * PARTITION + i0;
          float* ah = acc.data() + h * G * D;
          const bool blocked = with_vectors_per_head(D, [&](auto nv) {
            constexpr int NV = decltype(nv)::value;
            over_chunks<chunk_heads(NV)>(G, [&](int64_t g0, auto gc) {
              weigh_values<T, NV, decltype(gc)::value>(wh + g0 * PARTITION, vrows.data() + i0, h * head_stride, m,
                                                       ah + g0 * D);
            });
          });
          if (!blocked)
            for (int64_t i = 0; i < m; ++i)
              for (int64_t g = 0; g < G; ++g)
                axpy<T>(ah + g * D, wh[g * PARTITION + i], vrows[i0 + i] + h * head_stride, D);
        }
      }
      for (int64_t hg = 0; hg < heads * G; ++hg)
        std::copy(acc.data() + hg * D, acc.data() + (hg + 1) * D, rec_task + hg * rec);
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
  const bool int8_cache = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.size(4) == q.size(2) + (int8_cache ? KV_SCALE_BYTES : 0) && q.size(1) % kv_cache.size(3) == 0,
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
  } else if (int8_cache) {
    decode_kernel<int8_t>(q, kv_cache, tables.data_ptr<int32_t>(), tables.size(1), lp, scale, window, out);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16,
                "paged_attention_decode: kv_cache must be float32, bfloat16 or int8");
    decode_kernel<at::BFloat16>(q, kv_cache, tables.data_ptr<int32_t>(), tables.size(1), lp, scale, window, out);
  }
  return out;
}

// kv_cache[0] and [1] at flat token slot slot_mapping[t] <- key[t], value[t] (converted to the cache dtype,
// rounding to nearest even for bfloat16; quantized per row with its scale for int8). key, value: [T, kv_heads, head_dim], rows may be strided
// (views into the fused QKV output).
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv_cache: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat, "write_kv_cache: float32 key/value");
  const bool int8_cache = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 || int8_cache,
              "write_kv_cache: kv_cache must be float32, bfloat16 or int8");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(1) == kv_cache.size(3) &&
                  key.size(2) + (int8_cache ? KV_SCALE_BYTES : 0) == kv_cache.size(4) && value.sizes() == key.sizes(),
              "write_kv_cache: key/value must be [tokens, kv_heads, head_dim] matching the cache");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "write_kv_cache: each token's heads must be contiguous");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == key.size(0), "write_kv_cache: one slot per token");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2), D = key.size(2);
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
      if (int8_cache) {
        int8_t* base = kv_cache.data_ptr<int8_t>() + sp[t] * kv_cache.stride(2);
        for (int64_t h = 0; h < key.size(1); ++h) {
          quantize_int8_row(ks + h * D, D, base + h * kv_cache.stride(3));
          quantize_int8_row(vs + h * D, D, base + half + h * kv_cache.stride(3));
        }
      } else if (kv_cache.scalar_type() == at::kFloat) {
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
