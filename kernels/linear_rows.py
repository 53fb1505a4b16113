"""Which row counts of an fp32 linear the C++ few-row kernel takes on this machine: measured,
not assumed.

Where the kernel beats MKL's sgemm depends on the CPU more than on the shapes. On an Intel
Xeon (AVX-512) it won at 4-24 rows only: MKL was as close to the memory floor at 1-3 rows and
faster past 24. On an AMD EPYC (AVX2) MKL's few-row sgemm costs 2-5x the kernel's at 1-3 rows
and the kernel wins up to 256 (benchmarks/cpu_kernels_micro.py). So a process times both once,
on weights larger than the CPU caches (memory-bound, as a model's are), at a ladder of row
counts, and the kernel takes the span from its first winning rung to its last.
BATCHGEN_CPU_LINEAR_ROWS=LO-HI (or 0 for none) sets the span instead, for runs that must not
depend on a measurement.
"""

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

ROWS_VAR = "BATCHGEN_CPU_LINEAR_ROWS"
RUNGS = (1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256)  # past the last, sgemm's blocking pays
# Six 2048 x 1024 weights: 48 MB, more than the last-level caches of the CPUs we run on.
WEIGHTS, OUT_FEATURES, IN_FEATURES = 6, 2048, 1024
REPEATS = 2  # alternating, best of; the first round also warms up
# A rung goes to the kernel only when it is this much faster: near a tie either is as fast, and
# the margin keeps the verdict from flipping between runs with the machine's noise.
MARGIN = 0.95

log = logging.getLogger(__name__)
_span: range | None = None
_lock = threading.Lock()


def parse_span(text: str) -> range:
    """'LO-HI' -> range(LO, HI + 1); '0' -> the empty span."""
    if text.strip() == "0":
        return range(0)
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise ValueError(f"{ROWS_VAR}={text!r}: expected LO-HI (rows, e.g. 4-24) or 0") from None
    if not 1 <= low <= high:
        raise ValueError(f"{ROWS_VAR}={text!r}: expected 1 <= LO <= HI")
    return range(low, high + 1)


def span_of_wins(wins: dict[int, bool]) -> range:
    """From each rung's verdict (whether the kernel was the faster), the rows from the first
    winning rung to the last."""
    won = [rows for rows, kernel_won in sorted(wins.items()) if kernel_won]
    return range(won[0], won[-1] + 1) if won else range(0)


def measure(kernel) -> dict[int, dict[str, float]]:
    """Best-of-REPEATS seconds of `kernel` and of F.linear at each rung, on the calling thread."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(OUT_FEATURES, IN_FEATURES, generator=g) for _ in range(WEIGHTS)]
    ops = {"cpp": kernel, "mkl": lambda x, w: F.linear(x, w)}
    best = {rows: {name: float("inf") for name in ops} for rows in RUNGS}
    with torch.inference_mode():
        for rows in RUNGS:
            x = torch.randn(rows, IN_FEATURES, generator=g)
            for _ in range(REPEATS + 1):
                for name, op in ops.items():
                    start = time.perf_counter()
                    for w in weights:
                        op(x, w)
                    best[rows][name] = min(best[rows][name], time.perf_counter() - start)
    return best


def span(kernel) -> range:
    """The row counts the C++ kernel (`kernel(x, weight)`) takes: BATCHGEN_CPU_LINEAR_ROWS if
    set, else measured once per process. The timing runs on a thread of its own, which ends with
    it: OpenMP keeps a worker pool for each thread that ran a parallel region, and a second pool
    beside the stepping thread's slows every step (runtime/engine.py, on_a_passing_thread)."""
    global _span
    if _span is None:
        with _lock:
            if _span is None:
                if os.environ.get(ROWS_VAR):
                    _span = parse_span(os.environ[ROWS_VAR])
                else:
                    with ThreadPoolExecutor(1, thread_name_prefix="batchgen-calibrate") as timer:
                        times = timer.submit(measure, kernel).result()
                    _span = span_of_wins({rows: t["cpp"] < MARGIN * t["mkl"]
                                          for rows, t in times.items()})
                    log.info("C++ few-row linear takes rows %s (ms, cpp/mkl: %s)",
                             f"{_span.start}-{_span.stop - 1}" if _span else "none",
                             ", ".join(f"{rows}: {t['cpp'] * 1e3:.1f}/{t['mkl'] * 1e3:.1f}"
                                       for rows, t in times.items()))
    return _span
