"""The sequence primitives applied mid-generation — suspend/resume, evict, migrate to another
engine, fork (n > 1, copy-on-write) — leave every output exactly as an uninterrupted run."""

import pickle
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import (BatchSpy, CallCounter, assert_idle_and_clean, assert_matches, collect,
                     greedy_requests, live_sequences, make_engine, random_prompts,
                     teacher_forced_logprobs)
from runtime import Request, SamplingParams
from runtime.sequence import Status

MAX_TOKENS = 24
PROMPTS = random_prompts((9, 23, 40, 70), seed=3)


def reference(tiny, family, prompt, max_tokens=MAX_TOKENS):
    return tiny.greedy(family, prompt, max_tokens)


def check_greedy(tiny, family, done, prompts=PROMPTS, ids=None, max_tokens=MAX_TOKENS):
    ids = ids if ids is not None else [f"r{i}" for i in range(len(prompts))]
    assert sorted(done) == sorted(ids)
    for request_id in ids:
        prompt = prompts[int(request_id[1:])]
        assert done[request_id].prompt_tokens == len(prompt)
        assert_matches(done[request_id], *reference(tiny, family, prompt, max_tokens), max_tokens=max_tokens)


def start(engine, prompts=PROMPTS, steps=6, max_tokens=MAX_TOKENS):
    """Submit greedy requests and run a few steps: every request is decoding by then."""
    for request in greedy_requests(prompts, max_tokens):
        engine.submit(request)
    for _ in range(steps):
        assert engine.step()
    for i in range(len(prompts)):
        [seq] = live_sequences(engine, f"r{i}")
        assert seq.status is Status.DECODING and 0 < seq.num_generated < max_tokens


# ---- suspend / resume ----------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_suspend_holds_a_request_while_others_run_then_resume_is_exact(tiny, family):
    engine = make_engine(tiny.dir(family))
    start(engine)
    suspends = CallCounter(engine.scheduler, "suspend")
    assert engine.suspend("r2") == 1
    assert len(suspends) == 1 and suspends.calls[0][1] == {"hold": True}
    seq = engine.scheduler.held["r2#0"]
    assert seq.status is Status.SUSPENDED and seq.block_table == []
    assert seq.seq_id in engine.scheduler.host
    assert engine.scheduler.host.used_blocks == 3  # 40 + 5 computed tokens
    assert engine.suspend("r2") == 0  # already held
    assert engine.sequence_counts() == {"waiting": 0, "running": 3, "suspended": 0}  # held apart
    generated = seq.num_generated

    spy = BatchSpy(engine)
    decoded = engine.stats.decode_tokens
    for _ in range(5):
        assert engine.step()  # the others keep going
    assert seq.num_generated == generated
    assert all("r2" not in step["decodes"] and not step["prefills"] for step in spy.steps)
    assert engine.stats.decode_tokens - decoded == 3 * 5

    assert engine.resume("r2") == 1
    assert engine.resume("r2") == 0
    assert "r2" not in engine.scheduler.held
    done = collect(engine)
    check_greedy(tiny, family, done)
    assert seq.counters["suspends"] == 1 and seq.counters["evictions"] == 0
    assert_idle_and_clean(engine)


def test_waiting_request_is_not_suspended_and_unknown_ids_raise(tiny):
    engine = make_engine(tiny.dir("qwen2"))
    engine.submit(greedy_requests(PROMPTS[:1])[0])
    assert engine.suspend("r0") == 0  # not admitted yet: nothing to suspend
    for primitive in (engine.suspend, engine.resume, engine.evict, engine.migrate_out):
        with pytest.raises(KeyError):
            primitive("nope")
    done = collect(engine)
    check_greedy(tiny, "qwen2", done, ids=["r0"])


def test_only_held_requests_left_is_reported_not_spun_on(tiny):
    engine = make_engine(tiny.dir("qwen2"))
    start(engine, PROMPTS[:2], steps=3)
    engine.suspend("r0")
    engine.suspend("r1")
    with pytest.raises(RuntimeError, match="resume"):
        engine.poll()
    engine.resume("r1")
    engine.resume("r0")
    check_greedy(tiny, "qwen2", collect(engine), ids=["r0", "r1"])
    assert_idle_and_clean(engine)


def test_suspend_during_chunked_prefill_is_exact(tiny):
    engine = make_engine(tiny.dir("llama"), max_num_batched_tokens=16)
    prompt = PROMPTS[3]  # 70 tokens: five chunks
    engine.submit(greedy_requests([prompt])[0])
    assert engine.step() and engine.step()
    [seq] = live_sequences(engine, "r0")
    assert seq.status is Status.PREFILLING and seq.num_computed == 32
    assert engine.suspend("r0") == 1
    assert engine.resume("r0") == 1
    spy = BatchSpy(engine)
    done = collect(engine)
    assert spy.prefill_chunks("r0")[0] == (32, 16)  # resumed where it stopped, nothing recomputed
    assert_matches(done["r0"], *reference(tiny, "llama", prompt), max_tokens=MAX_TOKENS)
    assert_idle_and_clean(engine)


