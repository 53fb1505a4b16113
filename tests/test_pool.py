"""`EnginePool` (runtime/pool.py): engines in their own processes; outputs equal one engine's
(greedy and seeded sampling) whether work is split statically, pulled from a shared queue, or
moved mid-generation — KV and RNG state along — from a busy engine to an idle one; per-engine
load, migrations and idle time are reported; a dead engine process fails callers, not hangs them."""

import multiprocessing
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import kv_block_bytes, make_engine, random_prompts
from runtime import Request, SamplingParams
from runtime.engine import RequestLoad
from runtime.pool import EnginePool, idle_seconds
from runtime.rebalance import QUEUE_ORDERS, choose_donation

FAMILY = "qwen2"
KV_BYTES = 1 << 24  # small caches: each engine zeroes its own


def load(request_id, remaining, where="running"):
    return RequestLoad(request_id, where, remaining, 10)


# ---- decisions (no processes) ---------------------------------------------------------------

def test_donation_evens_out_the_two_keeping_the_longest():
    loads = [load("long", 300), load("mid", 100), load("a", 40), load("b", 40), load("c", 20)]
    # Half of the 500 tokens: 250 to move; "long" stays (one sequence cannot be split).
    assert choose_donation(loads, 0, min_tokens=16) == ["mid", "a", "b", "c"]
    assert choose_donation(loads, 150, min_tokens=16) == ["mid", "a", "c"]  # 160 of 175
    assert choose_donation([load("long", 300), load("x", 290), load("y", 10)], 0, 16) == ["x", "y"]


def test_no_donation_of_a_lone_request_or_of_too_little():
    assert choose_donation([load("only", 500)], 0, min_tokens=16) == []
    assert choose_donation([load("a", 20), load("b", 10)], 0, min_tokens=16) == []  # 10 < 16
    assert choose_donation([load("a", 200), load("b", 150)], 180, min_tokens=16) == []


def test_waiting_requests_move_first_at_equal_size():
    loads = [load("long", 300), load("r", 50), load("w", 50, "waiting")]
    assert choose_donation(loads, 0, min_tokens=16) == ["w", "r"]
    assert choose_donation(loads, 250, min_tokens=16) == ["w"]


def test_idle_seconds_within_a_window_and_its_tail():
    flips = [(1.0, True), (3.0, False), (4.0, True), (6.0, False)]
    assert idle_seconds(flips, 0.0, 10.0) == (6.0, 4.0)  # idle 0-1, 3-4, 6-10; tail 6-10
    assert idle_seconds(flips, 2.0, 5.0) == (1.0, 0.0)  # busy at the end
    assert idle_seconds([], 2.0, 5.0) == (3.0, 3.0)  # never busy: all tail
    assert idle_seconds([(0.5, True)], 2.0, 5.0) == (0.0, 0.0)  # busy since before the window


# ---- pools -------------------------------------------------------------------------------------

@pytest.mark.parametrize("option, message", [
    (dict(reallocate="no"), "reallocate must be True or False, got 'no'"),
    (dict(report_interval=-1), "report_interval must be a number >= 0.001, got -1"),
    (dict(start_timeout=float("nan")), "start_timeout must be a number >= 0.001, got nan"),
    (dict(min_steal_tokens=-5), "min_steal_tokens must be a number >= 0, got -5"),
    (dict(kv_cache_bytes=1.5e6), "kv_cache_bytes must be a whole number >= 0, got 1500000.0"),
    (dict(preemption="drop"), "preemption must be one of ('suspend', 'evict'), got 'drop'"),
    (dict(dtype="fp32"), "dtype='fp32': give one of"),
    (dict(num_engines="2"), "num_engines must be a whole number >= 1, got '2'"),
    (dict(threads_per_engine=2.5), "threads_per_engine must be a whole number >= 1, got 2.5"),
    # a typo, and a switch whose "no" would be true: refused here, not in each engine process
    (dict(max_num_seq=4), "engine_args: unknown ['max_num_seq']"),
    (dict(ngram_drafts="no"), "ngram_drafts must be True or False, got 'no'"),
])
def test_bad_pool_options_are_refused_before_any_engine_starts(tiny, option, message):
    before = set(multiprocessing.active_children())
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        EnginePool(tiny.dir(FAMILY), **option)
    assert set(multiprocessing.active_children()) <= before


def test_arguments_an_engine_refuses_once_loaded_raise_a_value_error(tiny):
    """A KV cache too small for the model's blocks is known only once its config is read, in
    the engine's process: the pool raises the engine's ValueError, as one engine would."""
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"engine \d failed to start: kv_cache_bytes=1000 holds fewer than 2 blocks"):
        EnginePool(tiny.dir(FAMILY), kv_cache_bytes=1000)
    assert set(multiprocessing.active_children()) <= before


