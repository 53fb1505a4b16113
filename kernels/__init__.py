"""Compute ops. Each op has a torch implementation, the reference for the Triton kernels
(kernels/triton/) that run CUDA tensors and for the C++ kernels (kernels/cpu_kernels.py) that
run CPU tensors. kernels/backend.py picks one per call, by device (and BATCHGEN_CPU_KERNELS);
`prepare(device)` builds the C++ kernels ahead of use."""

from kernels import activation, attention, cpu_kernels as cpp, matmul, moe, norm, rope, sampling
from kernels.backend import TRITON_DTYPES, bf16_matmul_is_fast, decode_stack_runs, dispatch, prepare
from kernels.cpu_kernels import KernelBuildError, decode_stack  # decode_stack: CPU only
from kernels.moe import route  # softmax and top-k: torch's own kernels on every device

add_rms_norm = dispatch(norm.add_rms_norm, cpp.add_rms_norm)
apply_rope = dispatch(rope.apply_rope, cpp.apply_rope)
argmax = dispatch(sampling.argmax, cpp.argmax, triton=False)
bf16_weight_linear = dispatch(matmul.bf16_weight_linear, cpp.bf16_weight_linear, triton=False)
# GeGLU: torch's own GELU kernels on every device (no C++ or Triton kernel of ours).
gelu_and_mul = dispatch(activation.gelu_and_mul, triton=False)
gelu_tanh_and_mul = dispatch(activation.gelu_tanh_and_mul, triton=False)
expert_ffn = dispatch(moe.expert_ffn, cpp.expert_ffn, triton=False)  # streamed experts (CPU)
grouped_experts = dispatch(moe.grouped_experts, cpp.grouped_experts)
linear = dispatch(matmul.linear, cpp.linear, triton=False)
pack_bf16_weight = dispatch(matmul.pack_bf16_weight, cpp.pack_bf16_weight, triton=False)
pack_linear_weight = dispatch(matmul.pack_linear_weight, cpp.pack_linear_weight, triton=False)
paged_decode_attention = dispatch(attention.paged_decode_attention, cpp.paged_decode_attention)
paged_prefill_attention = dispatch(attention.paged_prefill_attention)
rms_norm = dispatch(norm.rms_norm, cpp.rms_norm)
# Gemma's norms in bf16 / fp16 (in fp32 they are rms_norm): torch's kernels on every device.
rms_norm_fp32_scale = dispatch(norm.rms_norm_fp32_scale, triton=False)
silu_and_mul = dispatch(activation.silu_and_mul, cpp.silu_and_mul)
write_kv = dispatch(attention.write_kv, cpp.write_kv)

__all__ = [
    "add_rms_norm",
    "apply_rope",
    "argmax",
    "bf16_matmul_is_fast",
    "bf16_weight_linear",
    "decode_stack",
    "decode_stack_runs",
    "expert_ffn",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "grouped_experts",
    "KernelBuildError",
    "linear",
    "pack_bf16_weight",
    "pack_linear_weight",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepare",
    "rms_norm",
    "rms_norm_fp32_scale",
    "route",
    "silu_and_mul",
    "TRITON_DTYPES",
    "write_kv",
]
