"""Model FLOPs utilisation: the model FLOP/s our engine achieves in decode ÷ the sgemm FLOP/s this
machine reaches, both measured in the same run."""

import time

import torch
from torch import nn

from benchmarks import onednn
from runtime.moe import SparseMoeBlock


def sgemm_flops_per_s(size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` fp32 square matmul throughput with the current torch thread count: the
    faster of MKL's sgemm and (where torch has it) oneDNN's on a packed weight, the two our
    engine's linears run on (kernels/linear_rows.py)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    candidates = [lambda: a @ b]
    if onednn.available():
        packed = onednn.pack(b.t().contiguous())  # [out, in], as a linear's weight
        candidates.append(lambda: onednn.linear(a, packed))
    best = float("inf")
    for matmul in candidates:
        matmul()  # warm up the threads and the primitive
        best = min(best, *(_timed(matmul) for _ in range(repeats)))
    return 2 * size ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_params_per_token(model: nn.Module) -> int:
    """Weights one token multiplies through: every linear layer (the LM head included), and of
    each MoE block only the top-k experts it is routed to."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()
        elif isinstance(module, SparseMoeBlock):
            per_expert = (module.experts.gate_up_proj[0].numel() + module.experts.down_proj[0].numel())
            total += module.top_k * per_expert
    return total  # a tied LM head is an nn.Linear sharing the embedding: counted once, as used


def decode_model_flops(model: nn.Module, tokens: int, context: int) -> float:
    """FLOPs of decoding `tokens` tokens whose attended contexts sum to `context`: 2 per weight
    multiply-add, plus attention's q·k and p·v over the context in every layer."""
    spec = model.spec
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * context
    return 2 * matmul_params_per_token(model) * tokens + attention
