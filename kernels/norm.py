import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (as transformers' Llama does)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x + residual) and the sum itself, the next residual (one pass on a GPU)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rms_norm_fp32_scale(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose fp32 scale multiplies the fp32 normalised x, rounded once to x's dtype:
    transformers' Gemma norms (x * (1 + weight.float())), where Llama's round x first."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)
