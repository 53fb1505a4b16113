"""The remaining-work estimate (runtime/estimate.py) and the `adaptive` admission order that ranks
by it: exact when only max_tokens can end a sequence, the bound until enough sequences finished,
then Kaplan-Meier over finished lengths (outputs cut by max_tokens are censored, not taken as
their natural length), conditioned on the tokens a sequence already generated."""

import pytest

from helpers import make_engine, random_prompts
from runtime import Request, SamplingParams
from runtime.estimate import EstimateOrder, LengthEstimator, exact_length

LOOSE = SamplingParams(max_tokens=100)  # may stop on EOS: 100 is only a bound


def learned(*observations, **kwargs) -> LengthEstimator:
    """An estimator that saw `count` samples of `length` for each (count, length, natural)."""
    estimator = LengthEstimator(**kwargs)
    for count, length, natural in observations:
        for _ in range(count):
            estimator.observe(length, natural)
    return estimator


def test_exact_lengths_are_known_whatever_was_learned():
    assert exact_length(SamplingParams(max_tokens=7, ignore_eos=True))
    assert not exact_length(SamplingParams(max_tokens=7, ignore_eos=True, stop_token_ids=(5,)))
    assert not exact_length(LOOSE)
    estimator = learned((50, 3, True))
    assert estimator.remaining(SamplingParams(max_tokens=40, ignore_eos=True), 10) == 30


def test_the_bound_until_enough_samples_outlive_the_sequence():
    estimator = learned((7, 5, True), min_samples=8)
    assert estimator.remaining(LOOSE, 0) == 100  # 7 < min_samples
    estimator.observe(5, True)
    assert estimator.remaining(LOOSE, 0) == pytest.approx(5)
    assert estimator.remaining(LOOSE, 3) == pytest.approx(2)
    # Nothing seen ran past 5 tokens: about this one the data say nothing.
    assert estimator.remaining(LOOSE, 6) == 94
    assert estimator.remaining(SamplingParams(max_tokens=4), 0) == 4  # never above the bound


def test_censored_lengths_are_lower_bounds_not_lengths():
    """20 outputs cut at 4 tokens say only 'longer than 4'; the 10 that stopped on their own ran
    50. A plain mean of the observed lengths would say 19.3."""
    estimator = learned((20, 4, False), (10, 50, True))
    assert estimator.remaining(LOOSE, 0) == pytest.approx(50)
    assert estimator.remaining(LOOSE, 30) == pytest.approx(20)


def test_heavy_tail_a_long_runner_is_expected_to_run_longer():
    estimator = learned((90, 10, True), (10, 200, True))
    params = SamplingParams(max_tokens=1000)
    assert estimator.remaining(params, 0) == pytest.approx(0.9 * 10 + 0.1 * 200)
    assert estimator.remaining(params, 20) == pytest.approx(180)
    assert estimator.remaining(SamplingParams(max_tokens=100), 20) == pytest.approx(80)  # capped


def test_survivors_beyond_the_data_run_to_their_bound():
    estimator = learned((30, 100, False))  # all cut at 100: none ever stopped on its own
    assert estimator.remaining(SamplingParams(max_tokens=300), 0) == pytest.approx(300)


def test_only_the_latest_window_counts():
    estimator = learned((16, 10, True), min_samples=4, window=16)
    assert estimator.remaining(LOOSE, 0) == pytest.approx(10)
    for _ in range(16):
        estimator.observe(40, True)
    assert len(estimator) == 16
    assert estimator.remaining(LOOSE, 0) == pytest.approx(40)


# ---- in the engine ----------------------------------------------------------------------------

def teach_short_outputs(engine, tiny, count=8):
    """Finish `count` requests that stop on a stop token after at most 3 tokens."""
    prompts = random_prompts([12] * count, seed=21)
    requests = []
    for i, prompt in enumerate(prompts):
        tokens, _ = tiny.greedy("qwen2", prompt, 3)
        requests.append(Request(f"teach{i}", prompt_token_ids=prompt,
                                params=SamplingParams(max_tokens=50, stop_token_ids=(tokens[2],))))
    done = engine.generate(requests)
    assert all(c.finish_reason == "stop" and len(c.token_ids) <= 3 for c in done)


def test_finished_sequences_feed_the_engines_estimator(tiny):
    engine = make_engine(tiny.dir("qwen2"))
    engine.generate([Request("exact", prompt_token_ids=[5, 6, 7],
                             params=SamplingParams(max_tokens=4, ignore_eos=True))])
    assert len(engine.scheduler.estimator) == 0  # an exact length teaches nothing
    teach_short_outputs(engine, tiny)
    assert len(engine.scheduler.estimator) == 8
    assert engine.scheduler.estimator.remaining(LOOSE, 0) <= 3