def test_suspend_fails_cleanly_when_the_host_tier_is_full(tiny):
    engine = make_engine(tiny.dir("qwen2"), host_kv_bytes=0)
    start(engine, PROMPTS[:2], steps=2)
    with pytest.raises(ValueError, match="'r1': the host KV tier cannot hold .* nothing was suspended"):
        engine.suspend("r1")
    check_greedy(tiny, "qwen2", collect(engine), ids=["r0", "r1"])
    assert_idle_and_clean(engine)


def test_suspend_takes_all_of_a_requests_samples_or_none(tiny):
    """Three samples of 3 blocks each against a host tier of 4 blocks: none is held, so nothing
    waits on a resume() the caller, told it failed, would never send."""
    from helpers import kv_block_bytes

    model = tiny.dir("qwen2")
    engine = make_engine(model, host_kv_bytes=4 * kv_block_bytes(model, 16))
    engine.submit(Request("a", prompt_token_ids=list(PROMPTS[2]),
                          params=SamplingParams(max_tokens=MAX_TOKENS, n=3, temperature=1.0, seed=5)))
    for _ in range(3):
        engine.step()
    assert len(live_sequences(engine, "a")) == 3
    with pytest.raises(ValueError, match="nothing was suspended"):
        engine.suspend("a")
    assert not engine.scheduler.held
    [done] = collect(engine).values()
    assert len(done.outputs) == 3 and all(o.finish_reason != "error" for o in done.outputs)
    assert_idle_and_clean(engine)


# ---- evict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_evict_mid_generation_recomputes_and_is_exact(tiny, family):
    engine = make_engine(tiny.dir(family), enable_prefix_caching=False)
    start(engine)
    [seq] = live_sequences(engine, "r2")
    tokens = len(seq.token_ids)
    free = engine.scheduler.blocks.num_free
    assert engine.evict("r2") == 1
    assert seq.status is Status.WAITING and seq.num_computed == 0 and seq.block_table == []
    assert engine.scheduler.blocks.num_free == free + 3  # 40 + 5 computed tokens: 3 blocks
    assert seq in engine.scheduler.waiting
    spy = BatchSpy(engine)
    done = collect(engine)
    # Recomputed from scratch: prompt and the tokens generated so far, in one chunk.
    assert spy.prefill_chunks("r2") == [(0, tokens)]
    check_greedy(tiny, family, done)
    assert seq.counters["evictions"] == 1
    assert_idle_and_clean(engine)


def test_evict_a_held_request_then_finish_is_exact(tiny):
    engine = make_engine(tiny.dir("qwen3"))
    start(engine)
    assert engine.suspend("r1") == 1
    assert engine.evict("r1") == 1
    assert "r1" not in engine.scheduler.held and engine.scheduler.host.used_blocks == 0
    check_greedy(tiny, "qwen3", collect(engine))
    assert_idle_and_clean(engine)


def test_evict_during_chunked_prefill_is_exact(tiny):
    engine = make_engine(tiny.dir("smollm"), max_num_batched_tokens=16)
    prompts = PROMPTS[2:]
    for request in greedy_requests(prompts):
        engine.submit(request)
    assert engine.step() and engine.step()
    [seq] = live_sequences(engine, "r0")
    assert seq.status is Status.PREFILLING
    assert engine.evict("r0") == 1
    done = collect(engine)
    check_greedy(tiny, "smollm", done, prompts=prompts, ids=["r0", "r1"])
    assert_idle_and_clean(engine)


# ---- migrate -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_migrate_mid_generation_to_another_engine_is_exact(tiny, family):
    source, target = make_engine(tiny.dir(family)), make_engine(tiny.dir(family))
    start(source)
    [seq] = live_sequences(source, "r2")
    generated = list(seq.generated_ids)
    state = pickle.loads(pickle.dumps(source.migrate_out("r2")))
    assert state["request_id"] == "r2" and state["prompt_tokens"] == len(PROMPTS[2])
    [exported] = state["sequences"]
    assert exported["token_ids"] == PROMPTS[2] + generated and generated
    assert seq.status is Status.MIGRATED
    with pytest.raises(KeyError):
        source.suspend("r2")

    target.migrate_in(state)
    with pytest.raises(ValueError, match="in flight"):
        target.migrate_in(state)
    moved = collect(target)
    assert list(moved) == ["r2"]
    assert moved["r2"].prompt_tokens == len(PROMPTS[2])
    assert_matches(moved["r2"], *reference(tiny, family, PROMPTS[2]), max_tokens=MAX_TOKENS)

    stayed = collect(source)
    check_greedy(tiny, family, stayed, ids=["r0", "r1", "r3"])
    assert_idle_and_clean(source)
    assert_idle_and_clean(target)


