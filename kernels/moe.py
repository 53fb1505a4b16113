"""Mixture-of-experts routing and expert-level batching: every token of the step that chose an
expert meets that expert's weights in one matmul, whatever sequence it belongs to."""

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as Mixtral, Qwen-MoE and OLMoE do it: softmax over all experts in fp32, keep
    the k largest, optionally rescale those to sum to 1.

    router_logits: [tokens, experts]; returns weights [tokens, k] (fp32) and expert ids [tokens, k].
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, ffn=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU experts over routed tokens, one matmul pair per expert that has tokens.

    hidden: [T, H]; topk_ids, topk_weights: [T, k] (each token's experts and router weights);
    gate_up_proj: [E, 2I, H] (gate rows, then up rows); down_proj: [E, H, I].

    The T*k (token, expert) pairs are sorted by expert, so each expert's tokens are contiguous:
    the expert runs once on all of them (a grouped matmul), and experts nobody chose cost
    nothing. Each output is scaled by its router weight and added back to its token's row.

    Returns the combined output [T, H] and the tokens each expert processed [E] (int64, on the
    CPU: splitting the sorted pairs per expert needs the counts there anyway). `ffn` runs the
    experts over their rows (default `expert_ffn`; kernels/cpu_kernels.py passes its own).
    """
    order, token_of_pair, counts = sort_by_expert(topk_ids, gate_up_proj.shape[0])
    out = (ffn or expert_ffn)(hidden[token_of_pair], gate_up_proj, down_proj, counts)
    return combine(hidden, out, topk_weights, order, token_of_pair), counts


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs sorted by expert: their order in the flat [T*k] ids, the token of
    each sorted pair, and the pairs per expert [num_experts] (int64, on the CPU)."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_pair = order // top_k  # pair i of token t sits at flat position t * k + i
    counts = torch.bincount(flat_ids, minlength=num_experts).cpu()
    return order, token_of_pair, counts


def expert_ffn(rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert over its contiguous run of rows (counts[e] rows for expert e)."""
    if _grouped_mm_fits(rows, gate_up_proj, down_proj):
        # One call per projection for all experts: no Python loop, each expert's weights read once.
        offsets = counts.cumsum(0).to(torch.int32)
        up = torch._grouped_mm(rows, gate_up_proj.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(silu_and_mul(up), down_proj.transpose(1, 2), offs=offsets)
    outputs = [F.linear(silu_and_mul(F.linear(part, gate_up_proj[expert])), down_proj[expert])
               for expert, part in enumerate(rows.split(counts.tolist())) if len(part)]
    return torch.cat(outputs) if outputs else rows  # rows is empty when there are no tokens


def combine(hidden: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor,
            order: torch.Tensor, token_of_pair: torch.Tensor) -> torch.Tensor:
    """Each sorted pair's expert output scaled by its router weight (in the weights' dtype: the
    model's, or fp32 for Mixtral, as transformers applies them), summed into its token's row in
    fp32 and rounded once to the model's dtype, as transformers sums a token's k outputs (added
    into a bf16 row one by one, each would round)."""
    weighted = out * topk_weights.reshape(-1)[order, None]
    summed = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return summed.index_add_(0, token_of_pair, weighted.float()).to(hidden.dtype)


def _grouped_mm_fits(rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """torch._grouped_mm's CPU kernel needs rows (hidden and intermediate) of whole 16-byte
    multiples and at least one pair; other shapes (tiny test models) take the per-expert loop,
    which computes the same products."""
    row_bytes = (gate_up_proj.shape[2] * rows.element_size(), down_proj.shape[2] * rows.element_size())
    return rows.shape[0] > 0 and rows.device.type == "cpu" and all(b % 16 == 0 for b in row_bytes)
