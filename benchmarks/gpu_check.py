"""The Triton kernels on a CUDA machine: each against its torch op (max abs error in fp32, fp16
and bf16) and timed against it, then the engine end to end on tiny random models with the
Triton kernels, its greedy tokens compared with the CPU torch path's, seeded sampling on CUDA,
and weight streaming on CUDA (pinned host slots, a copy stream) against the CUDA engine that
holds every weight.

    python -m benchmarks.gpu_check [--out benchmarks/results/gpu_check.json]

Set up from the repo root: `pip install torch==2.13.0 -e '.[test,cuda]'`. PyPI's Linux torch
2.13.0 wheel is the CUDA 13.0 build (it needs a driver that supports CUDA 13); with an older
driver first install torch 2.13.0 from the download.pytorch.org index for your CUDA version
(https://pytorch.org/get-started/locally/). `python -c "import torch;
print(torch.cuda.is_available())"` must print True.

Prints a table and writes the same rows as JSON. Exit status: 0 all good, 1 a kernel off its
tolerance or a token mismatch, 2 no CUDA device. Sized to finish in well under 5 minutes. No
downloads: the models are random, built from transformers configs.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kernels import activation, attention, moe, norm, rope

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Max abs error allowed, relative to the reference's largest magnitude (at least 1).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
TORCH_OPS = SimpleNamespace(
    add_rms_norm=norm.add_rms_norm, apply_rope=rope.apply_rope, grouped_experts=moe.grouped_experts,
    paged_decode_attention=attention.paged_decode_attention,
    paged_prefill_attention=attention.paged_prefill_attention, rms_norm=norm.rms_norm,
    silu_and_mul=activation.silu_and_mul, write_kv=attention.write_kv)

# Llama-8B-like attention and norms, Mixtral-like experts (scaled down to keep the run short).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 32, 8, 128, 16
EXPERTS, TOP_K, EXPERT_INTER = 8, 2, 1792


def _randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _paged_cache(context_lens, dtype):
    """K/V caches holding every sequence's context in shuffled blocks; tables padded with block 0
    (the ops' contract: any valid block id, masked)."""
    blocks = [-(-n // BLOCK) for n in context_lens]
    free = torch.randperm(sum(blocks)).tolist()
    tables = [[free.pop() for _ in range(n)] + [0] * (max(blocks) - n) for n in blocks]
    k, v = (_randn(sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2))
    return k, v, torch.tensor(tables, device="cuda")


def _decode(dtype):
    lens = torch.randint(1, 2049, (64,)).tolist()
    k, v, tables = _paged_cache(lens, dtype)
    return (_randn(64, HEADS, HEAD_DIM, dtype=dtype), k, v, tables, torch.tensor(lens, device="cuda"),
            HEAD_DIM ** -0.5)


def _prefill(dtype, window=None):
    start, chunk = 1000, 512
    k, v, tables = _paged_cache([start + chunk], dtype)
    return _randn(chunk, HEADS, HEAD_DIM, dtype=dtype), k, v, tables[0], start, HEAD_DIM ** -0.5, window


def _grouped_experts(dtype):
    tokens = 512
    ids = torch.stack([torch.randperm(EXPERTS - 1)[:TOP_K] for _ in range(tokens)]).cuda()  # one idle
    return (_randn(tokens, HIDDEN, dtype=dtype), ids, torch.softmax(torch.randn(tokens, TOP_K, device="cuda"), -1),
            _randn(EXPERTS, 2 * EXPERT_INTER, HIDDEN, dtype=dtype, scale=0.02),
            _randn(EXPERTS, HIDDEN, EXPERT_INTER, dtype=dtype, scale=0.02))


def _rope(dtype):
    angles = torch.rand(512, HEAD_DIM // 2, device="cuda") * 100
    qkv = _randn(512, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    q = qkv[:, :HEADS * HEAD_DIM].view(512, HEADS, HEAD_DIM)  # strided, as in the model
    return q, angles.cos().repeat(1, 2).to(dtype), angles.sin().repeat(1, 2).to(dtype)


def _write_kv(dtype):
    k_cache, v_cache, _ = _paged_cache([4096], dtype)
    kv = _randn(512, 2, KV_HEADS, HEAD_DIM, dtype=dtype)
    return k_cache, v_cache, torch.randperm(4096, device="cuda")[:512], kv[:, 0], kv[:, 1]


# (label, op, inputs in a dtype)
CASES = [
    ("paged_decode_attention", "paged_decode_attention", _decode),
    ("paged_prefill_attention", "paged_prefill_attention", _prefill),
    ("paged_prefill_attention w=256", "paged_prefill_attention", lambda dtype: _prefill(dtype, window=256)),
    ("grouped_experts", "grouped_experts", _grouped_experts),
    ("rms_norm", "rms_norm",
     lambda dtype: (_randn(2048, HIDDEN, dtype=dtype, scale=3), _randn(HIDDEN, dtype=dtype), 1e-5)),
    ("add_rms_norm", "add_rms_norm",
     lambda dtype: (*(_randn(2048, HIDDEN, dtype=dtype) for _ in range(2)), _randn(HIDDEN, dtype=dtype), 1e-5)),
    ("apply_rope", "apply_rope", _rope),
    ("silu_and_mul", "silu_and_mul", lambda dtype: (_randn(2048, 2 * 14336, dtype=dtype, scale=3),)),
    ("write_kv", "write_kv", _write_kv),
]


def _run(ops, op: str, args) -> tuple[torch.Tensor, ...]:
    """The op's tensors to compare: write_kv's are the caches it wrote, grouped_experts' the
    combined output (its counts come from the same torch code on both paths)."""
    result = getattr(ops, op)(*args)
    if op == "write_kv":
        return args[0], args[1]
    if op == "grouped_experts":
        return result[0],
    return result if isinstance(result, tuple) else (result,)


def _upcast(args):
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def check_kernels(triton_ops) -> list[dict]:
    from triton.testing import do_bench

    print(f"{'op':30} dtype  {'max abs err':>21}       triton (median)   torch (median)  speedup")
    rows = []
    for label, op, inputs in CASES:
        for dtype_name, dtype in DTYPES.items():
            torch.manual_seed(0)
            args = inputs(dtype)
            got, want = _run(triton_ops, op, args), _run(TORCH_OPS, op, _upcast(args))
            error = max((g.float() - w).abs().max().item() for g, w in zip(got, want))
            scale = max(1.0, *(w.abs().max().item() for w in want))
            triton_ms = do_bench(lambda: _run(triton_ops, op, args), return_mode="median")
            torch_ms = do_bench(lambda: _run(TORCH_OPS, op, args), return_mode="median")
            row = dict(op=label, dtype=dtype_name, max_abs_err=error,
                       ok=error <= TOLERANCE[dtype] * scale, triton_ms=triton_ms, torch_ms=torch_ms,
                       speedup=torch_ms / triton_ms)
            rows.append(row)
            print(f"{label:30} {dtype_name:5} {error:21.2e} {'ok  ' if row['ok'] else 'FAIL'}"
                  f"  {triton_ms:11.3f} ms   {torch_ms:11.3f} ms   x{row['speedup']:5.2f}",
                  flush=True)
    return rows


def _tiny_model(family: str, directory: Path) -> Path:
    """A random model in the spirit of tests/tiny_models.py: GQA, and for the MoE family a
    dense and a sparse layer, a shared expert and a sliding window."""
    import transformers

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
    if family == "llama":
        config, model_cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2,
                                             moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                             decoder_sparse_step=2, use_sliding_window=True, sliding_window=24)
        model_cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    model_cls(config).save_pretrained(directory)
    return directory


def check_engine() -> list[dict]:
    from runtime import Engine, Request, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 5, 16, 17, 33, 64, 100, 150)]
    requests = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=32))
                for i, p in enumerate(prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llama", "qwen2_moe"):
            model = _tiny_model(family, Path(tmp) / family)
            # A small step budget prefills the longer prompts in chunks.
            # On a machine of several GPUs, the last while device 0 is current: the Triton
            # kernels must launch on the engine's device, not the current one.
            cuda = f"cuda:{torch.cuda.device_count() - 1}"
            engines = {device: Engine(model, device=device, kv_cache_bytes=64 << 20, max_num_batched_tokens=64)
                       for device in ("cpu", cuda)}
            engines["cuda"] = engines.pop(cuda)
            expected = [c.token_ids for c in engines["cpu"].generate(requests)]
            start = time.perf_counter()
            got = [c.token_ids for c in engines["cuda"].generate(requests)]
            elapsed = time.perf_counter() - start
            same = sum(a == b for a, b in zip(expected, got))
            rows.append(dict(model=family, requests=len(requests), identical=same,
                             ok=same == len(requests), cuda_s=elapsed))
            print(f"engine {family:10} greedy tokens identical to CPU torch: {same}/{len(requests)}"
                  f" ({elapsed:.1f} s on CUDA)", flush=True)
            rows.append(_check_sampling(engines, prompts, family))
            rows += [_check_streaming(model, requests, got, host_copy) for host_copy in (False, True)]
    return rows


def _check_sampling(engines, prompts, family: str) -> dict:
    """Seeded sampling on CUDA: every request completes (each sequence's generator is a CPU
    one) and a second run draws the same tokens. Tokens equal to the CPU engine's are counted,
    not required: logits that differ in the last bits can tip a draw."""
    from runtime import Request, SamplingParams

    requests = [Request(f"s{i}", prompt_token_ids=p,
                        params=SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=i))
                for i, p in enumerate(prompts)]
    runs = [engines["cuda"].generate(requests) for _ in range(2)]
    errors = [c.error for c in runs[0] + runs[1] if c.error]
    repeated = sum(a.token_ids == b.token_ids for a, b in zip(*runs))
    like_cpu = sum(a.token_ids == b.token_ids for a, b in zip(runs[0], engines["cpu"].generate(requests)))
    ok = not errors and repeated == len(requests)
    print(f"engine {family:10} seeded sampling on CUDA: {len(errors)} errors, {repeated}/{len(requests)} "
          f"repeated, {like_cpu}/{len(requests)} as on CPU", flush=True)
    return dict(model=f"{family} (seeded sampling)", requests=len(requests), errors=errors[:3],
                repeated=repeated, identical_to_cpu=like_cpu, ok=ok)