def test_an_engine_process_killed_while_loading_fails_the_pool_at_once(tiny):
    """The OOM killer sends no "failed" message: the pool notices the exit instead of waiting
    out start_timeout."""
    def kill_the_first_engine():
        while not stop.is_set():
            engines = [p for p in multiprocessing.active_children()
                       if p.name.startswith("batchgen-pool-engine-") and p.pid not in others]
            if engines:
                engines[0].kill()
                return
            time.sleep(0.01)

    others = {p.pid for p in multiprocessing.active_children()}  # other tests' pools
    stop = threading.Event()
    killer = threading.Thread(target=kill_the_first_engine, daemon=True)
    killer.start()
    try:
        with pytest.raises(RuntimeError, match=r"exited while starting \(index, exit code\): \[\([01], -9\)\]"):
            EnginePool(tiny.dir(FAMILY), num_engines=2, kv_cache_bytes=KV_BYTES, start_timeout=300)
    finally:
        stop.set()


def test_closing_the_pool_releases_callers_still_waiting(tiny):
    pool = EnginePool(tiny.dir(FAMILY), num_engines=1, kv_cache_bytes=KV_BYTES, max_num_seqs=1)
    requests = [Request(f"r{i}", prompt_token_ids=[5, 6, 7 + i],
                        params=SamplingParams(max_tokens=400, ignore_eos=True)) for i in range(8)]
    failures = []

    def wait_for_all():
        try:
            pool.generate(requests)
        except RuntimeError as exc:
            failures.append(str(exc))

    waiter = threading.Thread(target=wait_for_all)
    waiter.start()
    while not pool.has_unfinished():
        time.sleep(0.01)
    pool.close()
    waiter.join(30)
    assert not waiter.is_alive() and failures == ["engine pool failed: it was closed"]


def test_a_busy_pool_closes_with_its_engines_exiting_on_their_own(tiny):
    """Engines busy sending big updates (logprobs) when closed: each exits once its last
    updates leave its queue, which the pool reads and drops; nobody read them, each waited out
    its join on a full pipe and was terminated (exit code -15)."""
    model = tiny.dir(FAMILY)
    pool = EnginePool(model, num_engines=2, kv_cache_bytes=256 * kv_block_bytes(model), max_num_seqs=64)
    for i, prompt in enumerate(random_prompts([200] * 300, seed=1)):
        scored = SamplingParams(max_tokens=[1, 2, 3, 200][i % 4], ignore_eos=True, logprobs=20, prompt_logprobs=20)
        pool.submit(Request(f"r{i}", prompt_token_ids=prompt, params=scored))
    time.sleep(1.5)  # busy, updates on their way, none collected
    pool.close()
    assert [e.process.exitcode for e in pool._engines] == [0, 0]


def test_a_shared_queue_hands_an_engine_as_many_samples_as_it_runs(tiny):
    """max_num_seqs counts samples: with n = 2 and room for 2, each engine holds one request,
    and the rest wait in the pool's queue for whichever engine frees first."""
    model = tiny.dir(FAMILY)
    with EnginePool(model, num_engines=2, reallocate=False, max_num_seqs=2, kv_cache_bytes=KV_BYTES) as pool:
        for i in range(4):
            pool.submit(Request(f"r{i}", prompt_token_ids=[5, 6, 7, 8 + i],
                                params=SamplingParams(max_tokens=300, n=2, temperature=1.0, seed=i, ignore_eos=True)))
        held = 0
        while pool.has_unfinished():
            held = max(held, *(engine["in_flight"] for engine in pool.stats()))
            time.sleep(0.02)
    assert held == 1


PROMPTS = random_prompts([5, 9, 13, 20, 7, 11, 30, 8, 16, 6], seed=31)
LENGTHS = [150, 10, 12, 120, 8, 9, 140, 11, 60, 7]  # skewed: three long, one medium


def skewed_requests(prefix="r", sampled=(), lengths=LENGTHS):
    """Greedy requests of fixed lengths (ignore_eos), with logprobs; those in `sampled` are
    seeded samples with n=2 instead."""
    requests = []
    for i, (prompt, length) in enumerate(zip(PROMPTS, lengths)):
        params = SamplingParams(max_tokens=length, ignore_eos=True, logprobs=0)
        if i in sampled:
            params = SamplingParams(max_tokens=length, ignore_eos=True, logprobs=0, temperature=1.0,
                                    seed=100 + i, n=2)
        requests.append(Request(f"{prefix}{i}", prompt_token_ids=prompt, params=params))
    return requests


