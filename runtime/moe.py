"""The sparse MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, with expert-level batching.

The model runs one flattened batch per step (decode rows and prefill chunks of every resident
sequence), so each expert meets all the step's tokens routed to it, from whichever sequence, in
one grouped matmul: no per-sequence loop, no padding.
"""

import math

import torch
from torch import nn

from kernels import grouped_experts, route
from runtime.config import ModelSpec, MoESpec
from runtime.model import MLP


class Experts(nn.Module):
    """num_experts SwiGLU experts, stacked as transformers 5 stores them. Memory-constrained mode
    swaps this module for runtime/weight_stream.py's StreamedExperts (same call)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed tokens through their experts: (combined output, tokens per expert)."""
        return grouped_experts(x, ids, weights, self.gate_up_proj, self.down_proj)


class SparseMoeBlock(nn.Module):
    """Router (`gate`) -> top-k experts, plus Qwen2-MoE's sigmoid-gated shared expert.

    `expert_calls` and `expert_tokens` count, since the model was built, the expert matmuls run
    (one per expert with tokens, per step) and the tokens they processed: their ratio is the
    tokens per expert call that expert-level batching achieves.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.round_router_weights = moe.round_router_weights
        # The router stays on torch's matmul: top-k is discontinuous, so its logits keep the
        # summation order transformers computes them in.
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, spec.hidden_size, moe.intermediate_size)
        self.shared_expert = MLP(spec, moe.shared_expert_size) if moe.shared_expert_size else None
        self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False) if moe.shared_expert_size else None
        self.expert_calls = 0
        self.expert_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        if self.round_router_weights:
            weights = weights.to(x.dtype)
        out, counts = self.experts(x, ids, weights)
        self.expert_calls += int((counts > 0).sum())
        self.expert_tokens += int(counts.sum())
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


# Per-expert tensor names of checkpoints that do not store experts fused: (gate, up, down).
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"),  # Qwen2/3-MoE, OLMoE
                     ("w1", "w3", "w2"))  # Mixtral


def per_expert_names(checkpoint, name: str, moe: MoESpec) -> list[list[str]] | None:
    """Where the stacked tensor `name` (`….experts.gate_up_proj` or `….experts.down_proj`) is
    stored one expert at a time (what `save_pretrained` writes, and older checkpoints): each
    expert's stored tensors, concatenated in this order to form its slice. None where the
    checkpoint stores it fused (transformers 5). `checkpoint` answers `in` and `shape(name)`,
    and names its `model_dir`. Experts stored that the config has no place for are refused:
    loading only those it names would run another model than the checkpoint's (transformers
    refuses too)."""
    prefix, kind = name.rsplit(".", 1)
    # transformers builds Qwen2-MoE's shared expert even 0 wide, and saves it so: nothing to run.
    shared = f"{prefix.rsplit('.', 1)[0]}.shared_expert.down_proj.weight"
    if not moe.shared_expert_size and shared in checkpoint and math.prod(checkpoint.shape(shared)):
        raise ValueError(f"{checkpoint.model_dir}: the checkpoint stores a shared expert ({shared!r}, "
                         f"{list(checkpoint.shape(shared))}), which the config has none of "
                         f"(shared_expert_intermediate_size)")
    for gate, up, down in _PER_EXPERT_NAMES:
        parts = (gate, up) if kind == "gate_up_proj" else (down,)
        first = f"{prefix}.0.{parts[0]}.weight"
        if first in checkpoint:
            if name in checkpoint:  # a stale copy in the other layout: which is meant?
                raise ValueError(f"{checkpoint.model_dir}: the checkpoint stores {name!r} both fused and per "
                                 f"expert ({first!r}, ...); keep one of the two")
            extra = f"{prefix}.{moe.num_experts}.{parts[0]}.weight"
            if extra in checkpoint:
                raise ValueError(f"{checkpoint.model_dir}: the checkpoint stores more experts than the "
                                 f"config's {moe.num_experts} ({extra!r}, ...)")
            return [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(moe.num_experts)]
    if name in checkpoint:
        return None
    raise KeyError(f"{checkpoint.model_dir}: the checkpoint has no tensor {name!r}, fused or per expert")
