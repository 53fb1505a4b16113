"""`Generate` on the DirectRunner: exactly one row per input record (good and bad records
in one run), per-record sampling fields honoured, outputs equal to the bare engine's on the same
model, passthrough fields and Beam metrics; with two SDK worker processes, one engine serves
both; a record left in state by a dead worker is resubmitted by id and answered once."""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing
import types
from collections import Counter, defaultdict
from pathlib import Path

import apache_beam as beam
import psutil
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing import test_stream
from apache_beam.testing.util import assert_that
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import Timestamp

from batchgen_beam.engine_client import EngineClient, EngineConfig, EngineService
from batchgen_beam.generate import EngineMetrics, Generate, _GenerateFn, _LiveJobs, _StreamingGenerateFn, stateful_stage
from batchgen_beam.records import parse_record
from batchgen_beam.rows import row_to_json
from beam_helpers import (CONTEXT, ENGINE_ARGS, IN_MEMORY, MULTI_PROCESSING, bundled_prompts,
                          chat_model_dir, counter, distribution, gone, run_pipeline, worker_pythonpath)
from runtime import Engine, Request, SamplingParams
from runtime.request import Completion, SampleOutput, Timings

MAX_TOKENS = 8  # the transform-wide default
STAMP = Timestamp(1_700_000_000)  # a record's event time, in tests that call the DoFn itself
FIXED_LENGTHS = (1, 3, 5, 11)  # per-record max_tokens, with ignore_eos
SAMPLED = {"s-7": (7, 0.8), "s-7-again": (7, 0.8), "s-8": (8, 0.8), "s-7-hot": (7, 1.5)}
SAMPLED_TOKENS = 16


def chat_line(custom_id, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], **body}}


