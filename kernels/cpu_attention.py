"""The C++ paged decode attention for CPU tensors (kernels/csrc/paged_decode_attention.cpp).

torch's extension loader JIT-builds it on first use (about 25 s; needs g++, ninja and the Python
headers) and caches the build in TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so
later processes only load it. A failed build raises KernelBuildError: the torch implementation
is an explicit opt-out (BATCHGEN_CPU_ATTENTION=torch), never a silent fallback.
"""

import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_module = None
_lock = threading.Lock()  # engines may first step on different threads: build once


class KernelBuildError(RuntimeError):
    """The C++ CPU attention kernel could not be built."""


def _simd_flags() -> list[str]:
    """-mavx2 -mfma where this CPU has both (the build is cached per machine's home)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    except FileNotFoundError:  # not Linux: build for the compiler's default target
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags) else []


def _load():
    from torch.utils import cpp_extension
    try:
        return cpp_extension.load(name="batchgen_paged_decode_attention", sources=[str(SOURCE)],
                                  extra_cflags=["-O3", "-fopenmp", *_simd_flags()],
                                  extra_ldflags=["-fopenmp"])
    except Exception as error:
        raise KernelBuildError(
            f"building the C++ CPU attention kernel ({SOURCE}) failed: {error}. It needs g++, "
            "ninja and the Python headers; or set BATCHGEN_CPU_ATTENTION=torch to run the torch "
            "implementation instead") from error


def build():
    """The compiled extension module, built (or loaded from the cache) on the first call."""
    global _module
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
