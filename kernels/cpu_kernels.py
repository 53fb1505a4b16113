"""The C++ kernels for CPU tensors (kernels/csrc/): paged decode attention, the linear on
weights packed into panels, the few-row linear on plain weights (and its grouped form for MoE
experts), and the per-token ops of a decoder layer (RMSNorm, RMSNorm with the residual add,
RoPE, SiLU-and-mul, the KV cache write) and the greedy argmax over a step's logits, each with
the contract of its torch op; and `decode_stack`, a dense decoder stack's decode step through
those kernels in one call.

torch's extension loader JIT-builds them into one module on first use (about a minute; needs
g++, ninja and the Python headers) and caches the build in TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions; one directory per Python and torch version and checkout), so later
processes only load it. Processes take turns at the build through an OS file lock, which dies
with its holder: torch's own lock is a file that a process killed mid-build leaves behind, and
every later load then waited on it forever. A build directory this process cannot write (one
built into a container image that runs read-only or as another user) is copied, with its files'
times, into this user's own folder under the temp folder first, whole or not at all: ninja finds
the copy up to date and only loads it (or rebuilds there if the sources changed). A failed build raises KernelBuildError: the torch ops are
an explicit opt-out (BATCHGEN_CPU_KERNELS=torch), never a silent fallback.
"""

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import linear_rows, matmul, moe, norm, sampling

SOURCES = [Path(__file__).parent / "csrc" / name for name in
           ("bindings.cpp", "decode_stack.cpp", "paged_decode_attention.cpp", "panel_linear.cpp",
            "small_rows_linear.cpp", "pointwise.cpp")]
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


def build_directory() -> Path:
    """Where the build is cached: one per Python and torch version, as torch's default is, and
    per checkout (two checkouts sharing one would rebuild over each other's sources)."""
    from torch.utils import cpp_extension
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    checkout = hashlib.sha1(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]
    # torch reads TORCH_EXTENSIONS_DIR only where it picks the directory itself.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"batchgen_cpu_kernels-{version}-{checkout}"


def _load():
    import ninja
    from torch.utils import cpp_extension

    directory = build_directory()
    path = os.environ.get("PATH")
    try:
        if directory.is_dir() and not os.access(directory, os.W_OK):
            directory = _private_copy(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "build.flock", "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            # Every builder holds this turn, so a torch lock file seen now is a dead process's.
            (directory / "lock").unlink(missing_ok=True)
            # torch runs `ninja` from PATH: always the one pip installed with this package. An
            # activated environment finds it, `venv/bin/python -m ...` (cron, an IDE) finds the
            # system's or none, and two ninja versions log commands under different hashes,
            # so each rebuilt the shared cache the other had built (minutes, at engine start).
            os.environ["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, path]))
            return cpp_extension.load(name="batchgen_cpu_kernels", sources=[str(s) for s in SOURCES],
                                      extra_cflags=["-O3", "-fopenmp", *_simd_flags()],
                                      extra_ldflags=["-fopenmp"], build_directory=str(directory))
    except Exception as error:
        raise KernelBuildError(
            f"building the C++ CPU kernels ({SOURCES[0].parent}) failed: {error}. They need g++, "
            f"ninja, the Python headers and a writable build folder ({directory}; "
            "TORCH_EXTENSIONS_DIR moves it); or set BATCHGEN_CPU_KERNELS=torch where the engine "
            "runs (on a remote runner, in the workers' environment) to run the torch "
            "implementations instead") from error
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def _private_copy(prebuilt: Path) -> Path:
    """A copy of prebuilt's build files, with their times (which ninja's up-to-date check
    compares; its log, .ninja_log, holds the command hashes), in this user's folder under the
    temp folder: no other user's, whose module this process would load and run. Made in a
    staging folder and renamed into place, so a process killed mid-copy leaves no partial copy
    that later loads would take for whole."""
    mine = Path(tempfile.gettempdir()) / f"batchgen_cpu_kernels-{os.getuid()}"
    mine.mkdir(mode=0o700, exist_ok=True)
    owner = mine.stat()
    if owner.st_uid != os.getuid() or owner.st_mode & 0o022:
        raise PermissionError(f"{mine} is not this user's alone (owner uid {owner.st_uid}, "
                              f"mode {owner.st_mode & 0o777:o}): its kernels will not be loaded")
    copy = mine / prebuilt.name
    if not copy.is_dir():
        staging = Path(tempfile.mkdtemp(dir=mine))
        for file in prebuilt.iterdir():
            if file.is_file() and file.name not in ("build.flock", "lock"):
                shutil.copy2(file, staging / file.name)
        try:
            staging.rename(copy)
        except OSError:  # another process's copy went into place first
            shutil.rmtree(staging)
    return copy


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
                           sliding_window: int | None = None, softcap: float | None = None
                           ) -> torch.Tensor:
    """kernels.attention.paged_decode_attention, reading the cache in place; block table entries
    past a sequence's context are never read, so any padding value works."""
    return build().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          sliding_window, softcap)


