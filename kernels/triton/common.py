"""What the Triton kernels share: the launch check, tile sizes and the fp32-accumulating dot."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.backend import TRITON_DTYPES

# Fixed when the kernels are decorated: from here on they are interpreted, or compiled for a GPU.
INTERPRETED = triton.knobs.runtime.interpret


def check_launchable(tensor: torch.Tensor) -> None:
    """Triton runs CPU tensors only in its interpreter: say so instead of '0 active drivers'."""
    if tensor.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("Triton kernels run CPU tensors only under TRITON_INTERPRET=1, set "
                           "before kernels.triton is first imported")


@dataclass(frozen=True)
class Tiles:
    """A kernel's launch shape: at most max_block_m rows per program (fewer rows take the
    smallest tile covering them), block_n columns (or cached positions) and block_k reduction
    elements per step, num_warps warps."""
    max_block_m: int
    block_n: int
    block_k: int = 0
    num_warps: int = 4

    def block_m(self, rows: int) -> int:
        return tile(min(rows, self.max_block_m), at_least=16)


def tiles_for(table: dict[torch.dtype, Tiles], dtype: torch.dtype) -> Tiles:
    """A kernel's tiles for inputs of `dtype`, from its table (one entry per TRITON_DTYPES)."""
    if dtype not in table:
        raise NotImplementedError(f"the Triton kernels run {', '.join(map(str, TRITON_DTYPES))}, not {dtype}")
    return table[dtype]


def tile(n: int, at_least: int = 1) -> int:
    """The power-of-two tile covering n (tl.arange needs one); tl.dot needs at least 16."""
    return max(at_least, triton.next_power_of_2(n))


def dot_dtype(dtype: torch.dtype):
    """tl.dot's operand type for inputs of `dtype`.

    A product of two fp16 or bf16 values is exact in fp32, so half-precision inputs go to the
    tensor cores as they are and accumulate in fp32; fp32 inputs stay true fp32 (not TF32,
    which torch does not default to either). The interpreter's bf16 arithmetic is wrong, so
    there bf16 is widened to fp32.
    """
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not INTERPRETED:
        return tl.bfloat16
    return tl.float32


@triton.jit
def dot(a, b, DTYPE: tl.constexpr):
    """a @ b with operands in DTYPE, accumulated in fp32."""
    if DTYPE == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(DTYPE), b.to(DTYPE))
    return out
