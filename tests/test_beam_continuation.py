"""Stragglers in `Generate` (straggler_timeout_s): at the end of input a key's records still
running leave the engine (tokens so far and RNG state) as continuations, re-keyed, and a second
stage resumes them; each record still gets exactly one row, equal to the bare engine's (greedy
and seeded sampling). Checked through the engine client, the DoFn directly, and pipelines on the
DirectRunner in memory and with two SDK worker processes."""

import threading
import time
from collections import Counter

import pytest
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import Timestamp

from batchgen_beam.engine_client import EngineClient, EngineConfig
from batchgen_beam.generate import CONTINUATIONS, CONTINUED, Continuation, _GenerateFn, shard_of, stateful_stage
from batchgen_beam.records import parse_record
from beam_helpers import (ENGINE_ARGS, FAMILY, IN_MEMORY, MULTI_PROCESSING, bundled_prompts, counter,
                          worker_pythonpath)
from runtime import Engine
from test_beam_generate import BAD_RECORDS, Bag, Timer, engine_requests, generate_rows, row_key

# Two sequences at a time: most records are still queued or running when the input ends.
ARGS = {**ENGINE_ARGS, "max_num_seqs": 2}
CONTEXT = 256


@pytest.fixture(scope="module")
def model_dir(tiny_chat):
    return tiny_chat.dir(FAMILY, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def config(model_dir):
    return EngineConfig.of(str(model_dir), **ARGS)


@pytest.fixture(scope="module")
def bare_engine(model_dir):
    return Engine(model_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def good(bare_engine):
    """10 greedy records of staggered lengths (so one is always mid-generation while another
    starts), 2 seeded samples, and one that may stop on its own."""
    prompts = bundled_prompts(bare_engine.tokenizer, 12, 30)
    records = [{"id": f"g{i:02d}", "prompt": p, "max_tokens": 60 + 9 * i, "ignore_eos": True, "index": i}
               for i, p in enumerate(prompts[:10])]
    records += [{"id": f"s-{seed}", "prompt": prompts[10], "max_tokens": 80, "ignore_eos": True,
                 "temperature": 0.9, "seed": seed} for seed in (7, 8)]
    return records + [{"id": "natural", "prompt": prompts[11], "max_tokens": 100}]


def bare_tokens(bare_engine, records) -> dict[str, list[int]]:
    return {c.id: c.token_ids for c in bare_engine.generate([parse_record(r).to_request() for r in records])}


def wait_for(condition, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def decoded(client: EngineClient) -> int:
    return client.info()["decode_tokens"]


def test_client_migrates_running_requests_out_and_resumes_them(config, bare_engine):
    client = EngineClient(config)
    prompts = bundled_prompts(bare_engine.tokenizer, 6, 30)
    requests = engine_requests(prompts, "moved-", max_tokens=180)
    ids = [r.id for r in requests]
    client.submit(requests)
    start = decoded(client)
    wait_for(lambda: decoded(client) >= start + 5, "decoding")
    states = client.migrate_out(ids)
    assert len(states) >= 2  # two at a time, 180 tokens each: ~540 steps of work
    assert any(len(s["sequences"][0]["token_ids"]) > s["prompt_tokens"] for s in states.values())
    assert not any(client.knows(rid) for rid in states)
    assert client.migrate_out(list(states)) == {}  # gone from the engine
    client.resume(states.values())
    done = client.wait_all(ids)
    expected = {c.id: c.token_ids for c in bare_engine.generate(engine_requests(prompts, "moved-", 180))}
    assert {rid: c.token_ids for rid, c in done.items()} == expected
    assert client.take(ids, timeout=0.5) == {}  # each exactly once


def test_an_id_given_twice_in_one_call_runs_once_and_routing_goes_on(config, bare_engine):
    """What a key's pending records hand the client when two identical records are unknown to
    it (a second window, a restarted worker): one run, one completion, and no error that kills
    the machine's routing for every later request."""
    client = EngineClient(config)
    prompts = bundled_prompts(bare_engine.tokenizer, 3, 30)
    twice, other, later = engine_requests(prompts, "twice-", max_tokens=150)
    client.submit([twice, other, twice])
    start = decoded(client)
    wait_for(lambda: decoded(client) >= start + 3, "decoding")
    state = client.migrate_out([twice.id])[twice.id]
    client.resume([state, state])
    done = client.wait_all([twice.id, other.id])
    expected = {c.id: c.token_ids for c in bare_engine.generate([twice, other, later])}
    assert {rid: c.token_ids for rid, c in done.items()} == {rid: expected[rid] for rid in done}
    assert client.take([twice.id], timeout=0.5) == {}  # exactly once
    client.submit([later])
    assert client.wait_all([later.id])[later.id].token_ids == expected[later.id]


def test_flush_hands_stragglers_to_a_second_stage_exactly_once(config, good, bare_engine, monkeypatch):
    """The DoFn itself: the first stage's flush (timeout 0) emits rows for what is done and a
    continuation for the rest; the second stage, keyed by id + CONTINUED, emits their rows."""
    monkeypatch.setattr(EngineClient, "_instances", {})
    # Longer than the pipeline's: ~700 steps of work, flushed after a few.
    long = [{**r, "max_tokens": r.get("max_tokens", 100) + 90} for r in good[:5] + good[-3:]]
    records = [parse_record(r) for r in long]
    first = stateful_stage(_GenerateFn, "t")(config, num_shards=1, max_in_flight=1024, namespace="cont", straggler_timeout_s=0.0)
    first.setup()
    bag, outputs = Bag(), []
    start = decoded(first._client)
    stamps = {parsed.id: Timestamp(10 + i) for i, parsed in enumerate(records)}
    for parsed in records:
        outputs += first.process((0, parsed), window=GlobalWindow(), timestamp=stamps[parsed.id],
                                 pending=bag, flush=Timer())
    wait_for(lambda: decoded(first._client) >= start + 3, "decoding")
    outputs += first.flush(pending=bag, window=GlobalWindow())
    assert bag.items == []
    rows = [o for o in outputs if not isinstance(o, TaggedOutput)]
    handed = [o for o in outputs if isinstance(o, TaggedOutput)]
    assert {o.tag for o in handed} == {CONTINUATIONS} and len(handed) >= 2
    continued = [o.value for o in handed]  # each keeps its record's timestamp
    assert all(isinstance(c.value, Continuation) and c.timestamp == stamps[c.value.parsed.id] for c in continued)
    # Some left mid-generation: their tokens so far travel with them.
    assert any(len(c.value.state["sequences"][0]["token_ids"]) > c.value.state["prompt_tokens"] for c in continued)

    second = stateful_stage(_GenerateFn, "t_continued")(config, num_shards=4, max_in_flight=1024, namespace="cont", shard_suffix=CONTINUED)
    second.setup()
    bags = {}
    for continuation in continued:
        shard = shard_of(continuation.value.parsed.id + CONTINUED, 4)
        rows += second.process((shard, continuation.value), window=GlobalWindow(), timestamp=continuation.timestamp,
                               pending=bags.setdefault(shard, Bag()), flush=Timer())
    for bag in bags.values():
        rows += second.flush(pending=bag, window=GlobalWindow())

    assert all(row.timestamp == stamps[row.value["id"]] for row in rows)  # whichever stage emitted it
    rows = [row.value for row in rows]
    assert Counter(row["id"] for row in rows) == Counter(p.id for p in records)
    assert {row["id"]: row["token_ids"] for row in rows} == bare_tokens(bare_engine, long)


def gated_rows(records, model_dir, config, tmp_path, flags):
    """Run Generate(straggler_timeout_s=0) with the engine's slots held by this process's gate
    requests until the first key's flush has handed records off (so some surely are), then free
    the engine. The workers share this process's engine: the same config on one machine."""
    client = EngineClient(config)
    gates = engine_requests(["gate"] * 1000, "gate-", max_tokens=CONTEXT - 16)  # minutes of work
    client.submit(gates)
    handed_before = client.info()["migrated_out"]
    outcome = []

    def run():
        try:
            outcome.append(generate_rows(records, model_dir, tmp_path, flags, ARGS, straggler_timeout_s=0.0))
        except BaseException as error:  # noqa: BLE001 - raised below
            outcome.append(error)

    pipeline = threading.Thread(target=run, daemon=True)
    pipeline.start()
    try:
        wait_for(lambda: client.info()["migrated_out"] > handed_before or outcome, "a hand-off", 120)
    finally:
        client.migrate_out([g.id for g in gates])
    pipeline.join(300)
    assert outcome and not isinstance(outcome[0], BaseException), outcome
    return outcome[0]


def check_rows(rows, result, good, bare_engine):
    assert Counter(row_key(row) for row in rows) == \
        Counter([r["id"] for r in good] + [key for _, key, _ in BAD_RECORDS.values()])
    assert counter(result, "continuations") >= 1
    assert counter(result, "sequences_finished") == len(rows)
    by_id = {row_key(row): row for row in rows}
    assert {rid: by_id[rid]["token_ids"] for rid in (r["id"] for r in good)} == bare_tokens(bare_engine, good)


@pytest.mark.parametrize("type_check", [[], ["--performance_runtime_type_check"]], ids=["plain", "type-checked"])
def test_pipeline_continues_stragglers_in_memory(model_dir, config, good, bare_engine, tmp_path, type_check):
    """Type-checked: the first stage's continuations failed the rows' dict hint."""
    records = good + [raw for raw, _, _ in BAD_RECORDS.values()]
    rows, result = gated_rows(records, model_dir, config, tmp_path, IN_MEMORY + type_check)
    check_rows(rows, result, good, bare_engine)


@pytest.mark.slow
def test_pipeline_continues_stragglers_with_two_sdk_processes(model_dir, config, good, bare_engine, tmp_path,
                                                              monkeypatch):
    worker_pythonpath(monkeypatch)
    records = good + [raw for raw, _, _ in BAD_RECORDS.values()]
    rows, result = gated_rows(records, model_dir, config, tmp_path, MULTI_PROCESSING)
    check_rows(rows, result, good, bare_engine)