def _check_streaming(model: Path, requests, expected: list[list[int]], host_copy: bool) -> dict:
    """Weight streaming on CUDA (pinned slots, a copy stream; host_copy: from a pinned host copy
    of the weights) at the smallest budget that fits, so an MoE layer's routed experts stream in
    chunks of one: greedy tokens against the CUDA engine that holds every weight."""
    from runtime import Engine

    probe = Engine(model, device="cuda", weight_budget_bytes=1 << 30, kv_cache_bytes=64 << 20).weights
    budget = probe.resident_bytes + 2 * probe.slot_bytes + 2 * probe.expert_bytes
    del probe
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = Engine(model, device="cuda", weight_budget_bytes=budget, kv_cache_bytes=64 << 20,
                    max_num_batched_tokens=64, weights_in_host_memory=host_copy)
    label = f"{model.name}{' host copy' if host_copy else ''}"
    start = time.perf_counter()
    got = [c.token_ids for c in engine.generate(requests)]
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base  # weights, KV cache and activations
    same = sum(a == b for a, b in zip(expected, got))
    print(f"streaming {label:17} greedy tokens identical to CUDA resident: {same}/{len(requests)}"
          f" (budget {budget:,} B + KV {64 << 20:,} B; peak device memory {peak:,} B; "
          f"{engine.stats.weight_bytes_read:,} B read, {elapsed:.1f} s)", flush=True)
    return dict(model=f"{label} (weight streaming)", requests=len(requests), identical=same,
                ok=same == len(requests), cuda_s=elapsed, weight_budget_bytes=budget,
                kv_cache_bytes=64 << 20, peak_device_bytes=peak,
                weight_bytes_read=engine.stats.weight_bytes_read)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}): run it on a CUDA machine, set up as the docstring says",
              file=sys.stderr)
        return 2
    import triton

    from kernels.backend import triton_ops
    kernels = check_kernels(triton_ops())
    engine = check_engine()
    ok = all(row["ok"] for row in kernels + engine)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  ok=ok, kernels=kernels, engine=engine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{'all good' if ok else 'MISMATCH'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
