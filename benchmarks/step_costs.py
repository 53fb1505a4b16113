"""Measured per-step costs of one engine: decode step time by batch size, prefill time per token,
and what moving a running sequence's KV to another engine costs per token (export, pickle both
ways, write into a cache). W4 records them in its JSON and the multi-worker simulation
(benchmarks/w4_simulate.py) projects from them.

    python -m benchmarks.step_costs [--threads 1] [--batch-sizes 1 2 4 8 16 32 64]
"""

import argparse
import json
import pickle
import time
from pathlib import Path

import torch

from benchmarks.workloads import w1
from runtime import Engine, Request, SamplingParams
from runtime.default_model import default_model_dir
from runtime.tokenizer import load_tokenizer

DECODE_STEPS = 8  # timed decode steps per batch size, after one untimed warm-up step
PREFILL_TOKENS = 512  # one chunk: W1's prompt set concatenated, cut to this length
RESIDENT_TOKENS = 512  # decode sequences' max_tokens: more than prefill and timed steps take


def start_decoding(engine: Engine, requests: list[Request]) -> None:
    """Submit the requests and step until every one is resident and past its prefill, then one
    untimed warm-up step with all of them decoding."""
    for request in requests:
        engine.submit(request)
    engine.step()  # submitted requests reach the scheduler only when a step drains the inbox
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    assert len(engine.scheduler.running) == len(requests), "not every request is resident"
    engine.step()


def _decode_step_seconds(engine: Engine, prompts: list[list[int]], batch: int) -> float:
    """Median decode step time with `batch` sequences resident, all past their prefill."""
    # Long enough that none finishes while the later ones prefill or during the timed steps
    # (taken out after them, not run to their end).
    requests = [Request(f"d{batch}-{i}", prompt_token_ids=prompts[i % len(prompts)],
                        params=SamplingParams(max_tokens=RESIDENT_TOKENS, ignore_eos=True))
                for i in range(batch)]
    start_decoding(engine, requests)
    times = []
    for _ in range(DECODE_STEPS):
        assert len(engine.scheduler.running) == batch, "a sequence left during the timed steps"
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request in requests:
        engine.migrate_out(request.id)
    assert not engine.has_unfinished()
    return sorted(times)[len(times) // 2]


def _prefill_seconds_per_token(engine: Engine, prompts: list[list[int]]) -> float:
    tokens = [t for p in prompts for t in p][:PREFILL_TOKENS]
    times = []
    for attempt in range(3):  # distinct first tokens: the prefix cache must not serve it
        ids = [tokens[attempt]] + tokens[1:]
        engine.submit(Request(f"p{attempt}", prompt_token_ids=ids, params=SamplingParams(max_tokens=1)))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        engine.poll()
    return sorted(times)[1] / len(tokens)


def _kv_migration_seconds_per_token(engine: Engine, prompts: list[list[int]]) -> float:
    """Migrate a sequence of PREFILL_TOKENS computed tokens, KV included, through pickle, and
    write its KV back into a cache: the work a donor and a taker do beyond the pipe between them."""
    tokens = [t for p in prompts for t in p][:PREFILL_TOKENS]
    engine.submit(Request("kv", prompt_token_ids=tokens,
                          params=SamplingParams(max_tokens=4, ignore_eos=True)))
    engine.step()
    engine.step()
    start = time.perf_counter()
    state = pickle.loads(pickle.dumps(engine.migrate_out("kv", with_kv=True)))
    [seq] = state["sequences"]
    blocks = engine.scheduler.blocks.allocate(seq["kv"].shape[2])
    engine.kv.write_blocks(blocks, seq["kv"])
    elapsed = time.perf_counter() - start
    engine.scheduler.blocks.release(blocks)
    return elapsed / seq["num_computed"]


def measure(model_dir: Path, threads: int, batch_sizes: list[int]) -> dict:
    torch.set_num_threads(threads)
    engine = Engine(model_dir, max_num_seqs=max(batch_sizes), max_num_batched_tokens=PREFILL_TOKENS,
                    kv_cache_bytes=1 << 30, enable_prefix_caching=False)
    prompts = [it.prompt_ids for it in w1(load_tokenizer(model_dir), 64)]
    return {"threads": threads,
            "decode_step_s": {b: _decode_step_seconds(engine, prompts, b) for b in batch_sizes},
            "prefill_s_per_token": _prefill_seconds_per_token(engine, prompts),
            "kv_migration_s_per_token": _kv_migration_seconds_per_token(engine, prompts)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = parser.parse_args(argv)
    costs = measure(default_model_dir(), args.threads, args.batch_sizes)
    print(json.dumps(costs, indent=2))
    return costs


if __name__ == "__main__":
    main()
