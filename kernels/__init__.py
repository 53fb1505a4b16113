"""Compute ops. Each op has a torch implementation: the CPU path and the reference for the
Triton kernels (kernels/triton/) that run CUDA tensors. kernels/backend.py picks one per call,
by device."""

from kernels import activation, attention, moe, norm, rope
from kernels.backend import dispatch
from kernels.moe import route  # softmax and top-k: torch's own kernels on every device

add_rms_norm = dispatch(norm.add_rms_norm)
apply_rope = dispatch(rope.apply_rope)
grouped_experts = dispatch(moe.grouped_experts)
paged_decode_attention = dispatch(attention.paged_decode_attention)
paged_prefill_attention = dispatch(attention.paged_prefill_attention)
rms_norm = dispatch(norm.rms_norm)
silu_and_mul = dispatch(activation.silu_and_mul)
write_kv = dispatch(attention.write_kv)

__all__ = [
    "add_rms_norm",
    "apply_rope",
    "grouped_experts",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "route",
    "silu_and_mul",
    "write_kv",
]
