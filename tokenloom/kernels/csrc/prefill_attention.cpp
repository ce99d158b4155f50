// Paged attention for prefill chunks: the queries of one or more chunks attend causally (optionally within a
// sliding window) over keys and values read straight from the paged KV cache, after write_kv_cache has put
// the chunk's own K/V there. No gather into a contiguous buffer, no mask tensor, one call for all of a step's
// chunks.
//
// Layout (tokenloom/model/layers/attention_native.py): kv_cache [2, num_blocks, block_size, kv_heads,
// head_dim], float32 or bfloat16, or int8 rows of head_dim values and a float32 scale (head_dim + 4 bytes,
// tokenloom/kernels/kv_int8.py); block_tables int32 [chunks, max_blocks]; query_starts int32 [chunks + 1]
// (chunk c is rows [query_starts[c], query_starts[c+1]) of q and out); context_lens int32 [chunks] (tokens
// in the cache, the chunk's own included, so the chunk's first row sits at position context_len - rows).
// Query head h reads KV head h / (heads / kv_heads) (GQA).
//
// Flash-style: a task is (chunk, KV head, query tile): a tile of positions x the G query heads sharing the KV
// head, M = positions * G rows. It walks the keys in tiles of KEY_TILE with an online softmax (running max,
// denominator, and output rescaled when the max grows). Scores are kept transposed, S^T [key][row], so the
// scores come from one GEMM with the rows in vector lanes (K rows broadcast, Q^T packed once per task), and
// the softmax's max, exp and sums are all vertical vector ops; the output then accumulates O[row][dim] from
// P broadcasts times V rows. Both products run from register tiles.
//
// Batch and thread invariance: key tiles are aligned to absolute positions, and a row's arithmetic (its
// lane of each vector op, in the same order) depends only on its query, the keys and that grid; a key tile
// wholly masked for a row leaves it bit-unchanged (alpha = exp(0) = 1 exactly, p = 0). So a row's output
// does not depend on the other rows of its tile, the other chunks of the call or which thread ran it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

using namespace tokenloom_vec;

// Keys per online-softmax step: two cache blocks. The output rescale and the softmax bookkeeping are paid
// once per tile, the masked waste on the diagonal grows with it.
constexpr int64_t KEY_TILE = 32;
// Rows (positions x query heads of a group) per task: 3 AVX512 vectors; 16 positions for SmolLM2's G = 3.
constexpr int64_t TARGET_ROWS = 48;