def assert_same_outputs(got, want):
    assert [c.id for c in got] == [c.id for c in want]
    for mine, theirs in zip(got, want):
        assert mine.error is None, mine.error
        assert [o.token_ids for o in mine.outputs] == [o.token_ids for o in theirs.outputs], mine.id
        for a, b in zip(mine.outputs, theirs.outputs):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert mine.prompt_tokens == theirs.prompt_tokens


@pytest.fixture(scope="module")
def single(tiny):
    """One engine in this process: the outputs every pool must reproduce."""
    return make_engine(tiny.dir(FAMILY))


@pytest.fixture(scope="module")
def static_pool(tiny):
    with EnginePool(tiny.dir(FAMILY), num_engines=2, split="static", min_steal_tokens=16,
                    kv_cache_bytes=KV_BYTES) as pool:
        yield pool


@pytest.fixture(scope="module")
def shared_pool(tiny):
    with EnginePool(tiny.dir(FAMILY), num_engines=2, split="shared", policy="longest_first",
                    min_steal_tokens=16, kv_cache_bytes=KV_BYTES, max_num_seqs=2) as pool:
        yield pool


def counters(pool, key):
    return [s[key] for s in pool.stats()]  # in every report, before the first migration too


def test_an_idle_engine_takes_running_sequences_and_outputs_stay_exact(static_pool, single):
    """Everything pinned on engine 0 and running there; then reallocation is switched on and
    engine 1, idle, takes half of it mid-generation, KV along."""
    lengths = [3 * n for n in LENGTHS]  # the long ones outlast the coordinator's reaction
    requests = skewed_requests("steal", sampled={3, 8}, lengths=lengths)
    want = single.generate(requests)
    before = {k: counters(static_pool, k) for k in ("migrated_in", "kv_migrated_in", "decode_tokens", "steps")}
    static_pool.reallocate = False
    try:
        for request in requests:
            static_pool.submit(request, engine=0)
        # Causal: no donation is asked for until engine 0 reports every request admitted (a
        # donation that races the first step hands over waiting requests, which carry no KV).
        deadline = time.monotonic() + 60
        while counters(static_pool, "steps")[0] == before["steps"][0] or static_pool.stats()[0]["waiting"]:
            assert time.monotonic() < deadline, "engine 0 never started its requests"
            time.sleep(0.001)
    finally:
        static_pool.reallocate = True
    done = {}
    while len(done) < len(requests):
        done.update((c.id, c) for c in static_pool.poll(timeout=60))
    got = [done[r.id] for r in requests]
    assert_same_outputs(got, want)
    migrated_in = [a - b for a, b in zip(counters(static_pool, "migrated_in"), before["migrated_in"])]
    kv_in = [a - b for a, b in zip(counters(static_pool, "kv_migrated_in"), before["kv_migrated_in"])]
    decoded = [a - b for a, b in zip(counters(static_pool, "decode_tokens"), before["decode_tokens"])]
    assert migrated_in[1] >= 1  # (engine 0 may take some back once it runs lighter: allowed)
    assert kv_in[1] >= 1  # running sequences moved with their KV, not recomputed
    first_tokens = len(LENGTHS) + 2  # every sample's first token comes from its prefill
    assert decoded[1] > 0 and sum(decoded) == sum(lengths) + lengths[3] + lengths[8] - first_tokens


def test_without_reallocation_the_static_split_leaves_an_engine_idle(static_pool, single):
    static_pool.reallocate = False
    try:
        requests = skewed_requests("still")
        decoded = counters(static_pool, "decode_tokens")
        start = time.monotonic()
        got = static_pool.generate(requests, engines=[0] * len(requests))
        end = time.monotonic()
        assert_same_outputs(got, single.generate(requests))
        assert counters(static_pool, "decode_tokens")[1] == decoded[1]  # engine 1 did nothing
        idle = static_pool.idle(start, end)
        assert idle[1]["idle_s"] == idle[1]["tail_idle_s"] == pytest.approx(end - start)
        assert idle[0]["idle_s"] < 0.5 * (end - start)
    finally:
        static_pool.reallocate = True


def test_static_split_round_robin_by_default(static_pool, single):
    static_pool.reallocate = False
    try:
        requests = skewed_requests("rr")
        submitted = counters(static_pool, "commands")
        got = static_pool.generate(requests)
        assert_same_outputs(got, single.generate(requests))
        assert [a - b for a, b in zip(counters(static_pool, "commands"), submitted)] == [1, 1]
    finally:
        static_pool.reallocate = True