def test_migrate_in_under_another_request_id(tiny):
    source = make_engine(tiny.dir("qwen2"))
    target = make_engine(tiny.dir("qwen2"))
    params = SamplingParams(max_tokens=MAX_TOKENS, n=2, temperature=1.0, seed=3)
    want = make_engine(tiny.dir("qwen2")).generate([Request("s", prompt_token_ids=PROMPTS[1], params=params)])[0]
    source.submit(Request("s", prompt_token_ids=PROMPTS[1], params=params))
    for _ in range(4):
        assert source.step()
    state = source.migrate_out("s", with_kv=True)
    target.migrate_in({**state, "request_id": "s-again"})
    assert target.step()
    assert [s.seq_id for s in live_sequences(target, "s-again")] == ["s-again#0", "s-again#1"]
    moved = collect(target)
    assert list(moved) == ["s-again"]
    assert [o.token_ids for o in moved["s-again"].outputs] == [o.token_ids for o in want.outputs]
    assert_idle_and_clean(target)


def three_steps_in_with_r3_prefilling(tiny):
    """A mistral engine three steps into PROMPTS at 32 tokens a step (r3 still prefilling), and
    an empty target engine."""
    source = make_engine(tiny.dir("mistral"), max_num_batched_tokens=32)
    target = make_engine(tiny.dir("mistral"))
    for request in greedy_requests(PROMPTS):
        source.submit(request)
    for _ in range(3):
        assert source.step()
    [r3] = live_sequences(source, "r3")
    return source, target, r3


def test_migrate_a_held_request_and_one_still_prefilling(tiny):
    source, target, r3 = three_steps_in_with_r3_prefilling(tiny)
    assert r3.status is Status.PREFILLING  # 70 tokens behind the others at 32 per step
    assert source.suspend("r0") == 1
    for request_id in ("r0", "r3"):
        target.migrate_in(pickle.loads(pickle.dumps(source.migrate_out(request_id))))
    assert source.scheduler.host.used_blocks == 0
    check_greedy(tiny, "mistral", collect(target), ids=["r0", "r3"])
    check_greedy(tiny, "mistral", collect(source), ids=["r1", "r2"])
    assert_idle_and_clean(source)
    assert_idle_and_clean(target)


def test_migrate_in_refuses_a_state_this_engine_could_never_finish(tiny):
    """Too long for its context, more samples than its blocks, or not a state at all: each
    would wait here forever, and hold up the requests behind it."""
    model = tiny.dir("qwen2")
    source, small = make_engine(model), make_engine(model, num_blocks=4, max_model_len=64)
    source.submit(Request("big", prompt_token_ids=list(PROMPTS[3]), params=SamplingParams(max_tokens=8)))
    source.step()
    state = source.migrate_out("big")
    with pytest.raises(ValueError, match="'big': 71 tokens; this engine's context holds 64"):
        small.migrate_in(state)
    with pytest.raises(ValueError, match="n=5 is more than the KV cache's 4 blocks"):
        small.migrate_in({**state, "n": 5})
    with pytest.raises(ValueError, match="'ghost': not a migrate_out state"):
        small.migrate_in({"format": state["format"], "request_id": "ghost", "prompt_tokens": 3, "n": 1,
                          "outputs": {}, "sequences": []})
    for not_a_state in (None, [state], {**state, "request_id": None}):
        with pytest.raises(ValueError, match="migrate_in: not a migrate_out state"):
            small.migrate_in(not_a_state)
    [sequence] = state["sequences"]
    for broken, why in (({"outputs": 5}, "outputs must be a dict"), ({"prompt_tokens": None}, "prompt_tokens"),
                        ({"sequences": [None]}, "sequences must be"),
                        ({"sequences": [{**sequence, "num_prompt_tokens": None}]}, "num_prompt_tokens must be of type int"),
                        ({"sequences": [{**sequence, "token_ids": [5, 10 ** 6]}]}, "token_ids must be ints"),
                        ({"sequences": [{**sequence, "num_prompt_tokens": 10 ** 3}]}, "num_prompt_tokens must be in")):
        with pytest.raises(ValueError, match=f"'big': not a migrate_out state \\(.*{why}"):
            small.migrate_in({**state, **broken})
    without = {k: v for k, v in state.items() if k != "outputs"}
    with pytest.raises(ValueError, match="outputs must be a dict"):
        small.migrate_in(without)
    earlier = {k: v for k, v in state.items() if k != "format"}  # exported by an earlier release
    with pytest.raises(ValueError, match="'big': a state of another release"):
        small.migrate_in(earlier)
    for samples, outputs in (([], {0: "finished"}),  # nothing left to run
                             ([{**sequence, "forked": True}], {})):  # a forked sample missing
        with pytest.raises(ValueError, match="'big': not a migrate_out state"):
            small.migrate_in({**state, "n": 2, "sequences": samples, "outputs": outputs})
    [done] = small.generate(greedy_requests(PROMPTS[:1], 8))  # nothing was left behind
    assert done.error is None
    assert_idle_and_clean(small)
    source.migrate_in(state)
    assert collect(source)["big"].error is None


