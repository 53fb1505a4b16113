"""W4 (DESIGN.md §8): two engines x one thread on W1's skewed work — a static even split against
reallocation (runtime/pool.py), with one engine on both threads as the token reference.

    python -m benchmarks.multi_engine [--quick] [--split interleaved|contiguous|grouped]
                                      [--requests N] [--scale F] [--reference-threads 2]
                                      [--skip-step-costs]

Systems, each on the same W1 requests (greedy, ignore_eos, fp32; logprobs=2 so a diverging token
can be checked for a near tie):
- static split: request i on engine i % 2, or contiguous halves, no reallocation — what Beam's
  keyed partitioning or a file's bundles give. `grouped` orders the requests by task first (W1's
  short, medium and long classes, as an input concatenated from three datasets is) and then
  takes contiguous halves: the skew lands on one engine, as it does when records of one kind
  are stored together;
- static split + reallocation: the same start, idle engines take work from busy ones;
- shared queue + reallocation: the pool's default (longest expected work first, late binding);
- one engine, both threads: the reference outputs (and a time for comparison).
Reported per system: batch completion time (first submit → last completion; engine start-up
excluded, reported as load_s), per engine idle time and tail idle time (after it last had work),
migrations, and per request token identity with the one engine. The step costs of one engine on
one thread (benchmarks/step_costs.py) are measured in the same run, for benchmarks/w4_simulate.py.
`--requests` and `--scale` (W1 lengths x F) make smoke runs; they are recorded in the JSON.
"""

import argparse
import time

import torch

from benchmarks import report, step_costs
from benchmarks.workloads import WorkItem, w1
from runtime import Engine, EnginePool, Request
from runtime.default_model import default_model_dir
from runtime.tokenizer import load_tokenizer

LOGPROBS = 2  # the top two: the margin between them at a diverging position


def requests_of(items: list[WorkItem]) -> list[Request]:
    return [it.request(logprobs=LOGPROBS) for it in items]


def _summary(system: str, load: float, elapsed: float, completions) -> dict:
    return {"system": system, "load_s": load, "batch_completion_s": elapsed,
            "output_tokens": sum(c.completion_tokens for c in completions),
            "tokens": {c.id: c.token_ids for c in completions},
            "top_logprobs": {c.id: c.outputs[0].top_logprobs for c in completions}}


def run_single(model_dir, items: list[WorkItem], threads: int, engine_args: dict) -> dict:
    start = time.perf_counter()
    engine = Engine(model_dir, num_threads=threads, **engine_args)
    load = time.perf_counter() - start
    start = time.perf_counter()
    completions = engine.generate(requests_of(items))
    result = _summary(f"one engine x {threads} threads", load, time.perf_counter() - start, completions)
    result["steps"] = engine.stats.steps
    return result


def run_pool(model_dir, items: list[WorkItem], name: str, engines: list[int] | None,
             engine_args: dict, **pool_args) -> dict:
    start = time.monotonic()
    with EnginePool(model_dir, num_engines=2, threads_per_engine=1, **pool_args, **engine_args) as pool:
        load = time.monotonic() - start
        start = time.monotonic()
        completions = pool.generate(requests_of(items), engines)
        end = time.monotonic()
        result = _summary(name, load, end - start, completions)
        idle = pool.idle(start, end)
        result["engines"] = [{**{k: s[k] for k in ("steps", "decode_tokens", "prefill_tokens",
                                                          "migrated_in", "migrated_out", "kv_migrated_in")},
                              **spans} for s, spans in zip(pool.stats(), idle)]
        result["tail_idle_fraction"] = max(e["tail_idle_s"] for e in idle) / (end - start)
        result["idle_fraction"] = sum(e["idle_s"] for e in idle) / (2 * (end - start))
        result["timeline"] = [[{**sample, "t": sample["t"] - start} for sample in engine
                               if start <= sample["t"] <= end] for engine in pool.timeline()]
    return result


def exactness(result: dict, reference: dict, items: list[WorkItem]) -> dict:
    """Token identity with the reference per request; for each request that differs, where it
    first does and the reference's margin between its top two tokens there."""
    diverged = []
    for it in items:
        mine, theirs = result["tokens"][it.id], reference["tokens"][it.id]
        if mine != theirs:
            # (one may be a prefix of the other: a request cut short differs where it ends)
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            margin = None
            if at < len(theirs):
                top = sorted(reference["top_logprobs"][it.id][at].values(), reverse=True)
                margin = top[0] - top[1]
            diverged.append({"id": it.id, "first_diff": at, "lengths": [len(mine), len(theirs)],
                             "reference_top2_margin": margin})
    return {"identical": f"{len(items) - len(diverged)}/{len(items)}", "diverged": diverged}


