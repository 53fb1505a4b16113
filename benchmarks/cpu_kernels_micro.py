"""The C++ CPU kernels (kernels/cpu_kernels.py) against the torch ops they replace: decode
attention alone at the default model's shape (all its layers, batch 64 x context 300); all the
default model's linears (its 30 layers' projections and the lm_head) at decode row counts: the
few-row kernel on plain weights and the panel kernel on packed ones against MKL's sgemm and
oneDNN's on its packed weights; and one engine decode step, every C++ kernel against every torch op, at
batch 3, 8, 32 and 64 with contexts of about 300. Writes results/cpu_kernels_micro.json.

    python -m benchmarks.cpu_kernels_micro [--threads 2] [--out benchmarks/results/cpu_kernels_micro.json]

Both implementations run in the same process, alternating, so the machine's drift hits both.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import kernels
from benchmarks.step_costs import start_decoding
from benchmarks.workloads import bundled_prompts
import torch.nn.functional as F

from benchmarks import onednn
from kernels import attention, cpu_kernels
from runtime import Engine, Request, SamplingParams
from runtime.config import ModelSpec, load_hf_config, model_spec
from runtime.default_model import default_model_dir
from runtime.tokenizer import load_tokenizer

BATCH, CONTEXT, BLOCK_SIZE = 64, 300, 16
ENGINE_BATCHES = (3, 8, 32, 64)
LINEAR_ROWS = (1, 2, 3, 4, 8, 12, 16, 24, 32, 64, 128, 256)
REPEATS = 7  # timed repeats per implementation
CHOICES = ("torch", "cpp")


def _summary_ms(times: list[float]) -> dict:
    """Median and best: on a shared machine other work only ever adds time, so the best of the
    repeats is the steadier estimate when the median moves."""
    return {"median": round(statistics.median(times) * 1e3, 1), "min": round(min(times) * 1e3, 1)}


def attention_layers(spec: ModelSpec) -> dict:
    """Decode attention over every layer's own cache (so nothing stays in the CPU caches between
    layers), each sequence's blocks scattered through the cache."""
    g = torch.Generator().manual_seed(0)
    width = -(-CONTEXT // BLOCK_SIZE)
    shape = (BATCH * width, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
              for _ in range(spec.num_layers)]
    tables = torch.randperm(BATCH * width, generator=g).view(BATCH, width)
    lens = torch.full((BATCH,), CONTEXT)
    q = torch.randn(BATCH, spec.num_heads, spec.head_dim, generator=g)
    ops = {"torch": attention.paged_decode_attention, "cpp": cpu_kernels.paged_decode_attention}
    scale = spec.head_dim ** -0.5

    def all_layers(op):
        return [op(q, k, v, tables, lens, scale) for k, v in caches]

    outs = {name: all_layers(op) for name, op in ops.items()}  # warm-up, and the agreement check
    times = {name: [] for name in ops}
    for _ in range(REPEATS):
        for name, op in ops.items():
            start = time.perf_counter()
            all_layers(op)
            times[name].append(time.perf_counter() - start)
    return {"layers": spec.num_layers, "batch": BATCH, "context": CONTEXT,
            "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "ms": {name: _summary_ms(t) for name, t in times.items()},
            "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(*outs.values()))}


def linears(model_dir: Path) -> dict:
    """Time to run all of the default model's linears once (what a decode step reads: every
    weight), x rows at a time: C++ kernel, MKL's sgemm, and (where torch has it) oneDNN's on
    weights packed into its layout. Random weights of its shapes."""
    spec = model_spec(load_hf_config(model_dir))
    g = torch.Generator().manual_seed(1)
    hidden, qkv = spec.hidden_size, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    shapes = [(qkv, hidden), (spec.num_heads * spec.head_dim, hidden), (2 * spec.intermediate_size, hidden),
              (hidden, spec.intermediate_size)]
    weights = [torch.randn(shape, generator=g) for _ in range(spec.num_layers) for shape in shapes]
    weights.append(torch.randn(spec.vocab_size, hidden, generator=g))
    panel = cpu_kernels.build().panel_linear
    ops = {"mkl": (F.linear, weights), "cpp": (cpu_kernels.build().small_rows_linear, weights),
           "panel": (lambda x, packed, bias: panel(x, *packed, bias),
                     [(cpu_kernels.pack_panels(w), w.shape[0]) for w in weights])}
    if onednn.available():
        ops["onednn"] = (onednn.linear, [onednn.pack(w) for w in weights])
    results = {}
    for rows in LINEAR_ROWS:
        inputs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in weights}}
        times = {name: [] for name in ops}
        for repeat in range(REPEATS + 1):  # the first round warms up
            for name, (op, op_weights) in ops.items():
                start = time.perf_counter()
                for w, plain in zip(op_weights, weights):
                    op(inputs[plain.shape[1]], w, None)
                if repeat:
                    times[name].append(time.perf_counter() - start)
        results[str(rows)] = {name: _summary_ms(t) for name, t in times.items()}
    return {"weights_mb": round(sum(w.numel() for w in weights) * 4 / 1e6, 1), "ms": results}


def engine_steps(model_dir: Path) -> dict:
    """Median decode step time per implementation, batches of distinct ~CONTEXT-token prompts
    (no shared prefix blocks), the two implementations alternating step by step."""
    tokenizer = load_tokenizer(model_dir)
    text = [t for p in bundled_prompts() for t in tokenizer.encode(p)]
    engine = Engine(model_dir, max_num_seqs=max(ENGINE_BATCHES), max_num_batched_tokens=1024,
                    kv_cache_bytes=1 << 30, enable_prefix_caching=False)
    results = {}
    for batch in ENGINE_BATCHES:
        # Enough tokens that none finishes: the first prefilled decode during the others' prefill.
        requests = [Request(f"b{batch}-{i}", prompt_token_ids=(text[i:] + text[:i])[:CONTEXT - 1],
                            params=SamplingParams(max_tokens=CONTEXT, ignore_eos=True))
                    for i in range(batch)]
        start_decoding(engine, requests)
        decode_steps = engine.stats.decode_steps
        times = {choice: [] for choice in CHOICES}
        for _ in range(REPEATS):
            for choice in CHOICES:
                os.environ["BATCHGEN_CPU_KERNELS"] = choice
                start = time.perf_counter()
                engine.step()
                times[choice].append(time.perf_counter() - start)
        os.environ.pop("BATCHGEN_CPU_KERNELS")
        assert engine.stats.decode_steps - decode_steps == REPEATS * len(CHOICES), "a timed step prefilled"
        for request in requests:  # dropped, not run to the end
            engine.migrate_out(request.id)
        assert not engine.has_unfinished()
        results[str(batch)] = {choice: _summary_ms(t) for choice, t in times.items()}
    return {"context": CONTEXT, "decode_step_ms": results}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_kernels_micro.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels.prepare("cpu")
    model_dir = default_model_dir()
    with torch.inference_mode():
        layers = attention_layers(model_spec(load_hf_config(model_dir)))
        linear = linears(model_dir)
    report = {"threads": args.threads, "attention": layers, "linears": linear,
              "engine": engine_steps(model_dir)}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