#if defined(__AVX512F__)
constexpr int QK_KEYS = 8;    // keys per QK register tile (broadcast), x QK_MAX_RV row vectors
constexpr int QK_MAX_RV = 3;  // 8 x 3 accumulators + 3 query vectors + 1 broadcast of 32 registers
constexpr int PV_ROWS = 6;    // rows per PV register tile, x PV_COLS vectors of head_dim
constexpr int PV_COLS = 4;    // 6 x 4 accumulators + 4 value vectors + 1 broadcast
inline vf keep_le(vf s, vf a, vf b, vf other) {  // a <= b ? s : other
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), other, s);
}
inline vf keep_lt(vf s, vf a, vf b, vf other) {  // a < b ? s : other
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), other, s);
}
inline vf keep_eq(vf s, vf a, vf b, vf other) {  // a == b ? s : other
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), other, s);
}
#else
constexpr int QK_KEYS = 4;    // 4 x 2 accumulators + 2 query vectors + 1 broadcast of 16 registers
constexpr int QK_MAX_RV = 2;
constexpr int PV_ROWS = 6;    // 6 x 2 accumulators + 2 value vectors + 1 broadcast
constexpr int PV_COLS = 2;
inline vf keep_le(vf s, vf a, vf b, vf other) { return _mm256_blendv_ps(other, s, _mm256_cmp_ps(a, b, _CMP_LE_OQ)); }
inline vf keep_lt(vf s, vf a, vf b, vf other) { return _mm256_blendv_ps(other, s, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
inline vf keep_eq(vf s, vf a, vf b, vf other) { return _mm256_blendv_ps(other, s, _mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
#endif
static_assert(KEY_TILE % QK_KEYS == 0, "a key tile is whole QK register tiles");

// Calls f with std::integral_constant<int, n> for 1 <= n <= N.
template <int N, typename F>
inline void with_count(int n, F&& f) {
  if constexpr (N == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    if (n == N) f(std::integral_constant<int, N>{});
    else with_count<N - 1>(n, f);
  }
}

// S^T[j][rows] = sum_d K[j][d] * Q^T[d][rows] for QK_KEYS keys and RV row vectors (scale folded into Q^T).
template <int RV>
inline void qk_tile(const float* const* krows, const float* qt, int64_t ldq, int64_t dim, float* st, int64_t lds) {
  vf acc[QK_KEYS][RV];
  for (int k = 0; k < QK_KEYS; ++k)
    for (int r = 0; r < RV; ++r) acc[k][r] = vzero();
  for (int64_t d = 0; d < dim; ++d) {
    vf qv[RV];
    for (int r = 0; r < RV; ++r) qv[r] = vload(qt + d * ldq + r * VL);
    for (int k = 0; k < QK_KEYS; ++k) {
      const vf b = vset1(krows[k][d]);
      for (int r = 0; r < RV; ++r) acc[k][r] = vfma(b, qv[r], acc[k][r]);
    }
  }
  for (int k = 0; k < QK_KEYS; ++k)
    for (int r = 0; r < RV; ++r) vstore(st + k * lds + r * VL, acc[k][r]);
}

// O[rows][cols] = O * alpha[row] + sum_j P^T[j][row] * V[j][cols] for R rows and CV vectors of columns.
template <int R, int CV>
inline void pv_tile(const float* pt, int64_t ldp, const float* const* vrows, int64_t nkeys, const float* alpha,
                    float* o, int64_t ldo) {
  vf acc[R][CV];
  for (int r = 0; r < R; ++r) {
    const vf a = vset1(alpha[r]);
    for (int c = 0; c < CV; ++c) acc[r][c] = vmul(vload(o + r * ldo + c * VL), a);
  }
  for (int64_t j = 0; j < nkeys; ++j) {
    vf v[CV];
    for (int c = 0; c < CV; ++c) v[c] = vload(vrows[j] + c * VL);
    for (int r = 0; r < R; ++r) {
      const vf p = vset1(pt[j * ldp + r]);
      for (int c = 0; c < CV; ++c) acc[r][c] = vfma(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CV; ++c) vstore(o + r * ldo + c * VL, acc[r][c]);
}

struct Task {
  int64_t chunk, kv_head, first, last;  // query rows [first, last) of the chunk, relative to its start
  int64_t cost;                         // rows x keys, to hand out the largest first
};

// One thread's buffers, sized once for the call's largest task.
struct Scratch {
  std::vector<float> qt, st, o, mx, den, alpha, pos, kpack, vpack, zero;
  std::vector<const float*> krows, vrows;
  Scratch(int64_t rows_padded, int64_t rows, int64_t dim, int64_t dim_padded)
      : qt(dim * rows_padded), st(KEY_TILE * rows_padded), o(rows * dim_padded), mx(rows_padded),
        den(rows_padded), alpha(rows_padded), pos(rows_padded), kpack(KEY_TILE * dim_padded),
        vpack(KEY_TILE * dim_padded), zero(dim_padded, 0.0f), krows(KEY_TILE), vrows(KEY_TILE) {}
};

template <typename T>
struct Prefill {
  const float* q;
  int64_t q_row_stride, q_head_stride;
  const T* k_base;
  const T* v_base;
  int64_t block_size, block_stride, token_stride, head_stride;
  const int32_t* tables;
  int64_t table_width;
  const int32_t* starts;
  const int32_t* lens;
  int64_t H, D, Dp, G;
  float scale;
  int64_t window;
  float* out;
  int64_t out_row_stride;

  // Row pointers for keys (or values) [k0, k0 + nk) of a task: straight into the cache when it is float32
  // with whole vectors per head, else converted (int8: times the row's scale) and padded into `pack`.
  // Padding keys point at zeros.
  void key_rows(const T* base, const int32_t* table, int64_t kv_head, int64_t k0, int64_t nk, float* pack,
                const float* zero, const float** rows) const {
    constexpr bool direct = std::is_same<T, float>::value;
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t p = k0 + j;
      const T* src = base + table[p / block_size] * block_stride + (p % block_size) * token_stride +
                     kv_head * head_stride;
      if constexpr (direct) {
        if (D == Dp) {
          rows[j] = reinterpret_cast<const float*>(src);
          continue;
        }
      }
      float* dst = pack + j * Dp;
      int64_t d = 0;
      if constexpr (std::is_same<T, int8_t>::value) {
        const float sc = int8_row_scale(src, D);
        const vf sv = vset1(sc);
        for (; d + VL <= D; d += VL) vstore(dst + d, vmul(vload_i8(src + d), sv));
        for (; d < D; ++d) dst[d] = static_cast<float>(src[d]) * sc;
      } else if constexpr (!direct) {
        for (; d + VL <= D; d += VL) vstore(dst + d, vload_bf16(reinterpret_cast<const uint16_t*>(src) + d));
      }
      for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
      for (; d < Dp; ++d) dst[d] = 0.0f;
      rows[j] = dst;
    }
    for (int64_t j = nk; j < KEY_TILE; ++j) rows[j] = zero;
  }

  void run(const Task& task, Scratch& s) const {
    const int64_t n = starts[task.chunk + 1] - starts[task.chunk];
    const int64_t offset = lens[task.chunk] - n;  // position of the chunk's first row
    const int64_t positions = task.last - task.first;
    const int64_t M = positions * G, Mp = (M + VL - 1) / VL * VL, RVs = Mp / VL;
    const int64_t first_pos = offset + task.first, last_pos = offset + task.last - 1;
    const int32_t* table = tables + task.chunk * table_width;
    const int64_t row0 = starts[task.chunk] + task.first;

    // Q^T [dim][row], scaled; row m is position m / G, query head kv_head * G + m % G. Padding rows are zero
    // and sit at position -1, where they see no key.
    std::fill(s.qt.begin(), s.qt.begin() + D * Mp, 0.0f);
    for (int64_t m = 0; m < M; ++m) {
      const float* src = q + (row0 + m / G) * q_row_stride + (task.kv_head * G + m % G) * q_head_stride;
      for (int64_t d = 0; d < D; ++d) s.qt[d * Mp + m] = src[d] * scale;
    }
    for (int64_t m = 0; m < Mp; ++m) {
      s.pos[m] = m < M ? static_cast<float>(first_pos + m / G) : -1.0f;
      s.mx[m] = -INFINITY;
      s.den[m] = 0.0f;
    }
    std::fill(s.o.begin(), s.o.begin() + M * Dp, 0.0f);

    const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
    const vf neg_inf = vset1(-INFINITY);
    for (int64_t k0 = lo / KEY_TILE * KEY_TILE; k0 <= last_pos; k0 += KEY_TILE) {
      const int64_t nk = std::min<int64_t>(KEY_TILE, last_pos + 1 - k0);
      key_rows(k_base, table, task.kv_head, k0, nk, s.kpack.data(), s.zero.data(), s.krows.data());
      key_rows(v_base, table, task.kv_head, k0, nk, s.vpack.data(), s.zero.data(), s.vrows.data());

      for (int64_t j = 0; j < nk; j += QK_KEYS)
        for (int64_t rv = 0; rv < RVs; rv += QK_MAX_RV)
          with_count<QK_MAX_RV>(static_cast<int>(std::min<int64_t>(QK_MAX_RV, RVs - rv)), [&](auto nrv) {
            qk_tile<decltype(nrv)::value>(s.krows.data() + j, s.qt.data() + rv * VL, Mp, D,
                                          s.st.data() + j * Mp + rv * VL, Mp);
          });

      // Some row misses some key of this tile: past its position, or before its window.
      const bool masked = k0 + nk - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
      for (int64_t rv = 0; rv < RVs; ++rv) {
        float* col = s.st.data() + rv * VL;
        const vf posv = vload(s.pos.data() + rv * VL);
        vf tmax = neg_inf;
        for (int64_t j = 0; j < nk; ++j) {
          vf sc = vload(col + j * Mp);
          if (masked) {
            const vf kp = vset1(static_cast<float>(k0 + j));
            sc = keep_le(sc, kp, posv, neg_inf);                                    // key at or before the row
            if (window > 0) sc = keep_lt(sc, posv, vset1(static_cast<float>(k0 + j + window)), neg_inf);
            vstore(col + j * Mp, sc);
          }
          tmax = vmax(tmax, sc);
        }
        const vf old = vload(s.mx.data() + rv * VL);
        const vf mnew = vmax(old, tmax);
        const vf shift = keep_eq(vzero(), mnew, neg_inf, mnew);  // a row with no key yet: exp(-inf - 0) = 0
        const vf alpha = vexp(vsub(old, shift));
        vf sum = vzero();
        for (int64_t j = 0; j < nk; ++j) {
          const vf p = vexp(vsub(vload(col + j * Mp), shift));
          vstore(col + j * Mp, p);
          sum = vadd(sum, p);
        }
        vstore(s.den.data() + rv * VL, vfma(vload(s.den.data() + rv * VL), alpha, sum));
        vstore(s.mx.data() + rv * VL, mnew);
        vstore(s.alpha.data() + rv * VL, alpha);
      }

      for (int64_t m = 0; m < M; m += PV_ROWS)
        with_count<PV_ROWS>(static_cast<int>(std::min<int64_t>(PV_ROWS, M - m)), [&](auto nr) {
          constexpr int R = decltype(nr)::value;
          int64_t c = 0;
          for (; c + PV_COLS * VL <= Dp; c += PV_COLS * VL) {
            const float* vr[KEY_TILE];
            for (int64_t j = 0; j < nk; ++j) vr[j] = s.vrows[j] + c;
            pv_tile<R, PV_COLS>(s.st.data() + m, Mp, vr, nk, s.alpha.data() + m, s.o.data() + m * Dp + c, Dp);
          }
          for (; c < Dp; c += VL) {
            const float* vr[KEY_TILE];
            for (int64_t j = 0; j < nk; ++j) vr[j] = s.vrows[j] + c;
            pv_tile<R, 1>(s.st.data() + m, Mp, vr, nk, s.alpha.data() + m, s.o.data() + m * Dp + c, Dp);
          }
        });
    }

    for (int64_t m = 0; m < M; ++m) {
      float* dst = out + (row0 + m / G) * out_row_stride + (task.kv_head * G + m % G) * D;
      const float inv = s.den[m] > 0.0f ? 1.0f / s.den[m] : 0.0f;
      const float* o = s.o.data() + m * Dp;
      for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
    }
  }
};

template <typename T>
void prefill_kernel(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                    const at::Tensor& starts, const at::Tensor& lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = kv_cache.size(3), G = H / KVH;
  Prefill<T> p;
  p.q = q.data_ptr<float>();
  p.q_row_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k_base = kv_cache.data_ptr<T>();
  p.v_base = p.k_base + kv_cache.stride(0);
  p.block_size = kv_cache.size(2);
  p.block_stride = kv_cache.stride(1);
  p.token_stride = kv_cache.stride(2);
  p.head_stride = kv_cache.stride(3);
  p.tables = tables.data_ptr<int32_t>();
  p.table_width = tables.size(1);
  p.starts = starts.data_ptr<int32_t>();
  p.lens = lens.data_ptr<int32_t>();
  p.H = H;
  p.D = D;
  p.Dp = (D + VL - 1) / VL * VL;
  p.G = G;
  p.scale = static_cast<float>(scale);
  p.window = window;
  p.out = out.data_ptr<float>();
  p.out_row_stride = out.stride(0);

  const int64_t positions_per_task = std::max<int64_t>(1, TARGET_ROWS / G);
  std::vector<Task> tasks;
  for (int64_t c = 0; c + 1 < starts.size(0); ++c) {
    const int64_t n = p.starts[c + 1] - p.starts[c], offset = p.lens[c] - n;
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t first = 0; first < n; first += positions_per_task) {
        const int64_t last = std::min(n, first + positions_per_task);
        const int64_t keys = window > 0 ? std::min<int64_t>(offset + last, window + last - first) : offset + last;
        tasks.push_back({c, h, first, last, (last - first) * keys});
      }
  }
  if (tasks.empty()) return;
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });

  const int64_t rows = positions_per_task * G, rows_padded = (rows + VL - 1) / VL * VL;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(rows_padded, rows, D, p.Dp);
    for (int64_t w = begin; w < end; ++w)
      for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) p.run(tasks[t], scratch);
  });
}

