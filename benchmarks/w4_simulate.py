"""Projects W4 to many workers: batch completion time of a static split vs reallocation for 8 to
128 workers (one engine each), from measured step costs.

    python -m benchmarks.w4_simulate [--measure | --costs a W4 JSON holding step_costs]
                                     [--workers 8 16 32 64 128] [--requests-per-worker 32]

Inputs are measurements: one engine's decode step time by batch size, prefill time per token and
KV migration time per token (benchmarks/step_costs.py), taken from a W4 JSON (benchmarks.
multi_engine measures them in the same run as its systems) or measured now (--measure). The job:
workers x requests-per-worker requests with W1's lengths (its generator, run longer) and W1's
prompts' token counts.

An engine is modelled as the scheduler runs it: up to max_num_seqs resident, admitted longest
first, a per-step token budget shared by one decode token per resident sequence and prefill chunks;
a step costs decode_step_s(decoding sequences), interpolated between the measured batch sizes,
plus prefill_s_per_token per prefill token. Static: request i on worker i % W. Reallocation: the
pool's rules (runtime/pool.py) — a shared queue handing the longest work to the least loaded worker
with a free slot, and a worker under half another's remaining tokens taking requests from it
(runtime.rebalance.choose_donation), paying kv_migration_s_per_token per token they carry.
Workers advance in step order (the earliest clock first), so a taker sees a donor at most one step
ahead. Not modelled: message latency, the pool's report interval, workers contending for a machine.
With a W4 JSON, its own configuration (2 workers, its requests) is simulated as well and printed
next to the measured times: how far to trust the projection.
"""

import argparse
import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import RESULTS_DIR
from benchmarks.multi_engine import grouped_by_task, static_engines
from benchmarks.workloads import WorkItem, w1
from runtime.default_model import default_model_dir
from runtime.engine import RequestLoad
from runtime.pool import STEAL_BELOW
from runtime.rebalance import choose_donation
from runtime.tokenizer import load_tokenizer

MIN_STEAL_TOKENS = 64  # EnginePool's default


class Costs:
    def __init__(self, measured: dict):
        table = sorted((int(b), t) for b, t in measured["decode_step_s"].items())
        self.batches, self.times = [b for b, _ in table], [t for _, t in table]
        self.prefill = measured["prefill_s_per_token"]
        self.kv = measured["kv_migration_s_per_token"]

    def decode(self, batch: int) -> float:
        """Piecewise linear in the batch size through the measured points (linear beyond them)."""
        if batch == 0:
            return 0.0
        i = min(max(bisect.bisect_left(self.batches, batch), 1), len(self.batches) - 1)
        (b0, t0), (b1, t1) = (self.batches[i - 1], self.times[i - 1]), (self.batches[i], self.times[i])
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)


@dataclass
class Seq:
    id: int
    prefill: int  # prompt tokens still to compute
    left: int  # output tokens still to generate
    context: int = 0  # tokens with KV: what a migration carries


@dataclass
class Worker:
    costs: Costs
    max_num_seqs: int
    budget: int
    clock: float = 0.0
    idle: float = 0.0
    last_busy: float = 0.0
    queue: list[Seq] = field(default_factory=list)  # sent here, not admitted
    resident: list[Seq] = field(default_factory=list)
    load: int = 0  # output tokens still to generate, queue included

    def has_work(self) -> bool:
        return bool(self.queue or self.resident)

    def take(self, seqs: list[Seq], now: float) -> None:
        if not self.has_work() and now > self.clock:
            self.idle += now - self.clock
            self.clock = now
        for seq in seqs:
            (self.resident if seq.context else self.queue).append(seq)
            self.load += seq.left

    def step(self) -> int:
        """One scheduler step; returns how many sequences finished."""
        self.queue.sort(key=lambda s: -s.left)
        while self.queue and len(self.resident) < self.max_num_seqs:
            self.resident.append(self.queue.pop(0))
        decoding = [s for s in self.resident if not s.prefill]
        sampling = list(decoding)
        budget, prefilled = self.budget - len(decoding), 0
        for seq in self.resident:
            if seq.prefill and budget:
                chunk = min(seq.prefill, budget)
                seq.prefill -= chunk
                seq.context += chunk
                budget -= chunk
                prefilled += chunk
                if not seq.prefill:  # its last chunk samples the first token
                    sampling.append(seq)
        for seq in sampling:
            seq.left -= 1
            seq.context += 1
        self.load -= len(sampling)
        self.clock += self.costs.decode(len(decoding)) + self.costs.prefill * prefilled
        self.last_busy = self.clock
        before = len(self.resident)
        self.resident = [s for s in self.resident if s.left]
        return before - len(self.resident)