@pytest.mark.parametrize("with_kv", [False, True])
def test_migrate_in_refuses_a_request_that_ran_on_other_weights(tiny, tmp_path, with_kv):
    """The same architecture with another training, or the base model without the adapter the
    request ran with: its KV has the same layout, but continuing would mix two models' tokens."""
    from tiny_models import make_lora_adapter, make_tiny_model

    model = tiny.dir("qwen2")
    make_lora_adapter(model, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    retrained = make_tiny_model("qwen2", tmp_path / "retrained", seed=1)
    adapted = make_engine(model, lora=tmp_path / "adapter")
    adapted.submit(greedy_requests(PROMPTS[1:2], 8)[0])
    adapted.step()
    state = pickle.loads(pickle.dumps(adapted.migrate_out("r0", with_kv=with_kv)))
    for other in (make_engine(model), make_engine(retrained)):
        with pytest.raises(ValueError, match="'r0': it was running on other weights"):
            other.migrate_in(state)
        assert_idle_and_clean(other)
    same = make_engine(model, lora=tmp_path / "adapter")
    same.migrate_in(state)
    [ran_on] = make_engine(model, lora=tmp_path / "adapter").generate(greedy_requests(PROMPTS[1:2], 8))
    assert collect(same)["r0"].token_ids == ran_on.token_ids


def _one_value_changed(model: Path, copy: Path, where: float) -> None:
    """`copy`: the checkpoint with one fp32 value, `where` of the way through its tensor data,
    doubled (a same-size file: a partial fine-tune or a merged adapter, in miniature)."""
    if copy != model:
        shutil.copytree(model, copy, dirs_exist_ok=True)
    [weights] = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # past the header
    at = start + int((len(data) - start) * where) // 4 * 4
    data[at:at + 4] = struct.pack("<f", 2 * struct.unpack("<f", data[at:at + 4])[0] + 1)
    weights.write_bytes(data)


def test_migrate_in_refuses_weights_that_differ_in_one_value(tiny, tmp_path):
    """Every byte of the checkpoint counts: a digest of sampled spans took the KV that a copy
    with one layer edited computed, and registered it in the prefix cache, where later requests
    of that prompt found it."""
    model = tiny.dir("llama")
    for where in (0.03, 0.53, 0.97):
        _one_value_changed(model, tmp_path / "edited", where)
        source = make_engine(tmp_path / "edited")
        source.submit(greedy_requests(PROMPTS[1:2], 8)[0])
        source.step()
        state = source.migrate_out("r0", with_kv=True)
        other = make_engine(model)
        with pytest.raises(ValueError, match="'r0': it was running on other weights"):
            other.migrate_in(state)
        assert_idle_and_clean(other)
    make_engine(tmp_path / "edited").migrate_in(state)  # the same files: taken


def test_an_engine_whose_files_were_saved_again_takes_and_gives_no_migration(tiny, tmp_path):
    """Its weights are the files as they were: the files now (a notebook's new fine-tune saved
    in place) are another engine's, which must not take its requests' KV."""
    shutil.copytree(tiny.dir("llama"), tmp_path / "model")
    loaded_before = make_engine(tmp_path / "model")
    loaded_before.submit(greedy_requests(PROMPTS[1:2], 8)[0])
    loaded_before.step()
    _one_value_changed(tmp_path / "model", tmp_path / "model", 0.5)
    loaded_after = make_engine(tmp_path / "model")
    with pytest.raises(ValueError, match="'r0': it was running on other weights"):
        loaded_after.migrate_in(loaded_before.migrate_out("r0", with_kv=True))
    assert_idle_and_clean(loaded_after)


@pytest.mark.parametrize("with_kv", [False, True])
def test_migrate_in_refuses_a_request_that_ran_in_another_dtype(tiny, with_kv):
    """The same files computed in bf16 are other weights for a request begun in fp32 (without
    its KV the move was taken, and the tokens changed precision mid-way)."""
    model = tiny.dir("qwen2")
    source = make_engine(model)
    source.submit(greedy_requests(PROMPTS[1:2], 8)[0])
    source.step()
    state = source.migrate_out("r0", with_kv=with_kv)
    half = make_engine(model, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'r0': it was running on other weights"):
        half.migrate_in(state)
    assert_idle_and_clean(half)


def test_migrate_in_checks_the_request_as_submit_does(tiny_chat, tmp_path):
    """A state whose sampling values this engine refuses at submit (more logprobs than its
    max_logprobs, stop strings or a schema without a tokenizer) is refused on arrival as well:
    it was taken, and returned more logprobs than allowed or failed at its first token."""
    model = tiny_chat.dir("qwen2")
    bare = tmp_path / "no-tokenizer"  # the same weights, no tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, bare / name)
    cases = [(SamplingParams(max_tokens=8, logprobs=5), make_engine(model, max_logprobs=2),
              "logprobs: must be <= the engine's max_logprobs"),
             (SamplingParams(max_tokens=8, stop=["zzz"]), make_engine(bare), "stop: stop strings need a model"),
             (SamplingParams(max_tokens=8, json_schema='{"type": "object"}'), make_engine(bare),
              "json_schema, regex, choice: structured output needs a model")]
    for params, target, refusal in cases:
        source = make_engine(model)
        source.submit(Request("x", prompt="Once upon a time", params=params))
        source.step()
        state = source.migrate_out("x", with_kv=True)
        with pytest.raises(ValueError, match=f"'x': {refusal}"):
            target.migrate_in(state)
        assert_idle_and_clean(target)


def test_a_migrated_request_keeps_its_timings_from_before_the_move(tiny):
    """Its submission, first scheduling and first token happened at the source: carried as
    ages, so the target's clock (another machine's) places them before the move (give or take
    the move itself, not counted)."""
    source, target = make_engine(tiny.dir("qwen2")), make_engine(tiny.dir("qwen2"))
    source.submit(greedy_requests(PROMPTS[1:2], 8)[0])
    for _ in range(3):
        source.step()
    time.sleep(0.05)  # a gap the move takes far less than
    before_move = time.perf_counter()
    target.migrate_in(pickle.loads(pickle.dumps(source.migrate_out("r0"))))
    timings = collect(target)["r0"].timings
    assert timings.submitted < timings.first_scheduled < timings.first_token < before_move < timings.finished


def test_migrate_in_refuses_kv_in_blocks_of_another_size(tiny):
    model = tiny.dir("qwen2")
    source, target = make_engine(model), make_engine(model, block_size=8)
    [request] = greedy_requests(PROMPTS[1:2], 8)
    source.submit(request)
    source.step()
    state = source.migrate_out("r0", with_kv=True)
    assert state["sequences"][0]["kv"] is not None
    with pytest.raises(ValueError, match="its KV is laid out"):
        target.migrate_in(state)
    assert_idle_and_clean(target)
    source.migrate_in(state)
    assert_matches(collect(source)["r0"], *reference(tiny, "qwen2", PROMPTS[1], 8), max_tokens=8)


def test_a_generate_call_waiting_on_a_request_migrated_away_returns(tiny):
    engine, other = make_engine(tiny.dir("qwen2")).start(), make_engine(tiny.dir("qwen2"))
    request = Request("g", prompt_token_ids=list(PROMPTS[0]),
                      params=SamplingParams(max_tokens=400, ignore_eos=True))
    results = []
    waiting = threading.Thread(target=lambda: results.extend(engine.generate([request])))
    waiting.start()
    deadline = time.monotonic() + 30
    while not engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    other.migrate_in(engine.migrate_out("g"))
    waiting.join(30)
    [moved] = results
    assert moved.finish_reason == "error" and "migrated out of this engine" in moved.error
    assert collect(other)["g"].completion_tokens == 400
    engine.stop()
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_migrate_with_kv_continues_without_recomputing(tiny, family):
    source, target = make_engine(tiny.dir(family)), make_engine(tiny.dir(family))
    start(source)
    [seq] = live_sequences(source, "r2")
    computed = seq.num_computed  # 40 prompt + 5 generated tokens: 3 blocks
    state = pickle.loads(pickle.dumps(source.migrate_out("r2", with_kv=True)))
    [exported] = state["sequences"]
    assert exported["num_computed"] == computed == 45 and exported["resume_status"] == "DECODING"
    assert exported["kv"].shape[2] == 3
    assert source.scheduler.blocks.num_free == source.kv.num_blocks - sum(
        len(s.block_table) for s in source.scheduler.running)  # its blocks came back

    target.migrate_in(state)
    spy = BatchSpy(target)
    moved = collect(target)
    assert spy.prefill_chunks("r2") == []  # swapped in and decoded on: nothing recomputed
    assert spy.steps[0]["decodes"] == ["r2"]
    assert_matches(moved["r2"], *reference(tiny, family, PROMPTS[2]), max_tokens=MAX_TOKENS)
    check_greedy(tiny, family, collect(source), ids=["r0", "r1", "r3"])
    assert_idle_and_clean(source)
    assert_idle_and_clean(target)


def test_migrate_with_kv_of_a_held_and_a_prefilling_request(tiny):
    source, target, r3 = three_steps_in_with_r3_prefilling(tiny)
    computed = r3.num_computed
    assert r3.status is Status.PREFILLING and 0 < computed < len(PROMPTS[3])
    assert source.suspend("r0") == 1
    states = [pickle.loads(pickle.dumps(source.migrate_out(rid, with_kv=True))) for rid in ("r0", "r3")]
    assert [s["sequences"][0]["resume_status"] for s in states] == ["DECODING", "PREFILLING"]
    assert source.scheduler.host.used_blocks == 0  # r0's parked KV left with it
    spy = BatchSpy(target)
    for state in states:
        target.migrate_in(state)
    check_greedy(tiny, "mistral", collect(target), ids=["r0", "r3"])
    assert spy.prefill_chunks("r0") == []
    assert spy.prefill_chunks("r3")[0][0] == computed  # its prefill went on where it stopped
    check_greedy(tiny, "mistral", collect(source), ids=["r1", "r2"])
    assert_idle_and_clean(source)
    assert_idle_and_clean(target)


def test_kv_arriving_at_a_full_host_tier_is_recomputed(tiny):
    source = make_engine(tiny.dir("qwen2"))
    target = make_engine(tiny.dir("qwen2"), host_kv_bytes=0)
    start(source)
    [seq] = live_sequences(source, "r1")
    tokens = seq.num_tokens
    target.migrate_in(pickle.loads(pickle.dumps(source.migrate_out("r1", with_kv=True))))
    spy = BatchSpy(target)
    check_greedy(tiny, "qwen2", collect(target), ids=["r1"])
    assert spy.prefill_chunks("r1") == [(0, tokens)]  # evicted on arrival: one full recompute
    collect(source)
    assert_idle_and_clean(source)
    assert_idle_and_clean(target)


SAMPLED = SamplingParams(max_tokens=20, temperature=1.0, seed=7, n=2, logprobs=0)


@pytest.mark.parametrize("with_kv", [False, True], ids=["recompute", "kv-travels"])
@pytest.mark.parametrize("migrate_after_steps", [1, 4, 9], ids=["while-prefilling", "after-fork", "later"])
def test_migrate_keeps_each_samples_rng_stream(tiny, migrate_after_steps, with_kv):
    family = "qwen2"
    prompt = PROMPTS[3]
    others = greedy_requests(PROMPTS[:2], prefix="g")

    plain = make_engine(tiny.dir(family), max_num_batched_tokens=48)
    uninterrupted = plain.generate([Request("s", prompt_token_ids=prompt, params=SAMPLED)] + others)[0]
    assert len(uninterrupted.outputs) == 2
    assert uninterrupted.outputs[0].token_ids != uninterrupted.outputs[1].token_ids

    source = make_engine(tiny.dir(family), max_num_batched_tokens=48)
    target = make_engine(tiny.dir(family))
    for request in [Request("s", prompt_token_ids=prompt, params=SAMPLED)] + others:
        source.submit(request)
    for _ in range(migrate_after_steps):
        assert source.step()
    state = pickle.loads(pickle.dumps(source.migrate_out("s", with_kv=with_kv)))
    assert all(("kv" in seq) == with_kv for seq in state["sequences"])
    # 70 tokens at 48 per step: still one sequence after one step, forked after the second.
    assert len(state["sequences"]) == (1 if migrate_after_steps == 1 else 2)
    target.migrate_in(state)
    moved = collect(target)["s"]
    assert [o.index for o in moved.outputs] == [0, 1]
    for got, want in zip(moved.outputs, uninterrupted.outputs):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    collect(source)
    assert_idle_and_clean(source)
    assert_idle_and_clean(target)


@pytest.mark.parametrize("primitive", ["suspend", "migrate_out"])
def test_a_primitive_from_another_thread_waits_at_most_a_step_of_the_running_loop(tiny, primitive):
    """Steps that hold the GIL (a small model is mostly Python) must not starve a caller: a
    plain lock is re-taken by the loop before the woken caller runs, step after step."""
    engine = make_engine(tiny.dir("qwen2"), max_num_seqs=2)
    run = engine.runner.run

    def gil_holding_run(batch):
        deadline = time.perf_counter() + 0.002
        while time.perf_counter() < deadline:
            pass
        return run(batch)

    engine.runner.run = gil_holding_run
    requests = greedy_requests(random_prompts((12,) * 6, seed=5), max_tokens=150)
    with engine:  # ~450 steps of work
        for request in requests:
            engine.submit(request)
        while engine.stats.decode_tokens < 5:
            time.sleep(0.002)
        before = engine.stats.steps
        getattr(engine, primitive)("r0")
        assert engine.stats.steps - before <= 2
        if primitive == "suspend":
            engine.resume("r0")
        else:
            engine.submit(requests[0])  # the id is free again
        assert sorted(collect(engine)) == sorted(r.id for r in requests)



def test_a_primitive_racing_submit_finds_the_request_once_submit_claims_its_id(tiny):
    """submit() claims the id and queues the request as one step: a primitive from another
    thread never finds the id taken but the request nowhere (it raised KeyError)."""
    engine = make_engine(tiny.dir("qwen2"))
    claimed, release = threading.Event(), threading.Event()

    class SlowInbox(type(engine._inbox)):
        def put(self, item):
            claimed.set()  # the id is claimed by now; hold the queueing back
            release.wait(5)
            super().put(item)

    engine._inbox = SlowInbox()
    [request] = greedy_requests(PROMPTS[:1], MAX_TOKENS)
    submitter = threading.Thread(target=engine.submit, args=(request,))
    submitter.start()
    assert claimed.wait(5)
    threading.Timer(0.05, release.set).start()
    assert engine.evict("r0") == 0  # found once queued; nothing computed to evict yet
    submitter.join(5)
    assert_matches(collect(engine)["r0"], *reference(tiny, "qwen2", PROMPTS[0]), max_tokens=MAX_TOKENS)

# ---- fork (n > 1) --------------------------------------------------------------------------

def test_sampled_n3_gives_three_seeded_reproducible_samples(tiny):
    engine = make_engine(tiny.dir("llama"))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42, n=3, ignore_eos=True)
    [first] = engine.generate([Request("a", prompt_token_ids=PROMPTS[1], params=params)])
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in first.outputs)
    assert first.completion_tokens == 48
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    [again] = engine.generate([Request("a", prompt_token_ids=PROMPTS[1], params=params)])
    fresh = make_engine(tiny.dir("llama")).generate([
        Request("x", prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=5)),
        Request("a", prompt_token_ids=PROMPTS[1], params=params)])[1]
    for run in (again, fresh):
        assert [o.token_ids for o in run.outputs] == [o.token_ids for o in first.outputs]


