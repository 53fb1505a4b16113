"""kernels/linear_rows.py: which row counts the C++ few-row linear takes and which sgemm takes
the rest, measured per machine or set by BATCHGEN_CPU_LINEAR_ROWS and BATCHGEN_CPU_SGEMM."""

import threading

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_kernels, linear_rows, onednn
from kernels.linear_rows import Plan


@pytest.fixture
def unmeasured(monkeypatch):
    """The process's plan forgotten (restored afterwards), the variables unset."""
    monkeypatch.setattr(linear_rows, "_plan", None)
    monkeypatch.delenv(linear_rows.ROWS_VAR, raising=False)
    monkeypatch.delenv(linear_rows.SGEMM_VAR, raising=False)


def rung_times(cpp, mkl=lambda rows: 1.0, onednn=None):
    """Seconds per rung from per-implementation functions of the row count."""
    times = {rows: {"cpp": cpp(rows), "mkl": mkl(rows)} for rows in linear_rows.RUNGS}
    if onednn is not None:
        for rows in linear_rows.RUNGS:
            times[rows]["onednn"] = onednn(rows)
    return times


@pytest.mark.parametrize("text,span", [("4-24", range(4, 25)), ("1-1", range(1, 2)), ("0", range(0)),
                                       (" 2-256 ", range(2, 257))])
def test_the_variable_names_a_span(text, span):
    assert linear_rows.parse_span(text) == span


@pytest.mark.parametrize("text", ["", "4", "4-", "a-b", "24-4", "0-8", "4-24-32", "-3-4"])
def test_a_malformed_span_is_refused(text):
    with pytest.raises(ValueError, match=linear_rows.ROWS_VAR):
        linear_rows.parse_span(text)


@pytest.mark.parametrize("wins,span", [
    ({1: False, 2: False, 3: False, 4: True, 8: True, 24: True, 32: False, 64: False}, range(4, 25)),
    ({1: True, 2: True, 64: True, 128: True, 256: False}, range(1, 129)),
    ({1: True, 2: True, 256: True}, range(1, 257)),
    ({1: False, 8: False}, range(0)),
    ({8: True, 1: True, 4: None}, range(1, 9)),  # a tie inside stays in the span
    ({1: True, 8: False, 16: True, 24: False, 32: None}, range(1, 17)),  # a loss then a win: noise
    ({1: True, 2: True, 4: False, 8: None, 16: True}, range(1, 3)),  # a loss and no win next: the end
    ({1: None, 2: True, 4: None, 8: False}, range(2, 3)),
])
def test_the_span_runs_from_the_first_winning_rung_to_the_last_before_it_loses_for_good(wins, span):
    assert linear_rows.span_of_wins(wins) == span


@pytest.mark.parametrize("kernel_s,other_s,verdict", [(0.5, 1.0, True), (1.0, 0.5, False),
                                                      (1.0, 1.02, None), (1.02, 1.0, None)])
def test_a_verdict_within_the_margin_is_a_tie(kernel_s, other_s, verdict):
    assert linear_rows.verdict(kernel_s, other_s) is verdict


@pytest.mark.parametrize("onednn_time,sgemm", [(0.9, "onednn"), (0.97, "mkl"), (1.5, "mkl"), (None, "mkl")])
def test_onednn_takes_the_rest_only_when_faster_beyond_the_margin(onednn_time, sgemm):
    times = rung_times(cpp=lambda rows: 0.1 if rows <= 4 else 9.0,
                       onednn=None if onednn_time is None else lambda rows: onednn_time)
    assert linear_rows.plan_of_times(times) == Plan(range(1, 5), sgemm, range(1, 5))


def test_the_kernels_span_is_where_it_beats_the_chosen_sgemm():
    """The kernel beats MKL up to 64 rows but oneDNN only up to 8: oneDNN, and the kernel to 8
    for linears; the experts (whose alternative runs on MKL) keep it to 64."""
    times = rung_times(cpp=lambda rows: 0.5 if rows <= 8 else 0.8 if rows <= 64 else 2.0,
                       onednn=lambda rows: 0.7)
    assert linear_rows.plan_of_times(times) == Plan(range(1, 9), "onednn", range(1, 65))
    assert linear_rows.plan_of_times(times, sgemm="mkl") == Plan(range(1, 65), "mkl", range(1, 65))