MODES = {"static": "static split (i % W)", "static_steal": "static split + reallocation",
         "shared": "shared queue + reallocation"}


def simulate(costs: Costs, prompt_tokens: list[int], lengths: list[int], workers: int,
             mode: str, max_num_seqs: int = 64, budget: int = 512,
             engines: list[int] | None = None) -> dict:
    """engines: each request's worker under a static split (default: request i on i % workers)."""
    pool = [Worker(costs, max_num_seqs, budget) for _ in range(workers)]
    seqs = [Seq(i, p, n) for i, (p, n) in enumerate(zip(prompt_tokens, lengths))]
    reallocate = mode != "static"
    shared = sorted(seqs, key=lambda s: -s.left) if mode == "shared" else []
    if mode != "shared":
        for seq in seqs:
            pool[seq.id % workers if engines is None else engines[seq.id]].take([seq], 0.0)
    migrations = 0

    def dispatch(now: float) -> None:
        while shared:
            free = [w for w in pool if len(w.queue) + len(w.resident) < max_num_seqs]
            if not free:
                return
            min(free, key=lambda w: w.load).take([shared.pop(0)], now)

    def rebalance() -> int:
        moved = 0
        while True:
            taker = min(pool, key=lambda w: w.load)
            donor = max(pool, key=lambda w: w.load)
            if donor.load - taker.load < MIN_STEAL_TOKENS or taker.load > STEAL_BELOW * donor.load \
                    or len(donor.queue) + len(donor.resident) < 2:
                return moved
            by_id = {s.id: s for s in donor.queue + donor.resident}
            loads = [RequestLoad(str(s.id), "running" if s.context else "waiting", s.left, s.context)
                     for s in by_id.values()]
            chosen = [by_id[int(i)] for i in choose_donation(loads, taker.load, MIN_STEAL_TOKENS)]
            if not chosen:
                return moved
            donor.queue = [s for s in donor.queue if s not in chosen]
            donor.resident = [s for s in donor.resident if s not in chosen]
            donor.load -= sum(s.left for s in chosen)
            taker.take(chosen, max(taker.clock, donor.clock))
            taker.clock += costs.kv * sum(s.context for s in chosen)
            moved += len(chosen)

    dispatch(0.0)
    while True:
        busy = [w for w in pool if w.has_work()]
        if not busy:
            break
        worker = min(busy, key=lambda w: w.clock)
        finished = worker.step()
        if reallocate and (finished or not worker.has_work()):
            dispatch(worker.clock)
            if not shared:
                migrations += rebalance()
    end = max(w.last_busy for w in pool)
    idle = [w.idle + end - w.last_busy for w in pool]
    return {"batch_completion_s": end, "migrations": migrations,
            "tail_idle_fraction": max(end - w.last_busy for w in pool) / end,
            "idle_fraction": sum(idle) / (workers * end)}


