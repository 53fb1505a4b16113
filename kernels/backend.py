"""Which implementation runs an op: the Triton kernels (kernels/triton/) for CUDA tensors (torch
for the linear, which cuBLAS does well); for CPU tensors the C++ kernels (kernels/cpu_kernels.py)
unless BATCHGEN_CPU_KERNELS=torch; torch for everything else.

The choice follows the tensor's device, never whether `triton` imports: triton is installed on
many CPU boxes (torch's CUDA wheels pull it in), and launching a kernel there fails with
"0 active drivers". Triton is imported only when a CUDA tensor first needs it.

To run the Triton kernels on CPU tensors (tests, debugging), set TRITON_INTERPRET=1 before
kernels.triton is first imported (its kernels are interpreted or compiled from then on) and
either call `kernels.triton.<op>` directly or wrap the calls in `forced_triton()`, which routes
every op of `kernels` to Triton whatever the device.
"""

import contextlib
import functools
import os

import torch

from kernels import cpu_kernels as cpp

_forced = False
CPU_KERNELS_VAR = "BATCHGEN_CPU_KERNELS"
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the Triton kernels have tiles for these


def backend_for(device: torch.device) -> str:
    """'triton' for CUDA devices (and everywhere inside `forced_triton()`), else 'torch'."""
    return "triton" if _forced or device.type == "cuda" else "torch"


def cpu_kernels() -> str:
    """BATCHGEN_CPU_KERNELS: 'cpp' (the default, the C++ kernels) or 'torch'; read at every call,
    so a process can switch."""
    choice = os.environ.get(CPU_KERNELS_VAR, "cpp")
    if choice not in ("cpp", "torch"):
        raise ValueError(f"{CPU_KERNELS_VAR}={choice!r}: expected 'cpp' or 'torch'")
    return choice


def uses_cpp(device: torch.device) -> bool:
    """Whether ops with a C++ kernel run it on this device: CPU tensors, outside
    `forced_triton()`, unless BATCHGEN_CPU_KERNELS=torch."""
    return device.type == "cpu" and backend_for(device) == "torch" and cpu_kernels() == "cpp"


def decode_stack_runs(x: torch.Tensor) -> bool:
    """Whether cpu_kernels.decode_stack can take a decode step on these hidden states: the C++
    kernels run x's device and the panel kernel takes linears of this many rows or more. Below
    its span the stack still runs, on its panel linears: one C++ call for the whole step beats
    the Python layers on MKL's few-row linears there (Xeon, SmolLM2, decode steps at context 16:
    1 row 20.8 against 25.5 ms, 4 rows 23.3 against 40.1 ms)."""
    if not uses_cpp(x.device):  # first: the plan builds and times the C++ kernels
        return False
    panel_rows = cpp.linear_plan().panel_rows
    return bool(panel_rows) and x.shape[0] < panel_rows.stop


def decode_attention_pads(device: torch.device) -> bool:
    """Whether paged_decode_attention on `device` is the torch op, which gathers every row's KV
    padded to the longest context: callers then batch rows of similar length together. The C++
    and Triton kernels read each row's own context only."""
    return backend_for(device) == "torch" and not uses_cpp(device)


def bf16_matmul_is_fast(device: torch.device) -> bool:
    """Whether bf16 matmuls run on matrix units here, several times fp32's speed: CPUs with
    AVX512-BF16 or AMX (oneDNN takes them). CUDA's tensor cores are too, but the screen that
    asks (runtime/logit_screen.py) has not been timed on a GPU, so not yet claimed."""
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def prepare(device: str | torch.device) -> None:
    """Build (or load from the cache) the C++ kernels where `device` will run them, and measure
    which rows of fp32 linears the panel kernel, the few-row kernel and sgemm each take
    (kernels/linear_rows.py), so no step pays for either. Raises cpu_kernels.KernelBuildError
    where the build fails."""
    if uses_cpp(torch.device(device)):
        cpp.build()
        cpp.linear_plan()


@contextlib.contextmanager
def forced_triton():
    """Route every op to the Triton kernels, on any device, until the block exits.

    Process-wide (the engine may step on another thread), so meant for tests and debugging.
    """
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous


def triton_ops():
    """The kernels.triton package, with a clear error where triton is missing."""
    try:
        import triton  # noqa: F401  (only to tell a missing install apart)
    except ImportError as error:
        raise ImportError("CUDA tensors run the Triton kernels, and triton is not installed: "
                          "install the `cuda` extra (pip install 'batchgen-beam[cuda]')") from error
    import kernels.triton
    return kernels.triton


def dispatch(torch_op, cpp_op=None, triton=True):
    """The public op: torch_op, or (where `triton`) the Triton kernel of the same name, by the
    first argument's device; cpp_op (a C++ kernel) instead of torch_op for CPU tensors, as
    cpu_kernels() says."""
    name = torch_op.__name__

    @functools.wraps(torch_op)
    def op(*args, **kwargs):  # runs ~300 times a decode step: one device test, one env lookup
        device_type = args[0].device.type
        if _forced or device_type == "cuda":
            if triton:
                return getattr(triton_ops(), name)(*args, **kwargs)
        elif cpp_op is not None and device_type == "cpu" and cpu_kernels() == "cpp":
            return cpp_op(*args, **kwargs)
        return torch_op(*args, **kwargs)
    return op
