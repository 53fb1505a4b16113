"""Small helpers shared by the engine tests."""

import json
import random
from pathlib import Path

import torch

from runtime import Completion, Engine, Request, SamplingParams

EOS = 2  # eos_token_id of every tiny model (tests/tiny_models.py)
VOCAB = 256


def random_prompt(length: int, rng: random.Random) -> list[int]:
    """Random token ids, never bos/eos/pad (0, 1, 2)."""
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(n, rng) for n in lengths]


def kv_block_bytes(model_dir: Path, block_size: int = 16) -> int:
    """fp32 KV bytes of one block: 2 (K and V) * layers * block_size * kv_heads * head_dim * 4."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)  # an image-text model's language model
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * block_size * kv_heads * head_dim * 4


def make_engine(model_dir: Path, num_blocks: int = 256, **kwargs) -> Engine:
    """An engine with a small KV cache (the 2 GiB default takes a second just to zero)."""
    kwargs.setdefault("kv_cache_bytes", num_blocks * kv_block_bytes(model_dir, kwargs.get("block_size", 16)))
    return Engine(model_dir, **kwargs)


def greedy_requests(prompts, max_tokens: int = 24, prefix: str = "r", **params) -> list[Request]:
    return [Request(f"{prefix}{i}", prompt_token_ids=list(p),
                    params=SamplingParams(max_tokens=max_tokens, logprobs=0, **params))
            for i, p in enumerate(prompts)]


def assert_matches(completion: Completion, expected_tokens, expected_logprobs, tol: float = 1e-4,
                   max_tokens: int | None = None) -> None:
    """Token-exact, logprobs within tol, and a finish reason consistent with the tokens."""
    assert completion.error is None, completion.error
    assert completion.token_ids == list(expected_tokens), completion.id
    assert completion.logprobs is not None and len(completion.logprobs) == len(expected_logprobs)
    worst = max((abs(a - b) for a, b in zip(completion.logprobs, expected_logprobs)), default=0.0)
    assert worst <= tol, f"{completion.id}: logprob off by {worst}"
    if max_tokens is not None:
        if len(expected_tokens) < max_tokens:
            assert expected_tokens[-1] == EOS
            assert completion.finish_reason == "stop"
        else:
            assert len(expected_tokens) == max_tokens
            assert completion.finish_reason == ("stop" if expected_tokens[-1] == EOS else "length")


def collect(engine: Engine) -> dict[str, Completion]:
    """Drive the engine (no background loop) until nothing is in flight; completions by id,
    failing on a duplicate."""
    done = {}
    for completion in engine.completions():
        assert completion.id not in done, f"{completion.id} completed twice"
        done[completion.id] = completion
    return done


def live_sequences(engine: Engine, request_id: str):
    """The request's sequences the scheduler holds (any queue), sample index order."""
    sched = engine.scheduler
    seqs = [s for s in list(sched.waiting) + list(sched.running) + list(sched.suspended)
            + list(sched.held.values()) if s.request_id == request_id]
    return sorted(seqs, key=lambda s: s.sample_index)


def assert_idle_and_clean(engine: Engine) -> None:
    """Nothing in flight, every KV block back on the free list, the host tier empty."""
    sched = engine.scheduler
    assert not engine.has_unfinished()
    assert not (sched.waiting or sched.running or sched.suspended or sched.held)
    assert engine.sequence_counts() == {"waiting": 0, "running": 0, "suspended": 0}
    assert sched.blocks.num_free == engine.kv.num_blocks
    assert all(count == 0 for count in sched.blocks.ref_counts)
    assert sched.host.used_blocks == 0


class BatchSpy:
    """Records, for every step, the batch the runner is asked to run (before it runs)."""

    def __init__(self, engine: Engine):
        self.steps: list[dict] = []
        original = engine.runner.run

        def run(batch):
            self.steps.append({
                "num_tokens": batch.num_tokens,
                "decodes": [s.request_id for s in batch.decodes],
                "prefills": [(s.request_id, s.num_computed, n) for s, n in batch.prefills],
            })
            return original(batch)

        engine.runner.run = run

    def prefill_chunks(self, request_id: str) -> list[tuple[int, int]]:
        """(start, length) of each prefill chunk the request ran."""
        return [(start, n) for step in self.steps for rid, start, n in step["prefills"]
                if rid == request_id]


class CallCounter:
    """Counts calls to a bound method of an object (and still calls it)."""

    def __init__(self, obj, name: str):
        self.calls = []
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            self.calls.append((args, kwargs))
            return original(*args, **kwargs)

        setattr(obj, name, wrapper)

    def __len__(self) -> int:
        return len(self.calls)


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt, tokens) -> list[float]:
    """transformers' log-probability of each generated token given everything before it: any
    output, sampled or not, must match it if the engine computed the right KV."""
    logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    rows = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return rows[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
