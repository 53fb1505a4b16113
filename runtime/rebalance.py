"""Which work an engine hands to an idler one, and in which order a shared queue hands out work.

Loads are expected remaining output tokens (runtime/estimate.py). With continuous batching an
engine's time is roughly a per-step cost times its longest sequence plus a per-token cost times
all its tokens; a single sequence cannot be split, so the donor keeps its longest request and
gives away what evens out the rest.
"""

from typing import Callable

from runtime.engine import RequestLoad
from runtime.estimate import LengthEstimator
from runtime.request import Request

# Orders of a shared queue (lowest key first), the pool-level counterparts of the scheduler's
# admission orders; prompts are not tokenized yet, so only the output counts.
QUEUE_ORDERS: dict[str, Callable[[Request, LengthEstimator], float]] = {
    "fifo": lambda r, est: 0,
    "longest_first": lambda r, est: -r.params.max_tokens * r.params.n,
    "shortest_first": lambda r, est: r.params.max_tokens * r.params.n,
    "adaptive": lambda r, est: -est.remaining(r.params, 0) * r.params.n,
}


def choose_donation(loads: list[RequestLoad], taker_load: float, min_tokens: float) -> list[str]:
    """Request ids to move from a donor with `loads` to a taker with `taker_load` so both end up
    near half their sum; [] when that would shift fewer than `min_tokens`."""
    gap = (sum(ld.remaining_tokens for ld in loads) - taker_load) / 2
    if len(loads) < 2 or gap < min_tokens:
        return []
    chosen, moved = [], 0.0
    # Waiting requests first at equal size: they move without KV.
    ranked = sorted(loads, key=lambda ld: (-ld.remaining_tokens, ld.where != "waiting"))
    for load in ranked[1:]:
        if moved + load.remaining_tokens <= gap:
            chosen.append(load.request_id)
            moved += load.remaining_tokens
    return chosen if moved >= min_tokens else []

