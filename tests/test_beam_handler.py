"""`BatchGenModelHandler` under RunInference on the DirectRunner: prompt strings, record dicts
(per-record fields override inference_args) and chat message lists; under KeyedModelHandler;
with_exception_handling (bad records are error rows in the main output, never failures); bad
inference_args fail when the transform is applied; batching does not start at 1."""

import gc
import json
import time
from collections import Counter
from typing import NamedTuple

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.ml.inference.base import KeyedModelHandler, KeyModelMapping, RunInference

from batchgen_beam.engine_client import EngineClient, EngineConfig, EngineStartError
from batchgen_beam.handler import BatchGenModelHandler, as_record, content_id
from batchgen_beam.records import Parsed, Rejected, parse_record, plain
from batchgen_beam.rows import error_row
from beam_helpers import (CONTEXT, ENGINE_ARGS, IN_MEMORY, bundled_prompts, chat_model_dir, counter, gone,
                          run_pipeline)
from runtime import Engine, Request, SamplingParams

MAX_TOKENS = 6  # inference_args
INFERENCE_ARGS = {"max_tokens": MAX_TOKENS}
LONG_PROMPT = "Tell me everything about the history of every river in the world. " * 20


@pytest.fixture(scope="module")
def model_dir(tiny_chat):
    return chat_model_dir(tiny_chat)  # the same engine as test_beam_generate's in-memory runs


@pytest.fixture(scope="module")
def bare_engine(model_dir):
    return Engine(model_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def prompts(bare_engine):
    # Short: with the chat template and 12 generated tokens they stay inside the 64-token context.
    return bundled_prompts(bare_engine.tokenizer, 12, 30)


def chats(prompts):
    return [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}]
            for p in prompts[6:9]]


