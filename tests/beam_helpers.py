"""Helpers for the Beam-face tests: the shared tiny chat model, running a pipeline on the
DirectRunner and reading its outputs back, and Beam metrics.

Functions that run inside a pipeline come from batchgen_beam or the standard library (pickled by
reference) or are lambdas (pickled by value), so SDK worker processes never import this module."""

import json
import os
import time
from pathlib import Path

import apache_beam as beam
import psutil
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions

REPO = Path(__file__).resolve().parent.parent
FAMILY = "qwen2"
CONTEXT = 64  # max_position_embeddings of the tiny model: a long prompt is an engine-level error
# Small KV cache (the 2 GiB default takes a second just to zero); one thread on a shared machine.
ENGINE_ARGS = {"kv_cache_bytes": 1 << 24, "num_threads": 1}
IN_MEMORY = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
MULTI_PROCESSING = ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                    "--direct_num_workers=2"]


def chat_model_dir(tiny_chat) -> Path:
    """The tiny chat model both Beam test modules use: the same directory and ENGINE_ARGS mean
    the same engine process, started once per pytest session."""
    return tiny_chat.dir(FAMILY, max_position_embeddings=CONTEXT)


def bundled_prompts(tokenizer, count: int, max_prompt_tokens: int) -> list[str]:
    """`count` prompts from the bundled prompt set whose tokens fit `max_prompt_tokens`."""
    lines = (REPO / "batchgen_beam" / "data" / "prompts.jsonl").read_text(encoding="utf-8")
    prompts = [json.loads(line)["prompt"] for line in lines.splitlines()]
    fitting = [p for p in prompts if len(tokenizer.encode(p)) <= max_prompt_tokens]
    assert len(fitting) >= count, f"only {len(fitting)} bundled prompts fit {max_prompt_tokens} tokens"
    return fitting[:count]


def run_pipeline(build, out_dir: Path, flags: list[str]):
    """Run `build(pipeline) -> {name: PCollection of JSON strings}` and read each output back.
    Returns ({name: [decoded JSON values]}, the PipelineResult)."""
    pipeline = beam.Pipeline(options=PipelineOptions(flags))
    names = []
    for name, pcoll in build(pipeline).items():
        names.append(name)
        pcoll | f"Write {name}" >> beam.io.WriteToText(str(out_dir / name), file_name_suffix=".jsonl")
    result = pipeline.run()
    result.wait_until_finish()
    outputs = {}
    for name in names:
        lines = [line for path in sorted(out_dir.glob(f"{name}-*.jsonl"))
                 for line in path.read_text(encoding="utf-8").splitlines()]
        outputs[name] = [json.loads(line) for line in lines]
    return outputs, result


def counter(result, name: str, namespace: str = "batchgen") -> int:
    """The committed value of a Beam counter, summed over steps (0 if it never moved)."""
    found = result.metrics().query(MetricsFilter().with_namespace(namespace).with_name(name))
    return sum(c.committed for c in found["counters"])


def distribution(result, name: str, namespace: str = "batchgen"):
    """The committed DistributionResult of a Beam distribution (exactly one step must report it)."""
    found = result.metrics().query(MetricsFilter().with_namespace(namespace).with_name(name))
    [dist] = found["distributions"]
    return dist.committed


def worker_pythonpath(monkeypatch) -> None:
    """SDK worker processes (multi_processing) must import batchgen_beam and runtime."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))


def gone(pid: int, within: float = 15.0) -> bool:
    """Whether the process ends (or is a zombie: ended, not yet reaped) within the time."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False
