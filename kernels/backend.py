"""Which implementation runs an op: the Triton kernels (kernels/triton/) for CUDA tensors, torch
for every other device.

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

import torch

_forced = False


def backend_for(device: torch.device) -> str:
    """'triton' for CUDA devices (and everywhere inside `forced_triton()`), else 'torch'."""
    return "triton" if _forced or device.type == "cuda" else "torch"


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


def dispatch(torch_op):
    """The public op: torch_op, or the Triton kernel of the same name, by the first argument's
    device."""
    @functools.wraps(torch_op)
    def op(*args, **kwargs):
        if backend_for(args[0].device) == "triton":
            return getattr(triton_ops(), torch_op.__name__)(*args, **kwargs)
        return torch_op(*args, **kwargs)
    return op
