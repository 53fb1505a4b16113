"""Which implementation takes an fp32 linear of a given row count on this machine: measured,
not assumed.

Three candidates. The panel kernel runs on a copy of the weight packed once at load into
k-major panels (kernels/csrc/panel_linear.cpp): outer products from registers, near the FMA
peak from ~8 rows and at the memory floor below. The few-row kernel reads the plain weight once
for all rows (dot products), for weights that are not packed: streamed layers (W3) and MoE
experts. MKL's sgemm through torch takes every other row count.
Which wins where depends on the CPU, and on the shapes too. On an AMD EPYC (Zen 4) the panel
kernel beats MKL at every row count, 2,048-row prefills included, and the few-row kernel beats
it up to ~256 rows; on an Intel Xeon (AVX-512) the few-row kernel won at 4-24 rows only
(benchmarks/cpu_kernels_micro.py), and MKL beats the panel kernel from ~512 rows (prefill chunks:
W1's prefill 20% faster on MKL). So a process times all three once, on weights larger than
the CPU caches (memory-bound, as a model's are), at a ladder of row counts up to a full prefill
step; each kernel's span runs from its first rung to beat MKL up to where MKL beats it at two
rungs in a row and the kernel does not win two in a row after (this machine's noise flips
single rungs, and sometimes two ties). The panel kernel blocks its rows (192
at a time), so its cost per row is flat past the last rung: a span no loss ended stays open. (A
calibration that ended it at 64, 128 or 256 rows on a noisy tie sent the rest to MKL: whole W1
runs 20% slower.)
BATCHGEN_CPU_PANEL_ROWS and BATCHGEN_CPU_LINEAR_ROWS (LO-HI, LO- for open-ended, or 0 for
none) set the two spans instead, for runs that must not depend on a measurement; with both set
nothing is measured.
"""

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROWS_VAR = "BATCHGEN_CPU_LINEAR_ROWS"
PANEL_VAR = "BATCHGEN_CPU_PANEL_ROWS"
RUNGS = (1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256, 512, 1024, 2048)
# The few-row kernel re-reads the weight for every few rows: past this rung it has long lost,
# and timing it there would cost seconds.
FEW_ROWS_LAST_RUNG = 256
OPEN_END = sys.maxsize  # a span's stop when it has none
# Six 2048 x 1024 weights: 48 MB, more than the last-level caches of the CPUs we run on. Past
# FEW_ROWS_LAST_RUNG a linear is bound by its arithmetic, not its weight reads: two weights do.
WEIGHTS, OUT_FEATURES, IN_FEATURES = 6, 2048, 1024
COMPUTE_BOUND_WEIGHTS = 2
REPEATS = 4  # alternating, best of; the first round also warms up
# A rung goes to a kernel only when it is this much faster than MKL: near a tie either is as
# fast, and the margin keeps the verdict from flipping with the noise.
MARGIN = 0.95

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    panel_rows: range  # row counts of a linear the panel kernel takes, on its packed weight
    kernel_rows: range  # row counts of an unpacked linear (and an MoE expert) the few-row kernel takes


_plan: Plan | None = None
_lock = threading.Lock()


def parse_span(text: str, variable: str = ROWS_VAR) -> range:
    """'LO-HI' -> range(LO, HI + 1); 'LO-' -> from LO on; '0' -> the empty span."""
    if text.strip() == "0":
        return range(0)
    try:
        low, high = text.strip().split("-")
        low, high = int(low), int(high) if high else OPEN_END - 1
    except ValueError:
        raise ValueError(f"{variable}={text!r}: expected LO-HI (rows, e.g. 4-24), LO- or 0") from None
    if not 1 <= low <= high:
        raise ValueError(f"{variable}={text!r}: expected 1 <= LO <= HI")
    return range(low, high + 1)


def shown(span: range) -> str:
    """A span as the variables write it."""
    if not span:
        return "none"
    return f"{span.start}-" if span.stop == OPEN_END else f"{span.start}-{span.stop - 1}"


def verdict(kernel_s: float, other_s: float) -> bool | None:
    """True where the kernel is the faster by the margin, False where the other is, None (a
    tie) otherwise."""
    return True if kernel_s < MARGIN * other_s else False if other_s < MARGIN * kernel_s else None


