"""Online estimate of how many tokens a sequence still has to generate.

Batch completion time is set by the longest remaining work, so the scheduler and the engine pool
rank sequences by it. A sequence's output length is known only when nothing but max_tokens can end
it (ignore_eos, no stop strings or stop ids); otherwise max_tokens is an upper bound, often a loose
one. Finished sequences show how long outputs actually run. Outputs cut by max_tokens are censored
observations (the natural length was at least that long), so the estimator is Kaplan-Meier:
with S(k) = P(length > k), a sequence with g tokens so far and bound m expects
sum_{k=g}^{m-1} S(k) / S(g) more tokens. Beyond the longest observation S stays where it was
(a survivor is assumed to run to its bound). With fewer than `min_samples` observations longer
than g, the data say nothing about this sequence yet and the bound is the estimate. Only the
latest `window` observations count, so the estimate follows a workload that changes.
"""

import bisect
from collections import deque
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from runtime.sampling import SamplingParams


def exact_length(params: SamplingParams) -> bool:
    """Only max_tokens (or the context) can end it: its length is known in advance."""
    return params.ignore_eos and not params.stop and not params.stop_token_ids


class LengthEstimator:
    def __init__(self, min_samples: int = 8, window: int = 4096):
        if min_samples < 1 or window < min_samples:
            raise ValueError("need 1 <= min_samples <= window")
        self.min_samples, self.window = min_samples, window
        self._recent: deque[tuple[int, bool]] = deque()  # in arrival order, to forget the oldest
        self._lengths: list[int] = []  # the same observations, sorted: the at-risk counts
        self._events: dict[int, int] = {}  # length -> how many ended naturally there
        self._curve: tuple[list[int], list[float], list[float]] | None = None  # built lazily
        self.version = 0  # observations so far: what an estimate read depends on

    def __len__(self) -> int:
        return len(self._lengths)

    def observe(self, length: int, natural: bool) -> None:
        """A finished sample of `length` tokens; natural: it stopped on its own (EOS, a stop
        string or id), else max_tokens or the context cut it. Exact-length samples teach nothing
        about natural lengths: callers skip them."""
        self._recent.append((length, natural))
        bisect.insort(self._lengths, length)
        if natural:
            self._events[length] = self._events.get(length, 0) + 1
        if len(self._recent) > self.window:
            old, old_natural = self._recent.popleft()
            del self._lengths[bisect.bisect_left(self._lengths, old)]
            if old_natural:
                self._events[old] -= 1
                if not self._events[old]:
                    del self._events[old]
        self._curve = None
        self.version += 1

    def remaining(self, params: SamplingParams, generated: int) -> float:
        """Expected tokens still to come for a sample with `generated` tokens so far."""
        bound = max(params.max_tokens - generated, 0)
        at_risk = len(self._lengths) - bisect.bisect_right(self._lengths, generated)
        if exact_length(params) or at_risk < self.min_samples or bound == 0:
            return float(bound)
        survival_at_g = self._survival(generated)
        expected = (self._area(params.max_tokens) - self._area(generated)) / survival_at_g
        return min(expected, float(bound))

    # ---- the Kaplan-Meier curve: S(k) is a step function that drops at each event length ----
    def _build(self) -> tuple[list[int], list[float], list[float]]:
        if self._curve is None:
            times, values, survival = [], [], 1.0
            for t in sorted(self._events):
                at_risk = len(self._lengths) - bisect.bisect_left(self._lengths, t)
                survival *= 1.0 - self._events[t] / at_risk
                times.append(t)
                values.append(survival)
            # area[j]: sum of S(k) for k in [0, times[j]); S is 1 before the first event
            widths = [t - prev for t, prev in zip(times, [0] + times[:-1])]
            area = list(accumulate((w * v for w, v in zip(widths, [1.0] + values[:-1])), initial=0.0))[1:]
            self._curve = (times, values, area)
        return self._curve

    def _survival(self, k: int) -> float:
        times, values, _ = self._build()
        j = bisect.bisect_right(times, k)
        return values[j - 1] if j else 1.0

    def _area(self, x: int) -> float:
        """sum of S(k) for integer k in [0, x)."""
        times, values, area = self._build()
        j = bisect.bisect_right(times, x - 1)  # events at or before x - 1
        if j == 0:
            return float(x)
        return area[j - 1] + (x - times[j - 1]) * values[j - 1]


class EstimateOrder:
    """Keeps a queue in the order of a key over (item, estimator), lowest first (stable: ties
    keep arrival order), sorting it again only once items joined it or, for keys that read the
    estimate, the estimate changed: sorting a queue of thousands every step took every key
    every step.

    With `overdue_after`, waits are bounded: an item that has seen more than that many items
    taken from the queue since it joined (`joined_at(item)`: `taken` then) goes to the head,
    the longest overdue first. Under a priority key, a stream of arrivals that outrank it
    would otherwise hold it back for as long as the stream lasts."""

    def __init__(self, estimator: LengthEstimator, reads_estimate: bool,
                 joined_at: Callable[[Any], int] | None = None, overdue_after: int | None = None):
        self.estimator, self.reads_estimate = estimator, reads_estimate
        self.joined_at, self.overdue_after = joined_at, overdue_after
        self.taken = 0  # items taken from the head: the clock items age by
        self._sorted_for: int | None = None  # None: items joined (or left) since the last sort
        self._overdue = 0  # how many items at the head went there overdue
        # The earliest join of the items behind those, or lower (None: not known): a step
        # scans the queue only where one may be overdue.
        self._earliest: int | None = None

    def joined(self) -> None:
        self._sorted_for = None

    def took(self) -> None:
        """The queue's head was taken."""
        self.taken += 1
        self._overdue = max(self._overdue - 1, 0)

    def sort(self, items: list, key) -> None:
        sorted_for = self.estimator.version if self.reads_estimate else 0
        if self._sorted_for != sorted_for:
            items.sort(key=lambda item: key(item, self.estimator))
            self._sorted_for, self._overdue, self._earliest = sorted_for, 0, None
        if self.overdue_after is not None:
            self._put_overdue_first(items)

    def _put_overdue_first(self, items: list) -> None:
        due = self.taken - self.overdue_after
        if self._earliest is not None and self._earliest >= due:
            return
        overdue, waiting = [], []
        for item in items[self._overdue:]:
            (overdue if self.joined_at(item) < due else waiting).append(item)
        if overdue:
            overdue.sort(key=self.joined_at)
            items[self._overdue:] = overdue + waiting
            self._overdue += len(overdue)
        self._earliest = min(map(self.joined_at, waiting), default=None)
