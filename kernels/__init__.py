"""Compute ops. Each op has a torch implementation: the CPU path and the reference for any
accelerator kernel."""

from kernels.activation import silu_and_mul
from kernels.attention import paged_decode_attention, paged_prefill_attention, write_kv
from kernels.moe import grouped_experts, route
from kernels.norm import add_rms_norm, rms_norm
from kernels.rope import apply_rope

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