def good_records(prompts: list[str]) -> list:
    """34 records: greedy text and chat, fixed lengths, seeded sampling, an OpenAI Batch line and
    a JSON text line. Every mapping carries passthrough fields."""
    greedy = [{"id": f"g{i:02d}", "prompt": p, "source": "bundled", "index": i}
              for i, p in enumerate(prompts[:20])]
    chats = [{"id": f"c{i}", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": p}], "index": i}
             for i, p in enumerate(prompts[20:24])]
    fixed = [{"id": f"len-{k}", "prompt": prompts[0], "max_tokens": k, "ignore_eos": True}
             for k in FIXED_LENGTHS]
    sampled = [{"id": rid, "prompt": prompts[1], "seed": seed, "temperature": temperature,
                "max_tokens": SAMPLED_TOKENS, "ignore_eos": True}
               for rid, (seed, temperature) in SAMPLED.items()]
    openai = [chat_line("openai-1", max_tokens=4, temperature=0) | {"batch": "b1"}]
    text_line = ['{"id": "json-1", "prompt": "Tell me a story.", "note": "from a text file"}']
    return greedy + chats + fixed + sampled + openai + text_line


LONG_PROMPT = "Tell me everything about the history of every river in the world. " * 20

# kind -> (raw record, how its row is found, a fragment its error message must contain)
BAD_RECORDS = {
    "missing id": ({"prompt": "Hi", "tag": "missing-id"}, "tag:missing-id", "id: missing"),
    "empty id": ({"id": "", "prompt": "Hi", "tag": "empty-id"}, "tag:empty-id", "id: must not be empty"),
    "not an object": (42, "raw:42", "must be an object"),
    "undecodable bytes": (b'{"id": "bad-bytes", "prompt": "caf\xe9"}', "bad-bytes", "not valid UTF-8"),
    "invalid JSON line": ('{"id": "bad-json", "prompt": ', 'raw:{"id": "bad-json", "prompt": ',
                          "invalid JSON"),
    "empty prompt": ({"id": "bad-empty", "prompt": "  "}, "bad-empty", "prompt: must not be empty"),
    "prompt and messages": ({"id": "bad-both", "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]},
                            "bad-both", "not both"),
    "messages not a list": ({"id": "bad-messages", "messages": "Hi"}, "bad-messages",
                            "messages: must be a list"),
    "message with bad role": ({"id": "bad-role", "messages": [{"role": "robot", "content": "Beep"}]},
                              "bad-role", "messages[0].role: must be one of"),
    "string temperature": ({"id": "bad-temperature", "prompt": "Hi", "temperature": "hot"},
                           "bad-temperature", "temperature: must be a finite number"),
    "string max_tokens": ({"id": "bad-max-tokens", "prompt": "Hi", "max_tokens": "32"},
                          "bad-max-tokens", "max_tokens: must be an integer"),
    "top_p out of range": ({"id": "bad-top-p", "prompt": "Hi", "top_p": 1.5}, "bad-top-p",
                           "top_p: must be in (0, 1]"),
    "seed past int64": ({"id": "bad-seed", "prompt": "Hi", "seed": -(1 << 63) - 1}, "bad-seed",
                        "seed: must be >= -9223372036854775808"),
    "OpenAI unsupported key": (chat_line("bad-openai", tools=[{"type": "function"}]), "bad-openai",
                               "body.tools: not supported"),
    "OpenAI GET": (chat_line("bad-openai-get") | {"method": "GET"}, "bad-openai-get",
                   'method: must be "POST"'),
    "lone surrogate (a JSON escape)": ('{"id": "bad-surrogate", "prompt": "x \\ud800"}', "bad-surrogate",
                                       "prompt: not valid Unicode text"),
    # Valid as a record; the engine rejects it (prompt plus one token must fit the context).
    "prompt longer than the context": ({"id": "bad-too-long", "prompt": LONG_PROMPT}, "bad-too-long",
                                       f"the context holds {CONTEXT}"),
    # Valid as a record; more samples than the KV cache has blocks.
    "n over the KV cache's blocks": ({"id": "bad-n", "prompt": "Hi", "n": 10**9}, "bad-n",
                                     "n: must be <= the KV cache's"),
    # Valid as a record; more top logprobs than the vocabulary has tokens.
    "logprobs over the vocabulary": ({"id": "bad-logprobs", "prompt": "Hi", "logprobs": 10**8},
                                     "bad-logprobs", "logprobs: must be <= the vocabulary's"),
}


def row_key(row: dict) -> str:
    """The id of a row, or for a record without one, its tag or raw-line passthrough."""
    if row["id"] is not None:
        return row["id"]
    passthrough = row["passthrough"]
    return f"tag:{passthrough['tag']}" if "tag" in passthrough else f"raw:{passthrough['raw']}"


def expected_keys(records) -> Counter:
    keys = Counter(r["id"] if "id" in r else r["custom_id"]
                   for r in records if isinstance(r, dict))
    keys.update(["json-1"])  # the JSON text line
    keys.update(key for _, key, _ in BAD_RECORDS.values())
    return keys


def generate_rows(records, model_dir, tmp_path, flags, engine_args=ENGINE_ARGS, **options):
    def build(pipeline):
        rows = (pipeline
                | beam.Create(records, reshuffle=False)
                | Generate(str(model_dir), engine_args=engine_args, max_tokens=MAX_TOKENS, num_shards=4,
                           **options))
        return {"rows": rows | beam.Map(row_to_json)}

    outputs, result = run_pipeline(build, tmp_path, flags)
    return outputs["rows"], result


# ---- one in-memory run, checked from every side ------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_chat):
    return chat_model_dir(tiny_chat)


@pytest.fixture(scope="module")
def bare_engine(model_dir):
    return Engine(model_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def good(bare_engine):
    # Short prompts: with the chat template around them and the longest output (16 tokens)
    # they stay well inside the 64-token context.
    return good_records(bundled_prompts(bare_engine.tokenizer, 24, 30))


@pytest.fixture(scope="module")
def in_memory(model_dir, good, tmp_path_factory):
    records = good + [raw for raw, _, _ in BAD_RECORDS.values()]
    rows, result = generate_rows(records, model_dir, tmp_path_factory.mktemp("in-memory"), IN_MEMORY)
    return rows, result


@pytest.fixture(scope="module")
def rows_by_key(in_memory):
    rows, _ = in_memory
    return {row_key(row): row for row in rows}


@pytest.fixture(scope="module")
def bare_completions(bare_engine, good):
    """What the bare engine answers to every good record, with the same sampling params."""
    requests = [parse_record(r, {"max_tokens": MAX_TOKENS}).to_request() for r in good]
    return {c.id: c for c in bare_engine.generate(requests)}


def test_exactly_one_row_per_input_record(in_memory, good):
    rows, _ = in_memory
    assert len(rows) == len(good) + len(BAD_RECORDS)
    assert Counter(row_key(row) for row in rows) == expected_keys(good)


def test_good_records_equal_the_bare_engine(rows_by_key, bare_completions):
    """Greedy token ids, and seeded sampling's text, are the bare engine's on the same model."""
    assert len(bare_completions) == 34
    for record_id, completion in bare_completions.items():
        row = rows_by_key[record_id]
        assert row["error"] is None, (record_id, row["error"])
        assert row["token_ids"] == completion.token_ids, record_id
        assert row["text"] == completion.text, record_id
        assert row["finish_reason"] == completion.finish_reason, record_id
        assert (row["prompt_tokens"], row["completion_tokens"]) == \
            (completion.prompt_tokens, completion.completion_tokens), record_id


def test_transform_default_max_tokens(rows_by_key):
    greedy = [rows_by_key[f"g{i:02d}"] for i in range(20)]
    assert all(1 <= row["completion_tokens"] <= MAX_TOKENS for row in greedy)
    assert all(row["completion_tokens"] == MAX_TOKENS for row in greedy if row["finish_reason"] == "length")
    assert max(row["completion_tokens"] for row in greedy) == MAX_TOKENS  # not the engine's 16
    assert rows_by_key["openai-1"]["completion_tokens"] <= 4  # the OpenAI line's max_tokens


def test_per_record_max_tokens_with_ignore_eos(rows_by_key):
    for k in FIXED_LENGTHS:
        row = rows_by_key[f"len-{k}"]
        assert (row["completion_tokens"], len(row["token_ids"]), row["finish_reason"]) == (k, k, "length")


def test_per_record_seed_and_temperature(rows_by_key):
    texts = {rid: rows_by_key[rid]["token_ids"] for rid in SAMPLED}
    assert all(len(ids) == SAMPLED_TOKENS for ids in texts.values())
    assert texts["s-7"] == texts["s-7-again"]  # same seed and temperature: same sample
    assert texts["s-8"] != texts["s-7"]  # another seed
    assert texts["s-7-hot"] != texts["s-7"]  # another temperature, same seed


@pytest.mark.parametrize("kind", BAD_RECORDS)
def test_bad_record_becomes_an_error_row(kind, rows_by_key):
    _, key, fragment = BAD_RECORDS[kind]
    row = rows_by_key[key]
    assert fragment in row["error"]
    assert (row["finish_reason"], row["text"], row["token_ids"], row["completion_tokens"]) == \
        ("error", None, [], 0)
    assert row["error_type"] == "record"  # each its own doing, whether parsing or the engine saw it


def test_bad_records_do_not_stop_good_ones(in_memory, good):
    rows, _ = in_memory
    assert len(BAD_RECORDS) >= 12
    good_rows = [row for row in rows if row["error"] is None]
    assert len(good_rows) == len(good)
    assert all(row["finish_reason"] in ("stop", "length") and row["token_ids"] for row in good_rows)


def test_records_sharing_an_id_each_get_their_own_row(model_dir, tmp_path):
    # Ids are not always unique in real data: each record still gets the row of its own request.
    records = [{"id": "dup", "prompt": "Say hi", "max_tokens": k, "ignore_eos": True, "k": k}
               for k in (2, 5, 5)]  # the last an exact repeat
    rows, _ = generate_rows(records, model_dir, tmp_path, IN_MEMORY)
    assert sorted((r["passthrough"]["k"], r["completion_tokens"]) for r in rows) == [(2, 2), (5, 5), (5, 5)]
    short, long, repeat = sorted(rows, key=lambda r: r["completion_tokens"])
    assert short["token_ids"] == long["token_ids"][:2] and repeat["token_ids"] == long["token_ids"]


def test_two_generate_transforms_reading_one_input_each_emit_every_row(model_dir, good, tmp_path):
    """Their stateful stages hold records in state under names of their own (stateful_stage):
    with shared names the DirectRunner fired one's timers on the other's DoFn, and the records
    the second held at its window's end never came out."""
    records = good[:6]

    def build(pipeline):
        base = pipeline | beam.Create(records)
        short = base | "Short" >> Generate(str(model_dir), engine_args=ENGINE_ARGS, num_shards=4, max_tokens=3)
        longer = base | "Longer" >> Generate(str(model_dir), engine_args=ENGINE_ARGS, num_shards=4, max_tokens=6)
        return {"short": short | "s" >> beam.Map(row_to_json), "longer": longer | "l" >> beam.Map(row_to_json)}

    outputs, _ = run_pipeline(build, tmp_path, IN_MEMORY)
    for name, limit in (("short", 3), ("longer", 6)):
        assert sorted(row["id"] for row in outputs[name]) == sorted(r["id"] for r in records), name
        assert all(row["error"] is None and row["completion_tokens"] <= limit for row in outputs[name])


@pytest.mark.parametrize("windowing,straggler_timeout_s", [
    ("fixed", None), ("sliding", None), ("sliding", 0.0), ("merged sessions", None)])
def test_rows_leave_in_their_records_windows_with_their_timestamps(model_dir, good, tmp_path, windowing,
                                                                    straggler_timeout_s):
    """Whichever record's processing, which timer or which stage emits a row, it carries its
    record's window and timestamp: one row per record and window (a sliding window's record is
    in two), in a merged session too, where assigning windows afresh from the row's timestamp
    would make a session of its own."""
    from apache_beam.transforms import window

    class Seen(beam.DoFn):
        def process(self, element, timestamp=beam.DoFn.TimestampParam, where=beam.DoFn.WindowParam):
            yield json.dumps({"id": element["id"], "timestamp": float(timestamp), "window": str(where)})

    def build(pipeline):
        stamped = (pipeline | beam.Create([(i, record) for i, record in enumerate(good[:6])], reshuffle=False)
                   | beam.MapTuple(lambda i, record: window.TimestampedValue(record, 2 * i + 1)))
        if windowing == "merged sessions":  # one session [1, 16) out of a GroupByKey
            records = (stamped | beam.WindowInto(window.Sessions(5)) | beam.Map(lambda r: ("k", r))
                       | beam.GroupByKey() | beam.FlatMap(lambda kv: kv[1]))
        else:
            records = stamped | beam.WindowInto(window.FixedWindows(20) if windowing == "fixed"
                                                else window.SlidingWindows(10, 5))
        rows = records | Generate(str(model_dir), engine_args=ENGINE_ARGS, num_shards=2, max_tokens=4,
                                  straggler_timeout_s=straggler_timeout_s)
        return {"records": records | "r" >> beam.ParDo(Seen()), "rows": rows | beam.ParDo(Seen())}

    outputs, _ = run_pipeline(build, tmp_path, IN_MEMORY)
    placed = sorted((r["id"], r["window"], r["timestamp"]) for r in outputs["records"])
    assert len(placed) == (12 if windowing == "sliding" else 6)
    assert sorted((r["id"], r["window"], r["timestamp"]) for r in outputs["rows"]) == placed


def test_passthrough_fields_come_back(rows_by_key):
    assert rows_by_key["g03"]["passthrough"] == {"source": "bundled", "index": 3}
    assert rows_by_key["c2"]["passthrough"] == {"index": 2}
    assert rows_by_key["len-5"]["passthrough"] == {}
    assert rows_by_key["openai-1"]["passthrough"] == {"batch": "b1"}
    assert rows_by_key["json-1"]["passthrough"] == {"note": "from a text file"}
    assert rows_by_key["tag:missing-id"]["passthrough"] == {"tag": "missing-id"}


@pytest.mark.parametrize("options,problem", [
    (dict(num_shards=0), "num_shards must be a whole number >= 1, got 0"),
    (dict(max_in_flight=2.5), "max_in_flight must be a whole number >= 1, got 2.5"),
    (dict(straggler_timeout_s=-1), "straggler_timeout_s must be a number >= 0"),
    (dict(straggler_timeout_s=float("nan")), "straggler_timeout_s must be a number >= 0, got nan"),
    (dict(poll_interval_s=0), "poll_interval_s must be a number > 0, got 0"),
    (dict(clock=0.0), "clock must be a function returning seconds, got 0.0"),
    (dict(temperature=-1), "defaults: temperature: must be >= 0, got -1"),
    (dict(engine_args={"max_num_seq": 8}), r"engine_args: unknown \['max_num_seq'\]"),
    # "no" is true: the feature would silently stay on
    (dict(engine_args={"ngram_drafts": "no"}), "ngram_drafts must be True or False, got 'no'"),
    (dict(engine_args={"enable_prefix_caching": 0}), "enable_prefix_caching must be True or False, got 0"),
    # refused by the engine only once it started on a worker
    (dict(engine_args={"weights_in_host_memory": True}), "give weight_budget_bytes too"),
    (dict(engine_args={"weight_budget_bytes": 1 << 30, "lora": "adapter"}), "a LoRA adapter with weight streaming"),
])
def test_caller_mistakes_raise_at_construction(options, problem):
    """Before any worker runs: a mistake here would fail every record."""
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=problem):
        Generate("unused-model-dir", **options)


def test_the_bundle_based_direct_runner_is_refused_when_the_pipeline_is_built():
    """It loses what timers emit (rows reach a later GroupByKey after it ran; counters dropped)."""
    from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner

    pipeline = beam.Pipeline(runner=BundleBasedDirectRunner())
    with pytest.raises(ValueError, match="BundleBasedDirectRunner, which loses what a timer emits"):
        pipeline | beam.Create([{"id": "a", "prompt": "Hi"}]) | Generate("unused-model-dir")



def test_a_bounded_input_in_streaming_mode_on_the_direct_runner_is_refused():
    """The DirectRunner runs a streaming job on that runner, where a bounded input's window
    closes at once: the rows its window-end flush emits would be dropped as late."""
    pipeline = beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner", "--streaming"]))
    with pytest.raises(ValueError, match="bounded input .* streaming mode on the DirectRunner"):
        pipeline | beam.Create([{"id": "a", "prompt": "Hi"}]) | Generate("unused-model-dir")


@pytest.mark.parametrize("straggler_timeout_s", [None, 5])
def test_a_pipeline_that_requires_every_steps_output_type_builds(straggler_timeout_s):
    """--type_check_strictness=ALL_REQUIRED: Generate and its inner steps declare that rows are
    dicts (the pipeline stopped at "no output type-hint was found for ... Generate")."""
    pipeline = beam.Pipeline(options=PipelineOptions(["--type_check_strictness=ALL_REQUIRED"]))
    rows = (pipeline | beam.Create([{"id": "a", "prompt": "Hi"}]).with_output_types(dict)
            | Generate("unused-model-dir", straggler_timeout_s=straggler_timeout_s))
    assert rows.element_type == beam.typehints.Dict[typing.Any, typing.Any]


def test_metrics_count_rows_tokens_and_errors(in_memory):
    rows, result = in_memory
    assert counter(result, "sequences_finished") == len(rows)  # one per row, error rows included
    assert counter(result, "tokens_generated") == sum(row["completion_tokens"] for row in rows)
    assert counter(result, "errors") == sum(row["error"] is not None for row in rows) == len(BAD_RECORDS)


# ---- two SDK worker processes, one engine -------------------------------------------------

class ProcessWatcher(threading.Thread):
    """Samples this test process's descendants while a pipeline runs: the SDK worker processes,
    every engine process (a multiprocessing spawn child of a worker) and which workers hold a
    connection to the engine at `address_file` (host:port, written by MultiProcessShared)."""

    def __init__(self, address_file: Path):
        super().__init__(daemon=True)
        self.address_file = address_file
        self.sdk_workers: set[int] = set()
        self.engines: set[int] = set()
        self.listening: set[int] = set()  # engine pids listening on the address file's port
        self.connected: set[int] = set()  # SDK worker pids connected to that port
        self._stopping = threading.Event()

    def run(self):
        # Often: on a tiny model a worker's share of the stage can be over in well under a
        # second (one CI run's samples every 0.2 s saw only one of the two workers connected).
        while not self._stopping.wait(0.05):
            try:
                self.sample()
            except psutil.Error:  # a process ended between listing and reading it
                pass

    def stop(self):
        self._stopping.set()
        self.join()
        self.sample()

    def sample(self):
        port = int(self.address_file.read_text().rsplit(":", 1)[1]) if self.address_file.exists() else None
        for proc in psutil.Process().children(recursive=True):
            try:
                command = proc.cmdline()
                if command[1:3] == ["-m", "apache_beam.runners.worker.sdk_worker_main"]:
                    self.sdk_workers.add(proc.pid)
                    if port and any(c.raddr and c.raddr.port == port
                                    for c in proc.net_connections("tcp")):
                        self.connected.add(proc.pid)
                elif "spawn_main" in " ".join(command) and proc.ppid() in self.sdk_workers:
                    self.engines.add(proc.pid)
                    if port and any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                                    for c in proc.net_connections("tcp")):
                        self.listening.add(proc.pid)
            except psutil.Error:
                continue


@pytest.mark.slow
def test_two_sdk_processes_share_one_engine(model_dir, good, tmp_path, monkeypatch):
    """direct_running_mode=multi_processing: two SDK worker processes each run the Generate DoFn
    (the runner hands a stateful stage's bundles to its workers in turn). Checked, not assumed:
    the OS shows both workers connected to the one engine process that ever existed under
    them, and every DoFn call's `batchgen/engine_pid` metric names that same process."""
    worker_pythonpath(monkeypatch)
    engine_args = {**ENGINE_ARGS, "max_num_seqs": 48}  # its own engine, not this process's
    address_file = Path(tempfile.gettempdir()) / (EngineConfig.of(str(model_dir), **engine_args).tag + ".address")
    records = good + [raw for raw, _, _ in BAD_RECORDS.values()]
    watcher = ProcessWatcher(address_file)
    watcher.start()
    try:
        rows, result = generate_rows(records, model_dir, tmp_path, MULTI_PROCESSING, engine_args)
    finally:
        watcher.stop()

    assert Counter(row_key(row) for row in rows) == expected_keys(good)
    assert counter(result, "sequences_finished") == len(rows)
    assert counter(result, "errors") == len(BAD_RECORDS)

    assert len(watcher.sdk_workers) == 2
    assert len(watcher.engines) == 1, watcher.engines
    [engine_pid] = watcher.engines
    assert watcher.listening == {engine_pid}
    assert watcher.connected == watcher.sdk_workers  # both workers fed that engine
    pids = distribution(result, "engine_pid")
    assert pids.min == pids.max == engine_pid
    assert gone(engine_pid)  # the engine ended with the worker that started it


# ---- recovery: a dead engine, a dead worker ------------------------------------------------

def engine_requests(prompts, prefix, max_tokens=40):
    return [Request(f"{prefix}{i}", prompt=p, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]


def kill_engine(client) -> int:
    pid = client.info()["pid"]
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(10)  # reaped: the next call on the client finds it gone
    return pid


def restart_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "batchgen_beam.engine_client" and r.levelno == logging.WARNING]


def test_dead_engine_is_restarted_and_resident_requests_resubmitted(model_dir, bare_engine, caplog):
    """SIGKILL the engine process while requests are resident: the client starts a new engine,
    resubmits them, and every request completes exactly once, as the bare engine answers it.
    (The engine is the one this module's pipelines used; their client reconnects to the new
    engine on its next call.)"""
    caplog.set_level(logging.WARNING)
    client = EngineClient(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    prompts = bundled_prompts(bare_engine.tokenizer, 8, CONTEXT - 40 - 1)
    requests = engine_requests(prompts, "dead-")
    client.submit(requests)  # nothing taken yet: all 8 are resident when the engine dies
    old_pid = kill_engine(client)

    done = client.wait_all([r.id for r in requests])
    assert sorted(done) == sorted(r.id for r in requests)
    assert client.restarts == 1 and client.info()["pid"] != old_pid
    [warning] = restart_warnings(caplog)
    assert "starting a new one and resubmitting 8 resident request(s)" in warning
    expected = {c.id: c.token_ids for c in bare_engine.generate(engine_requests(prompts, "dead-"))}
    assert {rid: c.token_ids for rid, c in done.items()} == expected
    # Exactly once: nothing more arrives, and nothing is left resident.
    assert client.take([r.id for r in requests], timeout=1.0) == {}
    assert not client.knows(requests[0].id) and client.done_ids() == set()


def test_an_engine_whose_loop_fails_fails_its_requests_in_flight_and_is_replaced(model_dir, bare_engine):
    """The engine process lives on but its loop died (a bug): the requests in flight come back
    as error completions instead of never, and the next requests run on a fresh engine."""
    import weakref

    service = EngineService(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    prompts = bundled_prompts(bare_engine.tokenizer, 3, CONTEXT - 40 - 1)

    def broken_step():
        raise IndexError("index out of range in self")
    service.engine.step = broken_step
    failed_engine, build, failed_engine_alive = weakref.ref(service.engine), service._new_engine, []

    def new_engine():  # the failed one's KV cache and weights must be gone before
        failed_engine_alive.append(failed_engine() is not None)
        return build()
    service._new_engine = new_engine
    service.submit("client", engine_requests(prompts, "doomed-"))
    failed = collect(service, "client", 3)
    assert sorted(failed) == [f"doomed-{i}" for i in range(3)]
    assert all(c.finish_reason == "error" and "the engine failed while this request was in flight "
               "(IndexError: index out of range in self)" in c.error for c in failed.values())
    assert not any(c.invalid for c in failed.values())  # the engine's failure, not theirs
    assert service.info()["engine_failures"] == 1 and failed_engine_alive == [False]

    service.submit("client", engine_requests(prompts, "after-"))
    after = collect(service, "client", 3, acknowledge=list(failed))
    expected = {c.id: c.token_ids for c in bare_engine.generate(engine_requests(prompts, "after-"))}
    assert {rid: c.token_ids for rid, c in after.items()} == expected
    # The service is left as it is: its router polls the engine for the life of the process
    # (a stopped engine would turn that poll into a busy loop).


def test_an_engine_that_cannot_be_replaced_fails_its_requests_then_exits_the_process(
        model_dir, bare_engine, monkeypatch):
    """Building the replacement failed (out of memory, say): the requests in flight still get
    their error completions, and the process exits, so that clients start a fresh one (the
    router thread died instead, and every request waited forever)."""
    from batchgen_beam import engine_client

    service = EngineService(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    exited = threading.Event()

    def exit_process(code):
        exited.set()
        threading.Event().wait()  # nothing after it runs, as after the exit (a daemon thread)

    def no_memory():
        raise MemoryError("cannot allocate the new engine")

    monkeypatch.setattr(engine_client.os, "_exit", exit_process)
    service._new_engine = no_memory

    def broken_step():
        raise IndexError("index out of range in self")
    service.engine.step = broken_step
    service.submit("client", engine_requests(bundled_prompts(bare_engine.tokenizer, 2, 20), "doomed-"))
    assert exited.wait(60)
    with service._ready:
        failed = service._outboxes["client"]
        assert sorted(failed) == ["doomed-0", "doomed-1"]
        assert all("the engine failed while this request was in flight" in c.error for c in failed.values())


def test_rows_reach_clients_while_another_client_submits(model_dir, bare_engine):
    """A submit holds the engine while it tokenises (seconds for a prompt of megabytes, rejected
    or not): the other clients' polls still hand out their finished rows meanwhile."""
    service = EngineService(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    service.submit("reader", engine_requests(bundled_prompts(bare_engine.tokenizer, 2, 20), "quick-"))
    done = collect(service, "reader", 2)
    assert sorted(done) == ["quick-0", "quick-1"]
    service.submit("reader", engine_requests(bundled_prompts(bare_engine.tokenizer, 1, 20), "later-"))
    submitting, release = threading.Event(), threading.Event()

    def long_submit():
        with service._engine_lock:  # as a submit tokenising a huge prompt holds it
            submitting.set()
            release.wait(60)
    holder = threading.Thread(target=long_submit)
    holder.start()
    assert submitting.wait(10)
    rows = []
    poller = threading.Thread(target=lambda: rows.extend(collect(service, "reader", 1, list(done))))
    poller.start()
    poller.join(30)
    still_waiting = poller.is_alive()
    release.set()
    holder.join()
    poller.join()
    assert not still_waiting and rows == ["later-0"]


def test_a_client_that_leaves_leaves_nothing_behind_in_a_shared_engine(model_dir, bare_engine):
    """The engine outlives a client that leaves while others use it: what that client was owed
    (its taken but unacknowledged completions, those of its requests still running) is
    dropped, not kept for the life of the process; a retry elsewhere still gets its rows."""
    service = EngineService(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    prompts = bundled_prompts(bare_engine.tokenizer, 4, 20)
    service.join("stays")
    service.join("leaves")
    service.submit("leaves", engine_requests(prompts[:2], "done-", max_tokens=2))
    assert sorted(collect(service, "leaves", 2)) == ["done-0", "done-1"]  # taken, never acknowledged
    service.submit("leaves", engine_requests(prompts[2:], "running-", max_tokens=30))
    assert service.leave("leaves") == 1
    service.submit("stays", engine_requests(prompts[2:], "running-", max_tokens=30)[1:])  # a retry claims one
    assert sorted(collect(service, "stays", 1)) == ["running-1"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(service._owner) > 1:  # running-0 finishes unowned
        time.sleep(0.1)
    with service._ready:
        assert service._owner == {"running-1": "stays"} and list(service._delivered) == ["running-1"]
        assert set(service._outboxes) <= {"stays"} and set(service._taken) <= {"stays"}


def collect(service, client_id, count, acknowledge=()):
    done, deadline = {}, time.monotonic() + 120
    while len(done) < count and time.monotonic() < deadline:
        completions, _, _ = service.poll(client_id, 1.0, list(acknowledge))
        acknowledge = []
        done.update((c.id, c) for c in completions)
    return done


def test_submit_right_after_an_engine_death(model_dir, bare_engine, caplog):
    """The first call after the death is a submit: the restart resubmits what was resident
    (the new requests included) and the submit neither raises nor runs anything twice."""
    caplog.set_level(logging.WARNING)
    client = EngineClient(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    prompts = bundled_prompts(bare_engine.tokenizer, 6, CONTEXT - 40 - 1)
    early, late = engine_requests(prompts[:4], "early-"), engine_requests(prompts[4:], "late-")
    client.submit(early)
    kill_engine(client)
    client.submit(late)

    ids = [r.id for r in early + late]
    assert sorted(client.wait_all(ids)) == sorted(ids)
    assert client.restarts == 1
    [warning] = restart_warnings(caplog)
    assert "resubmitting 6 resident request(s)" in warning
    assert client.take(ids, timeout=1.0) == {}


class ServiceDyingOn:
    """A stand-in engine process that dies at any poll while `poison` is in it, and otherwise
    completes every request it holds."""

    def __init__(self, poison: str):
        self.poison, self.held = poison, []

    def submit(self, client_id, requests):
        self.held += [r.id for r in requests]

    def poll(self, client_id, timeout, acknowledged):
        if self.poison in self.held:
            raise EOFError("the engine process died")
        done, self.held = self.held, []
        return [Completion(rid, [SampleOutput(0, [1], "x", "length")], 1, Timings(submitted=0.0))
                for rid in done], [], {}


@pytest.mark.parametrize("innocents", [1, 3, 10, 16])
@pytest.mark.parametrize("before", ["none", "half", "all"])
def test_a_request_that_kills_the_engine_whenever_it_runs_ends_alone_as_an_error(monkeypatch, innocents, before):
    """It is resubmitted with those in flight beside it until they have been through
    SUSPECT_DEATHS deaths; then the suspects run apart, in halves split again wherever one
    kills the engine, so the poison ends as an error completion by itself (not invalid: no value
    of its own was wrong), every other one completes, and later requests run. A poison in the
    first half dies with it each time, one death after another within one call: that call
    raised "died 5 times in a row" before the poison was found."""
    from batchgen_beam.engine_client import SUSPECT_DEATHS

    started = []
    monkeypatch.setattr(EngineClient, "_connect", lambda self: started.append(ServiceDyingOn("poison"))
                        or started[-1])
    client = EngineClient(EngineConfig.of(None))
    split = {"none": 0, "half": innocents // 2, "all": innocents}[before]
    ids = [f"r{i}" for i in range(split)] + ["poison"] + [f"r{i}" for i in range(split, innocents)]
    client.submit([Request(rid, prompt="Hi") for rid in ids])
    done = client.wait_all(ids)
    poison = done.pop("poison")
    assert poison.finish_reason == "error" and not poison.invalid
    assert poison.error.startswith("the engine process died while this request ran apart from others")
    assert all(completion.error is None for completion in done.values()) and len(done) == innocents
    # Deaths with everyone in flight, one per halving of the suspects down to the poison, and
    # its own deaths alone.
    assert client.restarts == len(started) - 1 <= SUSPECT_DEATHS + math.ceil(math.log2(innocents + 1)) + SUSPECT_DEATHS + 1
    client.submit([Request("later", prompt="Hi")])
    assert client.wait_all(["later"])["later"].error is None


@pytest.mark.parametrize("in_flight", [0, 4, 64])
def test_an_engine_that_dies_whatever_it_holds_fails_the_call_after_a_few_deaths(monkeypatch, in_flight):
    """Deaths in a row are ridden out up to a few, plus one for each halving that setting a
    poison apart from the requests in flight may take; then the call raises, rather than
    restarting until every request has run alone and failed (131 restarts for 64)."""
    from batchgen_beam.engine_client import MAX_ENGINE_DEATHS, SUSPECT_DEATHS

    started = []
    monkeypatch.setattr(EngineClient, "_connect", lambda self: started.append(ServiceDyingOn("")) or started[-1])
    monkeypatch.setattr(ServiceDyingOn, "poll", lambda *args: (_ for _ in ()).throw(EOFError("the engine process died")))
    client = EngineClient(EngineConfig.of(None))
    ids = [f"r{i}" for i in range(in_flight)]
    client.submit([Request(rid, prompt="Hi") for rid in ids])
    deaths = MAX_ENGINE_DEATHS + 2 + (SUSPECT_DEATHS + in_flight.bit_length() if in_flight else 0)
    with pytest.raises(RuntimeError, match=f"died {deaths} times in a row"):
        client.wait_all(ids) if ids else client.done_ids()
    assert len(started) == deaths


def test_tokens_per_step_samples_only_the_steps_since_the_job_began():
    """The engine's counters are its life's: a job's first report sampled the average step of
    every earlier job too (22 tokens a step for a job whose steps had at most 5)."""
    metrics, sampled = EngineMetrics(), []
    metrics.tokens_per_step = types.SimpleNamespace(update=sampled.append)
    info = {"waiting": 0, "pid": 1, "steps": 10, "decode_tokens": 200, "prefill_tokens": 20}
    metrics.engine(info)
    metrics.engine({**info, "steps": 14, "decode_tokens": 212})
    assert sampled == [3]


class MachineDyingOn:
    """A stand-in for the machine's one engine process, shared by clients (SDK processes): it
    dies at any poll while `poison` is in it, whoever submitted it; a client that finds it dead
    starts the next one."""

    def __init__(self, poison: str):
        self.poison, self.lock, self.engine = poison, threading.Lock(), None

    def connect(self):
        with self.lock:
            if self.engine is None or self.engine.dead:
                self.engine = types.SimpleNamespace(dead=False, held={})
            engine = self.engine
        machine = self

        class Service:
            def join(self, client_id):
                machine._check(engine)

            def submit(self, client_id, requests):
                with machine.lock:
                    machine._check(engine)
                    engine.held.update({r.id: client_id for r in requests})

            def poll(self, client_id, timeout, acknowledged):
                time.sleep(0.005)
                with machine.lock:
                    machine._check(engine)
                    if machine.poison in engine.held:
                        engine.dead = True
                        raise EOFError("the engine process died")
                    mine = [rid for rid, owner in engine.held.items() if owner == client_id]
                    for rid in mine:
                        del engine.held[rid]
                return [Completion(rid, [SampleOutput(0, [1], "x", "length")], 1, Timings(submitted=0.0))
                        for rid in mine], [], {}
        return Service()

    @staticmethod
    def _check(engine):
        if engine.dead:
            raise EOFError("the engine process is gone")


def test_another_processs_poison_gets_no_request_of_this_one_blamed(monkeypatch):
    """Two SDK processes share the engine, one with a poison. Each ran its suspects apart from
    its own others only: this process's lone innocent suspect ran beside the other's poison,
    died with it, and ended as an error. Suspects now run in the machine's turn, one process's
    at a time."""
    machine = MachineDyingOn("poison")
    monkeypatch.setattr(EngineClient, "_connect", lambda self: machine.connect())
    first, second = EngineClient(EngineConfig.of(None)), EngineClient(EngineConfig.of(None))
    work = {first: ["a0", "a1", "poison", "a2"], second: ["b0", "b1", "b2", "b3"]}
    results = {}

    def run(client):
        client.submit([Request(rid, prompt="Hi") for rid in work[client]])
        results.update(client.wait_all(work[client]))
    threads = [threading.Thread(target=run, args=(client,)) for client in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == sorted(work[first] + work[second])
    assert {rid for rid, completion in results.items() if completion.error is not None} == {"poison"}


@pytest.mark.parametrize("let_go", ["abandon", "cancel"])
def test_a_trial_let_go_gives_the_machines_turn_back_at_once(monkeypatch, let_go):
    """A process's lone suspect ran in the machine's turn; the process let it go (a failed
    RunInference batch, a job that is over) and made no call after: it kept the turn, and
    another process's suspects waited for it forever."""
    machine = MachineDyingOn("poison")

    def connect(self):
        service = machine.connect()
        service.migrate_out = lambda client_id, ids: {}  # every one finished already
        return service
    monkeypatch.setattr(EngineClient, "_connect", connect)
    first, second = EngineClient(EngineConfig.of(None)), EngineClient(EngineConfig.of(None))
    first.submit([Request(rid, prompt="Hi") for rid in ("a0", "a1")])
    for _ in range(2):  # two deaths: a0 and a1 suspects, a0 running alone in the first's turn
        first._restart(first._connected(), EOFError("the engine process died"))
    assert first._trial == ["a0"]
    first.abandon(["a0", "a1"]) if let_go == "abandon" else first.cancel("a")
    second.submit([Request(rid, prompt="Hi") for rid in ("b0", "poison")])
    done = {}
    waiting = threading.Thread(target=lambda: done.update(second.wait_all(["b0", "poison"])), daemon=True)
    waiting.start()
    waiting.join(30)
    assert done["b0"].error is None and done["poison"].finish_reason == "error"


@pytest.mark.parametrize("whose", ["this process's", "another process's"])
def test_a_lone_suspect_is_not_blamed_for_a_poison_that_came_after_it(monkeypatch, whose):
    """A suspect runs alone but for requests not suspects yet: one submitted since may be a
    poison, which killed the engine beside it, and the innocent suspect ended as the error."""
    machine = MachineDyingOn("poison")
    monkeypatch.setattr(EngineClient, "_connect", lambda self: machine.connect())
    first, second = EngineClient(EngineConfig.of(None)), EngineClient(EngineConfig.of(None))
    first.submit([Request(rid, prompt="Hi") for rid in ("a0", "a1")])
    for _ in range(2):  # two deaths (of some other cause): a0 and a1 suspects, a0 running alone
        first._restart(first._connected(), EOFError("the engine process died"))
    assert first._trial == ["a0"]
    poisoned = first if whose == "this process's" else second
    poisoned.submit([Request("poison", prompt="Hi")])
    done = {}
    waits = [threading.Thread(target=lambda: done.update(first.wait_all(["a0", "a1"])), daemon=True),
             threading.Thread(target=lambda: done.update(poisoned.wait_all(["poison"])), daemon=True)]
    for wait in waits:
        wait.start()
    for wait in waits:
        wait.join(30)
    assert sorted(done) == ["a0", "a1", "poison"]
    assert [rid for rid, completion in sorted(done.items()) if completion.error is not None] == ["poison"]


def test_a_suspect_let_go_while_it_waits_for_its_turn_holds_up_no_other(monkeypatch):
    started = []
    monkeypatch.setattr(EngineClient, "_connect", lambda self: started.append(ServiceDyingOn("poison"))
                        or started[-1])
    client = EngineClient(EngineConfig.of(None))
    client.submit([Request(rid, prompt="Hi") for rid in ("a", "b", "c", "poison")])
    client._connected()
    for _ in range(2):  # two deaths: four suspects, in halves, the first half running
        client._restart(client._service, EOFError("the engine process died"))
    assert client._trial == ["a", "b"] and client._held_ids == {"c", "poison"}
    client.abandon(["c"])  # held: in no engine, so no completion of it is coming
    done = client.wait_all(["a", "b", "poison"])
    assert done["a"].error is None and done["b"].error is None and done["poison"].finish_reason == "error"
    assert not client._held_ids and not client._unwanted and not client._resident


class SharedProcessStarts:
    """A stand-in for Beam's MultiProcessShared: its first engine processes fail as they start
    (each `failures` entry is what Beam raises then), the next serves."""

    def __init__(self, failures: list[str]):
        self.failures, self.started = failures, 0

    def __call__(self, constructor, tag, always_proxy, spawn_process):
        return self

    def acquire(self):
        self.started += 1
        if self.started <= len(self.failures):
            raise RuntimeError(self.failures[self.started - 1])
        return types.SimpleNamespace(join=lambda client_id: None, leave=lambda client_id: 1)


def test_an_engine_process_killed_as_it_starts_is_started_again(monkeypatch):
    """Killed while loading (the OOM killer, a second crash right after a restart): another
    start, as for a death once it serves, up to MAX_ENGINE_DEATHS; an engine that raises as it
    starts is refused at once with its own error."""
    from batchgen_beam import engine_client
    from batchgen_beam.engine_client import MAX_ENGINE_DEATHS, EngineStartError

    killed = "Shared Server Process died unexpectedly with exit code -9"
    starts = SharedProcessStarts([killed] * (MAX_ENGINE_DEATHS - 1))
    monkeypatch.setattr(engine_client, "MultiProcessShared", starts)
    EngineClient(EngineConfig.of(None)).connect()
    assert starts.started == MAX_ENGINE_DEATHS
    starts = SharedProcessStarts([killed] * MAX_ENGINE_DEATHS)
    monkeypatch.setattr(engine_client, "MultiProcessShared", starts)
    with pytest.raises(EngineStartError, match=f"its process was gone {MAX_ENGINE_DEATHS} times .*exit code -9"):
        EngineClient(EngineConfig.of(None)).connect()
    crashed = ("Shared Server Process crashed:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
               "    Engine()\nValueError: kv_cache_bytes=0 holds fewer\nthan 2 blocks")
    starts = SharedProcessStarts([crashed])
    monkeypatch.setattr(engine_client, "MultiProcessShared", starts)
    with pytest.raises(EngineStartError, match="could not start: ValueError: kv_cache_bytes=0 holds fewer\nthan 2"):
        EngineClient(EngineConfig.of(None)).connect()
    assert starts.started == 1


class ServiceFinishingInTurn:
    """A stand-in engine process whose requests have all finished, delivered one per poll in
    submission order; it records what each poll acknowledged."""

    def __init__(self):
        self.undelivered, self.acknowledged = [], []

    def submit(self, client_id, requests):
        self.undelivered += [r.id for r in requests]

    def migrate_out(self, client_id, request_ids):
        return {}  # all finished: none to take out

    def poll(self, client_id, timeout, acknowledged):
        self.acknowledged += acknowledged
        done, self.undelivered = self.undelivered[:1], self.undelivered[1:]
        return [Completion(rid, [SampleOutput(0, [1], "x", "stop")], 1, Timings(submitted=0.0))
                for rid in done], [], {}


def test_cancelled_requests_that_had_finished_are_acknowledged_unread(monkeypatch):
    """Cancelling finished requests, whether their completions were already pulled or are still
    on their way, acknowledges them to the engine (which holds each until then) and never hands
    them out; other requests are untouched."""
    service = ServiceFinishingInTurn()
    monkeypatch.setattr(EngineClient, "_connect", lambda self: service)
    client = EngineClient(EngineConfig.of(None))
    client.submit([Request(rid, prompt="Hi") for rid in ("old:1", "old:2", "new:1")])
    assert client.done_ids() == {"old:1"}
    client.cancel("old:")
    assert not client.knows("old:1") and not client.knows("old:2")
    assert list(client.wait_all(["new:1"])) == ["new:1"]
    client.done_ids()
    assert sorted(service.acknowledged) == ["new:1", "old:1", "old:2"]
    assert client.done_ids() == set()


def test_abandoned_requests_are_acknowledged_and_run_again_when_submitted_again(monkeypatch):
    """A failed RunInference batch abandons its requests: their completions, pulled already or
    on their way, are acknowledged (the engine held them for good), and the batch's retry
    submitting the same ids gets them run."""
    service = ServiceFinishingInTurn()
    monkeypatch.setattr(EngineClient, "_connect", lambda self: service)
    client = EngineClient(EngineConfig.of(None))
    requests = [Request(rid, prompt="Hi") for rid in ("b:1", "b:2")]
    client.submit(requests)
    assert client.done_ids() == {"b:1"}
    client.abandon(["b:1", "b:2"])
    client.done_ids()
    client.done_ids()
    assert sorted(service.acknowledged) == ["b:1", "b:2"] and client.done_ids() == set()
    client.submit(requests)  # the retry
    assert sorted(client.wait_all(["b:1", "b:2"])) == ["b:1", "b:2"]


def test_an_id_submitted_again_right_after_it_was_taken_runs_again(model_dir, bare_engine):
    """Taking a completion is acknowledged to the engine only at the client's next poll; a
    record identical to one whose row just went out reuses its id before that."""
    client = EngineClient(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    [request] = engine_requests(bundled_prompts(bare_engine.tokenizer, 1, 20), "again-")
    client.submit([request])
    first = client.wait_all([request.id])
    client.submit([request])  # no poll in between
    second = client.take([request.id], timeout=60)
    assert second and second[request.id].token_ids == first[request.id].token_ids


def test_an_id_submitted_again_while_another_threads_poll_acknowledges_it_runs_again(
        model_dir, bare_engine, monkeypatch):
    """Bundle threads share the client. Another thread's poll carrying the acknowledgement of
    a taken id is on its way when this thread submits the id again (an identical record): the
    submit reached the engine first, which took it for the one in flight, and the late
    acknowledgement then disowned it; it never ran and the flush waited for good."""
    service = EngineService(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    monkeypatch.setattr(EngineClient, "_connect", lambda self: service)
    client = EngineClient(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    real_poll, polling = service.poll, threading.Event()

    def slow_poll(client_id, timeout, taken):
        if threading.current_thread().name == "other bundle":
            polling.set()
            time.sleep(0.5)  # its call still on the way
        return real_poll(client_id, timeout, taken)
    monkeypatch.setattr(service, "poll", slow_poll)
    [request] = engine_requests(bundled_prompts(bare_engine.tokenizer, 1, 20), "again-")
    client.submit([request])
    first = client.wait_all([request.id])
    other = threading.Thread(target=client.done_ids, name="other bundle")
    other.start()
    assert polling.wait(10)
    client.submit([request])
    second = client.take([request.id], timeout=30)
    other.join()
    assert second and second[request.id].token_ids == first[request.id].token_ids


def test_a_request_resubmitted_by_another_process_runs_once(model_dir, bare_engine):
    """A timer firing in another SDK process resubmits pending records by id: that client takes
    the requests over (finished or still running) instead of the engine running them twice, and
    the first client stops counting them as its own."""
    config = EngineConfig.of(str(model_dir), **ENGINE_ARGS)
    first, second = EngineClient(config), EngineClient(config)
    prompts = bundled_prompts(bare_engine.tokenizer, 4, CONTEXT - 40 - 1)
    requests = engine_requests(prompts, "takeover-")
    ids = [r.id for r in requests]
    before = first.info()["finished"]
    first.submit(requests[:2])
    first.wait_all([ids[0]])  # one finished and taken by `first`, one maybe still running
    first.submit(requests[2:])
    second.submit(requests[1:])

    done = second.wait_all(ids[1:])
    assert sorted(done) == sorted(ids[1:])
    assert second.info()["finished"] - before == len(requests)  # each generated exactly once
    assert first.take(ids, timeout=0.5) == {}  # and learns that the others were taken over
    assert not any(first.knows(rid) for rid in ids)
    expected = {c.id: c.token_ids for c in bare_engine.generate(engine_requests(prompts, "takeover-"))}
    assert {rid: c.token_ids for rid, c in done.items()} == {rid: expected[rid] for rid in ids[1:]}


def test_a_completion_pulled_but_not_taken_goes_to_the_process_that_took_it_over(model_dir,
                                                                                 bare_engine):
    """A process may already hold a completion it has not emitted when another process takes
    the request over: only the new owner may emit it, or the record would be output twice."""
    config = EngineConfig.of(str(model_dir), **ENGINE_ARGS)
    first, second = EngineClient(config), EngineClient(config)
    [request] = engine_requests(bundled_prompts(bare_engine.tokenizer, 1, CONTEXT - 40 - 1),
                                "pulled-")
    first.submit([request])
    deadline = time.monotonic() + 60
    while request.id not in first.done_ids():  # pulled into `first`, not taken
        assert time.monotonic() < deadline
    second.submit([request])

    assert list(second.wait_all([request.id])) == [request.id]
    assert first.take([request.id], timeout=0.5) == {}
    assert not first.knows(request.id)


class SlowToAnswer:
    """A stand-in engine process whose requests have all finished; a poll or a migrate_out
    takes `delay` seconds to answer, hands over what it holds, and counts the acknowledgements."""

    def __init__(self, delay: float):
        self.delay, self.held, self.acknowledged = delay, [], []

    def submit(self, client_id, requests):
        self.held += [r.id for r in requests]

    def poll(self, client_id, timeout, acknowledged):
        time.sleep(self.delay)
        self.acknowledged += acknowledged
        done, self.held = self.held, []
        return [Completion(rid, [SampleOutput(0, [1], "x", "stop")], 1, Timings(submitted=0.0))
                for rid in done], [], {}

    def migrate_out(self, client_id, request_ids):
        time.sleep(self.delay)
        self.held = [rid for rid in self.held if rid not in request_ids]
        return {rid: {"request_id": rid} for rid in request_ids}


@pytest.mark.parametrize("method", ["poll", "migrate_out"])
def test_a_call_the_main_thread_is_interrupted_in_still_completes(monkeypatch, method, interruptible):
    """A notebook's stop button (KeyboardInterrupt, which reaches only the main thread) while a
    call to the engine is under way: the call completes anyway and the client takes in what
    its reply carried. Its completions are then taken, and acknowledged, as usual; requests it
    took out are no longer this client's, so a re-run submits them again. (Cut short, the
    reply was lost with what it carried: every job waiting on those completions hung.)"""
    import _thread

    engine = SlowToAnswer(delay=0.5)
    monkeypatch.setattr(EngineClient, "_connect", lambda self: engine)
    client = EngineClient(EngineConfig.of(None))
    ids = ["a:1", "a:2"]
    client.submit([Request(rid, prompt="Hi") for rid in ids])
    threading.Timer(0.1, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        client.done_ids() if method == "poll" else client.migrate_out(ids)
    if method == "poll":
        assert sorted(client.wait_all(ids)) == ids
        client.done_ids()
        assert sorted(engine.acknowledged) == ids
    else:
        assert not any(client.knows(rid) for rid in ids)
        assert client.take(ids) == {} and engine.held == []


def test_a_failed_poll_keeps_its_acknowledgements_for_the_next(monkeypatch):
    """A poll that raised may never have reached the engine, which holds a taken request's id
    until it is acknowledged: an id held so would never run again when submitted again."""
    engine = SlowToAnswer(delay=0.0)
    failing = []

    def poll(client_id, timeout, acknowledged):
        if failing.pop() if failing else False:
            raise RuntimeError("the call failed")
        return SlowToAnswer.poll(engine, client_id, timeout, acknowledged)

    monkeypatch.setattr(engine, "poll", poll)
    monkeypatch.setattr(EngineClient, "_connect", lambda self: engine)
    client = EngineClient(EngineConfig.of(None))
    client.submit([Request("a:1", prompt="Hi")])
    assert list(client.wait_all(["a:1"])) == ["a:1"]
    failing.append(True)
    with pytest.raises(RuntimeError, match="the call failed"):
        client.done_ids()
    client.done_ids()
    assert engine.acknowledged == ["a:1"]


class Bag:
    """BagState stand-in: what the runner keeps per key across bundles and workers."""

    def __init__(self):
        self.items = []

    def read(self):
        return list(self.items)

    def add(self, value):
        self.items.append(value)

    def clear(self):
        self.items.clear()


class Timer:
    def __init__(self):
        self.set_to = []

    def set(self, timestamp):
        self.set_to.append(timestamp)


def test_a_script_without_the_main_guard_fails_saying_so(model_dir, tmp_path, monkeypatch):
    """The engine process starts with spawn, which runs the main module again: there, the
    pipeline's engine client waited forever for the lock its parent held while waiting for it."""
    worker_pythonpath(monkeypatch)
    engine_args = {**ENGINE_ARGS, "max_num_seqs": 5}  # an engine of its own, none to join
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import apache_beam as beam\n"
        "from batchgen_beam import Generate\n"
        "with beam.Pipeline(argv=['--runner=DirectRunner']) as p:\n"
        f"    p | beam.Create([{{'id': 'a', 'prompt_token_ids': [5, 6, 7]}}]) | Generate({str(model_dir)!r}, "
        f"max_tokens=2, engine_args={engine_args!r})\n")
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert child.returncode != 0
    assert 'needs `if __name__ == "__main__":`' in child.stderr
    # in the error the script's own process raises too, not only in what its children logged
    assert 'needs `if __name__ == \"__main__\":`' in child.stderr.strip().splitlines()[-1]


def test_records_left_in_state_are_resubmitted_by_a_restarted_worker(model_dir, good, bare_engine,
                                                                      monkeypatch):
    """Worker 1 takes records into state and dies before their rows are out. A new worker (a
    new DoFn and a new EngineClient: nothing of worker 1 survives but the state; the engine
    still runs worker 1's requests, for a client that will never take them) resubmits them by
    id when it first sees the key, and its flush emits every record's row: exactly one per
    record across both workers, equal to the bare engine's."""
    records = [parse_record(r, {"max_tokens": 16, "ignore_eos": True}) for r in good[:7]]
    bag, timer, rows = Bag(), Timer(), []
    monkeypatch.setattr(EngineClient, "_instances", {})  # this test's clients are its own

    def run(fn, method, *args, **state):
        rows.extend(getattr(fn, method)(*args, **state))

    worker1 = stateful_stage(_GenerateFn, "t")(EngineConfig.of(str(model_dir), **ENGINE_ARGS), num_shards=1,
                          max_in_flight=1024, namespace="job-1")
    worker1.setup()
    for parsed in records[:6]:
        run(worker1, "process", (0, parsed), window=GlobalWindow(), timestamp=STAMP, pending=bag, flush=timer)
    assert bag.items, "every row came out before the restart: nothing left to recover"
    assert len(rows) + len(bag.items) == 6
    assert timer.set_to and set(timer.set_to) == {GlobalWindow().max_timestamp()}

    # The worker dies: its DoFn and its process's clients are gone; the state survives.
    EngineClient._instances.clear()
    worker2 = stateful_stage(_GenerateFn, "t")(EngineConfig.of(str(model_dir), **ENGINE_ARGS), num_shards=1,
                          max_in_flight=1024, namespace="job-1")
    worker2.setup()
    run(worker2, "process", (0, records[6]), window=GlobalWindow(), timestamp=STAMP, pending=bag, flush=timer)
    run(worker2, "flush", pending=bag, window=GlobalWindow())

    assert all(row.timestamp == STAMP for row in rows)
    rows[:] = [row.value for row in rows]
    assert Counter(row["id"] for row in rows) == Counter(p.id for p in records)
    assert bag.items == []
    expected = {c.id: c.token_ids for c in bare_engine.generate([p.to_request() for p in records])}
    assert {row["id"]: row["token_ids"] for row in rows} == expected


def test_a_failed_jobs_requests_are_cancelled_when_another_job_starts(model_dir, good, monkeypatch):
    """A job fails (here at its window-end flush) with records in the engine. The same process
    then runs another job (a notebook re-running the fixed cell): the failed job's requests are
    cancelled instead of running ahead of the new job's, and its finished completions, which no
    one will take, are dropped."""
    client = EngineClient.shared(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    records = [dict(r, max_tokens=30, ignore_eos=True) for r in good[:12]]

    def downstream_bug(self, pending, window):
        raise RuntimeError("a bug downstream")
        yield

    def run(records):
        pipeline = beam.Pipeline(options=PipelineOptions(IN_MEMORY))
        _ = (pipeline | beam.Create(records, reshuffle=False)
             | Generate(str(model_dir), engine_args=ENGINE_ARGS, num_shards=2))
        pipeline.run().wait_until_finish()

    with monkeypatch.context() as patch:
        patch.setattr(_GenerateFn, "_flush", downstream_bug)
        with pytest.raises(Exception, match="a bug downstream"):
            run(records)
    assert client._has_resident(), "the failed job left nothing in the engine: nothing to test"

    run([dict(r, max_tokens=2) for r in good[:2]])
    assert not client._has_resident() and client.done_ids() == set()
    info = client.info()
    assert info["running"] == info["waiting"] == 0


def test_a_retried_bundle_of_the_same_job_keeps_its_requests(model_dir, good, bare_engine, monkeypatch):
    """Only another job cancels a job whose DoFns were all torn down: a retry of the same job
    (the same namespace) finds its requests still in the engine, and each row comes out once."""
    monkeypatch.setattr(EngineClient, "_instances", {})
    config = EngineConfig.of(str(model_dir), **ENGINE_ARGS)
    records = [parse_record(r, {"max_tokens": 16, "ignore_eos": True}) for r in good[:5]]
    stage = stateful_stage(_GenerateFn, "retry")
    bag, rows = Bag(), []
    first = stage(config, num_shards=1, max_in_flight=1024, namespace="job-r", job="retried")
    first.setup()
    for parsed in records:
        rows.extend(first.process((0, parsed), window=GlobalWindow(), timestamp=STAMP, pending=bag,
                                  flush=Timer()))
    held = [first._request_id(record) for record, _ in bag.items]
    assert held, "every row came out before the failure: nothing to retry"
    first.teardown()  # the bundle failed

    retry = stage(config, num_shards=1, max_in_flight=1024, namespace="job-r", job="retried")
    retry.setup()
    assert all(retry._client.knows(request_id) for request_id in held)
    rows.extend(retry.flush(pending=bag, window=GlobalWindow()))
    retry.teardown()
    assert sorted(row.value["id"] for row in rows) == sorted(p.id for p in records)
    assert bag.items == []


def test_on_an_unbounded_input_finished_rows_leave_before_the_window_ends(model_dir, good, bare_engine,
                                                                           monkeypatch):
    """Streaming: the global window ends only when the job drains, and a key may see no more
    records. Its processing-time poll timer emits each row as it finishes, once, and is set
    again only while rows are pending; the window's end then has nothing left to emit."""
    records = [parse_record(r, {"max_tokens": 16, "ignore_eos": True}) for r in good[:5]]
    bag, flush, poll, rows = Bag(), Timer(), Timer(), []
    monkeypatch.setattr(EngineClient, "_instances", {})
    fn = stateful_stage(_StreamingGenerateFn, "t")(EngineConfig.of(str(model_dir), **ENGINE_ARGS), num_shards=1,
                              max_in_flight=1024, namespace="stream-1", poll_interval_s=0.5, clock=time.time)
    fn.setup()
    for parsed in records:
        before = time.time()
        rows += fn.process((0, parsed), window=GlobalWindow(), timestamp=STAMP, pending=bag, flush=flush, poll=poll)
        assert before + 0.5 <= poll.set_to[-1] <= time.time() + 0.5
    deadline = time.monotonic() + 120
    while bag.items and time.monotonic() < deadline:
        armed = len(poll.set_to)
        rows += fn.poll(pending=bag, poll=poll, window=GlobalWindow())
        assert len(poll.set_to) == armed + bool(bag.items)  # re-armed while rows are pending
        time.sleep(0.05)
    assert bag.items == []
    assert list(fn.flush(pending=bag, window=GlobalWindow())) == []
    assert all(row.timestamp == STAMP for row in rows)  # the record's, not the poll's fire time
    rows = [row.value for row in rows]
    expected = {c.id: c.token_ids for c in bare_engine.generate([p.to_request() for p in records])}
    assert sorted(row["id"] for row in rows) == sorted(expected)  # one row each
    assert {row["id"]: row["token_ids"] for row in rows} == expected


def test_a_streaming_pipeline_emits_rows_before_its_window_ends(model_dir, good, bare_engine):
    """An unbounded input (a TestStream, on the DirectRunner's streaming mode) runs the polling
    first stage: each record yields exactly one row, while the global window is still open (the
    DirectRunner drops, as late, rows a window-end timer emits there)."""
    records = good[:6] + [{"id": "bad", "prompt": ""}]
    stream = (test_stream.TestStream().advance_watermark_to(0).add_elements(records[:4])
              .add_elements(["pause"]).advance_processing_time(10)
              .add_elements(records[4:]).add_elements(["pause"]).advance_processing_time(10)
              .advance_watermark_to_infinity())
    parsed = [parse_record(r, {"max_tokens": MAX_TOKENS}) for r in records[:6]]
    expected = {c.id: c.token_ids for c in bare_engine.generate([p.to_request() for p in parsed])}

    def check(rows):
        assert sorted(row["id"] for row in rows) == sorted([*expected, "bad"])  # one row each
        assert {row["id"]: row["token_ids"] for row in rows if row["id"] != "bad"} == expected
        [bad] = [row for row in rows if row["id"] == "bad"]
        assert "prompt: must not be empty" in bad["error"], bad

    with beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner", "--streaming"])) as pipeline:
        records_in = (pipeline | stream
                      | "Pause" >> beam.Filter(lambda r: r != "pause" or time.sleep(3)))
        rows = records_in | Generate(str(model_dir), engine_args=ENGINE_ARGS, max_tokens=MAX_TOKENS,
                                     clock=lambda: 0.0)  # a TestStream's processing time
        assert_that(rows, check)


def test_generate_polls_only_on_unbounded_inputs(model_dir):
    """Batch runners may never fire a processing-time timer (DESIGN.md §4), and a stateful
    DoFn with one forces the DirectRunner's legacy path: bounded inputs run without it."""
    def first_stage(pipeline, source):
        rows = pipeline | source | Generate(str(model_dir), engine_args=ENGINE_ARGS)
        return type(rows.producer.transform.fn)

    bounded = first_stage(beam.Pipeline(), beam.Create([{"id": "a", "prompt": "Hi"}]))
    assert issubclass(bounded, _GenerateFn) and not issubclass(bounded, _StreamingGenerateFn)
    unbounded = test_stream.TestStream().add_elements([{"id": "a", "prompt": "Hi"}])
    streaming = beam.Pipeline(options=PipelineOptions(["--streaming"]))
    assert issubclass(first_stage(streaming, unbounded), _StreamingGenerateFn)


def test_the_stages_of_one_batch_job_share_its_token_and_streaming_jobs_have_none(model_dir):
    """A failed batch job's requests are cancelled only by another job (_LiveJobs): every
    Generate stage of a pipeline carries the pipeline's token. The DirectRunner sets a streaming
    job's DoFns up and tears them down around each bundle, so none alive does not mean over:
    streaming stages are not tracked (two streaming Generates cancelled each other's requests)."""
    def stage_jobs(pipeline, source, name):
        rows = pipeline | f"in {name}" >> source | name >> Generate(
            str(model_dir), engine_args=ENGINE_ARGS, straggler_timeout_s=1.0)
        first, continued = rows.producer.inputs
        return [pcoll.producer.transform.fn._job for pcoll in (first, continued)]

    pipeline = beam.Pipeline()

    def records():
        return beam.Create([{"id": "a", "prompt": "Hi"}])

    jobs = stage_jobs(pipeline, records(), "A") + stage_jobs(pipeline, records(), "B")
    assert jobs[0] is not None and set(jobs) == {jobs[0]}
    assert stage_jobs(beam.Pipeline(), records(), "A") != jobs[:2]  # another job
    unbounded = test_stream.TestStream().add_elements([{"id": "a", "prompt": "Hi"}])
    streaming = beam.Pipeline(options=PipelineOptions(["--streaming"]))
    assert stage_jobs(streaming, unbounded, "S") == [None, None]


def test_a_retry_setting_up_while_its_job_is_cancelled_waits_for_the_cancel(monkeypatch):
    """Its records' ids are known to the client until the cancel forgets them: a retry that
    looked before then would resubmit none, and wait for them for ever."""
    monkeypatch.setattr(_LiveJobs, "_alive", Counter())
    monkeypatch.setattr(_LiveJobs, "_namespaces", defaultdict(dict))
    events = []

    class SlowClient:
        def cancel(self, prefix):
            events.append(f"cancel {prefix}")
            time.sleep(0.3)
            events.append("cancelled")

    monkeypatch.setattr(EngineClient, "shared", lambda config: SlowClient())
    config = EngineConfig.of(None)
    _LiveJobs.set_up("failed", "ns-f", config)
    _LiveJobs.torn_down("failed")
    another = threading.Thread(target=_LiveJobs.set_up, args=("another", "ns-a", config))
    another.start()
    while not events:
        time.sleep(0.01)
    _LiveJobs.set_up("failed", "ns-f", config)  # the failed job's retry
    events.append("retry set up")
    another.join()
    assert events == ["cancel ns-f:", "cancelled", "retry set up"]


def test_jobs_run_one_after_another_leave_no_trace_of_the_ended_ones(monkeypatch):
    """A notebook process runs pipeline after pipeline: what _LiveJobs keeps stays bounded."""
    monkeypatch.setattr(_LiveJobs, "_alive", Counter())
    monkeypatch.setattr(_LiveJobs, "_namespaces", defaultdict(dict))
    monkeypatch.setattr(EngineClient, "shared", lambda config: types.SimpleNamespace(cancel=lambda prefix: None))
    config = EngineConfig.of(None)
    for job in range(50):
        _LiveJobs.set_up(f"job{job}", "ns", config)
        _LiveJobs.torn_down(f"job{job}")
    assert set(_LiveJobs._alive) <= {"job49"} and set(_LiveJobs._namespaces) == {"job49"}


def test_cancelling_never_restarts_a_dead_engine(monkeypatch):
    """A new job cancels a failed job's requests: if the failed job's engine is gone (what
    failed it, often), nothing runs them any more, and starting a new engine just to take them
    out cost a model load and kept that engine up for the life of the process."""
    class GoneService:
        def submit(self, client_id, requests):
            pass

        def migrate_out(self, client_id, request_ids):
            raise EOFError("the engine process died")

    started = []
    monkeypatch.setattr(EngineClient, "_connect", lambda self: started.append(GoneService()) or started[-1])
    client = EngineClient(EngineConfig.of(None))
    client.submit([Request(rid, prompt="Hi") for rid in ("old:1", "old:2")])
    client.cancel("old:")
    assert len(started) == 1 and not client.knows("old:1") and not client.knows("old:2")
    assert client._unwanted == set()


def test_a_refused_request_is_its_own_fault_a_refused_migrated_state_the_engine_s(model_dir, bare_engine):
    """A request the engine refuses (values it cannot honour) would be refused again: invalid.
    A state another engine of the same configuration moved out should fit: its refusal is the
    engine side's, which a retry may mend."""
    service = EngineService(EngineConfig.of(str(model_dir), **ENGINE_ARGS))
    [prompt] = bundled_prompts(bare_engine.tokenizer, 1, 20)
    too_many = Request("too-many-logprobs", prompt=prompt, params=SamplingParams(max_tokens=2, logprobs=10_000))
    service.submit("client", [too_many])
    service.resume("client", [{"request_id": "malformed", "timings": None}])
    done = collect(service, "client", 2)
    assert done["too-many-logprobs"].error and done["too-many-logprobs"].invalid
    assert done["malformed"].error and not done["malformed"].invalid


def test_a_local_model_saved_again_in_place_is_another_engine(tmp_path):
    """A notebook re-saving a fine-tune into the same folder must not get the engine that
    loaded the old weights: the engine's key follows the local folders' files."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"old weights")
    first = EngineConfig.of(str(model), max_num_seqs=2)
    assert EngineConfig.of(str(model), max_num_seqs=2) == first  # untouched: the same engine
    (model / "model.safetensors").write_bytes(b"new weights, longer")
    assert EngineConfig.of(str(model), max_num_seqs=2).tag != first.tag
    # A transform built before the save and applied after: its pipeline takes the folder as it is.
    assert first.current() == EngineConfig.of(str(model), max_num_seqs=2) != first
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"a")
    with_adapter = EngineConfig.of(str(model), lora=str(adapter))
    os.utime(adapter / "adapter_model.safetensors", ns=(1, 1))
    assert EngineConfig.of(str(model), lora=str(adapter)) != with_adapter
    assert EngineConfig.of("gs://bucket/model").local_revision is None
    assert EngineConfig.of(None).local_revision is None


def test_a_model_folder_named_from_home_is_followed_too(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"old weights")
    first = EngineConfig.of("~/model")
    assert first.local_revision is not None
    (tmp_path / "model" / "model.safetensors").write_bytes(b"new weights, longer")
    assert EngineConfig.of("~/model").tag != first.tag