def test_the_plan_is_measured_once_on_a_thread_of_its_own(unmeasured, monkeypatch):
    seen = []

    def measure(kernel):
        seen.append(threading.current_thread())
        # The kernel wins at 2-8 rows, ties within the margin at 16, loses elsewhere.
        return rung_times(cpp=lambda rows: 0.5 if 2 <= rows <= 8 else 0.97 if rows == 16 else 2.0)

    monkeypatch.setattr(linear_rows, "measure", measure)
    assert cpu_kernels.linear_plan() == Plan(range(2, 9), "mkl", range(2, 9))
    assert cpu_kernels.linear_plan() == Plan(range(2, 9), "mkl", range(2, 9))
    assert len(seen) == 1 and seen[0] is not threading.current_thread()


def test_both_variables_replace_the_measurement(unmeasured, monkeypatch):
    monkeypatch.setenv(linear_rows.ROWS_VAR, "3-5")
    monkeypatch.setenv(linear_rows.SGEMM_VAR, "mkl")
    monkeypatch.setattr(linear_rows, "measure", lambda kernel: pytest.fail("measured"))
    assert cpu_kernels.linear_plan() == Plan(range(3, 6), "mkl", range(3, 6))


def test_one_variable_sets_its_part_and_the_other_is_measured(unmeasured, monkeypatch):
    monkeypatch.setattr(linear_rows, "measure", lambda kernel: rung_times(
        cpp=lambda rows: 0.5 if rows <= 64 else 2.0, onednn=lambda rows: 0.7))
    monkeypatch.setenv(linear_rows.SGEMM_VAR, "MKL")
    assert cpu_kernels.linear_plan() == Plan(range(1, 65), "mkl", range(1, 65))
    monkeypatch.setattr(linear_rows, "_plan", None)
    monkeypatch.delenv(linear_rows.SGEMM_VAR)
    monkeypatch.setenv(linear_rows.ROWS_VAR, "0")
    assert cpu_kernels.linear_plan() == Plan(range(0), "onednn", range(0))


def test_an_unknown_sgemm_is_refused(unmeasured, monkeypatch):
    monkeypatch.setenv(linear_rows.SGEMM_VAR, "openblas")
    with pytest.raises(ValueError, match=linear_rows.SGEMM_VAR):
        cpu_kernels.linear_plan()


def test_prepare_measures_the_plan(unmeasured, monkeypatch):
    monkeypatch.setattr(linear_rows, "measure", lambda kernel: rung_times(cpp=lambda rows: 1.0,
                                                                          mkl=lambda rows: 2.0))
    kernels.prepare("cpu")
    everything = range(1, linear_rows.RUNGS[-1] + 1)
    assert linear_rows._plan == Plan(everything, "mkl", everything)


def test_measure_times_every_implementation_at_every_rung(monkeypatch):
    """On smaller weights than the real measurement's, so the test stays quick."""
    monkeypatch.setattr(linear_rows, "WEIGHTS", 1)
    monkeypatch.setattr(linear_rows, "OUT_FEATURES", 64)
    monkeypatch.setattr(linear_rows, "IN_FEATURES", 32)
    calls = []

    def kernel(x, weight):
        calls.append(len(x))
        return F.linear(x, weight)

    times = linear_rows.measure(kernel)
    assert sorted(times) == sorted(linear_rows.RUNGS)
    names = {"cpp", "mkl", "onednn"} if onednn.available() else {"cpp", "mkl"}
    assert all(set(t) == names and all(0 < v < 1 for v in t.values()) for t in times.values())
    assert sorted(set(calls)) == sorted(linear_rows.RUNGS)


def test_the_measured_span_holds_the_rows_dispatch_gives_the_kernel(monkeypatch):
    monkeypatch.setattr(linear_rows, "_plan", Plan(range(2, 9), "mkl", range(2, 9)))
    called = []
    real_build = cpu_kernels.build

    def counting_build():
        called.append(True)
        return real_build()

    monkeypatch.setattr(cpu_kernels, "build", counting_build)
    weight = torch.randn(8, 16)
    for rows, kernel in ((1, False), (2, True), (8, True), (9, False)):
        called.clear()
        x = torch.randn(rows, 16)
        torch.testing.assert_close(kernels.linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
        assert bool(called) == kernel, rows
