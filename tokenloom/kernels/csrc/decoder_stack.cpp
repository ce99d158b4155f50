// A step through a whole Llama-family decoder stack (Llama, Mistral, Qwen2, Qwen3) in one call
// (tokenloom/model/native_stack.py).
//
// Layer by layer from Python, a batch-1 decode step of the embedded model makes ~330 op calls: ~11 a layer
// (two add-and-norms, four quantized GEMMs, the QKV split, rotary, the cache write, attention, SiLU-and-mul).
// Their Python and dispatch cost was ~4 ms of a 13.7 ms step (py-spy: 16% of the samples in the layers'
// Python; ~2.5 us of dispatch a call). This op runs the same ops, in the same order, on the same inputs,
// from C++: each through the dispatcher (a fraction of a microsecond), so the hidden states are the layer-
// by-layer forward's bit for bit. It holds no weights: the caller passes them (lists built once at load).
// Any step: the flat batch's first `num_decodes` rows are decodes (one token each), the rest prefill chunks
// (each a run of rows, causal over its sequence's cache), attended as the native backend does
// (tokenloom/model/layers/attention_native.py): decodes by paged_attention_decode, chunks by
// paged_attention_prefill, after write_kv_cache has put the step's K/V in the cache.
//
// weights: per layer, in order, input norm, post-attention norm, then qkv, o, gate_up, down, each as the
// interleaved panels (qpacked, scales, mins). layer_ints: per layer, its sliding window (0: none), then per
// linear (n, bits, block_size, int8 activations 0/1). qkv_biases, q_norms, k_norms: one entry a layer, None
// where the layer has none: Qwen2's bias is added to the qkv projection's output as QuantizedWeight.linear
// adds it (add_), Qwen3's per-head RMSNorm runs on q and k before rotary as SelfAttention.forward runs it
// (rms_norm over each head's head_dim values).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "lora.h"
#include "quant_gemm.h"

