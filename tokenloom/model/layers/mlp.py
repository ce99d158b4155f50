import torch
import torch.nn.functional as F

from tokenloom.kernels import layer_ops
from tokenloom.model.arch_config import UnsupportedModelError
from tokenloom.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenloom.model.layers.module import InferenceModule

# The gate's activation by HF config name (hidden_act / hidden_activation).
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(InferenceModule):
    """Gated feed-forward: down(act(gate(x)) * up(x)), gate and up in one matmul; SwiGLU by default, Gemma's
    GeLU(tanh) with activation="gelu_pytorch_tanh".

    Tensor parallel: each rank holds a slice of the intermediate features (gate/up column-parallel,
    down row-parallel), so one all-reduce per MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported MLP activation {activation!r} (supported: "
                                        f"{', '.join(ACTIVATIONS)})")
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, {"gate": intermediate_size,
                                                                     "up": intermediate_size})
        self.intermediate_size = self.gate_up_proj.offsets["up"][1]  # this rank's share
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * this rank's share]: gate then up
        if self.activation == "silu":
            if layer_ops.native(gate_up):
                return self.down_proj(torch.ops.tokenloom.silu_and_mul(gate_up))
            return self.down_proj(layer_ops.silu_and_mul_reference(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
