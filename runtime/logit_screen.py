"""Greedy tokens without the full fp32 logits: screen the vocabulary in bf16, verify in fp32.

A greedy row needs only the index of its largest logit. The lm_head is the widest linear of a
small model (SmolLM2: 49,152 x 576, a fifth of a decode token's FLOPs) and bf16 matrix units
run it several times faster than fp32 FMA. So: logits in bf16 for the whole vocabulary, the top
CANDIDATES of them recomputed exactly in fp32, and a bound that proves the fp32 argmax is among
them. A row the bound cannot clear gets its full fp32 logits; every row's answer is the fp32
argmax either way.

The bound. With u = 2^-9 (bf16's unit roundoff), a bf16 logit a_j of row h and weight row w_j
(bf16 inputs, products exact in fp32, fp32 accumulation over K terms, the result rounded to
bf16; the C++ kernel keeps h and the result in fp32, which only tightens this) is within (2u + 2^-18 + K 2^-24) |w_j|.|h| + u |a_j| of the exact dot product, and the
fp32 logit within K 2^-24 |w_j|.|h| of it; |w_j|.|h| <= ||w_j|| ||h|| (Cauchy-Schwarz). Every
token outside the top CANDIDATES has a_j <= a_k (the k-th largest), and a + 2u|a| grows with a,
so its fp32 logit is at most a_k + 2u|a_k| + C ||h|| max_j ||w_j||, with C = 2^-8 + 2K 2^-23
(double the terms above). A candidate whose fp32 logit beats that wins.
"""

from dataclasses import dataclass

import torch

from kernels import bf16_weight_linear, pack_bf16_weight

CANDIDATES = 16  # on SmolLM2's W1 decode rows, 99.9% of rows clear the bound with 16


@dataclass(frozen=True)
class LogitScreen:
    """What screening a linear's rows needs, made once from its (final) fp32 weight."""
    weight_bf16: torch.Tensor  # [vocab, hidden]
    packed: torch.Tensor | None  # kernels.pack_bf16_weight's copy of it
    max_row_norm: float  # max_j ||w_j||, rounded up

    @classmethod
    def of(cls, weight: torch.Tensor) -> "LogitScreen":
        weight = weight.detach()
        weight_bf16 = weight.to(torch.bfloat16)
        # Summed in fp32 (fp64 for an fp64 head) whatever the head's dtype: a bf16 norm rounds
        # by far more than the margin, and an fp64 copy of a large vocabulary's head would be
        # gigabytes. Rounded up by more than a K-term fp32 sum of squares can be off.
        norm = torch.linalg.vector_norm(weight, dim=1, dtype=_at_least_fp32(weight)).max().item()
        norm *= 1 + weight.shape[1] * 2.0 ** -22
        return cls(weight_bf16, pack_bf16_weight(weight_bf16), norm)


def screened_argmax(hidden: torch.Tensor, weight: torch.Tensor, screen: LogitScreen,
                    fp32_logits, finish) -> tuple[torch.Tensor, torch.Tensor, int]:
    """argmax(finish(hidden @ weight^T)) per row (first index on ties), its fp32 logit there, and
    how many rows needed their full logits, which `fp32_logits(rows)` computes (the caller's
    fp32 linear, finished).
    `finish` (the model's scaling and soft cap) is monotone but may make fp32 logits equal; the
    bound is then checked after it, so a token outside the candidates cannot tie the winner."""
    vocab, size = weight.shape
    k = min(CANDIDATES, vocab)
    top = bf16_weight_linear(hidden, screen.weight_bf16, screen.packed).topk(k, dim=1)
    # Sorted by token id, so the first of tied fp32 logits is the lowest id, as argmax has it.
    ids, _ = top.indices.sort(dim=1)
    # Finished in the model's dtype, then fp32, as the full path has them (a soft cap in bf16
    # ties many: the bound below then clears fewer rows, never a wrong one).
    exact = finish(torch.einsum("rkh,rh->rk", weight[ids], hidden)).float()
    best, where = exact.max(dim=1)
    tokens = ids.gather(1, where[:, None])[:, 0]
    kth = top.values[:, -1].float()
    slack = 2.0 ** -8 + 2 * size * 2.0 ** -23
    hidden_norm = torch.linalg.vector_norm(hidden, dim=1, dtype=_at_least_fp32(hidden))
    # Rounded to the model's dtype before `finish`, as a logit outside the candidates is: a
    # value of that dtype under the fp32 bound is under its rounding too (rounding is monotone).
    raw_bound = kth + 2.0 ** -8 * kth.abs() + slack * hidden_norm * screen.max_row_norm
    bound = finish(raw_bound.to(hidden.dtype)).float()
    # NaN anywhere fails the comparison: such rows take the full path, argmax's NaN rule. So
    # does a best candidate that overflowed (fp16): tokens outside the candidates may too, and
    # argmax takes the lowest id of those.
    cleared = (best > bound) & best.isfinite() if k < vocab else ~exact.isnan().any(dim=1)
    missed = (~cleared).nonzero()[:, 0]
    if len(missed):
        full = fp32_logits(hidden[missed])
        tokens[missed] = full.argmax(dim=1)
        best[missed] = full.gather(1, tokens[missed][:, None])[:, 0].float()
    return tokens, best, len(missed)


def _at_least_fp32(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)