def span_of_wins(wins: dict[int, bool | None], open_ended: bool = False) -> range:
    """From each rung's verdict, the rows from the kernel's first winning rung up to where it
    loses for good: a loss ends the span only where the next rung loses too (or there is none)
    and the kernel never again wins two rungs in a row; a loss the next rung does not confirm is
    the machine's noise, and so is a tie, and so is a pair of losses the kernel comes back from
    (on a Xeon, ties at 2 and 3 rows timed as losses ended a span at 1 row: W1 sampled 34%
    slower). An ended span keeps the ties before its first loss: MKL at a calibration tie was
    8-10% slower in whole decode steps (129-256 rows, Xeon). `open_ended`: a span no loss ended
    has no end."""
    rungs = sorted(wins)
    won, end = [], None
    for index, rows in enumerate(rungs):
        if wins[rows]:
            won.append(rows)
        elif wins[rows] is False and won:
            following = rungs[index + 1:index + 2]
            later = [wins[rung] for rung in rungs[index + 2:]]
            comes_back = any(a and b for a, b in zip(later, later[1:]))
            if all(wins[after] is False for after in following) and not comes_back:
                end = rungs[index - 1] + 1  # a win or a tie: a loss there would have ended it
                break
    if not won:
        return range(0)
    if end is None:
        end = OPEN_END if open_ended else won[-1] + 1
    return range(won[0], end)


def plan_of_times(times: dict[int, dict[str, float]]) -> Plan:
    """The plan from each rung's seconds per implementation ("panel", "cpp" and "mkl"; "cpp"
    only at the rungs it was timed)."""
    def wins(name: str) -> dict[int, bool | None]:
        return {rows: verdict(t[name], t["mkl"]) for rows, t in times.items() if name in t}

    return Plan(span_of_wins(wins("panel"), open_ended=True), span_of_wins(wins("cpp")))


def measure(kernel, panel, pack) -> dict[int, dict[str, float]]:
    """Best-of-REPEATS seconds at each rung of the few-row kernel (`kernel(x, weight)`; up to
    FEW_ROWS_LAST_RUNG), of the panel kernel (`panel(x, pack(weight), out_features)`) and of MKL,
    on the calling thread."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(OUT_FEATURES, IN_FEATURES, generator=g) for _ in range(WEIGHTS)]
    ops = {"panel": (lambda x, panels: panel(x, panels, OUT_FEATURES), [pack(w) for w in weights]),
           "cpp": (kernel, weights), "mkl": (F.linear, weights)}
    best = {}
    with torch.inference_mode():
        for rows in RUNGS:
            x = torch.randn(rows, IN_FEATURES, generator=g)
            timed = {name: op for name, op in ops.items() if name != "cpp" or rows <= FEW_ROWS_LAST_RUNG}
            count = WEIGHTS if rows <= FEW_ROWS_LAST_RUNG else COMPUTE_BOUND_WEIGHTS
            best[rows] = {name: float("inf") for name in timed}
            for _ in range(REPEATS + 1):
                for name, (op, op_weights) in timed.items():
                    start = time.perf_counter()
                    for w in op_weights[:count]:
                        op(x, w)
                    best[rows][name] = min(best[rows][name], time.perf_counter() - start)
    return best


def plan(kernel, panel, pack) -> Plan:
    """Which rows the two kernels take (`measure` says how they are called): set by the
    variables, else measured once per process. The timing runs on a thread of its own, which
    ends with it: OpenMP keeps a worker pool for each thread that ran a parallel region, and a
    second pool beside the stepping thread's slows every step (runtime/engine.py,
    on_a_passing_thread)."""
    global _plan
    if _plan is None:
        with _lock:
            if _plan is None:
                _plan = _resolve(kernel, panel, pack)
    return _plan


def described() -> dict | None:
    """The resolved plan's spans as the variables write them (for reports), if any."""
    return _plan and {"panel_rows": shown(_plan.panel_rows), "kernel_rows": shown(_plan.kernel_rows)}


def _resolve(kernel, panel, pack) -> Plan:
    panel_text, rows_text = os.environ.get(PANEL_VAR), os.environ.get(ROWS_VAR)
    panel_rows = parse_span(panel_text, PANEL_VAR) if panel_text else None
    kernel_rows = parse_span(rows_text) if rows_text else None
    if panel_rows is not None and kernel_rows is not None:
        return Plan(panel_rows, kernel_rows)
    with ThreadPoolExecutor(1, thread_name_prefix="batchgen-calibrate") as timer:
        times = timer.submit(measure, kernel, panel, pack).result()
    measured = plan_of_times(times)
    chosen = Plan(measured.panel_rows if panel_rows is None else panel_rows,
                  measured.kernel_rows if kernel_rows is None else kernel_rows)
    log.info("fp32 linears: the panel kernel at rows %s, the few-row kernel at rows %s (unpacked), "
             "MKL elsewhere (ms per rung: %s)", shown(chosen.panel_rows), shown(chosen.kernel_rows),
             "; ".join(f"{rows}: " + ", ".join(f"{name} {t[name] * 1e3:.1f}" for name in t)
                       for rows, t in times.items()))
    return chosen
