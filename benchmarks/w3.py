"""W3 memory-constrained (DESIGN.md §8): models larger than the weight budget, weights on disk.

    python -m benchmarks.w3 [--quick | --smoke] [--models dense moe] [--systems ours peer resident]
                            [--device cuda]

Two random-initialised fp32 models of over 4 GB (a Llama-style dense one and a Qwen3-MoE with 64
experts, top-8), built once and cached under ~/.cache/batchgen-beam/w3 (--smoke: two tiny ones).
Each runs under a weight budget of 25% of its weights in two systems, each alone in a child process
(benchmarks/w3_run.py): our engine streaming layers from the safetensors files, and transformers
with accelerate disk offload (device_map="auto", max_memory = the budget, offload_folder), padded
greedy `generate` in batches. Same prompts (bundled prompts, chat template), same output lengths
(ignore_eos), greedy, fp32, two threads. Reports throughput, peak RSS against budget + KV +
baseline, weight bytes read per generated token, and token agreement; writes results/W3*.json.
`--systems ours resident` checks streaming against our engine with every weight in memory.
`--device cuda`: the budget is GPU memory; we stream through pinned host slots on a copy stream,
the peer is accelerate offloading what exceeds `max_memory={0: budget}` to disk; peak GPU memory
is reported beside peak RSS. Two more systems there: `host`, our engine streaming from a pinned
host copy of the weights (weights_in_host_memory), and `peer-ram`, accelerate keeping what
exceeds the budget in host RAM.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.workloads import WorkItem, bundled_prompts
from runtime.default_model import default_model_dir

CACHE = Path.home() / ".cache" / "batchgen-beam" / "w3"
BUDGET_FRACTION = 0.25
PEER_BATCH = 8
# benchmarks/w3_run.py: streaming, accelerate disk offload, all in memory; on cuda also streaming
# from pinned host memory and accelerate offloading to host RAM.
SYSTEMS = ["ours", "peer", "resident", "host", "peer-ram"]
CUDA_ONLY = {"host", "peer-ram"}
# Vocabulary of the default model, whose tokenizer makes the prompts; embeddings tied.
_BASE = dict(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
             bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5)
MODELS = {  # name -> (transformers config class name, config)
    "dense": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=21,
                                  num_attention_heads=16, num_key_value_heads=4)),  # 4.19 GB
    "moe": ("Qwen3MoeConfig", dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=10,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                   num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                                   norm_topk_prob=True)),  # 4.25 GB
    # Smoke: layers heavy next to the embeddings, which alone outweigh 25% of so small a model.
    "dense-smoke": ("LlamaConfig", dict(hidden_size=128, intermediate_size=8192, num_hidden_layers=8,
                                        num_attention_heads=4, num_key_value_heads=2)),  # 127 MB
    "moe-smoke": ("Qwen3MoeConfig", dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                                         norm_topk_prob=True)),  # 127 MB
}
SMOKE_BUDGET_FRACTION = 0.5
# Requests and output tokens per request.
SIZES = {"full": (128, 32), "quick": (32, 16), "smoke": (8, 4)}


def build_model(name: str) -> Path:
    """The model's safetensors directory, random-initialised (seed 0) on first use."""
    import transformers

    config_name, config = MODELS[name]
    directory = CACHE / name
    if (directory / "config.json").exists():
        return directory
    print(f"building {name} in {directory} (once)", flush=True)
    hf_config = getattr(transformers, config_name)(**_BASE, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    partial = directory.with_name(name + ".partial")
    model.save_pretrained(partial, max_shard_size="1GB")
    partial.rename(directory)
    return directory


def weight_bytes(model_dir: Path) -> int:
    """Bytes of all the checkpoint's tensors (fp32: the models are built so)."""
    from safetensors import safe_open

    from runtime.loader import safetensors_files

    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) * 4 for key in f.keys())
    return total


def work_items(num_requests: int, max_tokens: int) -> list[WorkItem]:
    from runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir())
    prompts = bundled_prompts()
    items = []
    for i in range(num_requests):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                             tokenize=False, add_generation_prompt=True)
        items.append(WorkItem(f"w3-{i}", tokenizer.encode(text, add_special_tokens=False), max_tokens))
    return items


