"""Batch generation as a Beam pipeline: records in, one output row per record out.

    python -m pipelines.generate                      # the bundled prompts on the default model
    python -m pipelines.generate --input prompts.jsonl --output out/gen --format jsonl \\
        --model gs://bucket/models/x --max_tokens 256 --temperature 0.7 --seed 1 [Beam options]

Our flags are listed by --help; every other flag goes to Beam's PipelineOptions (--runner,
--direct_num_workers, --project, ...); a flag neither knows is an error. The runner defaults to
the DirectRunner.

On a local runner the engine is started here, in the launching process, before the pipeline
runs (so its load time is reported on its own), and the pipeline's workers on this machine
connect to that same engine (the same EngineConfig means the same engine). A progress bar then
shows records done and tokens/s, polled from the engine's counters in a background thread. On a
remote runner (Dataflow, ...) the workers start their own engines and there is no progress bar.

`main(argv)` returns the run's summary (also printed): records, errors, prompt and completion
tokens, tokens/s, the files written and the time taken, read from the pipeline's metrics. It is
`prepare` (every check of flags, paths and sampling values, and the engine started) then
`run_job`; the command exits with one line and status 2 where `prepare` refuses the job.
"""

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, PortableOptions, StandardOptions
from apache_beam.runners.runner import create_runner

import batchgen_beam
from batchgen_beam.engine_client import EngineClient, EngineConfig, EngineStartError
from batchgen_beam.generate import METRICS_NAMESPACE, Generate
from batchgen_beam.io import (INPUT_FORMATS, OUTPUT_FORMATS, ReadRecords, WriteRows, absolute_path,
                              check_input, check_output, file_records, infer_format, open_input)
from batchgen_beam.model_sources import check_local_folders, check_text_path, model_location
from batchgen_beam.records import (CHAT_FIELDS, SAMPLING_FIELDS, RepeatedKey, check_defaults,
                                   default_sampling_params, is_missing, is_openai_line, loads_record)
from runtime.default_model import DEFAULT_MODEL_NAME
from runtime.engine import DTYPES, LORA_WITH_STREAMING
from runtime.sampling import DEFAULT_MAX_LOGPROBS, over_max_logprobs
from runtime.scheduler import ADMISSION_ORDERS, PREEMPTION_MODES

