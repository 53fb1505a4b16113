import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias (nn.Linear's contract; cuBLAS or MKL through torch). `packed` is what
    `pack_linear_weight` made of this weight: a faster backend's copy, which torch ignores."""
    return F.linear(x, weight, bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A backend's copy of a linear's weight in the layout its matmul prefers, made once at load;
    None where the backend has none (torch: it multiplies the plain weight)."""
    return None


def bf16_weight_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """x @ weight^T for fp32 x and a bf16 weight, in bf16 matmuls (x rounded to bf16, fp32
    accumulation; oneDNN's matrix units on CPUs that have them), the result in bf16. `packed`
    is what `pack_bf16_weight` made of the weight. Each entry is within
    2^-8 |w_j|.|x| + 2^-9 |y_j| (plus fp32 accumulation) of the exact dot product."""
    return F.linear(x.to(torch.bfloat16), weight)


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A backend's copy of a bf16 weight for bf16_weight_linear; None for torch's."""
    return None