@pytest.mark.parametrize("family", ["qwen2", "smollm"])
def test_greedy_n2_both_samples_equal_transformers(tiny, family):
    engine = make_engine(tiny.dir(family))
    [completion] = engine.generate([Request("r", prompt_token_ids=PROMPTS[2],
                                            params=SamplingParams(max_tokens=MAX_TOKENS, n=2, logprobs=0))])
    tokens, logprobs = reference(tiny, family, PROMPTS[2])
    assert len(completion.outputs) == 2
    for output in completion.outputs:
        assert output.token_ids == tokens
        assert output.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert_idle_and_clean(engine)


def test_fork_shares_prompt_blocks_copy_on_write(tiny):
    engine = make_engine(tiny.dir("qwen2"), num_blocks=64)
    blocks = engine.scheduler.blocks
    prompt = PROMPTS[2]  # 40 tokens: two full blocks and a partial one
    engine.submit(Request("r", prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=MAX_TOKENS, n=3, logprobs=0)))
    assert engine.step()  # prefill, fork, first token of each sample
    seqs = live_sequences(engine, "r")
    assert [s.sample_index for s in seqs] == [0, 1, 2]
    tables = [s.block_table for s in seqs]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [blocks.ref_counts[b] for b in tables[0]] == [3, 3, 3]
    assert blocks.num_free == 64 - 3

    assert engine.step()  # each sample writes position 40 into the shared partial block: copies
    tables = [s.block_table for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert [blocks.ref_counts[b] for b in tables[0][:2]] == [3, 3]
    last = [t[2] for t in tables]
    assert len(set(last)) == 3 and all(blocks.ref_counts[b] == 1 for b in last)
    assert blocks.num_free == 64 - 5
    for k_cache, v_cache in engine.kv.layers:  # the copies carry the prompt's 8 tokens of KV
        for cache in (k_cache, v_cache):
            assert cache[last[0], :9].equal(cache[last[1], :9])
            assert cache[last[0], :9].equal(cache[last[2], :9])

    done = collect(engine)
    tokens, logprobs = reference(tiny, "qwen2", prompt)
    assert [o.token_ids for o in done["r"].outputs] == [tokens] * 3
    assert_idle_and_clean(engine)


def test_fork_on_a_full_block_boundary_needs_no_copy(tiny):
    engine = make_engine(tiny.dir("qwen2"), num_blocks=64)
    prompt = random_prompts([32], seed=9)[0]
    engine.submit(Request("r", prompt_token_ids=prompt, params=SamplingParams(max_tokens=8, n=2)))
    engine.step()
    engine.step()
    a, b = live_sequences(engine, "r")
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert engine.scheduler.blocks.num_free == 64 - 4
    done = collect(engine)
    assert [o.token_ids for o in done["r"].outputs] == [reference(tiny, "qwen2", prompt, 8)[0]] * 2


def test_forked_samples_under_kv_pressure_stay_exact(tiny):
    engine = make_engine(tiny.dir("qwen2"), num_blocks=8)
    prompts = random_prompts([20, 30], seed=13)
    completions = engine.generate([
        Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=40, n=3, logprobs=0))
        for i, p in enumerate(prompts)])
    for prompt, completion in zip(prompts, completions):
        tokens, logprobs = reference(tiny, "qwen2", prompt, 40)
        for output in completion.outputs:
            assert output.token_ids == tokens
            assert output.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("primitive", ["suspend", "evict", "migrate"])
