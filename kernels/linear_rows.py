"""Which implementation takes an fp32 linear of a given row count on this machine: measured,
not assumed.

Three candidates. The C++ few-row kernel reads the weights once for all rows, which is what
bounds a decode step's few rows. Past a few rows a blocked sgemm wins: oneDNN's on weights
pre-arranged once into its layout (kernels/onednn.py), or MKL's through torch on the plain ones.
Which wins where depends on the CPU more than on the shapes. On an Intel Xeon (AVX-512) the
kernel won at 4-24 rows only: MKL was as close to the memory floor at 1-3 rows and faster past
24. On an AMD EPYC (Zen 4) MKL costs 2-4x the kernel at 1-3 rows, and oneDNN beats MKL by
20-40% from 8 rows up and the kernel from 8-16 (benchmarks/cpu_kernels_micro.py).
So a process times all three once, on weights larger than the CPU caches (memory-bound, as a
model's are), at a ladder of row counts: the sgemm faster over the rungs from 16 rows up takes
every row count outside the kernel's span, and the kernel's span runs from its first rung to
beat that sgemm up to where that sgemm first beats it.
BATCHGEN_CPU_LINEAR_ROWS=LO-HI (or 0 for none) sets the span (the experts' too) and
BATCHGEN_CPU_SGEMM=onednn|mkl the sgemm instead, for runs that must not depend on a measurement;
with both set nothing is measured.
"""

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import onednn

ROWS_VAR = "BATCHGEN_CPU_LINEAR_ROWS"
SGEMM_VAR = "BATCHGEN_CPU_SGEMM"
SGEMMS = ("onednn", "mkl")
RUNGS = (1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256)  # past the last, sgemm's blocking pays
SGEMM_RUNGS = tuple(rows for rows in RUNGS if rows >= 16)  # where the sgemms are measured apart
# Six 2048 x 1024 weights: 48 MB, more than the last-level caches of the CPUs we run on.
WEIGHTS, OUT_FEATURES, IN_FEATURES = 6, 2048, 1024
REPEATS = 4  # alternating, best of; the first round also warms up
# A rung goes to the kernel (and the sgemm choice to oneDNN) only when it is this much faster:
# near a tie either is as fast, and the margin keeps the verdict from flipping with the noise.
MARGIN = 0.95

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    kernel_rows: range  # row counts of a linear the C++ few-row kernel takes
    sgemm: str  # "onednn" or "mkl": every other row count
    # Where the kernel beats MKL: the MoE experts' alternative is torch's grouped matmul, not
    # oneDNN, so while each expert has at most this many rows they take the kernel.
    expert_rows: range


_plan: Plan | None = None
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


def parse_sgemm(text: str) -> str:
    name = text.strip().lower()
    if name not in SGEMMS:
        raise ValueError(f"{SGEMM_VAR}={text!r}: expected one of {', '.join(SGEMMS)}")
    if name == "onednn" and not onednn.available():
        raise ValueError(f"{SGEMM_VAR}=onednn: this torch build has no oneDNN")
    return name


def verdict(kernel_s: float, other_s: float) -> bool | None:
    """True where the kernel is the faster by the margin, False where the other is, None (a
    tie) otherwise."""
    return True if kernel_s < MARGIN * other_s else False if other_s < MARGIN * kernel_s else None


def span_of_wins(wins: dict[int, bool | None]) -> range:
    """From each rung's verdict, the rows from the kernel's first winning rung to its last one
    before it loses for good: a loss the next rung's win contradicts is the machine's noise, and
    so is a tie."""
    rungs = sorted(wins)
    won = []
    for index, rows in enumerate(rungs):
        if wins[rows]:
            won.append(rows)
        elif wins[rows] is False and won and not any(wins[later] for later in rungs[index + 1:index + 2]):
            break
    return range(won[0], won[-1] + 1) if won else range(0)


def plan_of_times(times: dict[int, dict[str, float]], sgemm: str | None = None) -> Plan:
    """The plan from each rung's seconds per implementation ("cpp", "mkl" and, where this torch
    has it, "onednn"); `sgemm` given, only the kernel's spans."""
    def total(name: str) -> float:
        return sum(times[rows][name] for rows in SGEMM_RUNGS)

    if sgemm is None:
        sgemm = "onednn" if "onednn" in times[RUNGS[0]] and total("onednn") < MARGIN * total("mkl") else "mkl"
    return Plan(span_of_wins({rows: verdict(t["cpp"], t[sgemm]) for rows, t in times.items()}), sgemm,
                span_of_wins({rows: verdict(t["cpp"], t["mkl"]) for rows, t in times.items()}))


def measure(kernel) -> dict[int, dict[str, float]]:
    """Best-of-REPEATS seconds of `kernel`, of MKL and (where available) of oneDNN on packed
    weights at each rung, on the calling thread."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(OUT_FEATURES, IN_FEATURES, generator=g) for _ in range(WEIGHTS)]
    ops = {"cpp": (kernel, weights), "mkl": (F.linear, weights)}
    if onednn.available():
        ops["onednn"] = (onednn.linear, [onednn.pack(w) for w in weights])
    best = {rows: {name: float("inf") for name in ops} for rows in RUNGS}
    with torch.inference_mode():
        for rows in RUNGS:
            x = torch.randn(rows, IN_FEATURES, generator=g)
            for _ in range(REPEATS + 1):
                for name, (op, op_weights) in ops.items():
                    start = time.perf_counter()
                    for w in op_weights:
                        op(x, w)
                    best[rows][name] = min(best[rows][name], time.perf_counter() - start)
    return best


def plan(kernel) -> Plan:
    """Which rows the C++ kernel (`kernel(x, weight)`) takes and which sgemm takes the rest:
    set by the variables, else measured once per process. The timing runs on a thread of its
    own, which ends with it: OpenMP keeps a worker pool for each thread that ran a parallel
    region, and a second pool beside the stepping thread's slows every step
    (runtime/engine.py, on_a_passing_thread)."""
    global _plan
    if _plan is None:
        with _lock:
            if _plan is None:
                _plan = _resolve(kernel)
    return _plan


def _resolve(kernel) -> Plan:
    rows, sgemm = os.environ.get(ROWS_VAR), os.environ.get(SGEMM_VAR)
    span, sgemm = parse_span(rows) if rows else None, parse_sgemm(sgemm) if sgemm else None
    if span is not None and sgemm is not None:
        return Plan(span, sgemm, span)
    with ThreadPoolExecutor(1, thread_name_prefix="batchgen-calibrate") as timer:
        times = timer.submit(measure, kernel).result()
    measured = plan_of_times(times, sgemm)
    chosen = measured if span is None else Plan(span, measured.sgemm, span)
    shown = chosen.kernel_rows
    log.info("fp32 linears: the C++ few-row kernel at rows %s, %s's sgemm elsewhere (ms per rung: %s)",
             f"{shown.start}-{shown.stop - 1}" if shown else "none", chosen.sgemm,
             "; ".join(f"{rows}: " + ", ".join(f"{name} {t[name] * 1e3:.1f}" for name in t)
                       for rows, t in times.items()))
    return chosen