def kv_bytes(model_dir: Path, items: list[WorkItem]) -> int:
    """fp32 KV for every request's whole context at once, in 16-token blocks, plus a block each."""
    from runtime.config import load_hf_config, model_spec
    from runtime.kv_cache import KVCache

    per_block = KVCache.bytes_per_block(model_spec(load_hf_config(model_dir)), 16, torch.float32)
    return sum(-(-(len(it.prompt_ids) + it.max_tokens) // 16) + 1 for it in items) * per_block


def run_child(system: str, work: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work_file, result_file = Path(tmp) / "work.json", Path(tmp) / "result.json"
        work_file.write_text(json.dumps({**work, "offload_folder": str(Path(tmp) / "offload")}))
        subprocess.run([sys.executable, "-m", "benchmarks.w3_run", system, str(work_file), str(result_file)],
                       check=True)
        return json.loads(result_file.read_text())


def run_model(name: str, items: list[WorkItem], threads: int, fraction: float, systems: list[str],
              device: str) -> dict:
    model_dir = build_model(name)
    weights = weight_bytes(model_dir)
    work = {"model": str(model_dir), "items": [vars(it) for it in items], "threads": threads,
            "budget": int(weights * fraction), "kv_bytes": kv_bytes(model_dir, items),
            "peer_batch": PEER_BATCH, "device": device}
    print(f"{name}: {weights / 1e9:.2f} GB of weights, budget {work['budget'] / 1e9:.2f} GB, "
          f"KV {work['kv_bytes'] / 1e9:.2f} GB", flush=True)
    results = []
    for system in ["ours"] + [s for s in systems if s != "ours"]:  # ours first: the reference
        results.append(run_child(system, work))
        r = results[-1]
        gpu = f"  peak GPU {r['peak_device_bytes'] / 1e9:.2f} GB" if device == "cuda" else ""
        print(f"  {r['system']:<48} {r['batch_completion_s']:7.1f} s  peak RSS {r['peak_rss'] / 1e9:.2f} GB{gpu}  "
              f"{r['weight_bytes_per_token'] / 1e6:,.0f} MB read/token", flush=True)
    mismatches = report.compare(results, items)
    for streamed in (r for r in results if "weight_bytes_held" in r):  # our streaming rows
        if device == "cpu":
            streamed["rss_bound"] = work["budget"] + work["kv_bytes"] + streamed["baseline_rss"]
            streamed["peak_rss_over_budget_kv_baseline"] = streamed["peak_rss"] - streamed["rss_bound"]
        else:
            streamed["peak_device_over_budget_kv"] = (streamed["peak_device_bytes"] - work["budget"]
                                                      - work["kv_bytes"])
    return {"model": name, "model_dir": str(model_dir), "weight_bytes": weights,
            "weight_budget_bytes": work["budget"], "kv_cache_bytes": work["kv_bytes"],
            "peer_batch": PEER_BATCH, "work_mismatches": mismatches, "results": results}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=f"{SIZES['quick'][0]} requests x {SIZES['quick'][1]} tokens")
    size.add_argument("--smoke", action="store_true", help="tiny models, a few tokens: checks the harness")
    parser.add_argument("--models", nargs="+", choices=["dense", "moe"], default=["dense", "moe"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["ours", "peer"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cpu" and CUDA_ONLY & set(args.systems):
        parser.error(f"--systems {' '.join(sorted(CUDA_ONLY))} stream from host memory to a GPU: add --device cuda")

    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    num_requests, max_tokens = SIZES[mode]
    items = work_items(num_requests, max_tokens)
    workload = ("W3" if mode == "full" else f"W3-{mode}") + (
        "" if args.models == ["dense", "moe"] else "-" + "-".join(args.models)) + (
        "" if args.systems == ["ours", "peer"] else "-" + "-".join(args.systems)) + (
        "" if args.threads == 2 else f"-{args.threads}thread") + (
        "" if args.device == "cpu" else f"-{args.device}")
    fraction = SMOKE_BUDGET_FRACTION if args.smoke else BUDGET_FRACTION
    print(f"{workload}: {num_requests} requests x {max_tokens} tokens, weight budget "
          f"{fraction:.0%} of the weights", flush=True)
    runs = [run_model(name + ("-smoke" if args.smoke else ""), items, args.threads, fraction, args.systems,
                      args.device) for name in args.models]
    summary = {"workload": workload, "requests": num_requests, "output_tokens": num_requests * max_tokens,
               "budget_fraction": fraction, "device": args.device,
               "machine": report.machine(args.threads), "models": runs}
    if args.device == "cuda":
        summary["machine"]["gpu"] = torch.cuda.get_device_name()
    for run in runs:
        for r in run["results"]:
            r.pop("tokens")
    report.RESULTS_DIR.mkdir(exist_ok=True)
    out = report.RESULTS_DIR / f"{workload}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return summary


if __name__ == "__main__":
    main()
