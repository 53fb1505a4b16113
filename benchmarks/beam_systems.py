"""The Beam systems of DESIGN.md §8 on W1 work: our `Generate` transform, and `RunInference` with a
ModelHandler that calls transformers `generate` per batch (what a Beam user gets today).

Both run chat records on the DirectRunner; their time is first element → last row written, which
includes Beam's own start-up (model load excluded where the system allows: our engine process is
started before the clock, and reported separately; RunInference loads its model inside the
pipeline, so its time includes the load and its `load_s` is None).
"""

import glob
import json
import os
import tempfile
import time
from pathlib import Path

import apache_beam as beam
import torch
from apache_beam.ml.inference.base import ModelHandler, PredictionResult, RunInference
from apache_beam.options.pipeline_options import PipelineOptions

from batchgen_beam.engine_client import EngineClient, EngineConfig
from batchgen_beam.generate import Generate
from benchmarks.workloads import bundled_prompts, w1_output_lengths, w1_sampling


def w1_records(num_requests: int, sampled: bool = False) -> list[dict]:
    """W1 as records: the same prompts (chat messages), output lengths and sampling as `workloads.w1`."""
    prompts = bundled_prompts()
    return [{"id": f"w1-{i}", "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
             "max_tokens": length, "ignore_eos": True, **w1_sampling(i, sampled)}
            for i, length in enumerate(w1_output_lengths(num_requests))]


def _run_pipeline(records: list[dict], transform, to_pair) -> tuple[float, dict]:
    """Run records through `transform`; return the seconds it took and {id: token ids}. Rows go
    through files: the runner pickles functions, so appending to a list here would fill a copy."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        with beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner"])) as pipeline:
            (pipeline | beam.Create(records) | transform | beam.Map(lambda r: json.dumps(to_pair(r)))
             | beam.io.WriteToText(os.path.join(out, "rows")))
        seconds = time.perf_counter() - start
        pairs = [json.loads(line) for path in glob.glob(os.path.join(out, "rows*"))
                 for line in open(path, encoding="utf-8")]
    rows = dict(pairs)
    if len(rows) != len(pairs) or len(rows) != len(records):  # exactly one row per record
        raise RuntimeError(f"{len(pairs)} rows for {len(records)} records ({len(rows)} distinct ids)")
    return seconds, rows


def generate(records: list[dict], engine_args: dict) -> dict:
    config = EngineConfig.of(None, **engine_args)
    start = time.perf_counter()
    client = EngineClient.shared(config)  # one engine process for the harness's whole run
    client.info()  # start the engine process before the clock runs
    engine_start = time.perf_counter() - start
    client.reset_prefix_cache()  # an earlier round's prompts must not be cached: every system starts cold
    seconds, tokens = _run_pipeline(records, Generate(engine_args=engine_args),
                                    lambda row: (row["id"], row["token_ids"]))
    plan = client.info()["linear_plan"]  # measured in the engine's process
    return {"system": "Generate (Beam DirectRunner)", "load_s": engine_start,
            "batch_completion_s": seconds, "output_tokens": sum(map(len, tokens.values())),
            "linear_plan": plan, "tokens": tokens}


class _HFModel:
    """Model and tokenizer together (Beam's model cache needs a weak-referenceable object)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer


class TransformersGenerateHandler(ModelHandler):
    """Beam's way today: each batch padded and run through transformers `generate` until its
    longest request is done."""

    def __init__(self, model_dir: Path, batch_size: int):
        super().__init__(min_batch_size=batch_size, max_batch_size=batch_size)
        self._model_dir = model_dir

    def load_model(self):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=torch.float32).eval()
        return _HFModel(model, AutoTokenizer.from_pretrained(self._model_dir, padding_side="left"))

    def run_inference(self, batch, loaded, inference_args=None):
        model, tokenizer = loaded.model, loaded.tokenizer
        texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
                 for r in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        longest = max(r["max_tokens"] for r in batch)
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=longest,
                                 eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
        width = inputs["input_ids"].shape[1]
        return [PredictionResult(r, out[i, width:width + r["max_tokens"]].tolist())
                for i, r in enumerate(batch)]


def runinference_hf(model_dir: Path, records: list[dict], batch_size: int) -> dict:
    seconds, tokens = _run_pipeline(records, RunInference(TransformersGenerateHandler(model_dir, batch_size)),
                                    lambda result: (result.example["id"], result.inference))
    return {"system": f"RunInference + transformers generate (batch {batch_size})", "load_s": None,
            "batch_completion_s": seconds, "output_tokens": sum(map(len, tokens.values())),
            "tokens": tokens}
