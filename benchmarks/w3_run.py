"""One W3 system on one model, alone in this process, so its peak memory is its own:

    python -m benchmarks.w3_run {ours,host,resident,peer,peer-ram} WORK_JSON RESULT_JSON

WORK_JSON: model dir, items, weight budget, KV bytes, threads, peer batch size, offload folder,
device (on cuda the budget is GPU memory). Peak RSS is the kernel's high-water mark for this
program (VmHWM: anonymous and file-mapped pages, model load included); `baseline_rss` is the RSS
after imports, before any model is loaded (the interpreter, torch and transformers). On cuda, `peak_device_bytes` is the most GPU memory
torch's allocator held (weights, KV cache and activations).
"""

import json
import sys
import time
from pathlib import Path

import psutil
import torch

from benchmarks.workloads import WorkItem


def _peak_rss() -> int:
    """VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork and exec, so a child
    started right after benchmarks.w3 built a model reported the parent's peak (5 GB for 1.8)."""
    with open("/proc/self/status", encoding="ascii") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    return int(kib) * 1024


def _engine_run(work: dict, items: list[WorkItem], **engine_args) -> tuple[object, dict]:
    """Our engine built for the work and timed on it: (the engine, the common result fields)."""
    from runtime import Engine

    start = time.perf_counter()
    engine = Engine(work["model"], kv_cache_bytes=work["kv_bytes"], num_threads=work["threads"],
                    device=work["device"], **engine_args)
    load = time.perf_counter() - start
    start = time.perf_counter()
    completions = engine.generate([it.request() for it in items])
    elapsed = time.perf_counter() - start
    stats = engine.stats
    return engine, {"load_s": load, "batch_completion_s": elapsed,
                    "tokens": {c.id: c.token_ids for c in completions}, "steps": stats.steps,
                    "generated_tokens": stats.generated_tokens,
                    "weight_bytes_read": stats.weight_bytes_read,
                    "weight_bytes_per_token": stats.weight_bytes_per_token,
                    "kv_cache_bytes": work["kv_bytes"]}


def ours(work: dict, items: list[WorkItem]) -> dict:
    engine, result = _engine_run(work, items, weight_budget_bytes=work["budget"])
    return {"system": "batchgen engine (weight streaming)", **result,
            "weight_bytes_held": engine.weights.budget_used,
            "engine_args": {"max_num_seqs": engine.scheduler.max_num_seqs,
                            "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
                            "ring_experts_per_half": engine.weights.ring_experts},
            "bytes_read_counted_by": "engine counter: bytes read from the safetensors files (os.preadv)"}


def host(work: dict, items: list[WorkItem]) -> dict:
    """CUDA: streaming from pinned host memory (the checkpoint read once) instead of the files."""
    engine, result = _engine_run(work, items, weight_budget_bytes=work["budget"], weights_in_host_memory=True)
    return {"system": "batchgen engine (weight streaming from pinned host memory)", **result,
            "weight_bytes_held": engine.weights.budget_used, "host_bytes": engine.weights.host_bytes,
            "bytes_read_counted_by": "engine counter: bytes copied from host memory to the device"}


def resident(work: dict, items: list[WorkItem]) -> dict:
    """Our engine with every weight in memory, same batch limits as streaming: the reference for
    token-exactness and for what streaming costs."""
    from runtime.engine import STREAMING_BATCH

    _, result = _engine_run(work, items, **STREAMING_BATCH)
    return {"system": "batchgen engine (all weights resident)", **result}


class _OffloadCounter:
    """Bytes of offloaded weights accelerate loads back (every OffloadedWeightsLoader lookup)."""

    def __init__(self):
        from accelerate.utils import offload

        self.bytes = 0
        original = offload.OffloadedWeightsLoader.__getitem__

        def counting(loader, key):
            tensor = original(loader, key)
            self.bytes += tensor.numel() * tensor.element_size()
            return tensor

        offload.OffloadedWeightsLoader.__getitem__ = counting


def peer(work: dict, items: list[WorkItem]) -> dict:
    # What exceeds the budget goes to disk: on cuda nothing is kept in host RAM either.
    memory = {"cpu": work["budget"]} if work["device"] == "cpu" else {0: work["budget"], "cpu": 0}
    return _accelerate(work, items, memory, "disk offload")


def peer_ram(work: dict, items: list[WorkItem]) -> dict:
    """CUDA: what exceeds the GPU budget stays in host RAM (accelerate's CPU offload)."""
    return _accelerate(work, items, {0: work["budget"], "cpu": "1000GiB"}, "CPU offload")


def _accelerate(work: dict, items: list[WorkItem], memory: dict, kind: str) -> dict:
    from transformers import AutoModelForCausalLM

    from benchmarks.systems import padded_generate

    torch.set_num_threads(work["threads"])
    counter = _OffloadCounter()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        work["model"], dtype=torch.float32, device_map="auto", max_memory=memory,
        offload_folder=work["offload_folder"]).eval()
    load = time.perf_counter() - start
    placement = list(model.hf_device_map.values())
    load_bytes, counter.bytes = counter.bytes, 0
    tokens, generated, elapsed = padded_generate(model, items, work["peer_batch"], work["device"])
    return {"system": f"transformers + accelerate {kind} (batch {work['peer_batch']})",
            "load_s": load, "batch_completion_s": elapsed, "tokens": tokens,
            "generated_tokens": generated, "weight_bytes_read": counter.bytes,
            "weight_bytes_per_token": counter.bytes / generated, "weight_bytes_read_at_load": load_bytes,
            "modules_on_disk": placement.count("disk"), "modules_in_ram": placement.count("cpu"),
            "modules_on_gpu": placement.count(0),
            "bytes_read_counted_by": "offloaded tensors accelerate loads back (OffloadedWeightsLoader)"}


def main() -> None:
    system, work_file, result_file = sys.argv[1:]
    work = json.loads(Path(work_file).read_text())
    items = [WorkItem(**it) for it in work["items"]]
    import runtime  # noqa: F401  both systems' libraries, so the baseline counts them for both
    import transformers  # noqa: F401
    baseline = psutil.Process().memory_info().rss
    result = {"ours": ours, "host": host, "resident": resident, "peer": peer, "peer-ram": peer_ram}[system](work, items)
    result.update(output_tokens=sum(len(t) for t in result["tokens"].values()),
                  baseline_rss=baseline, peak_rss=_peak_rss())
    if work["device"] == "cuda":
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    Path(result_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
