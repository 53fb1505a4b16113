"""The benchmark harness's own arithmetic: model FLOPs per decoded token (dense and MoE), the
engine's decode-phase statistics, and the same-work check between systems."""

import pytest
import torch

from benchmarks import mfu, onednn, report
from benchmarks.workloads import WorkItem
from helpers import make_engine
from runtime import Request, SamplingParams
from runtime.loader import load_model


def _hand_count(spec, mlp_per_token: int) -> int:
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attention = spec.hidden_size * (q + 2 * kv) + q * spec.hidden_size
    return spec.num_layers * (attention + mlp_per_token) + spec.vocab_size * spec.hidden_size


def test_dense_matmul_params_per_token(tiny):
    model = load_model(tiny.dir("llama"), torch.device("cpu"), torch.float32)
    spec = model.spec
    assert mfu.matmul_params_per_token(model) == _hand_count(spec, 3 * spec.hidden_size * spec.intermediate_size)


def test_moe_counts_only_the_routed_experts(tiny):
    model = load_model(tiny.dir("olmoe"), torch.device("cpu"), torch.float32)  # every layer sparse
    spec, moe = model.spec, model.spec.moe
    router, experts = spec.hidden_size * moe.num_experts, moe.top_k * 3 * spec.hidden_size * moe.intermediate_size
    assert mfu.matmul_params_per_token(model) == _hand_count(spec, router + experts)


def test_decode_flops_add_attention_over_the_context(tiny):
    model = load_model(tiny.dir("llama"), torch.device("cpu"), torch.float32)
    spec = model.spec
    per_context_token = 4 * spec.num_layers * spec.num_heads * spec.head_dim
    assert (mfu.decode_model_flops(model, 3, 100) - mfu.decode_model_flops(model, 3, 0)
            == 100 * per_context_token)


