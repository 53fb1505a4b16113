"""W3's harness (benchmarks/w3.py): the KV it gives our engine covers every request at once, and
(slow: the default model's tokenizer, model builds, four child processes) a smoke run of both
systems reports identical tokens, bytes read and peak memory."""

import json

import pytest

from benchmarks import report, w3
from benchmarks.workloads import WorkItem
from helpers import kv_block_bytes


def test_a_system_that_did_other_work_is_named_in_the_json(tmp_path, monkeypatch):
    """W3's same-work check reached only the console, not the JSON a ratio is read from."""
    items = [WorkItem(f"w3-{i}", [5, 6, 7], 4) for i in range(3)]

    def child(system, work):
        tokens = {it.id: [9] * it.max_tokens for it in items}
        if system == "peer":
            del tokens["w3-0"]
        return {"system": system, "load_s": 0.1, "batch_completion_s": 1.0, "peak_rss": 1, "baseline_rss": 0,
                "weight_bytes_per_token": 1.0, "weight_bytes_held": 1, "tokens": tokens,
                "output_tokens": sum(map(len, tokens.values()))}

    monkeypatch.setattr(w3, "run_child", child)
    monkeypatch.setattr(w3, "build_model", lambda name: tmp_path)
    monkeypatch.setattr(w3, "weight_bytes", lambda directory: 1000)
    monkeypatch.setattr(w3, "kv_bytes", lambda directory, its: 10)
    monkeypatch.setattr(w3, "work_items", lambda requests, tokens: items)
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "results")
    w3.main(["--smoke", "--models", "dense"])
    [run] = json.loads((tmp_path / "results" / "W3-smoke-dense.json").read_text())["models"]
    assert [line.split(":")[0] for line in run["work_mismatches"]] == ["peer"]
    assert "work_mismatch" in run["results"][1]


def test_kv_bytes_hold_every_request_whole(tiny):
    directory = tiny.dir("llama")
    items = [WorkItem("a", [5] * 20, 12), WorkItem("b", [5] * 3, 13)]  # 32 and 16 tokens
    assert w3.kv_bytes(directory, items) == ((2 + 1) + (1 + 1)) * kv_block_bytes(directory)  # blocks + 1 each


@pytest.mark.slow
def test_smoke_run_of_both_systems(tmp_path, monkeypatch):
    monkeypatch.setattr(w3, "CACHE", tmp_path / "models")
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "results")
    summary = w3.main(["--smoke", "--models", "dense"])
    [run] = summary["models"]
    ours, peer = run["results"]
    assert peer["requests_token_identical_to_ours"] == f"{summary['requests']}/{summary['requests']}"
    for result in (ours, peer):
        assert result["output_tokens"] == summary["output_tokens"]
        assert result["weight_bytes_per_token"] > 0
        assert result["peak_rss"] > result["baseline_rss"]
    assert ours["weight_bytes_held"] <= run["weight_budget_bytes"]
    assert ours["rss_bound"] == run["weight_budget_bytes"] + run["kv_cache_bytes"] + ours["baseline_rss"]
    assert "rss_bound" not in peer  # the budget is ours; the peer is measured, not bounded
    assert json.loads((tmp_path / "results" / "W3-smoke-dense.json").read_text())["workload"] == "W3-smoke-dense"