namespace {

constexpr int64_t WEIGHTS_PER_LAYER = 14;     // 2 norms + 4 linears x (qpacked, scales, mins)
constexpr int64_t INTS_PER_LAYER = 1 + 4 * 4;  // window + 4 linears x (n, bits, block_size, a8)

using TensorCRef = const at::Tensor&;
using OptionalTensors = c10::List<c10::optional<at::Tensor>>;
using GemmFn = at::Tensor(TensorCRef, TensorCRef, TensorCRef, TensorCRef, int64_t, int64_t, int64_t);
using RmsNormFn = at::Tensor(TensorCRef, TensorCRef, double);
using AddRmsNormFn = std::tuple<at::Tensor, at::Tensor>(TensorCRef, TensorCRef, TensorCRef, double);
using RotaryFn = std::tuple<at::Tensor, at::Tensor>(TensorCRef, TensorCRef, TensorCRef, TensorCRef, TensorCRef);
using WriteKvFn = void(TensorCRef, TensorCRef, at::Tensor&, TensorCRef);
using DecodeFn = at::Tensor(TensorCRef, TensorCRef, TensorCRef, TensorCRef, double, int64_t);
using PrefillFn = void(TensorCRef, TensorCRef, TensorCRef, TensorCRef, TensorCRef, double, int64_t, at::Tensor&);
using SiluMulFn = at::Tensor(TensorCRef);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The ops this one runs, looked up once (the first call; every op's library is loaded by then).
struct Ops {
  c10::TypedOperatorHandle<GemmFn> gemm = find<GemmFn>("tokenloom::quant_gemm");
  c10::TypedOperatorHandle<GemmFn> gemm_a8 = find<GemmFn>("tokenloom::quant_gemm_a8");
  c10::TypedOperatorHandle<RmsNormFn> rms_norm = find<RmsNormFn>("tokenloom::rms_norm");
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm = find<AddRmsNormFn>("tokenloom::add_rms_norm");
  c10::TypedOperatorHandle<RotaryFn> rotary = find<RotaryFn>("tokenloom::rotary_embedding");
  c10::TypedOperatorHandle<WriteKvFn> write_kv = find<WriteKvFn>("tokenloom::write_kv_cache");
  c10::TypedOperatorHandle<DecodeFn> decode = find<DecodeFn>("tokenloom::paged_attention_decode");
  c10::TypedOperatorHandle<PrefillFn> prefill = find<PrefillFn>("tokenloom::paged_attention_prefill");
  c10::TypedOperatorHandle<SiluMulFn> silu_and_mul = find<SiluMulFn>("tokenloom::silu_and_mul");
};

constexpr int64_t LORA_TARGETS_PER_LAYER = 7;  // q, k, v, o, gate, up, down

// The step's LoRA adapters (tokenloom/lora/layer.py): per layer and target, the slot stacks A [slots, rank, in]
// and B [slots, rank, out] (None where no adapter may train the target) and the column where the target's
// output starts in its (fused) linear's output; the per-slot scaling and the rows grouped by slot, once for
// the step's 7 targets a layer. Inactive (no row_slots) when no row of the step uses an adapter.
//
// A layer's targets go in four passes (q, k and v; o; gate and up; down), called as plain C++ (csrc/lora.h),
// not through the dispatcher. With few adapter rows a pass runs inside the parallel region of the base matmul
// that reads the same input (csrc/side_work.h) and adds its sums to the output after it. On the embedded
// model at batch 1 with a rank-16 bfloat16 adapter (scripts/bench_lora_step.py, 2026-12-03): 210 calls through
// the dispatcher, each grouping the rows, added 1.3-1.7 ms to a ~5 ms step; 120 passes in regions of their own
// 0.6-1.4 ms; riding the matmuls 0.8-1.1 ms (before and after alternating).
class StepLora {
 public:
  StepLora(const OptionalTensors& a, const OptionalTensors& b, c10::IntArrayRef columns,
           const c10::optional<at::Tensor>& scaling, const c10::optional<at::Tensor>& row_slots, int64_t layers,
           int64_t rows) {
    if (!row_slots) return;
    const int64_t n = layers * LORA_TARGETS_PER_LAYER;
    TORCH_CHECK(scaling && scaling->scalar_type() == at::kFloat && scaling->dim() == 1 && scaling->is_contiguous(),
                "decoder_stack: LoRA rows need a contiguous float32 scaling [slots]");
    TORCH_CHECK(static_cast<int64_t>(a.size()) == n && static_cast<int64_t>(b.size()) == n &&
                    static_cast<int64_t>(columns.size()) == n,
                "decoder_stack: LoRA rows need, per layer, ", LORA_TARGETS_PER_LAYER,
                " entries of lora_a, lora_b and lora_columns");
    TORCH_CHECK(row_slots->size(0) == rows, "decoder_stack: one LoRA row slot a token");
    scaling_ = *scaling;
    plan_ = tokenloom_lora::plan_rows(*row_slots, scaling_.size(0));
    if (plan_.order.empty()) return;
    targets_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const c10::optional<at::Tensor> ai = a.get(i), bi = b.get(i);
      if (!ai) continue;
      TORCH_CHECK(bi && ai->dim() == 3 && bi->dim() == 3 && ai->is_contiguous() && bi->is_contiguous() &&
                      ai->scalar_type() == bi->scalar_type() && ai->size(0) == scaling_.size(0) &&
                      bi->size(0) == scaling_.size(0) && ai->size(1) == bi->size(1),
                  "decoder_stack: LoRA target ", i, " needs contiguous A [slots, rank, in] and B [slots, rank, out]");
      const at::ScalarType w = ai->scalar_type();
      TORCH_CHECK(w == at::kFloat || w == at::kBFloat16 || w == at::kHalf,
                  "decoder_stack: LoRA slots float32, bfloat16 or float16");
      // The lists own the tensors for the whole call.
      targets_[i] = Slots{ai->data_ptr(), bi->data_ptr(), w, ai->size(2), bi->size(2), ai->size(1), columns[i]};
    }
    active_ = true;
  }

  // A rank-split pass (few adapter rows) of targets [first, first + count) of layer l, to ride the base matmul
  // that computes their outputs from x; null when the step's rows take the block schedule, or none is trained.
  std::unique_ptr<tokenloom_lora::RankSplitPass> pass_for(TensorCRef x, int64_t l, int64_t first, int64_t count) {
    if (!active_ || !tokenloom_lora::takes_rank_split(plan_)) return nullptr;
    check_input(x);
    tokenloom_lora::Target targets[LORA_TARGETS_PER_LAYER];
    const int64_t n = gather(targets, nullptr, x, l, first, count);
    if (!n) return nullptr;
    return std::make_unique<tokenloom_lora::RankSplitPass>(plan_, targets, n, x.data_ptr<float>(), x.stride(0),
                                                           scaling_.data_ptr<float>());
  }

  // y += each row's adapter delta for targets [first, first + count) of layer l, as LoRALayer.add does after
  // the linear (after its bias); all of them read x. `pass`: the one pass_for gave for them, or null.
  void add(tokenloom_lora::RankSplitPass* pass, at::Tensor& y, TensorCRef x, int64_t l, int64_t first,
           int64_t count) {
    if (!active_) return;
    check_input(x);
    TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1,
                "decoder_stack: LoRA needs float32 output rows with unit column stride");
    tokenloom_lora::Target targets[LORA_TARGETS_PER_LAYER];
    const int64_t n = gather(targets, &y, x, l, first, count);
    if (!pass) return tokenloom_lora::add_targets(plan_, targets, n, x.data_ptr<float>(), x.stride(0),
                                                  scaling_.data_ptr<float>());
    pass->finish(targets);
  }