def test_primitives_on_a_forked_request_apply_to_every_sample(tiny, primitive):
    family = "mistral"
    engine = make_engine(tiny.dir(family))
    prompt = PROMPTS[2]
    engine.submit(Request("r", prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=MAX_TOKENS, n=3, logprobs=0)))
    engine.submit(greedy_requests(PROMPTS[:1])[0])
    for _ in range(4):
        assert engine.step()
    assert len(live_sequences(engine, "r")) == 3
    if primitive == "suspend":
        assert engine.suspend("r") == 3
        assert engine.step()  # r0 alone
        assert engine.resume("r") == 3
        done = collect(engine)
    elif primitive == "evict":
        assert engine.evict("r") == 3
        done = collect(engine)
    else:
        state = pickle.loads(pickle.dumps(engine.migrate_out("r")))
        assert len(state["sequences"]) == 3
        target = make_engine(tiny.dir(family))
        target.migrate_in(state)
        done = {**collect(engine), **collect(target)}
        assert_idle_and_clean(target)
    tokens, logprobs = reference(tiny, family, prompt)
    assert [o.index for o in done["r"].outputs] == [0, 1, 2]
    for output in done["r"].outputs:
        assert output.token_ids == tokens
        assert output.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert_matches(done["r0"], *reference(tiny, family, PROMPTS[0]), max_tokens=MAX_TOKENS)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_divergent_forked_samples_are_each_consistent_with_the_model(tiny, family):
    """Samples that share the prompt's partial block diverge from their first token: each must
    see only its own KV (copy-on-write), so each one's logprobs equal transformers' on its own
    text."""
    engine = make_engine(tiny.dir(family))
    prompt = PROMPTS[2]  # 40 tokens: the third block is shared while partly filled
    [completion] = engine.generate([Request("r", prompt_token_ids=prompt, params=SamplingParams(
        max_tokens=20, temperature=1.0, seed=11, n=4, logprobs=0, ignore_eos=True))])
    samples = [o.token_ids for o in completion.outputs]
    assert len({tuple(s) for s in samples}) == 4
    for output in completion.outputs:
        expected = teacher_forced_logprobs(tiny.hf(family), prompt, output.token_ids)
        assert output.logprobs == pytest.approx(expected, abs=1e-4)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("end", ["failed", "withdrawn"])
