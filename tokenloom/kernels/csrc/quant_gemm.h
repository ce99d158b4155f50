// The quantized matmul as plain C++ (csrc/quant_gemm.cpp), for the decoder stack to hand it side work.
#pragma once

#include <ATen/ATen.h>

#include "side_work.h"

namespace tokenloom_gemm {

// `tokenloom::quant_gemm` (int8_activations false) or `tokenloom::quant_gemm_a8` (true); `side`'s items run
// inside the matmul's first parallel region, its threads claiming them before their tiles. The caller runs
// what is left (side->run()) after the call: a matmul with no region leaves all of it.
at::Tensor quant_gemm_with(const at::Tensor& x, const at::Tensor& qpacked, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t n, int64_t bits, int64_t block, bool int8_activations,
                           tokenloom_side::SideWork* side);

}  // namespace tokenloom_gemm
