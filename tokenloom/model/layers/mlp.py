import torch
from torch import nn

from tokenloom.kernels import layer_ops
from tokenloom.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one matmul.

    Tensor parallel: each rank holds a slice of the intermediate features (gate/up column-parallel,
    down row-parallel), so one all-reduce per MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, {"gate": intermediate_size,
                                                                     "up": intermediate_size})
        self.intermediate_size = self.gate_up_proj.offsets["up"][1]  # this rank's share
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * this rank's share]: gate then up
        if layer_ops.native(gate_up):
            return self.down_proj(torch.ops.tokenloom.silu_and_mul(gate_up))
        return self.down_proj(layer_ops.silu_and_mul_reference(gate_up))