def test_a_request_that_does_not_pickle_fails_alone(static_pool, single, monkeypatch):
    """An engine's inbox pickles on a feeder thread, which drops a failing command whole: the
    requests sent with it were lost and generate() waited forever. The others keep the engines
    the round robin gives them."""
    good = skewed_requests("pickles")[:2]
    odd = Request("odd", messages=[{"role": "user", "content": "Hi", "meta": lambda: None}])
    sent, send = {}, static_pool._send_requests
    monkeypatch.setattr(static_pool, "_send_requests",
                        lambda index, batch: (sent.update({r.id: index for r in batch}), send(index, batch)))
    monkeypatch.setattr(static_pool, "reallocate", False)
    first = static_pool._next_static
    got = static_pool.generate([good[0], odd, good[1]])
    assert sent == {good[0].id: first % 2, good[1].id: (first + 2) % 2}
    assert_same_outputs([got[0], got[2]], single.generate(good))
    assert got[1].finish_reason == "error" and "does not pickle" in got[1].error
    assert not static_pool.has_unfinished()


def test_shared_queue_hands_out_longest_first_within_each_engines_slots(shared_pool, single):
    requests = skewed_requests("shared", sampled={8})
    got = shared_pool.generate(requests)
    assert_same_outputs(got, single.generate(requests))
    # Two slots per engine: the four longest are handed out first and the rest wait in the
    # pool's queue until one of those four finishes and frees a slot. (Causal, so it holds
    # however the OS schedules the engine processes; the clocks are the same monotonic one.)
    by_length = sorted(got, key=lambda c: -LENGTHS[int(c.id[len("shared"):])])
    first_slot_freed = min(c.timings.finished for c in by_length[:4])
    assert all(c.timings.first_scheduled > first_slot_freed for c in by_length[4:])
    assert all(sample["waiting"] + sample["running"] + sample["suspended"] <= 2
               for timeline in shared_pool.timeline() for sample in timeline)


def test_the_shared_queue_is_sorted_when_it_changes_not_at_every_message(shared_pool, monkeypatch):
    """Each key once per request that joins: sorting the whole queue at every engine report
    took 300 ms a dispatch, under the pool's lock, with 100,000 requests queued."""
    keys = []
    longest_first = QUEUE_ORDERS["longest_first"]
    monkeypatch.setitem(QUEUE_ORDERS, "longest_first", lambda r, est: keys.append(r.id) or longest_first(r, est))
    requests = [Request(f"sorted{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=3 + i % 5, ignore_eos=True))
                for i, p in enumerate(random_prompts([4 + i % 9 for i in range(40)], seed=14))]
    assert all(not c.error for c in shared_pool.generate(requests))
    assert len(keys) <= 2 * len(requests), len(keys)


def test_poll_and_submit(shared_pool, single):
    requests = skewed_requests("polled")[:4]
    for request in requests:
        shared_pool.submit(request)
    assert shared_pool.has_unfinished()
    done = {}
    while len(done) < len(requests):
        for completion in shared_pool.poll(timeout=5):
            assert completion.id not in done
            done[completion.id] = completion
    assert_same_outputs([done[r.id] for r in requests], single.generate(requests))
    assert shared_pool.poll() == [] and not shared_pool.has_unfinished()
    for timeout in (float("nan"), -1.0):  # nan waited forever: no deadline compares
        with pytest.raises(ValueError, match="timeout must be a number >= 0"):
            shared_pool.poll(timeout=timeout)


def test_bad_requests(shared_pool):
    [bad] = shared_pool.generate([Request("empty", prompt_token_ids=[])])
    assert bad.finish_reason == "error" and "empty" in bad.error
    [no_tokenizer] = shared_pool.generate([Request("stop", prompt_token_ids=[5, 6],
                                                   params=SamplingParams(stop=("x",)))])
    assert "tokenizer" in no_tokenizer.error
    with pytest.raises(ValueError, match="repeated"):
        shared_pool.generate([Request("twice", prompt_token_ids=[5]), Request("twice", prompt_token_ids=[6])])
    with pytest.raises(ValueError, match="static"):
        shared_pool.submit(Request("pinned", prompt_token_ids=[5]), engine=0)
    with pytest.raises(TypeError):
        shared_pool.submit(Request("params", prompt_token_ids=[5], params={"max_tokens": 3}))
    with pytest.raises(TypeError, match="request ids are strings"):
        shared_pool.submit(Request(7, prompt_token_ids=[5]))
    for value in (None, "Hello"):  # failed inside on a missing .id
        with pytest.raises(TypeError, match="requests are runtime.Request objects, got "):
            shared_pool.submit(value)
    with pytest.raises(TypeError, match="requests are an iterable of runtime.Request objects, got NoneType"):
        shared_pool.generate(None)  # returned [] as if asked for nothing
    one = Request("gen", prompt_token_ids=[5], params=SamplingParams(max_tokens=2))
    [from_generator] = shared_pool.generate(r for r in [one])
    assert from_generator.id == "gen" and from_generator.finish_reason == "length"
    with pytest.raises(ValueError, match="split"):
        EnginePool(split="round_robin")


def test_a_static_pool_refuses_an_engine_index_that_is_no_int(static_pool):
    """Refused before the id is taken: the pool holds nothing in flight after it."""
    request = Request("where", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=2))
    for index in (0.5, 1.0, True, "0", -1, 2):
        with pytest.raises(ValueError, match="engine index"):
            static_pool.generate([request], engines=[index])
        with pytest.raises(ValueError, match="engine index"):
            static_pool.submit(request, engine=index)
    assert not static_pool.has_unfinished()
    [done] = static_pool.generate([request], engines=[np.int64(1)])
    assert done.error is None and len(done.token_ids) == 2


