import torch
import triton
import triton.language as tl

from kernels.triton.common import check_launchable


@triton.jit
def _silu_and_mul_kernel(gate_up, out, size, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up + row * row_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(gate_up + row * row_stride + size + cols, mask=mask).to(tl.float32)
    tl.store(out + row * size + cols, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up on the halves of the last dim (kernels.activation.silu_and_mul)."""
    check_launchable(gate_up)
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], size, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(size))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](
            rows, out, size, rows.stride(0), BLOCK=block)
    return out