 private:
  static void check_input(TensorCRef x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                "decoder_stack: LoRA needs float32 input rows with unit column stride");
  }

  // The trained targets among [first, first + count) of layer l, writing into y's columns (y null: not known
  // yet); how many.
  int64_t gather(tokenloom_lora::Target* targets, at::Tensor* y, TensorCRef x, int64_t l, int64_t first,
                 int64_t count) const {
    int64_t n = 0;
    for (int64_t t = first; t < first + count; ++t) {
      const Slots& s = targets_[l * LORA_TARGETS_PER_LAYER + t];
      if (!s.a) continue;
      TORCH_CHECK(s.in == x.size(1) && (!y || s.column + s.out <= y->size(1)), "decoder_stack: LoRA target of layer ",
                  l, " does not fit its linear");
      targets[n++] = {y ? y->data_ptr<float>() + s.column : nullptr, y ? y->stride(0) : 0, s.a, s.b, s.dtype,
                      s.in, s.out, s.rank};
    }
    return n;
  }

  struct Slots {
    const void* a = nullptr;
    const void* b = nullptr;
    at::ScalarType dtype = at::kFloat;
    int64_t in = 0, out = 0, rank = 0, column = 0;
  };
  bool active_ = false;
  at::Tensor scaling_;
  tokenloom_lora::RowPlan plan_;
  std::vector<Slots> targets_;
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

// One quantized linear of a layer: its panels in `weights` from `w`, its ints in `ints` from `i`; `side`: work
// to run inside the matmul's parallel region (a LoRA pass of its targets), or null.
at::Tensor linear(const Ops& o, TensorCRef x, at::TensorList weights, int64_t w, c10::IntArrayRef ints, int64_t i,
                  tokenloom_side::SideWork* side = nullptr) {
  if (side)
    return tokenloom_gemm::quant_gemm_with(x, weights[w], weights[w + 1], weights[w + 2], ints[i], ints[i + 1],
                                           ints[i + 2], ints[i + 3] != 0, side);
  const auto& gemm = ints[i + 3] ? o.gemm_a8 : o.gemm;
  return gemm.call(x, weights[w], weights[w + 1], weights[w + 2], ints[i], ints[i + 1], ints[i + 2]);
}

// Where the step's rows attend: the native attention backend's metadata (NativeAttentionMetadata).
struct StepAttention {
  int64_t num_decodes;
  const c10::optional<at::Tensor>& decode_tables;
  const c10::optional<at::Tensor>& decode_lens;
  const c10::optional<at::Tensor>& prefill_tables;
  const c10::optional<at::Tensor>& prefill_starts;
  const c10::optional<at::Tensor>& prefill_lens;
};

// One layer's attention over its cache (already holding the step's K/V), as NativeAttention.__call__.
at::Tensor attend(const Ops& o, TensorCRef q, TensorCRef cache, const StepAttention& a, double scale, int64_t window) {
  const int64_t T = q.size(0), d = a.num_decodes;
  at::Tensor decoded;
  if (d) {
    decoded = o.decode.call(d == T ? q : q.narrow(0, 0, d), cache, *a.decode_tables, *a.decode_lens, scale, window);
    if (d == T) return decoded;
  }
  at::Tensor out = at::empty({T, q.size(1) * q.size(2)}, q.options());
  if (d) out.narrow(0, 0, d).copy_(decoded);
  o.prefill.call(q, cache, *a.prefill_tables, *a.prefill_starts, *a.prefill_lens, scale, window, out);
  return out;
}

// A list of per-layer optional tensors: one entry a layer, None where the layer has none.
void check_per_layer(const OptionalTensors& tensors, int64_t layers, const char* what) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers, "decoder_stack: one entry a layer in ", what,
              " (None where a layer has none)");
}