def records(prompts):
    """Per-record fields over inference_args, passthrough, and bad records."""
    return [
        {"id": "r-default", "prompt": prompts[0], "user": "u1"},
        {"id": "r-len3", "prompt": prompts[1], "max_tokens": 3, "ignore_eos": True},
        {"id": "r-len11", "prompt": prompts[1], "max_tokens": 11, "ignore_eos": True},
        {"id": "r-seed", "prompt": prompts[2], "seed": 5, "temperature": 0.9, "max_tokens": 12,
         "ignore_eos": True},
        {"prompt": prompts[3], "note": "no id: the handler gives it one"},
        {"custom_id": "r-openai", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": prompts[4]}]}},
        {"id": "r-bad-temperature", "prompt": "Hi", "temperature": "hot"},
        {"id": "r-bad-role", "messages": [{"role": "robot", "content": "Beep"}]},
        {"id": "r-bad-empty", "prompt": ""},
        {"id": "r-too-long", "prompt": LONG_PROMPT},
    ]


BAD = {"r-bad-temperature": "temperature: must be a finite number",
       "r-bad-role": "messages[0].role: must be one of",
       "r-bad-empty": "prompt: must not be empty",
       "r-too-long": f"the context holds {CONTEXT}"}


class Prompted(NamedTuple):
    prompt: str
    max_tokens: int


def test_numpy_values_get_the_ids_of_the_python_values_they_hold():
    """The id seeds a job's sample: np.str_("Hello") drew another than "Hello", and numpy 2's
    reprs (np.int64(4) where 1.x wrote 4) moved ids with a numpy upgrade."""
    assert as_record(np.str_("Hello")) == as_record("Hello")
    assert as_record({"prompt": np.str_("Hi"), "max_tokens": np.int64(4), "temperature": np.array(0.5)}) \
        == as_record({"prompt": "Hi", "max_tokens": 4, "temperature": 0.5})
    assert as_record([{"role": np.str_("user"), "content": "Hi"}]) == as_record([{"role": "user", "content": "Hi"}])


def test_an_example_plain_values_cannot_be_made_of_still_gets_a_row():
    """A namedtuple as a mapping key (a dict once plain, which no key can be), or a list subclass
    that list(iterable) cannot build: as_record raised, and the job failed."""
    class Pair(list):
        def __init__(self, first, second):
            super().__init__([first, second])

    for example in ({"prompt": "Hi", Prompted("a", 1): 1}, {"prompt": "Hi", "pair": Pair(1, 2)}):
        assert isinstance(parse_record(as_record(example)), Rejected)
    chat = Pair({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"})
    assert parse_record(as_record(chat)).messages[0]["content"] == "Hi"


def test_bytes_are_a_prompt_as_a_string_is():
    """They were read as a JSON line: b"Hello there" was "record: invalid JSON"."""
    record = as_record(b"Hello there")
    assert record["id"].startswith("example-") and parse_record(record).prompt == "Hello there"
    assert parse_record(as_record(b'{"prompt": "Hi"}')).prompt == '{"prompt": "Hi"}'
    rejected = parse_record(as_record(b"\xff\xfe"))
    assert isinstance(rejected, Rejected) and "UTF-8" in rejected.error


def test_examples_as_records():
    chat = [{"role": "user", "content": "Hi"}]
    assert as_record("Hi") == {"id": content_id("Hi"), "prompt": "Hi"}
    assert as_record(chat) == {"id": content_id(chat), "messages": chat}
    assert as_record(tuple(chat)) == {"id": content_id(tuple(chat)), "messages": chat}
    assert as_record({"id": "a", "prompt": "Hi"}) == {"id": "a", "prompt": "Hi"}
    # A namedtuple is a tuple, but a record: its fields, not a chat of them.
    fields = {"prompt": "Hi", "max_tokens": 3}
    assert as_record(Prompted("Hi", 3)) == {**fields, "id": content_id(fields)}
    assert as_record(beam.Row(id="a", prompt="Hi")) == {"id": "a", "prompt": "Hi"}
    # A null id (a Parquet or BigQuery column with gaps) is no id: the content id fills it.
    for gap in (None, float("nan"), np.float64("nan")):  # NaN: pandas' missing value
        record = {"id": gap, "prompt": "Hi"}
        assert as_record(record) == {"id": content_id(plain(record)), "prompt": "Hi"}
    assert as_record(beam.Row(id=None, prompt="Hi"))["id"].startswith("example-")
    assert as_record({"custom_id": None, "id": None, "prompt": "Hi"})["id"].startswith("example-")
    # An OpenAI Batch line's id is its custom_id (an "id" would make it a record of ours, one
    # without a prompt); a record of ours may carry a field named "body".
    line = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    assert as_record(line) == {**line, "custom_id": content_id(line)}
    assert parse_record(as_record(line)).prompt == "Hi"
    assert parse_record(as_record({"prompt": "Hi", "body": "an email"})).prompt == "Hi"
    # A line whose body is malformed or missing keeps its custom_id, and its error row names the body.
    for body in ({"body": None}, {"body": "text"}, {"body": []}, {}):
        line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", **body}
        row = error_row(parse_record(as_record(line)))
        assert row["id"] == "c" and row["error"].startswith("body:"), row


def test_an_example_without_an_id_is_named_by_its_content():
    """So a job's seed draws the same sample for it on every run, and another for another."""
    chat = [{"role": "user", "content": "Hi"}]
    assert content_id("Hi") == content_id("Hi") != content_id("Hi!")
    assert content_id(chat) == content_id([{"role": "user", "content": "Hi"}]) != content_id("Hi")
    seeds = {parse_record(as_record(e), {"seed": 1}).params.seed for e in ("Hi", "Hi!", "Hi")}
    assert len(seeds) == 2


def test_an_example_python_cannot_write_out_gets_an_error_row_not_an_exception():
    """An int past Python's digit limit for str(), or nesting past its recursion limit: its
    content id cannot come from repr(); its row says what is wrong, as Generate's does."""
    import sys

    deep: list = []
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    for example, problem in (({"prompt": "Hi", "note": 10 ** 5000}, "note: an integer of over"),
                             ({"prompt": "Hi", "note": deep}, "nested deeper than")):
        record = as_record(example)
        assert record["id"].startswith("example-")
        rejected = parse_record(record)
        assert not isinstance(rejected, Parsed) and problem in rejected.error, rejected


def handler(model_dir):
    return BatchGenModelHandler(str(model_dir), engine_args=ENGINE_ARGS)


@pytest.fixture(scope="module")
def outputs(model_dir, prompts, tmp_path_factory):
    """One pipeline, one branch per way of using the handler."""
    def build(p):
        def run(label, examples, model_handler, **kwargs):
            return (p | f"Create {label}" >> beam.Create(examples, reshuffle=False)
                    | f"RunInference {label}" >> RunInference(model_handler, inference_args=INFERENCE_ARGS, **kwargs))

        as_json = beam.Map(lambda r: json.dumps({"example": r.example, "row": r.inference}))
        keyed_examples = [(f"k{i}", p) for i, p in enumerate(prompts[9:12])] + \
            [("k-chat", chats(prompts)[0]), ("k-record", {"id": "kr", "prompt": prompts[0], "max_tokens": 2})]
        keyed = run("keyed", keyed_examples, KeyedModelHandler(handler(model_dir)))
        # A model per key: Beam loads each under a lock that connecting to the engine takes too
        # (an engine of its own, so no other branch has connected to it before).
        per_key = [KeyModelMapping([key], BatchGenModelHandler(str(model_dir), engine_args={
            **ENGINE_ARGS, "max_num_seqs": 7})) for key in ("ka", "kb")]
        mapped = run("mapped", [("ka", prompts[9]), ("kb", prompts[10])], KeyedModelHandler(per_key))
        main, dead_letters = (p | "Create handled" >> beam.Create(records(prompts), reshuffle=False)
                              | "RunInference handled" >> RunInference(
                                  handler(model_dir), inference_args=INFERENCE_ARGS).with_exception_handling())
        return {
            "strings": run("strings", prompts[:6], handler(model_dir)) | "strings json" >> as_json,
            "records": run("records", records(prompts), handler(model_dir)) | "records json" >> as_json,
            "chats": run("chats", chats(prompts), handler(model_dir)) | "chats json" >> as_json,
            "keyed": keyed | "keyed json" >> beam.Map(
                lambda kv: json.dumps({"key": kv[0], "example": kv[1].example, "row": kv[1].inference})),
            "mapped": mapped | "mapped json" >> beam.Map(
                lambda kv: json.dumps({"key": kv[0], "row": kv[1].inference})),
            "handled": main | "handled json" >> as_json,
            "failed": dead_letters.failed_inferences | "failed json" >> beam.Map(lambda x: json.dumps(x, default=str)),
        }

    results, _ = run_pipeline(build, tmp_path_factory.mktemp("handler"), IN_MEMORY)
    return results


def bare(bare_engine, request_id, params=None, **prompt):
    [completion] = bare_engine.generate([Request(request_id, params=params or SamplingParams(max_tokens=MAX_TOKENS),
                                                 **prompt)])
    return completion


def test_prompt_strings(outputs, prompts, bare_engine):
    results = outputs["strings"]
    assert sorted(r["example"] for r in results) == sorted(prompts[:6])  # one result per example
    for r in results:
        expected = bare(bare_engine, "s", prompt=r["example"])
        assert r["row"]["error"] is None
        assert r["row"]["token_ids"] == expected.token_ids  # greedy, max_tokens from inference_args
        assert isinstance(r["row"]["id"], str)
    assert len({r["row"]["id"] for r in results}) == len(results)


def test_chat_message_lists(outputs, prompts, bare_engine):
    results = outputs["chats"]
    assert sorted(json.dumps(r["example"]) for r in results) == sorted(json.dumps(c) for c in chats(prompts))
    for r in results:
        assert r["row"]["token_ids"] == bare(bare_engine, "c", messages=r["example"]).token_ids


def check_records(results, prompts, bare_engine):
    rows = {r["row"]["id"]: r["row"] for r in results}
    assert len(results) == len(rows) == len(records(prompts))
    assert rows["r-default"]["token_ids"] == bare(bare_engine, "d", prompt=prompts[0]).token_ids
    assert rows["r-default"]["passthrough"] == {"user": "u1"}
    assert (rows["r-len3"]["completion_tokens"], rows["r-len3"]["finish_reason"]) == (3, "length")
    assert (rows["r-len11"]["completion_tokens"], rows["r-len11"]["finish_reason"]) == (11, "length")
    seeded = SamplingParams(seed=5, temperature=0.9, max_tokens=12, ignore_eos=True)
    assert rows["r-seed"]["text"] == bare(bare_engine, "s", seeded, prompt=prompts[2]).text
    [no_id] = [row for row in rows.values() if row["passthrough"].get("note")]
    assert no_id["error"] is None and no_id["completion_tokens"] >= 1
    assert rows["r-openai"]["error"] is None
    for record_id, fragment in BAD.items():
        assert fragment in rows[record_id]["error"], record_id
        assert (rows[record_id]["finish_reason"], rows[record_id]["error_type"]) == ("error", "record")
    assert sum(row["error"] is not None for row in rows.values()) == len(BAD)


def test_record_dicts_with_per_record_overrides_and_bad_records(outputs, prompts, bare_engine):
    check_records(outputs["records"], prompts, bare_engine)


def test_keyed_model_handler(outputs, prompts, bare_engine):
    results = {r["key"]: r for r in outputs["keyed"]}
    assert sorted(results) == ["k-chat", "k-record", "k0", "k1", "k2"]
    for i, prompt in enumerate(prompts[9:12]):
        assert results[f"k{i}"]["example"] == prompt
        assert results[f"k{i}"]["row"]["token_ids"] == bare(bare_engine, "k", prompt=prompt).token_ids
    assert results["k-chat"]["row"]["token_ids"] == \
        bare(bare_engine, "kc", messages=chats(prompts)[0]).token_ids
    assert results["k-record"]["row"]["id"] == "kr"
    assert results["k-record"]["row"]["completion_tokens"] <= 2


def test_a_keyed_model_handler_with_a_model_per_key(outputs, prompts, bare_engine):
    results = {r["key"]: r["row"] for r in outputs["mapped"]}
    assert sorted(results) == ["ka", "kb"]
    for key, prompt in (("ka", prompts[9]), ("kb", prompts[10])):
        assert results[key]["token_ids"] == bare(bare_engine, key, prompt=prompt).token_ids


def test_with_exception_handling_bad_records_are_rows_not_failures(outputs, prompts, bare_engine):
    check_records(outputs["handled"], prompts, bare_engine)
    assert outputs["failed"] == []


@pytest.mark.parametrize("arguments, problem", [
    # Beam's ModelHandler took them and did nothing with them
    (dict(temperature=0.5), r"unknown \['temperature'\]: sampling and chat fields go in RunInference's inference_args"),
    (dict(max_num_seqs=4), r"unknown \['max_num_seqs'\].*engine arguments in engine_args"),
    (dict(min_batch_size=0), "min_batch_size must be a whole number >= 1, got 0"),
    (dict(max_batch_size="8"), "max_batch_size must be a whole number >= 1, got '8'"),
    (dict(min_batch_size=64, max_batch_size=8), r"min_batch_size \(64\) must not be above max_batch_size \(8\)"),
    (dict(engine_args={"greedy_screen": "off"}), "greedy_screen must be True or False, got 'off'"),
    # Beam 2.77's ModelHandler passes it to a BatchElements that does not take it: RunInference failed
    (dict(max_batch_weight=100), "max_batch_weight: Beam 2.77's BatchElements does not take it"),
    # Beam sets them in the SDK process: the machine's one engine may have started before
    (dict(env_vars={"OMP_NUM_THREADS": "1"}), "env_vars: not supported"),
    (dict(max_batch_weight=np.array([1, 2])), "max_batch_weight: Beam 2.77's BatchElements does not take it"),
])
def test_handler_mistakes_raise_at_construction_naming_the_argument(arguments, problem):
    with pytest.raises((TypeError, ValueError), match=problem):
        BatchGenModelHandler("unused-model-dir", **arguments)


def test_beams_own_batching_arguments_pass_through():
    handler = BatchGenModelHandler("unused-model-dir", max_batch_duration_secs=5)
    assert handler.batch_elements_kwargs()["max_batch_duration_secs"] == 5


def test_beams_model_sharing_arguments_are_taken_and_change_nothing():
    """A user coming from Beam's Hugging Face or PyTorch handlers passes them; they were refused
    as unknown, where the README says they change nothing (one engine per machine serves all)."""
    handler = BatchGenModelHandler("unused-model-dir", large_model=True, model_copies=2)
    assert not handler.share_model_across_processes() and handler.model_copies() == 1
    assert handler.batch_elements_kwargs() == BatchGenModelHandler("unused-model-dir").batch_elements_kwargs()
    # Beam's defaults of the ones refused, as code that forwards every argument gives them
    BatchGenModelHandler("unused-model-dir", env_vars={}, max_batch_weight=None)
    BatchGenModelHandler("unused-model-dir", env_vars=None)


@pytest.mark.parametrize("inference_args, message", [
    ({"temperature": "hot"}, "temperature: must be a finite number"),
    ({"top_p": 2.0}, "top_p: must be in"),
    ({"max_token": 6}, "unknown fields"),
])
def test_bad_inference_args_fail_when_applied(model_dir, inference_args, message):
    model_handler = handler(model_dir)
    with pytest.raises(ValueError, match=message):
        model_handler.validate_inference_args(inference_args)
    pipeline = beam.Pipeline()  # applying the transform fails; nothing runs
    with pytest.raises(ValueError, match=message):
        pipeline | beam.Create(["Hi"]) | RunInference(model_handler, inference_args=inference_args)


def test_a_gcs_lora_adapter_is_merged_and_named_in_model_id(model_dir, gcs_emulator, tmp_path):
    from tiny_models import make_lora_adapter

    make_lora_adapter(model_dir, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    uri = gcs_emulator.upload_dir(tmp_path / "adapter", "gs://adapters/handler")
    model_handler = BatchGenModelHandler(str(model_dir), engine_args={**ENGINE_ARGS, "lora": uri})
    [result] = model_handler.run_inference(["Hi"], model_handler.load_model(), INFERENCE_ARGS)
    assert result.model_id == f"{model_dir} + LoRA {uri}"
    request = Request("r", prompt="Hi", params=SamplingParams(max_tokens=MAX_TOKENS))
    [merged] = Engine(model_dir, **ENGINE_ARGS, lora=tmp_path / "adapter").generate([request])
    [plain] = Engine(model_dir, **ENGINE_ARGS).generate([request])
    assert result.inference["token_ids"] == merged.token_ids != plain.token_ids


def test_a_model_update_from_the_side_input_moves_later_batches_to_its_engine(model_dir, tmp_path):
    model_handler = handler(model_dir)
    [result] = model_handler.run_inference(["Hi"], model_handler.load_model(), INFERENCE_ARGS)
    assert result.model_id == str(model_dir) and result.inference["error"] is None
    model_handler.update_model_path(str(tmp_path / "newer"))
    assert model_handler.load_model().client.config == EngineConfig.of(str(tmp_path / "newer"), **ENGINE_ARGS)
    model_handler.update_model_path(None)  # no update: the model stays
    assert model_handler.load_model().client.config.model == str(tmp_path / "newer")


def test_an_engine_stops_once_no_lease_of_it_is_left(model_dir, monkeypatch):
    """A RunInference model that Beam replaces (a model update, a model per key evicted) drops
    its lease: the engine process, weights and KV cache, must not stay behind it."""
    from batchgen_beam import engine_client

    monkeypatch.setattr(engine_client, "IDLE_LEASE_GRACE_S", 0.5)
    model_handler = BatchGenModelHandler(str(model_dir), engine_args={**ENGINE_ARGS, "max_num_seqs": 5})
    first, second = model_handler.load_model(), model_handler.load_model()
    [result] = model_handler.run_inference(["Hi"], first, INFERENCE_ARGS)
    assert result.inference["error"] is None
    pid = first.client.info()["pid"]
    first.release()
    assert not gone(pid, within=1.0)  # the second lease still uses it
    del second
    gc.collect()
    assert gone(pid, within=60.0)
    [again] = model_handler.run_inference(["Hi"], model_handler.load_model(), INFERENCE_ARGS)
    assert again.inference["token_ids"] == result.inference["token_ids"]  # a fresh engine


@pytest.fixture
def own_leases(monkeypatch):
    """This test's leases alone in the process's books: the other tests' models, kept by Beam's
    shared-object cache, would count as engines in use beside this test's."""
    monkeypatch.setattr(EngineClient, "_instances", {})
    monkeypatch.setattr(EngineClient, "_leases", Counter())
    monkeypatch.setattr(EngineClient, "_idle", {})


def test_a_lease_taken_soon_after_the_last_was_dropped_keeps_its_engine(model_dir, monkeypatch, own_leases):
    """The next pipeline of a notebook takes a lease after Beam dropped the last one's: within
    the grace it finds the engine up (each pipeline reloaded the model), and once its own lease
    is gone the engine stops after the grace."""
    from batchgen_beam import engine_client

    monkeypatch.setattr(engine_client, "IDLE_LEASE_GRACE_S", 3.0)
    model_handler = BatchGenModelHandler(str(model_dir), engine_args={**ENGINE_ARGS, "max_num_seqs": 3})
    first = model_handler.load_model()
    pid = first.client.info()["pid"]
    first.release()
    time.sleep(1.0)
    second = model_handler.load_model()
    assert second.client.info()["pid"] == pid
    time.sleep(3.0)  # the first release's grace has passed: a lease was taken meanwhile
    [result] = model_handler.run_inference(["Hi"], second, INFERENCE_ARGS)
    assert result.inference["error"] is None and second.client.info()["pid"] == pid
    second.release()
    assert not gone(pid, within=1.5)
    assert gone(pid, within=60.0)


def test_an_engine_let_go_beside_another_leaves_at_once(model_dir, monkeypatch, own_leases):
    """A model update or a model per key evicted lets an engine go while another is in use or
    being taken up: it does not wait out the grace (two engines' memory was not asked for)."""
    from batchgen_beam import engine_client

    monkeypatch.setattr(engine_client, "IDLE_LEASE_GRACE_S", 30.0)
    old, new = (BatchGenModelHandler(str(model_dir), engine_args={**ENGINE_ARGS, "max_num_seqs": seqs})
                for seqs in (8, 9))
    first = old.load_model()
    first_pid = first.client.info()["pid"]
    second = new.load_model()  # the update's model, loaded before the old one is let go
    first.release()
    assert gone(first_pid, within=15.0)
    second_pid = second.client.info()["pid"]
    second.release()  # the last in use: it waits, until a lease of another config is taken
    assert not gone(second_pid, within=1.0)
    third = old.load_model()
    assert gone(second_pid, within=15.0)
    third_pid = third.client.info()["pid"]
    third.release()
    assert gone(third_pid, within=60.0)  # its grace


def test_joining_an_engine_stopped_meanwhile_starts_another(monkeypatch):
    """Its last client can stop the engine between another's acquire and join: the other
    starts a fresh engine rather than failing its batch."""
    from batchgen_beam import engine_client

    services = []

    class Service:
        def join(self, client_id):
            if len(services) == 1:
                raise EOFError("the engine process is gone")

    class Shared:  # MultiProcessShared's part that _connect uses
        def __init__(self, constructor, **kwargs):
            pass

        def acquire(self):
            services.append(Service())
            return services[-1]

    monkeypatch.setattr(engine_client, "MultiProcessShared", Shared)
    assert EngineClient(EngineConfig.of("unused-model-dir"))._connect() is services[1]


class MethodsOnly:
    """What run_inference gets under a KeyedModelHandler of several models when the model was
    loaded in another SDK process: Beam's AutoProxy, which forwards method calls only."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        value = getattr(self._model, name)
        if not callable(value):
            raise AttributeError(f"{name}: a proxy forwards method calls only")
        return value


def test_a_proxy_of_the_model_from_another_process_is_enough(model_dir):
    model_handler = handler(model_dir)
    [result] = model_handler.run_inference(["Hi"], MethodsOnly(model_handler.load_model()), INFERENCE_ARGS)
    assert result.inference["error"] is None and result.model_id == str(model_dir)


def test_a_model_dropped_and_loaded_again_at_once_runs(model_dir):
    """What Beam does when it evicts a model per key and loads it back: the dropped lease
    stops the engine while the new one connects; the new one must find a running engine."""
    model_handler = BatchGenModelHandler(str(model_dir), engine_args={**ENGINE_ARGS, "max_num_seqs": 4})
    for _ in range(3):
        lease = model_handler.load_model()
        [result] = model_handler.run_inference(["Hi"], lease, INFERENCE_ARGS)
        assert result.inference["error"] is None
        del lease


def test_a_failed_batch_leaves_nothing_behind(model_dir, monkeypatch):
    """Beam retries a failed batch under new ids: the old ones must not stay resident (they
    would be resubmitted after a restart, and keep the engine from ever stopping)."""
    lease = BatchGenModelHandler(str(model_dir), engine_args={**ENGINE_ARGS, "max_num_seqs": 4}).load_model()

    def broken(self, request_ids):
        raise RuntimeError("the batch failed")

    monkeypatch.setattr(EngineClient, "wait_all", broken)
    request = Request("failed-batch:0", prompt="Hi", params=SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="the batch failed"):
        lease.run([request])
    assert not lease.client.knows(request.id)
    lease.release()


def test_a_call_interrupted_while_it_waits_leaves_the_client_working(model_dir, interruptible):
    """A notebook's stop button (KeyboardInterrupt) during a poll: its reply is still due on
    the thread's connection to the engine, which the next call must not read as its own (it
    failed as if the engine had died, then hung rejoining over the same connection)."""
    import _thread
    import threading

    client = EngineClient(EngineConfig.of(str(model_dir), **{**ENGINE_ARGS, "max_num_seqs": 7})).connect()
    pid = client.info()["pid"]
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        client._pull(5.0)  # nothing submitted: the engine answers after 5 s
    assert client.info()["pid"] == pid and client.restarts == 0
    client.submit([Request("after", prompt="Hi", params=SamplingParams(max_tokens=2))])
    assert client.wait_all(["after"])["after"].error is None
    client._leave()


def test_a_pinned_client_keeps_its_engine(model_dir):
    config = EngineConfig.of(str(model_dir), **{**ENGINE_ARGS, "max_num_seqs": 6})
    pid = EngineClient.shared(config).info()["pid"]
    BatchGenModelHandler(str(model_dir), engine_args={**ENGINE_ARGS, "max_num_seqs": 6}).load_model().release()
    gc.collect()
    assert not gone(pid, within=1.0)


def test_batching_does_not_start_at_one(model_dir):
    kwargs = handler(model_dir).batch_elements_kwargs()
    assert kwargs["min_batch_size"] >= 16 and kwargs["max_batch_size"] >= kwargs["min_batch_size"]
    assert KeyedModelHandler(handler(model_dir)).batch_elements_kwargs() == kwargs
    custom = BatchGenModelHandler(str(model_dir), min_batch_size=8, max_batch_size=64)
    assert custom.batch_elements_kwargs() == {"min_batch_size": 8, "max_batch_size": 64}
    # A bound given alone moves the other's default out of its way (Beam refused min > max).
    for given, expected in (({"max_batch_size": 8}, (8, 8)), ({"max_batch_size": 1}, (1, 1)),
                            ({"min_batch_size": 300}, (300, 300)), ({"max_batch_size": 1000}, (32, 1000))):
        kwargs = BatchGenModelHandler(str(model_dir), **given).batch_elements_kwargs()
        assert (kwargs["min_batch_size"], kwargs["max_batch_size"]) == expected


def test_every_spelling_of_a_model_folder_names_one_engine(model_dir, monkeypatch):
    """A Path, a trailing slash, a relative path: one engine config, its model_id a string."""
    monkeypatch.chdir(model_dir.parent)
    spellings = [model_dir, str(model_dir), f"{model_dir}/", model_dir.name, f"./{model_dir.name}/"]
    configs = {EngineConfig.of(spelling, **ENGINE_ARGS) for spelling in spellings}
    assert configs == {EngineConfig.of(str(model_dir), **ENGINE_ARGS)}
    [result] = BatchGenModelHandler(model_dir, engine_args=ENGINE_ARGS).run_inference(
        ["Hi"], handler(model_dir).load_model(), INFERENCE_ARGS)
    assert result.model_id == str(model_dir)


def test_every_spelling_of_one_engine_configuration_names_one_engine(model_dir):
    """Defaults given or left out, a dtype by name or by value: one engine, not one a spelling
    (each with its own weights and KV cache)."""
    import torch

    def engine_of(**engine_args):
        return EngineConfig.of(str(model_dir), **ENGINE_ARGS, **engine_args)

    assert engine_of() == engine_of(dtype="float32") == engine_of(max_num_seqs=None) \
        == engine_of(enable_prefix_caching=True, device="cpu", lora=None)
    assert engine_of(dtype="bfloat16") == engine_of(dtype=torch.bfloat16) != engine_of()
    assert engine_of(max_num_seqs=3) != engine_of()
    assert engine_of(max_num_seqs=np.int64(3)) == engine_of(max_num_seqs=3)
    assert engine_of(device="cpu:0") == engine_of()
    assert engine_of(device="cuda") == engine_of(device="cuda:0") != engine_of(device="cuda:1")


def test_an_engine_start_error_keeps_a_message_of_several_lines():
    """huggingface_hub's config errors indent their second line: the reason came out empty."""
    report = ('Traceback (most recent call last):\n  File "/x/engine.py", line 9, in start\n    load()\n'
              '    ^^^^^^\nValueError: /m/config.json: transformers cannot read this config (Strict: bad field\n'
              '    TypeError: Field num_attention_heads expected int, got str)\n')
    error = EngineStartError.from_report(EngineConfig("/m"), report)
    assert error.error == ("ValueError: /m/config.json: transformers cannot read this config (Strict: bad field\n"
                           "    TypeError: Field num_attention_heads expected int, got str)")
    assert EngineStartError.from_report(EngineConfig("/m"), "no traceback\n  at all").error == "no traceback\n  at all"


def test_rows_and_errors_are_counted_under_run_inference(model_dir, prompts, tmp_path):
    """The batchgen counters Generate reports (README, Metrics), under RunInference too."""
    examples = [prompts[0], {"id": "bad", "prompt": ""}, {"id": "r", "prompt": prompts[1], "max_tokens": 3},
                {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": None}]

    def build(p):
        return {"rows": p | beam.Create(examples, reshuffle=False)
                | RunInference(handler(model_dir), inference_args=INFERENCE_ARGS)
                | beam.Map(lambda r: json.dumps(r.inference))}

    outputs, result = run_pipeline(build, tmp_path, IN_MEMORY)
    rows = outputs["rows"]
    assert len(rows) == 4 and sum(row["error"] is not None for row in rows) == 2
    assert counter(result, "sequences_finished") == 4
    assert counter(result, "errors") == 2
    assert counter(result, "tokens_generated") == sum(row["completion_tokens"] for row in rows) > 0