def test_engine_reports_the_decode_phase(tiny):
    engine = make_engine(tiny.dir("llama"), max_num_batched_tokens=64)
    lengths, max_tokens = (5, 9), 6
    engine.generate([Request(f"r{n}", prompt_token_ids=list(range(3, 3 + n)),
                             params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for n in lengths])
    stats = engine.stats
    # One step prefills both prompts and samples each one's first token; every later step decodes both.
    assert stats.decode_steps == max_tokens - 1
    assert stats.decode_step_tokens == 2 * (max_tokens - 1)
    # A decode step attends over everything before the new token, itself included.
    assert stats.decode_step_context == sum(n + i for n in lengths for i in range(1, max_tokens))
    assert 0 < stats.decode_step_seconds <= stats.forward_seconds * 10


def test_same_work_check_names_the_system_that_did_different_work():
    items = [WorkItem("a", [1], 2), WorkItem("b", [1], 3)]
    ours = {"system": "ours", "batch_completion_s": 1.0, "load_s": 0, "output_tokens": 5,
            "tokens": {"a": [4, 5], "b": [6, 7, 8]}}
    peer = {"system": "peer", "batch_completion_s": 2.0, "load_s": 0, "output_tokens": 4,
            "tokens": {"a": [4, 5], "b": [6, 9]}}
    mismatches = report.compare([ours, peer], items)
    assert len(mismatches) == 1 and mismatches[0].startswith("peer: 1 request")
    # its row carries it too: a ratio is never read (or plotted) without it
    assert peer["work_mismatch"].startswith("1 request") and "work_mismatch" not in ours
    assert peer["ours_faster_by"] == pytest.approx(2.0)
    assert peer["requests_token_identical_to_ours"] == "1/2"
    assert peer["first_differing_token"] == {"b": 1}


def test_rounds_alternate_the_order_and_keep_each_systems_best(monkeypatch):
    from benchmarks import w1

    sgemms = iter([100e9, 150e9, 120e9])
    monkeypatch.setattr(mfu, "sgemm_flops_per_s", lambda: next(sgemms))
    calls, times = [], {"a": iter([3.0, 2.0, 4.0]), "b": iter([5.0, 6.0, 1.0])}

    def run(name):
        calls.append(name)
        return {"system": name, "batch_completion_s": next(times[name])}

    results, measured = w1._best_of_rounds({n: (lambda n=n: run(n)) for n in "ab"}, ["a", "b"], 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert [r["batch_completion_s"] for r in results] == [2.0, 1.0]
    assert results[0]["rounds_batch_completion_s"] == [3.0, 2.0, 4.0]
    assert measured == [100e9, 150e9, 120e9]


def test_w1_gives_generates_engine_process_the_runs_threads(monkeypatch, tmp_path):
    """`Generate`'s engine runs in a process of its own, whose threads default to every core: on a
    machine with more cores than --threads it would run on more than its peers."""
    from benchmarks import beam_systems, systems, w1

    def fake(name):
        def run(*args, **kwargs):
            seen[name] = (args, kwargs)
            return {"system": name, "load_s": 0, "batch_completion_s": 1.0, "output_tokens": 0,
                    "tokens": {it.id: [0] * it.max_tokens for it in items}, "decode_model_flops_per_s": 1.0}
        return run

    seen, real_w1 = {}, w1.w1
    items = []
    monkeypatch.setattr(w1, "w1", lambda *a, **k: items.extend(real_w1(*a, **k)) or items)
    monkeypatch.setattr(w1, "_engine_with_decode_flops", fake("engine"))
    monkeypatch.setattr(systems, "vllm_cpu", fake("vllm"))
    monkeypatch.setattr(beam_systems, "generate", fake("generate"))
    monkeypatch.setattr(mfu, "sgemm_flops_per_s", lambda: 1e9)
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    w1.main(["--quick", "--threads", "3", "--systems", "engine", "generate", "vllm"])
    assert seen["generate"][0][1]["num_threads"] == 3
    assert seen["vllm"][0][2] == 3


def test_sgemm_rate_is_the_best_of_the_matmuls_the_engine_runs(monkeypatch):
    timed = []
    real_timed = mfu._timed
    monkeypatch.setattr(mfu, "_timed", lambda fn: timed.append(fn) or real_timed(fn))
    assert mfu.sgemm_flops_per_s(size=64, repeats=2) > 0
    assert len(set(timed)) == (2 if onednn.available() else 1)


@pytest.mark.parametrize("broken", ["no oneDNN", "ops fail"])
def test_onednn_is_unavailable_where_torch_lacks_it_or_its_ops_fail(broken, monkeypatch):
    onednn.available.cache_clear()
    if broken == "no oneDNN":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    else:
        monkeypatch.setattr(onednn, "pack", lambda weight: torch.ops.mkldnn.no_such_op(weight))
    try:
        assert onednn.available() is False
    finally:
        onednn.available.cache_clear()


def test_the_beam_harness_refuses_anything_but_one_row_per_record():
    """A duplicated (or lost) row would pass the same-work check once rows became a dict."""
    import apache_beam as beam

    from benchmarks.beam_systems import _run_pipeline

    records = [{"id": f"r{i}"} for i in range(3)]
    _, rows = _run_pipeline(records, beam.Map(lambda r: r), lambda r: (r["id"], [1]))
    assert rows == {f"r{i}": [1] for i in range(3)}
    with pytest.raises(RuntimeError, match="6 rows for 3 records"):
        _run_pipeline(records, beam.FlatMap(lambda r: [r, r]), lambda r: (r["id"], [1]))


def test_exactness_of_an_output_cut_short_says_where():
    from benchmarks.multi_engine import exactness

    items = [WorkItem("a", [1], 3)]
    reference = {"tokens": {"a": [4, 5, 6]}, "top_logprobs": {"a": [{4: -0.1, 7: -2.0}] * 3}}
    report_ = exactness({"tokens": {"a": [4, 5]}}, reference, items)
    assert report_["diverged"] == [{"id": "a", "first_diff": 2, "lengths": [2, 3],
                                    "reference_top2_margin": pytest.approx(1.9)}]