@pytest.mark.parametrize("admission,taught,first", [("longest_first", True, "a"),
                                                    ("adaptive", False, "a"),
                                                    ("adaptive", True, "b")])
def test_adaptive_ranks_by_learned_lengths_where_max_tokens_is_loose(tiny, admission, taught, first):
    """a: 10 prompt tokens, max_tokens 60; b: 30 prompt tokens, max_tokens 20. By the bound a is
    more work (70 vs 50); once outputs are known to stop within 3 tokens, b is (~33 vs ~13)."""
    engine = make_engine(tiny.dir("qwen2"), max_num_seqs=1, admission=admission)
    if taught:
        teach_short_outputs(engine, tiny)
    a, b = random_prompts([10, 30], seed=22)
    results = engine.generate([Request("a", prompt_token_ids=a, params=SamplingParams(max_tokens=60)),
                               Request("b", prompt_token_ids=b, params=SamplingParams(max_tokens=20))])
    assert min(results, key=lambda c: c.timings.first_scheduled).id == first


def test_workload_reports_each_requests_expected_remaining_tokens(tiny):
    engine = make_engine(tiny.dir("qwen2"), max_num_seqs=1, ngram_drafts=False)  # a token a step
    prompts = random_prompts([10, 20], seed=23)
    engine.submit(Request("x", prompt_token_ids=prompts[0],
                          params=SamplingParams(max_tokens=30, ignore_eos=True)))
    engine.submit(Request("y", prompt_token_ids=prompts[1],
                          params=SamplingParams(max_tokens=9, ignore_eos=True, n=2)))
    loads = {load.request_id: load for load in engine.workload()}
    assert {rid: (ld.where, ld.remaining_tokens, ld.context_tokens) for rid, ld in loads.items()} == \
        {"x": ("waiting", 30, 10), "y": ("waiting", 18, 20)}  # y: two samples to come
    for _ in range(5):
        engine.step()
    loads = {load.request_id: load for load in engine.workload()}
    assert (loads["x"].where, loads["x"].remaining_tokens, loads["x"].context_tokens) == ("running", 25, 15)
    assert loads["y"].where == "waiting"


def test_an_item_passed_over_long_enough_goes_first_oldest_first():
    """Keys rank 'long' items first; a short one joined at taken=0 is overdue once more than 3
    items were taken since, and goes to the head whatever joins after it."""
    joined = {}
    order = EstimateOrder(LengthEstimator(), reads_estimate=False, joined_at=joined.get, overdue_after=3)
    queue, rank = [], lambda item, est: 0 if item.startswith("long") else 1

    def join(*items):
        for item in items:
            joined[item] = order.taken
        queue.extend(items)
        order.joined()

    def take():
        order.sort(queue, rank)
        order.took()
        return queue.pop(0)

    join("short-a", "short-b")
    taken = []
    for i in range(8):  # a long arrival outranks them at every turn
        join(f"long{i}")
        taken.append(take())
    assert taken == ["long0", "long1", "long2", "long3", "short-a", "short-b", "long4", "long5"]
    assert EstimateOrder(LengthEstimator(), reads_estimate=False).overdue_after is None  # no aging


@pytest.mark.parametrize("admission", ["longest_first", "adaptive"])
def test_a_short_request_waits_no_longer_however_long_a_stream_of_longer_ones_lasts(tiny, admission):
    """Arrivals that outrank it, faster than the engine drains them, once held it back until the
    stream ended; now its wait is bounded (and its tokens are what it gets alone)."""
    def victim_finish_step(arrivals: int) -> int:
        engine = make_engine(tiny.dir("qwen2"), max_num_seqs=2, admission=admission, ngram_drafts=False)
        long_params = SamplingParams(max_tokens=12, ignore_eos=True)
        prompts = random_prompts([6] * arrivals, seed=31)
        victim = Request("victim", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2, ignore_eos=True))
        step, finished = 0, {}
        while step < 4 * arrivals or engine.has_unfinished() or "victim" not in finished:
            if step % 4 == 0 and step // 4 < arrivals:  # one every 4 steps; two at a time take 12 each
                engine.submit(Request(f"long{step}", prompt_token_ids=prompts[step // 4], params=long_params))
            if step == 21:  # both seats taken, longer ones waiting
                engine.submit(victim)
            engine.step()
            finished.update((c.id, (step, c)) for c in engine.finished())
            step += 1
        [alone] = make_engine(tiny.dir("qwen2")).generate([victim])
        assert finished["victim"][1].token_ids == alone.token_ids
        return finished["victim"][0]

    assert victim_finish_step(40) == victim_finish_step(80) < 4 * 40