def job(tokenizer, requests: int) -> tuple[list[int], list[int]]:
    items = w1(tokenizer, requests)
    return [len(it.prompt_ids) for it in items], [it.max_tokens for it in items]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--costs", type=Path, help="a JSON with step_costs (a W4 run's, or this script's)")
    source.add_argument("--measure", action="store_true", help="measure the step costs now")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--requests-per-worker", type=int, default=32)
    args = parser.parse_args(argv)

    w4 = json.loads(args.costs.read_text()) if args.costs else None
    if w4 is not None:
        if "step_costs" not in w4:
            raise SystemExit(f"{args.costs} holds no step_costs (a W4 run with --skip-step-costs); "
                             f"give a run's that has them, or --measure")
        measured = w4["step_costs"]
    else:
        from benchmarks import step_costs
        measured = step_costs.measure(default_model_dir(), 1, [1, 2, 4, 8, 16, 32, 64])
    costs = Costs(measured)
    tokenizer = load_tokenizer(default_model_dir())
    out = {"step_costs": measured, "costs_from": str(args.costs) if args.costs else "measured now",
           "requests_per_worker": args.requests_per_worker, "projection": []}

    if w4 is not None and "results" in w4:  # a W4 run: its measured configuration itself
        items = [WorkItem(it.id, it.prompt_ids, max(1, round(it.max_tokens * w4["scale"])))
                 for it in w1(tokenizer, w4["requests"])]
        split = w4.get("static_split", "interleaved")
        if split == "grouped":
            items = grouped_by_task(items)
        prompts, lengths = [len(it.prompt_ids) for it in items], [it.max_tokens for it in items]
        sizes = dict(max_num_seqs=w4.get("engine_args", {}).get("max_num_seqs", 64),
                     budget=w4.get("engine_args", {}).get("max_num_batched_tokens", 512),
                     engines=static_engines(items, split))
        measured_s = {r["system"]: r["batch_completion_s"] for r in w4["results"]}
        systems = {"static": next(s for s in measured_s if s.endswith("split")),
                   "static_steal": next(s for s in measured_s if s.endswith("split + reallocation")),
                   "shared": "shared queue + reallocation"}
        out["w4_check"] = {mode: {"measured_s": measured_s[system], "simulated_s": simulate(
            costs, prompts, lengths, 2, mode, **sizes)["batch_completion_s"]} for mode, system in systems.items()}
        print("W4 itself, measured vs simulated:", json.dumps(out["w4_check"], indent=1), flush=True)

    for workers in args.workers:
        prompts, lengths = job(tokenizer, workers * args.requests_per_worker)
        row = {"workers": workers, "requests": len(lengths)}
        row.update({mode: simulate(costs, prompts, lengths, workers, mode) for mode in MODES})
        for mode in ("static_steal", "shared"):
            row[mode]["speedup"] = row["static"]["batch_completion_s"] / row[mode]["batch_completion_s"]
        out["projection"].append(row)
        print(f"{workers:4d} workers, {len(lengths):5d} requests: " + "; ".join(
            f"{mode} {row[mode]['batch_completion_s']:.1f} s (tail idle "
            f"{row[mode]['tail_idle_fraction']:.0%}, {row[mode]['migrations']} moved"
            + (f", x{row[mode]['speedup']:.2f}" if mode != "static" else "") + ")" for mode in MODES),
            flush=True)

    path = RESULTS_DIR / "w4_simulation.json"
    RESULTS_DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    plot(out, path.with_suffix(".png"))
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["projection"]
    workers = [r["workers"] for r in rows]
    fig, (times, idle) = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, label), color in zip(MODES.items(), ("#dd8452", "#55a868", "#4c72b0")):
        times.plot(workers, [r[mode]["batch_completion_s"] for r in rows], "o-", color=color, label=label)
        idle.plot(workers, [100 * r[mode]["tail_idle_fraction"] for r in rows], "o-", color=color,
                  label=label)
    for r in rows:
        times.annotate(f"x{r['shared']['speedup']:.2f}", (r["workers"], r["shared"]["batch_completion_s"]),
                       textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    for ax in (times, idle):
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(w) for w in workers])
        ax.set_xlabel("workers (one engine, one thread each)")
        ax.legend(fontsize=8)
    times.margins(y=0.12)
    times.set_ylabel("batch completion time, s")
    idle.set_ylabel("longest tail idle, % of the run")
    fig.suptitle(f"W1-shaped work, {out['requests_per_worker']} requests per worker: projected from "
                 f"measured step costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
