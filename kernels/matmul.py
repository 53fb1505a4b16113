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
