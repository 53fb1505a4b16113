"""Compute ops. Each op has a torch implementation: the CPU path and the reference for the
Triton kernels (kernels/triton/) that run CUDA tensors and for the C++ paged decode attention
(kernels/cpu_attention.py) that runs CPU tensors. kernels/backend.py picks one per call, by
device (and BATCHGEN_CPU_ATTENTION); `prepare(device)` builds the C++ kernel ahead of use."""

from kernels import activation, attention, cpu_attention, moe, norm, rope
from kernels.backend import dispatch, prepare
from kernels.cpu_attention import KernelBuildError
from kernels.moe import route  # softmax and top-k: torch's own kernels on every device

add_rms_norm = dispatch(norm.add_rms_norm)
apply_rope = dispatch(rope.apply_rope)
grouped_experts = dispatch(moe.grouped_experts)
paged_decode_attention = dispatch(attention.paged_decode_attention,
                                  cpu_attention.paged_decode_attention)
paged_prefill_attention = dispatch(attention.paged_prefill_attention)
rms_norm = dispatch(norm.rms_norm)
silu_and_mul = dispatch(activation.silu_and_mul)
write_kv = dispatch(attention.write_kv)

__all__ = [
    "add_rms_norm",
    "apply_rope",
    "grouped_experts",
    "KernelBuildError",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepare",
    "rms_norm",
    "route",
    "silu_and_mul",
    "write_kv",
]