void paged_attention_prefill(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                             int64_t window, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "paged_attention_prefill: q must be float32 [tokens, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention_prefill: kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  const bool int8_cache = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.size(4) == q.size(2) + (int8_cache ? KV_SCALE_BYTES : 0) && q.size(1) % kv_cache.size(3) == 0,
              "paged_attention_prefill: head_dim or head counts of q and kv_cache disagree");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == q.size(0) &&
                  out.size(1) == q.size(1) * q.size(2) && out.stride(1) == 1,
              "paged_attention_prefill: out must be float32 [tokens, heads * head_dim] with contiguous rows");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_starts.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "paged_attention_prefill: block_tables, query_starts and context_lens must be int32");
  const int64_t C = context_lens.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= C && query_starts.dim() == 1 &&
                  query_starts.size(0) == C + 1,
              "paged_attention_prefill: one block table row and one context length per chunk, chunks + 1 starts");
  auto tables = block_tables.contiguous();
  auto starts = query_starts.contiguous();
  auto lens = context_lens.contiguous();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t block_size = kv_cache.size(2), num_blocks = kv_cache.size(1);
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(sp[c] >= 0 && sp[c] <= sp[c + 1] && sp[c + 1] <= q.size(0),
                "paged_attention_prefill: query_starts must rise within q's rows");
    TORCH_CHECK(lp[c] >= sp[c + 1] - sp[c], "paged_attention_prefill: a context length is shorter than its chunk");
    const int64_t used = (lp[c] + block_size - 1) / block_size;
    TORCH_CHECK(used <= tables.size(1), "paged_attention_prefill: a context length exceeds its block table");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tp[c * tables.size(1) + b] >= 0 && tp[c * tables.size(1) + b] < num_blocks,
                  "paged_attention_prefill: a block id outside the cache");
  }
  if (kv_cache.scalar_type() == at::kFloat) {
    prefill_kernel<float>(q, kv_cache, tables, starts, lens, scale, window, out);
  } else if (int8_cache) {
    prefill_kernel<int8_t>(q, kv_cache, tables, starts, lens, scale, window, out);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16,
                "paged_attention_prefill: kv_cache must be float32, bfloat16 or int8");
    prefill_kernel<at::BFloat16>(q, kv_cache, tables, starts, lens, scale, window, out);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("paged_attention_prefill(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_starts, "
        "Tensor context_lens, float scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) {
  m.impl("paged_attention_prefill", &paged_attention_prefill);
}
