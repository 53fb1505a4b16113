"""oneDNN's fp32 matmul on weights pre-arranged once into its blocked layout.

torch reaches oneDNN's linear only through two private ops, the ones Inductor's CPU backend
packs frozen weights with: `mkldnn::_reorder_linear_weight` (a one-time copy of the weight in
oneDNN's layout) and `mkldnn::_linear_pointwise` (the matmul on it, bias fused). On the AMD EPYC
this is 20-40% faster than MKL's sgemm on the same plain weights from 8 rows up (the default
model's linears at 256 rows: 367 against 583 ms); kernels/linear_rows.py measures whether it
wins on the machine at hand. The torch range in setup.py pins the ops' signatures; the tests
call them, so a change shows there.
"""

import torch


def available() -> bool:
    return torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 [out, in] weight in oneDNN's blocked layout: an opaque tensor for `linear` only,
    as large as the weight (a second copy: the plain one still serves the few-row kernel)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight^T + bias, the weight as `pack` left it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
