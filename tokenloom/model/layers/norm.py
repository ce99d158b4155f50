import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as in the HF reference implementations."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in float32 before the cast back (HF's Gemma3RMSNorm; the
    order of the multiply and the cast differs from Llama's and moves float16/bfloat16 outputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
