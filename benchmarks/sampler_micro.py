"""The sampler (runtime/sampling.py) against transformers' way of sampling a batch: its logits
warpers (temperature, min-p, top-k, top-p, in vLLM's order) over the whole batch, then one
torch.multinomial. Rows are the default model's real next-token logits over the bundled prompts
(a sampler's cost depends on how peaked they are). Ours gives each row its own generator (a
seeded request's stream); transformers draws the batch from one. Writes
results/sampler_micro.json.

    python -m benchmarks.sampler_micro [--threads 2] [--rows 128]

Both run in the same process, alternating, each keeping its best of REPEATS.
"""

import argparse
import json
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from benchmarks.report import RESULTS_DIR
from benchmarks.workloads import bundled_prompts, w1
from runtime.default_model import default_model_dir
from runtime.sampling import SampleRow, SamplingParams, sample
from runtime.tokenizer import load_tokenizer

CONFIGS = [dict(temperature=0.7), dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=50),
           dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05), dict(temperature=1.0, top_p=0.95),
           dict(temperature=0.1), dict(temperature=0.1, top_p=0.9)]
REPEATS = 5


def real_logits(rows: int) -> torch.Tensor:
    """The default model's next-token logits at every position of W1's prompts (the bundled
    ones, chat template applied), the first `rows` of them."""
    model_dir = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found = []
    for item in w1(load_tokenizer(model_dir), len(bundled_prompts())):
        with torch.no_grad():
            found.append(model(torch.tensor([item.prompt_ids])).logits[0])
        if sum(len(f) for f in found) >= rows:
            break
    return torch.cat(found)[:rows].contiguous()


def transformers_sample(logits: torch.Tensor, config: dict, generator: torch.Generator) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(config["temperature"])])
    if config.get("min_p"):
        warpers.append(MinPLogitsWarper(config["min_p"]))
    if config.get("top_k"):
        warpers.append(TopKLogitsWarper(config["top_k"]))
    if config.get("top_p"):
        warpers.append(TopPLogitsWarper(config["top_p"]))
    scores = warpers(None, logits.clone())
    return torch.multinomial(scores.softmax(-1), 1, generator=generator)


def best_seconds(run) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logits = real_logits(args.rows)
    results = []
    for config in CONFIGS:
        params = SamplingParams(**config)
        rows = [SampleRow(params, np.random.default_rng(i)) for i in range(len(logits))]
        generator = torch.Generator().manual_seed(0)
        ours = best_seconds(lambda: sample(logits, rows))
        theirs = best_seconds(lambda: transformers_sample(logits, config, generator))
        results.append({"config": config, "ours_us_per_row": ours / len(logits) * 1e6,
                        "transformers_us_per_row": theirs / len(logits) * 1e6, "ours_faster_by": theirs / ours})
        print(f"{json.dumps(config):<70} ours {results[-1]['ours_us_per_row']:7.0f} us/row   "
              f"transformers {results[-1]['transformers_us_per_row']:7.0f} us/row   x{theirs / ours:.1f}", flush=True)
    report = {"rows": len(logits), "vocab": logits.shape[-1], "threads": args.threads, "results": results}
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / "sampler_micro.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