def grouped_by_task(items: list[WorkItem]) -> list[WorkItem]:
    """W1's requests ordered by length class (16-64, 128-256, 512-1024 tokens), stable within one."""
    return sorted(items, key=lambda it: 0 if it.max_tokens <= 64 else 1 if it.max_tokens <= 256 else 2)


def static_engines(items: list[WorkItem], split: str) -> list[int]:
    if split == "interleaved":
        return [i % 2 for i in range(len(items))]
    return [0 if i < len(items) // 2 else 1 for i in range(len(items))]  # contiguous, grouped


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256")
    parser.add_argument("--requests", type=int, help="the first N W1 requests (smoke runs)")
    parser.add_argument("--scale", type=float, default=1.0, help="W1 lengths x F (smoke runs)")
    parser.add_argument("--split", choices=("interleaved", "contiguous", "grouped"),
                        default="interleaved")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--reference-threads", type=int, default=2,
                        help="threads of the one-engine reference (DESIGN.md §8: the same two cores)")
    parser.add_argument("--skip-step-costs", action="store_true")
    args = parser.parse_args(argv)

    model_dir = default_model_dir()
    items = w1(load_tokenizer(model_dir), 64 if args.quick else 256)[:args.requests]
    items = [WorkItem(it.id, it.prompt_ids, max(1, round(it.max_tokens * args.scale))) for it in items]
    if args.split == "grouped":
        items = grouped_by_task(items)
    workload = "W4" + ("-quick" if args.quick else "") + ("-grouped" if args.split == "grouped" else "") \
        + (f"-smoke-{len(items)}x{args.scale:g}" if args.requests or args.scale != 1.0 else "")
    total = sum(it.max_tokens for it in items)
    print(f"{workload}: {len(items)} requests, {total} output tokens, longest "
          f"{max(it.max_tokens for it in items)}; static split {args.split}", flush=True)

    engine_args = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "admission": "adaptive"}
    pinned = static_engines(items, args.split)
    results = [run_pool(model_dir, items, "shared queue + reallocation", None, engine_args,
                        split="shared", reallocate=True, policy="adaptive")]
    report.progress(results)
    results.append(run_pool(model_dir, items, f"static {args.split} split + reallocation", pinned,
                            engine_args, split="static", reallocate=True))
    report.progress(results)
    results.append(run_pool(model_dir, items, f"static {args.split} split", pinned, engine_args,
                            split="static", reallocate=False))
    report.progress(results)
    results.append(run_single(model_dir, items, args.reference_threads, engine_args))
    report.progress(results)

    mismatches = report.compare(results, items)
    reference = results[-1]
    for r in results[:-1]:
        r["vs_one_engine"] = exactness(r, reference, items)
        print(f"{r['system']:<52} identical to one engine: {r['vs_one_engine']['identical']}; "
              f"tail idle {r['tail_idle_fraction']:.1%} of the run", flush=True)
    static = results[2]["batch_completion_s"]
    speedups = {r["system"]: static / r["batch_completion_s"] for r in results[:2]}
    for system, speedup in speedups.items():
        print(f"{system}: x{speedup:.2f} lower batch completion time than the static split")

    out = {"workload": workload, "requests": len(items), "output_tokens": total,
           "scale": args.scale, "static_split": args.split, "engine_args": engine_args,
           "machine": report.machine(threads=2), "reference_threads": args.reference_threads,
           "speedup_vs_static": speedups,
           "work_mismatches": mismatches}
    if not args.skip_step_costs:
        print("measuring one engine's step costs on one thread ...", flush=True)
        out["step_costs"] = step_costs.measure(model_dir, 1, [1, 2, 4, 8, 16, 32, 64])
    for r in results:
        r.pop("top_logprobs")
    timelines = {r["system"]: r.pop("timeline") for r in results[:3]}
    path = report.write(f"multi_engine_{workload}", out, results)
    report.timelines(path.with_name(path.stem + "_timeline.png"),
                     f"{workload}: running requests per engine (shaded: idle)", timelines)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)  # this process only coordinates; the engines set their own threads
    main()