def linear_plan() -> linear_rows.Plan:
    """Which fp32 linears the panel kernel and the few-row kernel take on this machine, MKL the
    rest (kernels/linear_rows.py: measured once per process)."""
    return linear_rows.plan(lambda x, weight: build().small_rows_linear(x, weight, None),
                            lambda x, panels, out: build().panel_linear(x, panels, out, None),
                            pack_panels)


PANEL = 32  # output columns per panel (kPanel in kernels/csrc/panel_linear.cpp)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [panels, in, PANEL]: panel p holds outputs p * PANEL.. (zeros past the last),
    k-major, as panel_linear reads them."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(panels * PANEL, in_features)
    padded[:out_features] = weight.detach()
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """kernels.matmul.pack_linear_weight: where the panel kernel takes any row count on this
    machine, an fp32 weight packed into its panels (a second copy of the weight); else None."""
    if weight.dim() == 2 and weight.dtype == torch.float32 and linear_plan().panel_rows:
        return pack_panels(weight)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.matmul.linear: for fp32 [rows, in] inputs the panel kernel on `packed` or, with
    nothing packed, the few-row kernel, at the row counts each takes; MKL's sgemm (torch)
    otherwise."""
    if x.dim() == 2 and x.dtype == weight.dtype == torch.float32:
        rows, plan = x.shape[0], linear_plan()
        if packed is not None and rows in plan.panel_rows:
            return build().panel_linear(x, packed, weight.shape[0], bias)
        if packed is None and rows in plan.kernel_rows:
            return build().small_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# Rows up to which the panel kernel on a bf16 weight beats oneDNN's bf16 matmul: one register
# tile (kMaxRows with AVX-512). SmolLM2's lm_head on the Xeon (AMX): 12 rows 2.7 against 3.2 ms,
# 13 rows (two tiles) 5.2 against 3.1.
BF16_PANEL_ROWS = 12


def bf16_weight_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """kernels.matmul.bf16_weight_linear: up to BF16_PANEL_ROWS rows the panel kernel on the
    bf16 panels (x stays fp32, the result fp32: tighter than the op's bound); oneDNN above."""
    if packed is not None and x.dim() == 2 and x.dtype == torch.float32 and len(x) <= BF16_PANEL_ROWS:
        return build().panel_linear(x, packed, weight.shape[0], None)
    return matmul.bf16_weight_linear(x, weight, packed)


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """kernels.matmul.pack_bf16_weight: the bf16 weight in the panel kernel's panels."""
    return pack_panels(weight) if weight.dim() == 2 and weight.dtype == torch.bfloat16 else None


def expert_ffn(rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """kernels.moe.expert_ffn: in C++ where no expert has more rows than
    `linear_plan().kernel_rows` holds (decode steps: a few tokens per expert), torch's grouped
    matmul otherwise."""
    if (rows.dtype == gate_up_proj.dtype == torch.float32 and len(rows)
            and int(counts.max()) < linear_plan().kernel_rows.stop):
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


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.shape[1]:
        return sampling.argmax(logits)
    return build().argmax(logits)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    build().write_kv(k_cache, v_cache, slot_mapping, k, v)


def decode_stack(layers: list[dict], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float):
    """A dense decoder stack's decode step in one C++ call (kernels/csrc/decode_stack.cpp), over
    `layers`' parameters (dicts of DecodeLayer's fields: the weights of the norms of the
    sublayers' inputs and outputs, each or None, the q/k norms' or None and whether they norm
    all heads at once, the projections packed by pack_panels, their biases or None, the sliding
    window or None, the index of its RoPE table or -1, the residual multiplier, the activation,
    the attention soft cap or None). Its
    `forward(x, rope, slot_mapping, block_tables, context_lens, kv_caches)`, rope a list of
    (cos, sin), one per RoPE table, returns the last
    layer's output; it holds the parameters, so a model changed afterwards needs a new stack."""
    module = build()
    return module.DecodeStack([module.DecodeLayer(**layer) for layer in layers], num_heads,
                              num_kv_heads, head_dim, eps, scale)
