"""W1 (DESIGN.md §8): our engine vs transformers' padded `generate`, side by side.

    python -m benchmarks.engine_throughput [--quick] [--hf-batch-size 32] [--skip-hf]

Same machine, same run, same weights and prompts, greedy fp32, every request generating exactly
its W1 length (ignore_eos). Batch completion time excludes model load (reported separately).
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks.workloads import WorkItem, w1
from runtime import Engine, Request, SamplingParams
from runtime.default_model import default_model_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_engine(model_dir: Path, items: list[WorkItem], **engine_args) -> dict:
    start = time.perf_counter()
    engine = Engine(model_dir, **engine_args)
    load = time.perf_counter() - start
    requests = [Request(it.id, prompt_token_ids=it.prompt_ids,
                        params=SamplingParams(max_tokens=it.max_tokens, ignore_eos=True))
                for it in items]
    start = time.perf_counter()
    completions = engine.generate(requests)
    elapsed = time.perf_counter() - start
    return {"system": "batchgen engine", "load_s": load, "batch_completion_s": elapsed,
            "output_tokens": sum(c.completion_tokens for c in completions),
            "steps": engine.stats.steps, "engine_args": engine_args,
            "tokens": {c.id: c.token_ids for c in completions}}


@torch.inference_mode()
def run_hf_padded(model_dir: Path, items: list[WorkItem], batch_size: int) -> dict:
    """What a padded static-batch user gets: each batch runs until its longest request is done."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load = time.perf_counter() - start
    pad = model.generation_config.pad_token_id or 0
    tokens, generated = {}, 0
    start = time.perf_counter()
    for b in range(0, len(items), batch_size):
        batch = items[b:b + batch_size]
        width = max(len(it.prompt_ids) for it in batch)
        ids = torch.tensor([[pad] * (width - len(it.prompt_ids)) + it.prompt_ids for it in batch])
        mask = torch.tensor([[0] * (width - len(it.prompt_ids)) + [1] * len(it.prompt_ids) for it in batch])
        longest = max(it.max_tokens for it in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad)
        for row, it in enumerate(batch):
            tokens[it.id] = out[row, width:width + it.max_tokens].tolist()
        generated += len(batch) * longest
    elapsed = time.perf_counter() - start
    return {"system": f"transformers padded generate (batch {batch_size})", "load_s": load,
            "batch_completion_s": elapsed, "output_tokens": sum(it.max_tokens for it in items),
            "generated_incl_padding": generated, "tokens": tokens}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true", help="run only our engine")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--admission", default="longest_first")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    from runtime.tokenizer import load_tokenizer
    items = w1(load_tokenizer(model_dir), 64 if args.quick else 256)
    print(f"W1{' quick' if args.quick else ''}: {len(items)} requests, "
          f"{sum(it.max_tokens for it in items)} output tokens, longest {max(it.max_tokens for it in items)}")

    results = [run_engine(model_dir, items, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, admission=args.admission)]
    if not args.skip_hf:
        results.append(run_hf_padded(model_dir, items, args.hf_batch_size))
    ours = results[0]
    for r in results:
        r["tokens_per_s"] = r["output_tokens"] / r["batch_completion_s"]
        r["ours_faster_by"] = r["batch_completion_s"] / ours["batch_completion_s"]
        if r is not ours:  # same work: same token count per request; greedy fp32 should agree
            same = sum(r["tokens"][it.id] == ours["tokens"][it.id] for it in items)
            r["requests_token_identical_to_ours"] = f"{same}/{len(items)}"
        print(f"{r['system']:<42} {r['batch_completion_s']:8.1f} s  {r['tokens_per_s']:7.1f} tok/s  "
              f"ours faster x{r['ours_faster_by']:.2f}  (load {r['load_s']:.1f} s)")

    report = {"workload": "W1-quick" if args.quick else "W1", "requests": len(items),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "threads": args.threads},
              "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results]}
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"engine_throughput_{report['workload']}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