def test_the_samples_of_a_request_that_fails_or_is_withdrawn_end_and_close_their_coroutines(tiny, end, monkeypatch):
    """They left the scheduler but kept their coroutines open (a frame holding the sequence, and
    its grammar matcher's native memory, until the next full collection), and a withdrawn one
    was counted as migrated."""
    engine = make_engine(tiny.dir("llama"))
    engine.submit(Request("r", prompt_token_ids=PROMPTS[0],
                          params=SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=1)))
    engine.step()
    samples = live_sequences(engine, "r")
    assert len(samples) == 3
    if end == "failed":
        from runtime import engine as engine_module
        from runtime.sampling import SampledToken
        monkeypatch.setattr(engine_module, "sample", lambda logits, rows: [SampledToken(-1, error="boom")] * len(rows))
        engine.step()
        [failed] = engine.finished()
        assert failed.finish_reason == "error" and "boom" in failed.error
    else:
        engine._withdraw(["r"])
    for seq in samples:
        assert seq.status is Status.FINISHED and seq.finish_reason == ("error" if end == "failed" else "abort")
        assert seq._coroutine is None and seq.counters["migrations"] == 0
    assert_idle_and_clean(engine)


def test_an_interrupt_while_samples_are_forked_leaves_the_request_to_fork_again(tiny):
    """generate()'s caller interrupted while another request's samples were being made: that
    request kept 2 of its 3 samples, marked forked, and the engine stalled on it."""
    engine = make_engine(tiny.dir("llama"))
    other = Request("o", prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=1))
    engine.submit(other)
    made, real = [], engine._new_sequence

    def interrupted_at_the_second_child(*args, **kwargs):
        made.append(args[1])  # the sample index
        if made.count(2) == 1 and args[0] == "o":
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    engine._new_sequence = interrupted_at_the_second_child
    with pytest.raises(KeyboardInterrupt):
        engine.generate([Request("g", prompt_token_ids=PROMPTS[1], params=SamplingParams(max_tokens=5))])
    engine._new_sequence = real
    [done] = engine.completions()
    alone = make_engine(tiny.dir("llama")).generate([other])[0]
    assert done.error is None and [o.token_ids for o in done.outputs] == [o.token_ids for o in alone.outputs]
    assert_idle_and_clean(engine)
