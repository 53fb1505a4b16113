import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a packed gate/up projection: silu(gate) * up, halves of the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the exact (erf) GELU: gelu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
