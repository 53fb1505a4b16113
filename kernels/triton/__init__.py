"""Triton kernels for the ops of `kernels`, same names and signatures, computing in fp32 (half
inputs are loaded as they are, widened, and stored back in their dtype).

Meant for CUDA tensors, which `kernels` routes here (kernels/backend.py). Importing this package
imports triton; under TRITON_INTERPRET=1 (set before the import) the kernels also run CPU
tensors, in triton's interpreter: slow, for tests.
"""

from kernels.triton.activation import silu_and_mul
from kernels.triton.attention import paged_decode_attention, paged_prefill_attention, write_kv
from kernels.triton.moe import grouped_experts
from kernels.triton.norm import add_rms_norm, rms_norm
from kernels.triton.rope import apply_rope

__all__ = [
    "add_rms_norm",
    "apply_rope",
    "grouped_experts",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]