def test_a_dead_engine_process_fails_its_callers(tiny):
    with EnginePool(tiny.dir(FAMILY), num_engines=1, kv_cache_bytes=KV_BYTES) as pool:
        pool.submit(Request("long", prompt_token_ids=[5, 6, 7],
                            params=SamplingParams(max_tokens=400, ignore_eos=True)))
        pool._engines[0].process.kill()
        pool._engines[0].process.join()
        with pytest.raises(RuntimeError, match="exited"):  # was taken, to wait for a dead engine
            pool.submit(Request("after", prompt_token_ids=[5, 6]))
        with pytest.raises(RuntimeError, match="exited"):
            pool.poll()


class _StuckReader:
    """The pool's shared outbox as the coordinator saw it when an engine died midway through
    putting a message there: the read waits for the rest, which never comes."""

    def __init__(self, real, coordinator):
        self.real, self.coordinator = real, coordinator

    def get(self, timeout=None):
        if threading.current_thread() is self.coordinator:
            threading.Event().wait()
        return self.real.get(timeout=timeout)


def test_callers_see_a_dead_engine_while_the_coordinator_is_stuck_reading(tiny):
    """Killed while writing a message, an engine left the coordinator waiting for its rest for
    good; only the coordinator looked for dead engines, so generate() and poll() waited forever."""
    pool = EnginePool(tiny.dir(FAMILY), num_engines=1, kv_cache_bytes=KV_BYTES)
    try:
        real = pool._outbox
        pool._outbox = _StuckReader(real, pool._thread)
        time.sleep(0.5)  # the coordinator's next read is the stuck one
        pool._engines[0].process.kill()
        outcome = []
        caller = threading.Thread(target=lambda: outcome.append(_raised(pool.generate, [
            Request("r", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=4))])), daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "generate() waited on a dead engine"
        assert outcome == ["engine pool failed: engine process(es) [0] exited"]
        assert _raised(pool.poll) == "engine pool failed: engine process(es) [0] exited"
        pool._outbox = real
    finally:
        pool.close()


def _raised(call, *args):
    try:
        call(*args)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "never-closed"])
def test_a_process_whose_only_engine_died_under_a_full_inbox_exits(tiny, tmp_path, closed):
    """Killed as the caller handed it more than a pipe holds, the engine left its inbox's
    feeder thread blocked on a pipe nobody reads, and Python waited for that thread at exit
    for good (close() emptied dead engines' inboxes only while another engine lived), closed
    or not."""
    script = tmp_path / "child.py"
    script.write_text(f"""
import sys
sys.path[:0] = {sys.path!r}
import torch
torch.set_num_threads(1)
from runtime import Request, SamplingParams
from runtime.pool import EnginePool

if __name__ == "__main__":  # the engine process imports this file
    pool = EnginePool({str(tiny.dir(FAMILY))!r}, num_engines=1, kv_cache_bytes={KV_BYTES})
    pool._engines[0].process.kill()
    pool._engines[0].process.join()
    try:
        pool.generate([Request(f"r{{i}}", prompt_token_ids=list(range(5, 505)), params=SamplingParams(max_tokens=2))
                       for i in range(200)])
    except RuntimeError as error:
        print(error)
    if {closed!r}:
        pool.close()
""")
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert child.returncode == 0, child.stderr[-2000:]
    assert "engine process(es) [0] exited" in child.stdout