at::Tensor decoder_stack(TensorCRef embeddings, TensorCRef positions, at::TensorList weights,
                         c10::IntArrayRef layer_ints, const OptionalTensors& qkv_biases, const OptionalTensors& q_norms,
                         const OptionalTensors& k_norms, TensorCRef final_norm, TensorCRef cos, TensorCRef sin,
                         at::TensorList kv_caches, TensorCRef slot_mapping, int64_t num_decodes,
                         const c10::optional<at::Tensor>& decode_tables,
                         const c10::optional<at::Tensor>& decode_lens, const c10::optional<at::Tensor>& prefill_tables,
                         const c10::optional<at::Tensor>& prefill_starts, const c10::optional<at::Tensor>& prefill_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         const OptionalTensors& lora_a, const OptionalTensors& lora_b, c10::IntArrayRef lora_columns,
                         const c10::optional<at::Tensor>& lora_scaling,
                         const c10::optional<at::Tensor>& lora_row_slots) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * WEIGHTS_PER_LAYER,
              "decoder_stack: ", WEIGHTS_PER_LAYER, " weight tensors a layer, one KV cache a layer");
  TORCH_CHECK(static_cast<int64_t>(layer_ints.size()) == layers * INTS_PER_LAYER,
              "decoder_stack: ", INTS_PER_LAYER, " ints a layer");
  check_per_layer(qkv_biases, layers, "qkv_biases");
  check_per_layer(q_norms, layers, "q_norms");
  check_per_layer(k_norms, layers, "k_norms");
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.scalar_type() == at::kFloat,
              "decoder_stack: embeddings must be float32 [tokens, hidden]");
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= embeddings.size(0), "decoder_stack: num_decodes outside the batch");
  TORCH_CHECK(!num_decodes || (decode_tables && decode_lens), "decoder_stack: decodes need their tables and lengths");
  TORCH_CHECK(num_decodes == embeddings.size(0) || (prefill_tables && prefill_starts && prefill_lens),
              "decoder_stack: prefill rows need their chunks' tables, starts and lengths");
  const StepAttention step{num_decodes, decode_tables, decode_lens, prefill_tables, prefill_starts, prefill_lens};
  StepLora lora(lora_a, lora_b, lora_columns, lora_scaling, lora_row_slots, layers, embeddings.size(0));
  const Ops& o = ops();
  const int64_t T = embeddings.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = embeddings, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::TensorList w = weights.slice(l * WEIGHTS_PER_LAYER, WEIGHTS_PER_LAYER);
    const c10::IntArrayRef ints = layer_ints.slice(l * INTS_PER_LAYER, INTS_PER_LAYER);
    at::Tensor h;
    if (l == 0) {
      residual = x;
      h = o.rms_norm.call(x, w[0], eps);
    } else {
      std::tie(h, residual) = o.add_rms_norm.call(x, residual, w[0], eps);
    }
    auto qkv_pass = lora.pass_for(h, l, 0, 3);
    at::Tensor qkv = linear(o, h, w, 2, ints, 1, qkv_pass.get());
    const c10::optional<at::Tensor> qkv_bias = qkv_biases.get(l);
    if (qkv_bias) qkv.add_(*qkv_bias);
    lora.add(qkv_pass.get(), qkv, h, l, 0, 3);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    const c10::optional<at::Tensor> q_norm = q_norms.get(l), k_norm = k_norms.get(l);
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_stack: layer ", l,
                " has a norm on only one of q, k");
    if (q_norm) {
      q = o.rms_norm.call(q, *q_norm, eps);
      k = o.rms_norm.call(k, *k_norm, eps);
    }
    at::Tensor q_rot, k_rot;
    std::tie(q_rot, k_rot) = o.rotary.call(positions, q, k, cos, sin);
    at::Tensor cache = kv_caches[l];
    o.write_kv.call(k_rot, v, cache, slot_mapping);
    const at::Tensor attended = attend(o, q_rot, cache, step, scale, ints[0]);
    auto o_pass = lora.pass_for(attended, l, 3, 1);
    at::Tensor attn_out = linear(o, attended, w, 5, ints, 5, o_pass.get());
    lora.add(o_pass.get(), attn_out, attended, l, 3, 1);
    std::tie(h, residual) = o.add_rms_norm.call(attn_out, residual, w[1], eps);
    auto gate_up_pass = lora.pass_for(h, l, 4, 2);
    at::Tensor gate_up = linear(o, h, w, 8, ints, 9, gate_up_pass.get());
    lora.add(gate_up_pass.get(), gate_up, h, l, 4, 2);
    const at::Tensor activated = o.silu_and_mul.call(gate_up);
    auto down_pass = lora.pass_for(activated, l, 6, 1);
    x = linear(o, activated, w, 11, ints, 13, down_pass.get());
    lora.add(down_pass.get(), x, activated, l, 6, 1);
  }
  if (layers == 0) return o.rms_norm.call(x, final_norm, eps);
  return std::get<0>(o.add_rms_norm.call(x, residual, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom, m) {
  m.def("decoder_stack(Tensor embeddings, Tensor positions, Tensor[] weights, int[] layer_ints, Tensor?[] qkv_biases, "
        "Tensor?[] q_norms, Tensor?[] k_norms, Tensor final_norm, Tensor cos, Tensor sin, Tensor(a!)[] kv_caches, "
        "Tensor slot_mapping, int num_decodes, Tensor? decode_tables, Tensor? decode_lens, Tensor? prefill_tables, "
        "Tensor? prefill_starts, Tensor? prefill_lens, int num_heads, int num_kv_heads, int head_dim, float eps, "
        "float scale, Tensor?[] lora_a, Tensor?[] lora_b, int[] lora_columns, Tensor? lora_scaling, "
        "Tensor? lora_row_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom, CPU, m) { m.impl("decoder_stack", &decoder_stack); }
