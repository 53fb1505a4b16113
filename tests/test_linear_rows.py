"""kernels/linear_rows.py: which row counts the C++ few-row linear takes, measured per machine
or set by BATCHGEN_CPU_LINEAR_ROWS."""

import threading

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_kernels, linear_rows


@pytest.fixture
def unmeasured(monkeypatch):
    """The process's span forgotten (restored afterwards), the variable unset."""
    monkeypatch.setattr(linear_rows, "_span", None)
    monkeypatch.delenv(linear_rows.ROWS_VAR, raising=False)


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
    ({8: True, 1: True, 4: False}, range(1, 9)),  # a noisy rung inside stays in the span
])
def test_the_span_runs_from_the_first_winning_rung_to_the_last(wins, span):
    assert linear_rows.span_of_wins(wins) == span


def test_the_span_is_measured_once_on_a_thread_of_its_own(unmeasured, monkeypatch):
    seen = []

    def measure(kernel):
        seen.append(threading.current_thread())
        # The kernel wins at 2-8 rows, ties within the margin at 16, loses elsewhere.
        cpp = {rows: 0.5 if 2 <= rows <= 8 else 0.97 if rows == 16 else 2.0 for rows in linear_rows.RUNGS}
        return {rows: {"cpp": cpp[rows], "mkl": 1.0} for rows in linear_rows.RUNGS}

    monkeypatch.setattr(linear_rows, "measure", measure)
    assert cpu_kernels.linear_span() == range(2, 9)
    assert cpu_kernels.linear_span() == range(2, 9)
    assert len(seen) == 1 and seen[0] is not threading.current_thread()


def test_the_variable_overrides_the_measurement(unmeasured, monkeypatch):
    monkeypatch.setenv(linear_rows.ROWS_VAR, "3-5")
    monkeypatch.setattr(linear_rows, "measure", lambda kernel: pytest.fail("measured"))
    assert cpu_kernels.linear_span() == range(3, 6)


def test_prepare_measures_the_span(unmeasured, monkeypatch):
    monkeypatch.setattr(linear_rows, "measure",
                        lambda kernel: {rows: {"cpp": 1.0, "mkl": 2.0} for rows in linear_rows.RUNGS})
    kernels.prepare("cpu")
    assert linear_rows._span == range(1, linear_rows.RUNGS[-1] + 1)


def test_measure_times_both_implementations_at_every_rung(monkeypatch):
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
    assert all(0 < t["cpp"] < 1 and 0 < t["mkl"] < 1 for t in times.values())
    assert sorted(set(calls)) == sorted(linear_rows.RUNGS)


def test_the_measured_span_holds_the_rows_dispatch_gives_the_kernel(monkeypatch):
    monkeypatch.setattr(linear_rows, "_span", range(2, 9))
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
