"""What Beam costs: `Generate` on the DirectRunner vs the bare engine on the same work, and vs
`RunInference` with a ModelHandler that calls transformers `generate` per batch (Beam's way today).

    python -m benchmarks.beam_overhead [--quick] [--skip-hf]

W1 work (DESIGN.md §8): bundled prompt i % len(prompts) as a chat message, W1 output length,
ignore_eos, greedy, fp32. Times are first submit → last row; model load is excluded where the
system allows (the bare engine) and included in Beam's runs (a pipeline loads on its workers:
reported as-is, and the engine-process start is measured separately).
"""

import argparse
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
from benchmarks.workloads import bundled_prompts, w1_output_lengths
from runtime import Engine
from runtime.default_model import default_model_dir
from batchgen_beam.records import parse_record

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ENGINE_ARGS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "admission": "longest_first"}


def w1_records(num_requests: int) -> list[dict]:
    prompts = bundled_prompts()
    return [{"id": f"w1-{i}", "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
             "max_tokens": length, "ignore_eos": True}
            for i, length in enumerate(w1_output_lengths(num_requests))]


def run_bare(model_dir: Path, records: list[dict]) -> dict:
    engine = Engine(model_dir, **ENGINE_ARGS)
    requests = [parse_record(r).to_request() for r in records]
    start = time.perf_counter()
    completions = engine.generate(requests)
    return {"system": "bare engine", "seconds": time.perf_counter() - start,
            "output_tokens": sum(c.completion_tokens for c in completions),
            "tokens": {c.id: c.token_ids for c in completions}}


def _run_pipeline(records: list[dict], transform, to_tokens) -> tuple[float, dict]:
    """Run records through `transform` on the DirectRunner; returns the seconds it took and
    {id: token ids}. Rows go through files: the runner pickles functions, so appending to a
    list in this process would append to a copy."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        with beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner"])) as pipeline:
            (pipeline | beam.Create(records) | transform | beam.Map(lambda r: json.dumps(to_tokens(r)))
             | beam.io.WriteToText(os.path.join(out, "rows")))
        seconds = time.perf_counter() - start
        pairs = [json.loads(line) for path in glob.glob(os.path.join(out, "rows*"))
                 for line in open(path, encoding="utf-8")]
    return seconds, dict(pairs)


def run_generate(records: list[dict]) -> dict:
    config = EngineConfig.of(None, **ENGINE_ARGS)
    start = time.perf_counter()
    EngineClient.shared(config).info()  # start the engine process before the clock runs
    engine_start = time.perf_counter() - start
    seconds, tokens = _run_pipeline(records, Generate(engine_args=ENGINE_ARGS),
                                    lambda row: (row["id"], row["token_ids"]))
    return {"system": "Generate (DirectRunner)", "seconds": seconds, "engine_start_s": engine_start,
            "output_tokens": sum(map(len, tokens.values())), "tokens": tokens}


class _HFModel:
    """Model and tokenizer together (Beam's model cache needs a weak-referenceable object)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer


class _TransformersGenerate(ModelHandler):
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
                                 min_new_tokens=longest, pad_token_id=tokenizer.pad_token_id)
        width = inputs["input_ids"].shape[1]
        return [PredictionResult(r, out[i, width:width + r["max_tokens"]].tolist())
                for i, r in enumerate(batch)]


def run_runinference_hf(model_dir: Path, records: list[dict], batch_size: int) -> dict:
    seconds, tokens = _run_pipeline(records, RunInference(_TransformersGenerate(model_dir, batch_size)),
                                    lambda result: (result.example["id"], result.inference))
    return {"system": f"RunInference + transformers generate (batch {batch_size})",
            "seconds": seconds, "output_tokens": sum(map(len, tokens.values())), "tokens": tokens}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model_dir = default_model_dir()
    records = w1_records(64 if args.quick else 256)

    results = []
    runs = [lambda: run_bare(model_dir, records), lambda: run_generate(records)]
    if not args.skip_hf:
        runs.append(lambda: run_runinference_hf(model_dir, records, args.hf_batch_size))
    for run in runs:  # print each as it lands: the transformers run takes long
        results.append(run())
        r, bare = results[-1], results[0]
        r["tokens_per_s"] = r["output_tokens"] / r["seconds"]
        same = sum(r["tokens"].get(rec["id"]) == bare["tokens"][rec["id"]] for rec in records)
        r["requests_token_identical_to_bare"] = f"{same}/{len(records)}"
        print(f"{r['system']:<48} {r['seconds']:8.1f} s  {r['tokens_per_s']:7.1f} tok/s  "
              f"identical to bare {r['requests_token_identical_to_bare']}", flush=True)
    generate = results[1]
    for r in results:
        r["vs_generate"] = r["seconds"] / generate["seconds"]
        print(f"{r['system']:<48} x{r['vs_generate']:.2f} of Generate's time")
    print(f"Generate overhead vs bare engine: {generate['seconds'] / bare['seconds'] - 1:+.1%}")
    report = {"workload": "W1-quick" if args.quick else "W1", "requests": len(records),
              "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results]}
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"beam_overhead_{report['workload']}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
