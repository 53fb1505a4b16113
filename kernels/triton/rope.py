import torch
import triton
import triton.language as tl

from kernels.triton.common import check_launchable


@triton.jit
def _rope_kernel(x, cos, sin, out, heads, x_token_stride, x_head_stride, table_stride,
                 HALF: tl.constexpr, PASS: tl.constexpr, HEADS_TILE: tl.constexpr,
                 HALF_TILE: tl.constexpr, PASS_TILE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_TILE)[:, None]
    col = tl.arange(0, HALF_TILE)[None, :]
    mask = (head < heads) & (col < HALF)
    head_src = x + token * x_token_stride + head * x_head_stride
    head_dst = out + (token * heads + head) * (2 * HALF + PASS)
    src = head_src + col
    first = tl.load(src, mask=mask).to(tl.float32)
    second = tl.load(src + HALF, mask=mask).to(tl.float32)
    table = token * table_stride + col
    cos_first = tl.load(cos + table, mask=col < HALF).to(tl.float32)
    cos_second = tl.load(cos + table + HALF, mask=col < HALF).to(tl.float32)
    sin_first = tl.load(sin + table, mask=col < HALF).to(tl.float32)
    sin_second = tl.load(sin + table + HALF, mask=col < HALF).to(tl.float32)
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = (-second, first)
    dst = head_dst + col
    tl.store(dst, (first * cos_first - second * sin_first).to(out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (second * cos_second + first * sin_second).to(out.dtype.element_ty), mask=mask)
    if PASS > 0:  # partial rotary: the dims past the rotary ones are copied
        rest = tl.arange(0, PASS_TILE)[None, :]
        rest_mask = (head < heads) & (rest < PASS)
        kept = tl.load(head_src + 2 * HALF + rest, mask=rest_mask)
        tl.store(head_dst + 2 * HALF + rest, kept.to(out.dtype.element_ty), mask=rest_mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation rotary embedding over cos's width of each head's first dims
    (kernels.rope.apply_rope); x may be a strided view such as q out of the packed qkv
    projection."""
    check_launchable(x)
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    rotary = cos.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if tokens:
        _rope_kernel[(tokens,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                                HALF=rotary // 2, PASS=head_dim - rotary,
                                HEADS_TILE=triton.next_power_of_2(heads),
                                HALF_TILE=triton.next_power_of_2(max(rotary // 2, 1)),
                                PASS_TILE=triton.next_power_of_2(max(head_dim - rotary, 1)))
    return out
