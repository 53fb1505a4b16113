import torch
import triton
import triton.language as tl

from kernels.triton.common import check_launchable


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, size, x_stride, residual_stride, eps,
                     ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    values = tl.load(x + row * x_stride + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # Rounded to the input dtype before normalising, as the unfused add would be.
        values = (values.to(tl.float32) + tl.load(residual + row * residual_stride + cols, mask=mask,
                                                  other=0.0).to(tl.float32)).to(values.dtype)
        tl.store(residual_out + row * size + cols, values, mask=mask)
    values = values.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(values * values, axis=0) / size + eps)
    # Normalised, cast back to the input dtype, then scaled by the weight: transformers' order.
    normed = (values * rstd).to(x.dtype.element_ty).to(tl.float32)
    scaled = tl.load(weight + cols, mask=mask).to(tl.float32) * normed
    tl.store(out + row * size + cols, scaled.to(out.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(x, residual, weight, eps):
    check_launchable(x)
    weight = weight.contiguous()  # read as a dense vector
    size = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    # Without a residual the kernel never touches residual/residual_out: x and out stand in.
    residual_rows = _rows(residual) if residual is not None else rows
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, residual_out, size, rows.stride(0),
            residual_rows.stride(0), eps, ADD_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(size))
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (kernels.norm.rms_norm)."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add fused into RMSNorm (kernels.norm.add_rms_norm)."""
    return _launch(x, residual, weight, eps)
