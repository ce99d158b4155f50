// The mixed-batch LoRA pass as plain C++ (csrc/lora.cpp): what the `tokenloom::lora_add` op runs for one
// target, and what the decoder stack (csrc/decoder_stack.cpp) calls directly for a layer's targets, with the
// rows grouped once a step instead of once a call.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "side_work.h"

namespace tokenloom_lora {

// Up to ROW_BLOCK rows of one slot, `first` indexing the slot-sorted row order.
struct Block {
  int32_t slot;
  int32_t first;
  int32_t rows;
};

// A step's rows grouped by slot (stable), base-model rows (slot -1) dropped, cut into blocks of one slot.
// Every target of the step shares it; `scratch` is the passes' working memory, reused target after target.
struct RowPlan {
  std::vector<int32_t> order;
  std::vector<Block> blocks;
  std::vector<float> scratch;
  int64_t rows = 0;
  int64_t slots = 0;
};

// row_slots: int32 [rows], each -1 (base model) or a slot below `slots`.
RowPlan plan_rows(const at::Tensor& row_slots, int64_t slots);

// One target's operands. a [slots, rank, in] and b [slots, rank, out] contiguous, both of `dtype` (float32,
// bfloat16 or float16); y a float32 [rows, >= out] view with row stride y_stride.
struct Target {
  float* y;
  int64_t y_stride;
  const void* a;
  const void* b;
  at::ScalarType dtype;
  int64_t in;
  int64_t out;
  int64_t rank;
};

// The most targets one pass takes (a layer's q, k and v).
constexpr int64_t MAX_PASS_TARGETS = 3;

// y[t] += scaling[s] * (x[t] @ a[s].T) @ b[s] for every planned row t (slot s) and each of `count` (at most
// MAX_PASS_TARGETS) targets reading the same x (float32 [rows, in], row stride x_stride).
void add_targets(RowPlan& plan, const Target* targets, int64_t count, const float* x, int64_t x_stride,
                 const float* scaling);

// Whether a pass over these rows takes the rank-split schedule (few rows): then a RankSplitPass can ride the
// base matmul's parallel region.
bool takes_rank_split(const RowPlan& plan);

// A rank-split pass of `count` targets reading x: its items (each target's two rank halves) write their sums
// aside, so they may run while the targets' outputs are being computed (their y may be null then); `finish`
// runs what no thread claimed, then adds the sums to the outputs: the same targets, their y now set.
class RankSplitPass : public tokenloom_side::SideWork {
 public:
  RankSplitPass(RowPlan& plan, const Target* targets, int64_t count, const float* x, int64_t x_stride,
                const float* scaling);
  void finish(const Target* outputs);

 protected:
  void run_item(int64_t item) override;

 private:
  RowPlan& plan_;
  std::vector<Target> targets_;
  std::vector<int64_t> offsets_;
  const float* x_;
  int64_t x_stride_;
  const float* scaling_;
};

}  // namespace tokenloom_lora
