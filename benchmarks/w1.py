"""W1 (DESIGN.md §8), every system side by side: our engine bare (also without its n-gram drafts)
and through `Generate`, vLLM CPU, transformers padded `generate` (batch 16/32/64), transformers
`generate_batch`, and `RunInference` with a transformers `generate` handler. Plus this machine's
sgemm FLOP/s and our decode MFU.

    python -m benchmarks.w1 [--quick] [--sampled] [--rounds N] [--tag NAME] [--systems engine engine_no_drafts generate vllm hf16 hf32 hf64 generate_batch runinference]

Same prompts, same output token counts (ignore_eos), greedy, fp32, two threads; the report checks
every system generated exactly each request's length and counts requests token-identical to ours.
`--sampled` samples instead (temperature 0.7, top_p 0.9, request i seeded with i; ours, Generate
and vLLM only): Generate must still match ours token for token, vLLM draws from its own RNG.
Batch completion time is first submit → last completion, model load excluded (reported apart).
This machine's speed drifts by 10–20% within minutes: with `--rounds N` every system runs N times,
in alternating order (ours first, then ours last, ...), and each keeps its best round; sgemm is
measured at the start of every round and MFU divides by the best of them.
"""

import argparse

import torch

from benchmarks import beam_systems, mfu, report, systems
from benchmarks.workloads import w1
from runtime.default_model import default_model_dir

# 256 sequences and 2,048 tokens a step: 141 s against 149 s with 64 and 512 on full W1 (AMD EPYC, 2026-12-02).
ENGINE_ARGS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "admission": "longest_first"}
ALL_SYSTEMS = ["engine", "engine_no_drafts", "generate", "vllm", "hf16", "hf32", "hf64", "generate_batch", "runinference"]
SAMPLING_SYSTEMS = ["engine", "generate", "vllm"]


def _engine_with_decode_flops(model_dir, items) -> dict:
    result, engine = systems.engine(model_dir, items, return_engine=True, **ENGINE_ARGS)
    stats = engine.stats
    flops = mfu.decode_model_flops(engine.model, stats.decode_step_tokens, stats.decode_step_context)
    result.update(decode_steps=stats.decode_steps, decode_seconds=stats.decode_step_seconds,
                  decode_model_flops_per_s=flops / stats.decode_step_seconds)
    print(f"decode: {stats.decode_steps} steps, {stats.decode_step_seconds:.1f} s, "
          f"{result['decode_model_flops_per_s'] / 1e9:.1f} GFLOP/s", flush=True)
    return result


def _best_of_rounds(runs: dict, names: list[str], rounds: int) -> tuple[list[dict], list[float]]:
    """Each system's fastest run over `rounds` rounds in alternating order (a drift within the
    session then penalises no system more than another), with every round's time kept; and the
    sgemm FLOP/s measured at the start of each round."""
    best, seconds, sgemms = {}, {name: [] for name in names}, []
    for index in range(rounds):
        sgemms.append(mfu.sgemm_flops_per_s())
        print(f"round {index + 1}/{rounds}: sgemm {sgemms[-1] / 1e9:.1f} GFLOP/s", flush=True)
        for name in names if index % 2 == 0 else names[::-1]:
            result = runs[name]()
            seconds[name].append(result["batch_completion_s"])
            print(f"{result['system']:<52} {result['batch_completion_s']:8.1f} s", flush=True)
            if name not in best or result["batch_completion_s"] < best[name]["batch_completion_s"]:
                best[name] = result
    for name in names:
        best[name]["rounds_batch_completion_s"] = seconds[name]
    return [best[name] for name in names], sgemms


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256")
    parser.add_argument("--sampled", action="store_true",
                        help="temperature 0.7, top_p 0.9 and a seed per request instead of greedy")
    parser.add_argument("--systems", nargs="+", choices=ALL_SYSTEMS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="run every system this many times, "
                        "alternating the order, and keep each one's best")
    parser.add_argument("--tag", help="write results/<workload>-<tag>.json: a run of other systems "
                        "beside the main one (ours runs in each, as the reference)")
    args = parser.parse_args(argv)
    allowed = SAMPLING_SYSTEMS if args.sampled else ALL_SYSTEMS
    args.systems = args.systems or allowed
    if not set(args.systems) <= set(allowed):
        parser.error(f"--sampled runs only {', '.join(SAMPLING_SYSTEMS)}")

    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    from runtime.tokenizer import load_tokenizer
    num_requests = 64 if args.quick else 256
    items = w1(load_tokenizer(model_dir), num_requests, args.sampled)
    workload = ("W1-quick" if args.quick else "W1") + ("-sampled" if args.sampled else "")
    total = sum(it.max_tokens for it in items)
    print(f"{workload}: {len(items)} requests, {total} output tokens, "
          f"longest {max(it.max_tokens for it in items)}", flush=True)
    records = beam_systems.w1_records(num_requests, args.sampled)
    runs = {
        "engine": lambda: _engine_with_decode_flops(model_dir, items),
        "engine_no_drafts": lambda: systems.engine(model_dir, items, label="batchgen engine, no n-gram drafts",
                                                   ngram_drafts=False, **ENGINE_ARGS),
        # its engine runs in a process of its own: it takes the run's threads from its arguments
        "generate": lambda: beam_systems.generate(records, {**ENGINE_ARGS, "num_threads": args.threads}),
        "vllm": lambda: systems.vllm_cpu(model_dir, items, args.threads),
        "hf16": lambda: systems.hf_padded(model_dir, items, 16),
        "hf32": lambda: systems.hf_padded(model_dir, items, 32),
        "hf64": lambda: systems.hf_padded(model_dir, items, 64),
        "generate_batch": lambda: systems.hf_generate_batch(model_dir, items),
        "runinference": lambda: beam_systems.runinference_hf(model_dir, records, 32),
    }
    names = ["engine"] + [s for s in args.systems if s != "engine"]  # ours first: the reference
    results, sgemms = _best_of_rounds(runs, names, args.rounds)
    sgemm = max(sgemms)
    ours = results[0]
    ours["decode_mfu"] = ours["decode_model_flops_per_s"] / sgemm
    print(f"decode MFU {ours['decode_mfu']:.1%} (best sgemm of the run {sgemm / 1e9:.1f} GFLOP/s)")
    mismatches = report.compare(results, items)
    summary = {"workload": workload, "requests": len(items), "output_tokens": total,
               "model": str(model_dir), "engine_args": ENGINE_ARGS, "rounds": args.rounds,
               "sgemm_flops_per_s": sgemm, "sgemm_flops_per_s_each_round": sgemms,
               "machine": report.machine(args.threads), "work_mismatches": mismatches}
    report.write(f"{workload}-{args.tag}" if args.tag else workload, summary, results)
    return summary


if __name__ == "__main__":
    main()
