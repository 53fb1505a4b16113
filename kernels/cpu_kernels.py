"""The C++ kernels for CPU tensors (kernels/csrc/): paged decode attention, the few-row linear
of decode steps (and its grouped form for MoE experts), and the per-token ops of a decoder
layer (RMSNorm, RMSNorm with the residual add, RoPE, SiLU-and-mul), each with the contract of
its torch op.

torch's extension loader JIT-builds them into one module on first use (about a minute; needs
g++, ninja and the Python headers) and caches the build in TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), so later processes only load it. A failed build raises
KernelBuildError: the torch ops are an explicit opt-out (BATCHGEN_CPU_KERNELS=torch), never a
silent fallback.
"""

import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import linear_rows, moe, norm, onednn

SOURCES = [Path(__file__).parent / "csrc" / name for name in
           ("bindings.cpp", "paged_decode_attention.cpp", "small_rows_linear.cpp", "pointwise.cpp")]
_module = None
_lock = threading.Lock()  # engines may first step on different threads: build once


class KernelBuildError(RuntimeError):
    """The C++ CPU kernels could not be built."""


def _simd_flags() -> list[str]:
    """The widest of AVX-512 and AVX2 + FMA this CPU has (the build is cached per machine's home)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    except FileNotFoundError:  # not Linux: build for the compiler's default target
        return []
    chosen = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else []
    return chosen + (["-mavx512f"] if chosen and "avx512f" in flags else [])


def _load():
    from torch.utils import cpp_extension
    try:
        return cpp_extension.load(name="batchgen_cpu_kernels", sources=[str(s) for s in SOURCES],
                                  extra_cflags=["-O3", "-fopenmp", *_simd_flags()],
                                  extra_ldflags=["-fopenmp"])
    except Exception as error:
        raise KernelBuildError(
            f"building the C++ CPU kernels ({SOURCES[0].parent}) failed: {error}. They need g++, "
            "ninja and the Python headers; or set BATCHGEN_CPU_KERNELS=torch to run the torch "
            "implementations instead") from error


def build():
    """The compiled extension module, built (or loaded from the cache) on the first call."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                _module = _load()
    return _module


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None) -> torch.Tensor:
    """kernels.attention.paged_decode_attention, reading the cache in place; block table entries
    past a sequence's context are never read, so any padding value works."""
    return build().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          sliding_window)


def linear_plan() -> linear_rows.Plan:
    """Which fp32 linears the C++ kernel takes on this machine and which sgemm takes the others
    (kernels/linear_rows.py: measured once per process)."""
    return linear_rows.plan(lambda x, weight: build().small_rows_linear(x, weight, None))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """kernels.matmul.pack_linear_weight: where oneDNN is this machine's sgemm, an fp32 weight in
    its blocked layout (a second copy of the weight); else None."""
    if weight.dim() == 2 and weight.dtype == torch.float32 and linear_plan().sgemm == "onednn":
        return onednn.pack(weight)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.matmul.linear: for fp32 [rows, in] inputs the C++ kernel at the row counts it
    takes, else oneDNN on `packed` where given; MKL's sgemm (torch) otherwise."""
    if x.dim() == 2 and x.dtype == weight.dtype == torch.float32:
        if x.shape[0] in linear_plan().kernel_rows:
            return build().small_rows_linear(x, weight, bias)
        if packed is not None:
            return onednn.linear(x, packed, bias)
    return F.linear(x, weight, bias)


def expert_ffn(rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """kernels.moe.expert_ffn: in C++ where no expert has more rows than
    `linear_plan().expert_rows` holds (decode steps: a few tokens per expert), torch's grouped
    matmul otherwise."""
    if (rows.dtype == gate_up_proj.dtype == torch.float32 and len(rows)
            and int(counts.max()) < linear_plan().expert_rows.stop):
        module = build()
        up = module.grouped_small_rows_linear(rows, gate_up_proj, counts)
        return module.grouped_small_rows_linear(module.silu_and_mul(up), down_proj, counts)
    return moe.expert_ffn(rows, gate_up_proj, down_proj, counts)


def grouped_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.moe.grouped_experts with the experts run by `expert_ffn` above."""
    return moe.grouped_experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, ffn=expert_ffn)


# The norms' C++ kernels take weights of the activations' dtype, as the engine keeps them; a
# weight of another dtype promotes the output (transformers' fp32 norm weights on bf16
# activations), which the torch op does.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != weight.dtype:
        return norm.rms_norm(x, weight, eps)
    return build().rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype != weight.dtype:
        return norm.add_rms_norm(x, residual, weight, eps)
    return build().add_rms_norm(x, residual, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return build().apply_rope(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return build().silu_and_mul(gate_up)
