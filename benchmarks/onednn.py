"""oneDNN's fp32 matmul on weights pre-arranged once into its blocked layout.

torch reaches oneDNN's linear only through two private ops, the ones Inductor's CPU backend
packs frozen weights with: `mkldnn::_reorder_linear_weight` (a one-time copy of the weight in
oneDNN's layout) and `mkldnn::_linear_pointwise` (the matmul on it, bias fused). On the AMD EPYC
this is 20-40% faster than MKL's sgemm on the same plain weights from 8 rows up (the default
model's linears at 256 rows: 367 against 583 ms). The engine does not use it (its panel kernel,
kernels/csrc/panel_linear.cpp, is as fast or faster on the same kind of packed copy); the
benchmarks do, as part of this machine's sgemm peak (mfu.py) and as a reference row in
cpu_kernels_micro.py. The torch range in setup.py pins the ops' signatures; the tests call
them, so a change shows there.
"""

import functools

import torch


@functools.cache
def available() -> bool:
    """This torch has oneDNN and both ops run (a build for another CPU may lack either)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(2, 2)
        return torch.equal(linear(torch.ones(1, 2), pack(weight)), torch.full((1, 2), 2.0))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 [out, in] weight in oneDNN's blocked layout: an opaque tensor for `linear` only,
    as large as the weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight^T + bias, the weight as `pack` left it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
