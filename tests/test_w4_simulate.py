"""The multi-worker projection (benchmarks/w4_simulate.py): step costs interpolated from the
measured batch sizes, an engine's steps as the scheduler runs them, and the pool's reallocation
rules evening out a static split that piles the long work on one worker."""

import pytest

from benchmarks.w4_simulate import Costs, simulate

# Per-token dominated, so where the work goes shows in the time.
COSTS = Costs({"decode_step_s": {"1": 0.11, "4": 0.41, "16": 1.61}, "prefill_s_per_token": 0.001,
               "kv_migration_s_per_token": 0.0001})


def test_decode_cost_is_piecewise_linear_through_the_measurements():
    assert COSTS.decode(0) == 0.0
    assert COSTS.decode(1) == pytest.approx(0.11)
    assert COSTS.decode(2) == pytest.approx(0.21)
    assert COSTS.decode(10) == pytest.approx(1.01)
    assert COSTS.decode(32) == pytest.approx(3.21)  # beyond the last point: the last slope


def test_a_lone_sequence_costs_its_prefill_then_one_step_per_token():
    result = simulate(COSTS, [10], [5], workers=1, mode="static")
    # The prefill step samples the first token; four decode steps at batch 1 follow.
    assert result["batch_completion_s"] == pytest.approx(10 * 0.001 + 4 * 0.11)
    assert result["tail_idle_fraction"] == 0.0


def test_reallocation_evens_out_long_work_a_static_split_put_on_one_worker():
    lengths = [200, 1, 200, 1, 1, 1, 1, 1]  # i % 2: both long ones on worker 0
    prompts = [4] * len(lengths)
    static = simulate(COSTS, prompts, lengths, workers=2, mode="static")
    stolen = simulate(COSTS, prompts, lengths, workers=2, mode="static_steal")
    shared = simulate(COSTS, prompts, lengths, workers=2, mode="shared")
    # Worker 0: one step prefills its four 4-token prompts (and samples), then 199 at batch 2.
    assert static["batch_completion_s"] == pytest.approx(4 * 4 * 0.001 + 199 * 0.21)
    assert static["tail_idle_fraction"] > 0.9  # worker 1 done after its first step
    assert stolen["migrations"] == 1 and shared["migrations"] == 0  # shared: LPT from the start
    for result in (stolen, shared):
        assert result["batch_completion_s"] < 0.6 * static["batch_completion_s"]
        assert result["tail_idle_fraction"] < 0.05
