"""What the sampler runs over a step's logits."""

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the index of its largest logit, the first where several tie (a
    NaN counts as the largest, as torch.argmax has it)."""
    return logits.argmax(dim=-1)
