"""W2 (DESIGN.md §8): expert-level batching on a random ~0.5 B MoE (Qwen3-MoE, 32 experts, top-4)
against transformers' padded `generate` and `generate_batch`, side by side.

    python -m benchmarks.moe_throughput [--quick] [--hf-batch-sizes 64] [--skip-generate-batch]

W1's workload shape (prompts, chat template, output lengths) on W2's model; greedy fp32, every
request generating exactly its length. Reports batch completion time and, for every system, the
mean tokens per expert call (tokens routed ÷ expert matmuls run, over all MoE layers and steps).
Ours runs without its n-gram drafts, so each row it routes is a token it needed; the padded
peer's count includes its padding rows, which can only flatter it.
vLLM CPU is not in this harness yet: whether its CPU build runs Qwen3-MoE is untested here.
"""

import argparse

import torch

from benchmarks import report, systems
from benchmarks.workloads import w1, w2_model_dir


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[64],
                        help="padded generate batch sizes; none to skip")
    parser.add_argument("--skip-generate-batch", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = w2_model_dir()
    from runtime.tokenizer import load_tokenizer
    items = w1(load_tokenizer(model_dir), 64 if args.quick else 256)
    workload = "W2-quick" if args.quick else "W2"
    total = sum(it.max_tokens for it in items)
    print(f"{workload}: {len(items)} requests, {total} output tokens, "
          f"longest {max(it.max_tokens for it in items)}", flush=True)

    # Without n-gram drafts: a rejected guess's rows are routed too, and would count as tokens.
    results = [systems.engine(model_dir, items, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              admission="longest_first", kv_cache_bytes=4 << 30, ngram_drafts=False)]
    report.progress(results)
    for batch_size in args.hf_batch_sizes:
        results.append(systems.hf_padded(model_dir, items, batch_size))
        report.progress(results)
    if not args.skip_generate_batch:
        results.append(systems.hf_generate_batch(model_dir, items))
    mismatches = report.compare(results, items)
    ours = results[0]["tokens_per_expert_call"]
    for r in results:
        r["ours_tokens_per_expert_call_x"] = ours / r["tokens_per_expert_call"]
        print(f"{r['system']:<52} {r['tokens_per_expert_call']:6.2f} tokens/expert call "
              f"(ours x{r['ours_tokens_per_expert_call_x']:.2f})")
    summary = {"workload": workload, "requests": len(items), "output_tokens": total,
               "model": {"dir": str(model_dir), "family": "qwen3_moe",
                         "parameters": results[0]["parameters"]},
               "machine": report.machine(args.threads), "work_mismatches": mismatches}
    report.write(workload, summary, results)
    return summary


if __name__ == "__main__":
    main()
