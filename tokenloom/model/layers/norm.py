"""RMSNorm, optionally fused with the residual add before it (`norm(x, residual)`), as each decoder layer
boundary does: one native call instead of an add and five torch ops when the kernels are loaded."""
import torch
from torch import nn

from tokenloom.kernels import layer_ops
from tokenloom.model.layers.module import InferenceModule


class RMSNorm(InferenceModule):
    """RMSNorm computed in float32, as in the HF reference implementations."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: (norm(x + residual), x + residual)."""
        weight = self.weight  # read once: a parameter is found through nn.Module.__getattr__
        if weight.dtype == torch.float32 and layer_ops.native(x):
            if residual is None:
                return torch.ops.tokenloom.rms_norm(x, weight, self.eps)
            return torch.ops.tokenloom.add_rms_norm(x, residual, weight, self.eps)
        if residual is None:
            return layer_ops.rms_norm_reference(x, weight, self.eps)
        return layer_ops.add_rms_norm_reference(x, residual, weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in float32 before the cast back (HF's Gemma3RMSNorm; the
    order of the multiply and the cast differs from Llama's and moves float16/bfloat16 outputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