BUNDLED_PROMPTS = Path(batchgen_beam.__file__).resolve().parent / "data" / "prompts.jsonl"
# Sampling flags that set their record field's transform-wide default: (name, type, help).
SAMPLING_FLAGS = (
    ("top_p", float, "nucleus sampling (1: off)"),
    ("top_k", int, "top-k sampling (0: off)"),
    ("min_p", float, "drop tokens less likely than this times the likeliest (0: off)"),
    ("seed", int, "sampling seed, mixed with each record's id (the same record gives the same text; "
                  "other ids, other samples)"),
    ("logprobs", int, "return the log-probability of each generated token"),
    ("prompt_logprobs", int, "also score the prompt: each prompt token's log-probability and rank "
                             "(and the N likeliest tokens at each position)"),
    ("truncate_prompt_tokens", int, "keep only each prompt's last N tokens, -1: as many as the context "
                                    "holds (else a prompt over the context is an error row)"),
    ("min_tokens", int, "tokens to generate before EOS, stop ids or stop strings may end it"),
    ("repetition_penalty", float, "divide (multiply, if negative) the logits of tokens already in "
                                  "the prompt or output by this (1: off)"),
    ("frequency_penalty", float, "subtract this times a token's count in the output from its logit "
                                 "(-2 to 2; 0: off)"),
    ("presence_penalty", float, "subtract this from the logit of each token in the output (-2 to 2; "
                                "0: off)"),
    ("json_schema", str, "make every completion JSON that matches this JSON schema (its text; "
                         '\'{"type": "object"}\': any JSON object)'),
    ("regex", str, "make every completion text that this regular expression matches"),
)
DEFAULT_OUTPUT = "./output/generations"
PIPELINE_NAMESPACE = "batchgen_pipeline"  # this pipeline's own metrics
# Runners whose workers run on this machine, so they share an engine started here.
# (BundleBasedDirectRunner: Generate refuses it, with its reason.)
LOCAL_RUNNERS = {"directrunner", "switchingdirectrunner", "bundlebaseddirectrunner", "fnapirunner", "prismrunner"}
# Input larger than this is not counted up front (the bar then shows no total); Parquet row
# counts come from the footers and are always cheap.
COUNT_LIMIT_BYTES = 256 << 20


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.generate", allow_abbrev=False,  # Beam's flags pass through
        description="Generate a completion for every input record with a Beam pipeline. "
                    "Flags not listed here go to Beam's PipelineOptions (default "
                    "--runner=DirectRunner).",
        formatter_class=_HelpFormatter)
    io = parser.add_argument_group("input and output")
    io.add_argument("--input", default=None,
                    help="file or glob, local or gs://: JSONL (.jsonl/.json: our records or OpenAI "
                         "Batch lines), Parquet (.parquet), CSV (.csv) or TSV (.tsv) with a header "
                         "row, or text (.txt, one prompt per line); also compressed (.gz, .bz2, ...). "
                         f"Default: the {_count_lines(BUNDLED_PROMPTS)} bundled prompts "
                         "(batchgen_beam/data/prompts.jsonl), with the chat template applied")
    io.add_argument("--input_format", choices=INPUT_FORMATS, default=None,
                    help="input format, if the extension does not say")
    io.add_argument("--output", default=DEFAULT_OUTPUT,
                    help="output prefix, local or gs://; files are <output>-SSSSS-of-NNNNN.<format> (.jsonl for openai) "
                         "(it replaces the shards an earlier run left under it)")
    io.add_argument("--format", choices=OUTPUT_FORMATS, default="parquet",
                    help="output format: our rows as parquet or jsonl, or openai: OpenAI Batch API "
                         "output lines (.jsonl), one per record, as `vllm run-batch` writes them")
    io.add_argument("--output_shards", type=_whole_number(0), default=0,
                    help="number of output files (0: the runner decides)")
    io.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="turn records with a `prompt` into one user message, so the model's chat "
                         "template is applied (default: on for the bundled prompts, else off)")

    sampling = parser.add_argument_group(
        "sampling defaults (a record's own fields override them)")
    sampling.add_argument("--max_tokens", type=int, default=64, help="tokens to generate at most")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    for name, kind, text in SAMPLING_FLAGS:
        sampling.add_argument(f"--{name}", type=kind, default=None, help=text)
    sampling.add_argument("--stop", action="append", default=None, metavar="STRING",
                          help="stop string (repeat the flag for several)")
    sampling.add_argument("--bad_words", action="append", default=None, metavar="WORD",
                          help="a word whose tokens no completion may end with, vLLM's rule (repeat "
                               "the flag for several)")
    sampling.add_argument("--choice", action="append", default=None, metavar="STRING",
                          help="make every completion one of these (repeat the flag for each)")
    sampling.add_argument("--include_stop_str_in_output", action="store_true", default=None,
                          help="keep the stop string that ended a completion in its text")
    sampling.add_argument("--keep_special_tokens", dest="skip_special_tokens", action="store_false",
                          default=None, help="keep special tokens (e.g. <|im_end|>) in the text")
    sampling.add_argument("--ignore_eos", action="store_true", default=None,
                          help="generate max_tokens whatever the model says")
    sampling.add_argument("--chat_template_kwargs", type=_json_object, default=None, metavar="JSON",
                          help="variables for the chat template, e.g. '{\"enable_thinking\": false}' "
                               "(Qwen 3's); a record's own add to them")

    engine = parser.add_argument_group("model and engine")
    engine.add_argument("--model", default=None,
                        help="HF safetensors directory, local or gs://prefix (default: the default "
                             "model, SmolLM2-135M-Instruct)")
    engine.add_argument("--max_num_seqs", type=_whole_number(1), default=None,
                        help="sequences decoded together (engine default if not given)")
    engine.add_argument("--max_num_batched_tokens", type=_whole_number(1), default=None,
                        help="tokens per engine step (engine default if not given)")
    engine.add_argument("--kv_cache_mb", type=_whole_number(0), default=None,
                        help="device KV cache size in MiB (engine default if not given)")
    engine.add_argument("--host_kv_mb", type=_whole_number(0), default=None,
                        help="host memory in MiB that suspended sequences park their KV in "
                             "(engine default if not given)")
    engine.add_argument("--max_model_len", type=_whole_number(2), default=None,
                        help="the most tokens (prompt and completion) a sequence may hold "
                             "(default: the model's context)")
    engine.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the dtype the weights, activations and KV cache are held in "
                             "(default: float32)")
    engine.add_argument("--admission", choices=sorted(ADMISSION_ORDERS), default=None,
                        help="the order waiting records start in: fifo (the default), "
                             "longest_first or shortest_first by prompt + max_tokens, or "
                             "adaptive (longest expected first, learned from finished ones)")
    engine.add_argument("--preemption", choices=PREEMPTION_MODES, default=None,
                        help="what a sequence pushed out of a full KV cache does: suspend "
                             "(park its KV in host memory; the default) or evict (recompute it)")
    engine.add_argument("--no_prefix_caching", dest="enable_prefix_caching", action="store_const",
                        const=False, default=None,
                        help="never reuse the KV of a prompt prefix that an earlier record computed")
    engine.add_argument("--num_threads", type=_whole_number(1), default=None,
                        help="torch threads of the engine (default: all cores)")
    engine.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="where the engine runs (default: cpu)")
    engine.add_argument("--weight_budget_mb", type=_whole_number(0), default=None,
                        help="memory-constrained mode: decoder layers stream from the checkpoint "
                             "and the weights held on the device stay within this many MiB")
    engine.add_argument("--weights_in_host_memory", action="store_true", default=None,
                        help="with --device cuda and --weight_budget_mb: stream from a pinned host "
                             "copy of the weights instead of re-reading the files every step")
    engine.add_argument("--no_greedy_screen", dest="greedy_screen", action="store_const", const=False,
                        default=None, help="greedy rows take full fp32 logits, not a bf16 screen of "
                                           "the vocabulary verified in fp32 (same tokens; saves the bf16 "
                                           "copies of the lm_head)")
    engine.add_argument("--no_ngram_drafts", dest="ngram_drafts", action="store_const", const=False,
                        default=None, help="greedy records never guess tokens from earlier n-grams to "
                                           "verify in the same step (same tokens; more steps)")
    engine.add_argument("--max_logprobs", type=_whole_number(-1), default=None,
                        help="the most --logprobs / --prompt_logprobs a record may ask for "
                             "(default 20, as vLLM's; -1: the whole vocabulary)")
    engine.add_argument("--lora", default=None, metavar="DIR",
                        help="a PEFT LoRA adapter directory (local, on every worker, or gs://), "
                             "merged into the model's weights at load")
    engine.add_argument("--num_key_shards", type=_whole_number(1), default=16,
                        help="keys that records are spread over in the Generate transform")
    engine.add_argument("--max_in_flight", type=_whole_number(1), default=1024,
                        help="requests one worker process keeps in the engine at once")
    engine.add_argument("--straggler_timeout_s", type=float, default=None,
                        help="at the end of input, wait at most this long for a key's records, "
                             "then continue the unfinished ones on other keys (default: wait)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    return parser


def _whole_number(floor: int):
    """An argparse type: a whole number at least `floor` (argparse names the flag it refuses)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < floor:
            raise argparse.ArgumentTypeError(f"must be >= {floor}, got {value}")
        return value
    return parse


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args, beam_args = parser.parse_known_args(argv)
    if args.weights_in_host_memory and (args.device != "cuda" or args.weight_budget_mb is None):
        parser.error("--weights_in_host_memory streams weights to a GPU: it needs --device cuda "
                     "and --weight_budget_mb")
    if args.lora is not None and args.weight_budget_mb is not None:
        parser.error(f"--lora with --weight_budget_mb {LORA_WITH_STREAMING}")
    # Beam only warns of arguments no PipelineOptions takes and drops them: a mistyped sampling
    # flag (--temprature) would run the job with the default, unnoticed.
    discarded = _discarded_by_beam(beam_args)
    if unknown := sorted({arg.split("=", 1)[0] for arg in discarded if arg.startswith("--")}):
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (neither this job's flags, see "
                     f"--help, nor Beam's PipelineOptions)")
    if discarded:
        parser.error(f"unrecognized arguments: {' '.join(discarded)} (this job takes no positional "
                     f"arguments, and flags start with --)")
    cap = DEFAULT_MAX_LOGPROBS if args.max_logprobs is None else args.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):  # refused before the engine starts
        wanted = getattr(args, name)
        if over_max_logprobs(wanted, cap):
            parser.error(f"--{name} {wanted} is more than --max_logprobs allows ({cap}; -1 allows "
                         f"the whole vocabulary)")
    if not any(a == "--runner" or a.startswith("--runner=") for a in beam_args):
        beam_args = ["--runner=DirectRunner", *beam_args]
    return args, beam_args


def _discarded_by_beam(beam_args: list[str]) -> list[str]:
    """What Beam would drop with only a log line ("Discarding unparseable args"), by its own
    parser (it knows which of its flags take a value): a word that is no flag's value (an input
    path given without --input, a second value, a word after a flag that takes none) and a flag
    with a single dash (-temperature 0.9)."""
    discarded = []
    PipelineOptions(beam_args).get_all_options(
        retain_unknown_options=True,  # no warning: the caller refuses what it finds
        add_extra_args_fn=lambda parser: discarded.extend(parser.parse_known_args(beam_args)[1]))
    return discarded


def engine_args_of(args: argparse.Namespace) -> dict:
    """runtime.Engine keywords for the flags given (none: the engine's defaults, so the run
    shares an engine with any other user of the default configuration)."""
    given = {"max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "kv_cache_bytes": None if args.kv_cache_mb is None else args.kv_cache_mb << 20,
             "host_kv_bytes": None if args.host_kv_mb is None else args.host_kv_mb << 20,
             "max_model_len": args.max_model_len,
             "dtype": None if args.dtype is None else DTYPES[args.dtype],
             "admission": args.admission, "preemption": args.preemption,
             "enable_prefix_caching": args.enable_prefix_caching,
             "num_threads": args.num_threads, "device": args.device,
             "weight_budget_bytes": None if args.weight_budget_mb is None else args.weight_budget_mb << 20,
             "weights_in_host_memory": args.weights_in_host_memory, "greedy_screen": args.greedy_screen,
             "lora": model_location(args.lora), "max_logprobs": args.max_logprobs,
             "ngram_drafts": args.ngram_drafts}
    return {k: v for k, v in given.items() if v is not None}


# The engine's sizes in bytes that the flags give in MiB.
_MIB_FLAGS = {"kv_cache_bytes": "--kv_cache_mb", "host_kv_bytes": "--host_kv_mb",
              "weight_budget_bytes": "--weight_budget_mb"}


def _flags_named_in(engine_error: str) -> str:
    """Which flags set the engine arguments an error names, where the names differ."""
    named = [f"{arg} is {flag} MiB" for arg, flag in _MIB_FLAGS.items() if arg in engine_error]
    return f" ({'; '.join(named)})" if named else ""


def sampling_defaults_of(args: argparse.Namespace) -> dict:
    """The sampling and chat flags given (each named after its record field)."""
    given = {name: getattr(args, name, None) for name in (*SAMPLING_FIELDS, *CHAT_FIELDS)}
    return {k: v for k, v in given.items() if v is not None}


def _json_object(text: str) -> dict:
    try:
        value = loads_record(text)
    except RepeatedKey as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None
    except json.JSONDecodeError as bad:
        raise argparse.ArgumentTypeError(f"not JSON ({bad})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def model_of(args: argparse.Namespace) -> str | None:
    return model_location(args.model)


def as_chat(record):
    """A record with a plain `prompt` (text, or UTF-8 bytes) as a one-message chat (the engine
    then applies the model's chat template). Anything else, OpenAI Batch lines, token-id prompts
    and records that will fail validation included, passes unchanged so that `Generate` handles
    it as it would without this step."""
    raw = record
    if isinstance(record, (bytes, str)):
        try:
            record = loads_record(record)
        except (ValueError, UnicodeDecodeError, RecursionError):  # Generate says what is wrong
            return raw
    # As Generate reads them: a field given as null (a Parquet file's other kind of row) is
    # absent, and our records may carry a passthrough field named custom_id.
    if not isinstance(record, dict) or is_openai_line(record) or any(
            not is_missing(record.get(key)) for key in ("messages", "prompt_token_ids")):
        return raw
    prompt = record.get("prompt")
    if isinstance(prompt, bytes):  # a Parquet column of strings stored as binary
        try:
            prompt = prompt.decode("utf-8")
        except UnicodeDecodeError:  # Generate says what is wrong
            return raw
    if not isinstance(prompt, str) or not prompt.strip():
        return raw
    converted = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
    converted["messages"] = [{"role": "user", "content": prompt}]
    return converted


class _CountRows(beam.DoFn):
    """Counts what Generate's own metrics do not: prompt tokens."""

    def __init__(self):
        self._prompt_tokens = Metrics.counter(PIPELINE_NAMESPACE, "prompt_tokens")

    def process(self, row):
        self._prompt_tokens.inc(row["prompt_tokens"])
        yield row


class _NoteFiles(beam.DoFn):
    def __init__(self):
        self._files = Metrics.string_set(PIPELINE_NAMESPACE, "output_files")

    def process(self, name):
        self._files.add(name)


def count_records(pattern: str, fmt: str, limit_bytes: int = COUNT_LIMIT_BYTES) -> int | None:
    """How many records the input holds, where that is cheap to find out; else None."""
    import pyarrow.parquet as pq

    files = FileSystems.match([absolute_path(pattern)])[0].metadata_list
    if fmt == "parquet":
        total = 0
        for meta in files:
            with FileSystems.open(meta.path) as f:
                total += pq.ParquetFile(f).metadata.num_rows
        return total
    if sum(meta.size_in_bytes for meta in files) > limit_bytes:
        return None
    total = 0
    for meta in files:
        with open_input(meta.path) as f:  # read as the job reads them: a malformed row is its error row
            total += sum(1 for _ in file_records(f, meta.path, fmt))
    return total


class Progress:
    """A tqdm bar of records done (of the input's count, when known) and generated tokens/s,
    polled from the engine's counters by a background thread of this process."""

    def __init__(self, client: EngineClient, count, interval: float = 0.5, enabled: bool = True):
        from tqdm import tqdm

        self._client, self._count, self._interval = client, count, interval
        self._stop = threading.Event()
        self._base = client.info()  # the engine may have served earlier runs
        self.bar = tqdm(total=None, desc="generate", unit="rec", disable=not enabled,
                        dynamic_ncols=True, file=sys.stderr)
        self._thread = threading.Thread(target=self._run, name="batchgen-progress", daemon=True)

    def __enter__(self):
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.bar.close()

    def finish(self, records: int) -> None:
        """Stop polling and show the final count (rejected records never reach the engine, so
        the engine's count can fall short of it)."""
        self._stop.set()
        self._thread.join()
        try:
            self._show(self._client.info(), None)
        except Exception:
            pass
        self.bar.total = max(self.bar.total or 0, records)
        self.bar.n = records
        self.bar.refresh()

    def _run(self) -> None:
        try:
            total = self._count()
        except Exception:  # a count is a nicety; the pipeline reports any real problem
            total = None
        if total is not None and not self._stop.is_set():
            self.bar.total = total
            self.bar.refresh()
        while not self._stop.wait(self._interval):
            try:
                info = self._client.info()
            except Exception:  # e.g. the engine is restarting; the client resubmits its work
                continue
            self._show(info, total)

    def _show(self, info: dict, total: int | None) -> None:
        done = info["finished"] - self._base["finished"]
        tokens = info["generated_tokens"] - self._base["generated_tokens"]
        if total is not None:
            self.bar.n = min(done, total)
        elif done > self.bar.n:
            self.bar.n = done
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self.bar.set_postfix_str(f"{tokens / elapsed:.1f} tok/s, {info['running']} running",
                                 refresh=False)
        self.bar.refresh()


def _metrics(result) -> tuple[dict, dict]:
    """(counter totals, string-set unions) by metric name over our two namespaces."""
    counters, sets = {}, {}
    for namespace in (METRICS_NAMESPACE, PIPELINE_NAMESPACE):
        try:
            found = result.metrics().query(MetricsFilter().with_namespace(namespace))
        except Exception as exc:  # a runner without (some) metrics: the job itself succeeded
            logging.warning("could not read the %s metrics: %r", namespace, exc)
            continue
        for metric in found["counters"]:
            value = metric.committed if metric.committed is not None else metric.attempted
            counters[metric.key.metric.name] = counters.get(metric.key.metric.name, 0) + value
        for metric in found.get("string_sets", []):
            value = metric.committed if metric.committed is not None else metric.attempted
            sets.setdefault(metric.key.metric.name, set()).update(value or ())
    return counters, sets


def _runner_kind(runner_class: type) -> str:
    """What the checks take a runner for: the first runner they know that the class Beam makes
    of --runner is or extends ("direct" and TestDirectRunner: the DirectRunner; TestDataflowRunner:
    Dataflow's), else the class's own name."""
    known = (*LOCAL_RUNNERS, "dataflowrunner")
    return next((c.__name__ for c in runner_class.__mro__ if c.__name__.lower() in known), runner_class.__name__)


def _is_local(runner: str | None) -> bool:
    return str(runner).rsplit(".", 1)[-1].lower() in LOCAL_RUNNERS


def _workers_see_this_disk(runner: str | None, options: PipelineOptions) -> bool:
    """Whether the workers read and write this machine's files: a local runner's do, and a
    portable runner's (Flink) whose SDK workers run here (LOOPBACK); Dataflow's never."""
    if _is_local(runner):
        return True
    name = str(runner).rsplit(".", 1)[-1].lower()
    return name != "dataflowrunner" and \
        (options.view_as(PortableOptions).environment_type or "").upper() == "LOOPBACK"


def check_paths_for_workers(paths: dict[str, str], runner: str | None, options: PipelineOptions) -> None:
    """ValueError for a local path where the workers run elsewhere: they would find no such
    model or file (a JSONL or Parquet input then yields no records, and the job succeeds
    empty), or write to their own disks."""
    if _workers_see_this_disk(runner, options):
        return
    for flag, path in paths.items():
        if "://" not in path:
            raise ValueError(f"{flag} {path!r} is a local path, which the workers of {runner} "
                             f"(running elsewhere) cannot reach: give a gs:// one")


@dataclass
class Job:
    """A job whose flags, paths and (on a local runner) engine passed their checks, its pipeline
    built."""
    args: argparse.Namespace
    input_pattern: str
    input_format: str
    chat: bool  # prompts rendered as one-message chats
    runner: str | None
    pipeline: beam.Pipeline
    earlier: list[str]  # shards an earlier run left under the output prefix
    client: EngineClient | None  # this machine's engine, where the runner is local
    engine_start_s: float | None
    started: float


def prepare(argv: list[str] | None = None) -> Job:
    """The job the flags describe, checked before anything runs: a flag, path or sampling value
    it cannot run with raises here (ValueError or OSError, saying which), and so does an engine
    this machine cannot start with them (EngineStartError)."""
    started = time.perf_counter()
    args, beam_args = parse_args(argv)
    for flag in ("input", "output", "model", "lora"):
        if (path := getattr(args, flag)) is not None:
            check_text_path(f"--{flag}", path)
    bundled = args.input is None
    input_pattern = str(BUNDLED_PROMPTS) if bundled else args.input
    try:
        input_format = args.input_format or infer_format(input_pattern)
    except ValueError:
        raise ValueError(f"--input: cannot tell the format of {input_pattern!r} from its extension; "
                         f"give --input_format (one of {', '.join(INPUT_FORMATS)})") from None
    chat = bundled if args.chat is None else args.chat
    options = PipelineOptions(beam_args)
    runner = options.view_as(StandardOptions).runner
    try:  # a name Beam does not know, before the paths are judged by it
        runner_kind = _runner_kind(type(create_runner(runner)))
    except ValueError as unknown:
        raise ValueError(f"--runner: {unknown}") from None

    model, engine_args, defaults = model_of(args), engine_args_of(args), sampling_defaults_of(args)
    config = EngineConfig.of(model, **engine_args)
    generate = Generate(model, num_shards=args.num_key_shards, max_in_flight=args.max_in_flight,
                        engine_args=engine_args, straggler_timeout_s=args.straggler_timeout_s, **defaults)
    # The launcher's progress client must talk to the engine the workers use.
    assert generate._config == config, (generate._config, config)
    write = WriteRows(args.output, args.format, num_shards=args.output_shards, model=model)
    # After the flags: their mistakes are named first.
    paths = {"--input": args.input, "--output": args.output, "--model": args.model, "--lora": args.lora}
    check_paths_for_workers({flag: path for flag, path in paths.items() if path is not None}, runner_kind, options)
    check_input(input_pattern, input_format)
    check_output(args.output)
    # The bundled prompts travel in the pipeline to workers elsewhere.
    ship_prompts = bundled and not _workers_see_this_disk(runner_kind, options)
    earlier = write.existing_shards()  # the write replaces them

    pipeline = beam.Pipeline(options=options)
    if ship_prompts:
        records = pipeline | "Read" >> beam.Create(BUNDLED_PROMPTS.read_bytes().splitlines())
    else:
        records = pipeline | "Read" >> ReadRecords(input_pattern, input_format)
    if chat:
        records = records | "Chat" >> beam.Map(as_chat)
    (records
     | "Generate" >> generate
     | "Count" >> beam.ParDo(_CountRows())
     | "Write" >> write
     | "NoteFiles" >> beam.ParDo(_NoteFiles()))

    client = engine_start_s = None
    if _is_local(runner_kind):
        # The engine's folders are this machine's: a missing one is named here, not in the
        # crash of the process that would hold the engine.
        check_local_folders(model, engine_args.get("lora"))
        load_started = time.perf_counter()
        try:
            client = EngineClient.shared(config).connect()  # starts (or finds) this machine's engine
        except EngineStartError as failed:
            raise EngineStartError(config, f"{failed.error}{_flags_named_in(failed.error)}") from None
        engine_start_s = time.perf_counter() - load_started
        try:  # values no record could run with (logprobs past the vocabulary, say)
            client.check_params(default_sampling_params(check_defaults(defaults)))
        except ValueError as bad:
            raise ValueError(f"--{bad}") from None
    return Job(args, input_pattern, input_format, chat, runner, pipeline, earlier, client, engine_start_s,
               started)


def run_job(job: Job) -> dict:
    """Runs the job (with a progress bar where its engine is this machine's); returns and
    prints its summary."""
    args, run_started = job.args, time.perf_counter()
    if job.client is not None:
        with Progress(job.client, lambda: count_records(job.input_pattern, job.input_format),
                      enabled=not args.no_progress) as progress:
            result = job.pipeline.run()
            result.wait_until_finish()
            counters, sets = _metrics(result)
            progress.finish(counters.get("sequences_finished", 0))
    else:
        result = job.pipeline.run()
        result.wait_until_finish()
        counters, sets = _metrics(result)
    pipeline_s = time.perf_counter() - run_started
    written = sets.get("output_files", set())
    # Replaced by this run's shards of the same names, or removed (unknown if none were reported).
    removed = sorted(set(job.earlier) - set(written)) if written and str(result.state) == "DONE" else []

    completion_tokens = counters.get("tokens_generated", 0)
    summary = {
        "input": "bundled prompts" if args.input is None else job.input_pattern,
        "input_format": job.input_format,
        "chat_template": job.chat,
        "model": model_label(args),
        "runner": str(job.runner),
        "state": str(result.state),
        "records": counters.get("sequences_finished", 0),
        "errors": counters.get("errors", 0),
        "prompt_tokens": counters.get("prompt_tokens", 0),
        "completion_tokens": completion_tokens,
        "tokens_per_s": round(completion_tokens / pipeline_s, 2) if pipeline_s > 0 else None,
        "engine_start_s": None if job.engine_start_s is None else round(job.engine_start_s, 2),
        "pipeline_s": round(pipeline_s, 2),
        "wall_s": round(time.perf_counter() - job.started, 2),
        "output_files": sorted(written),
        "removed_files": removed,
        "format": args.format,
    }
    print(format_summary(summary))
    return summary


def main(argv: list[str] | None = None) -> dict:
    return run_job(prepare(argv))


def cli() -> None:
    """`python -m pipelines.generate`: a job refused before it runs exits with a line that
    says why (status 2, as a bad flag does), not a traceback."""
    try:
        job = prepare()
    except (ValueError, OSError, EngineStartError) as refused:
        parser = build_parser()
        parser.exit(2, f"{parser.prog}: error: {refused}\n")
    run_job(job)


def model_label(args: argparse.Namespace) -> str:
    """The model the summary names: the adapter merged into it too."""
    model = args.model or f"default ({DEFAULT_MODEL_NAME})"
    return model if args.lora is None else f"{model} + LoRA {args.lora}"


def format_summary(s: dict) -> str:
    engine = "" if s["engine_start_s"] is None else f"; engine start {s['engine_start_s']} s"
    files = "\n".join(f"  {name}" for name in s["output_files"]) or "  (none reported)"
    if s["removed_files"]:
        files += (f"\n  removed {len(s['removed_files'])} shard file(s) an earlier run left under "
                  f"this prefix")
    return (f"batchgen: {s['records']} records, {s['errors']} errors ({s['input']} -> "
            f"{s['format']}, model {s['model']})\n"
            f"  tokens: {s['prompt_tokens']} prompt, {s['completion_tokens']} completion; "
            f"{s['tokens_per_s']} completion tokens/s over {s['pipeline_s']} s of pipeline"
            f"{engine}; wall {s['wall_s']} s\n"
            f"  files:\n{files}")


if __name__ == "__main__":  # engine processes are spawned and re-import __main__
    # Run the importable module's main, so that the functions and DoFns above pickle as
    # pipelines.generate.* (which remote workers import) rather than as __main__.*.
    from pipelines.generate import cli as _cli
    _cli()
