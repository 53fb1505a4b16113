"""kernels/linear_rows.py: which row counts the panel kernel and the few-row kernel take (MKL
the rest), measured per machine or set by BATCHGEN_CPU_PANEL_ROWS and BATCHGEN_CPU_LINEAR_ROWS."""

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu_kernels, linear_rows
from kernels.linear_rows import OPEN_END, Plan


@pytest.fixture
def unmeasured(monkeypatch):
    """The process's plan forgotten (restored afterwards), the variables unset."""
    monkeypatch.setattr(linear_rows, "_plan", None)
    monkeypatch.delenv(linear_rows.ROWS_VAR, raising=False)
    monkeypatch.delenv(linear_rows.PANEL_VAR, raising=False)


def rung_times(cpp, mkl=lambda rows: 1.0, panel=lambda rows: 2.0):
    """Seconds per rung from per-implementation functions of the row count."""
    return {rows: {"panel": panel(rows), "cpp": cpp(rows), "mkl": mkl(rows)} for rows in linear_rows.RUNGS}


@pytest.mark.parametrize("text,span", [("4-24", range(4, 25)), ("1-1", range(1, 2)), ("0", range(0)),
                                       (" 2-256 ", range(2, 257)), ("8-", range(8, OPEN_END))])
def test_the_variable_names_a_span(text, span):
    assert linear_rows.parse_span(text) == span


@pytest.mark.parametrize("text", ["", "4", "-", "a-b", "24-4", "0-8", "4-24-32", "-3-4"])
def test_a_malformed_span_is_refused(text):
    with pytest.raises(ValueError, match=linear_rows.PANEL_VAR):
        linear_rows.parse_span(text, linear_rows.PANEL_VAR)


@pytest.mark.parametrize("wins,span", [
    ({1: False, 2: False, 3: False, 4: True, 8: True, 24: True, 32: False, 64: False}, range(4, 25)),
    ({1: True, 2: True, 64: True, 128: True, 256: False}, range(1, 129)),
    ({1: True, 2: True, 256: True}, range(1, 257)),
    ({1: False, 8: False}, range(0)),
    ({8: True, 1: True, 4: None}, range(1, 9)),  # a tie inside stays in the span
    ({1: True, 8: False, 16: True, 24: False, 32: None}, range(1, 17)),  # a loss then a win: noise
    ({1: True, 2: True, 4: False, 8: None, 16: True}, range(1, 17)),  # a loss then a tie: noise too
    ({1: True, 2: True, 4: False, 8: False, 16: True}, range(1, 3)),  # two losses in a row: the end
    ({1: None, 2: True, 4: None, 8: False}, range(2, 5)),  # the tie before the end stays
    ({8: True, 128: True, 256: None, 512: False, 1024: False, 2048: True}, range(8, 257)),
    ({1: True, 2: None, 4: None}, range(1, 2)),  # trailing ties no loss ended: not won
    # Two losses before a longer winning run: noise (memory-bound ties at 2 and 3 rows)
    ({1: True, 2: False, 3: False, 4: True, 8: True, 16: True, 64: True, 256: True, 512: False,
      1024: False, 2048: False}, range(1, 257)),
    ({1: True, 2: False, 3: False, 4: True, 8: False}, range(1, 2)),  # as many wins as losses after: the end
])
def test_the_span_runs_from_the_first_winning_rung_to_the_last_before_it_loses_for_good(wins, span):
    assert linear_rows.span_of_wins(wins) == span


def test_a_span_no_loss_ended_is_open_only_where_asked():
    wins = {1: False, 8: True, 256: True}
    assert linear_rows.span_of_wins(wins, open_ended=True) == range(8, OPEN_END)
    assert linear_rows.span_of_wins(wins) == range(8, 257)
    assert linear_rows.span_of_wins({1: True, 128: True, 256: None}, open_ended=True) == range(1, OPEN_END)
    assert linear_rows.span_of_wins({1: True, 64: False, 128: None, 256: None}, open_ended=True) == range(1, OPEN_END)
    assert linear_rows.span_of_wins({1: True, 64: True, 128: False, 256: False}, open_ended=True) == range(1, 65)


@pytest.mark.parametrize("kernel_s,other_s,verdict", [(0.5, 1.0, True), (1.0, 0.5, False),
                                                      (1.0, 1.02, None), (1.02, 1.0, None)])
def test_a_verdict_within_the_margin_is_a_tie(kernel_s, other_s, verdict):
    assert linear_rows.verdict(kernel_s, other_s) is verdict


def test_each_kernels_span_is_where_it_beats_mkl():
    """The panel kernel beats MKL from 2 rows on, to the last rung (open-ended); the few-row
    kernel up to 64 rows."""
    times = rung_times(cpp=lambda rows: 0.5 if rows <= 64 else 2.0, panel=lambda rows: 1.0 if rows == 1 else 0.4)
    assert linear_rows.plan_of_times(times) == Plan(range(2, OPEN_END), range(1, 65))


def test_the_plan_is_measured_once_on_a_thread_of_its_own(unmeasured, monkeypatch):
    seen = []

    def measure(kernel, panel, pack):
        seen.append(threading.current_thread())
        # The few-row kernel wins at 2-8 rows, ties within the margin at 16 (which it keeps),
        # loses elsewhere; the panel kernel wins at 4-128.
        return rung_times(cpp=lambda rows: 0.5 if 2 <= rows <= 8 else 0.97 if rows == 16 else 2.0,
                          panel=lambda rows: 0.5 if 4 <= rows <= 128 else 2.0)

    monkeypatch.setattr(linear_rows, "measure", measure)
    assert cpu_kernels.linear_plan() == Plan(range(4, 129), range(2, 17))
    assert cpu_kernels.linear_plan() == Plan(range(4, 129), range(2, 17))
    assert len(seen) == 1 and seen[0] is not threading.current_thread()


def test_both_variables_replace_the_measurement(unmeasured, monkeypatch):
    monkeypatch.setenv(linear_rows.ROWS_VAR, "3-5")
    monkeypatch.setenv(linear_rows.PANEL_VAR, "6-")
    monkeypatch.setattr(linear_rows, "measure", lambda *kernels: pytest.fail("measured"))
    assert cpu_kernels.linear_plan() == Plan(range(6, OPEN_END), range(3, 6))


def test_one_variable_sets_its_span_and_the_other_is_measured(unmeasured, monkeypatch):
    monkeypatch.setattr(linear_rows, "measure", lambda *kernels: rung_times(
        cpp=lambda rows: 0.5 if rows <= 64 else 2.0, panel=lambda rows: 0.5))
    monkeypatch.setenv(linear_rows.PANEL_VAR, "0")
    assert cpu_kernels.linear_plan() == Plan(range(0), range(1, 65))
    monkeypatch.setattr(linear_rows, "_plan", None)
    monkeypatch.delenv(linear_rows.PANEL_VAR)
    monkeypatch.setenv(linear_rows.ROWS_VAR, "0")
    assert cpu_kernels.linear_plan() == Plan(range(1, OPEN_END), range(0))


def test_a_malformed_variable_is_refused(unmeasured, monkeypatch):
    monkeypatch.setenv(linear_rows.PANEL_VAR, "many")
    with pytest.raises(ValueError, match=linear_rows.PANEL_VAR):
        cpu_kernels.linear_plan()


def test_prepare_measures_the_plan(unmeasured, monkeypatch):
    monkeypatch.setattr(linear_rows, "measure", lambda *kernels: rung_times(cpp=lambda rows: 1.0,
                                                                             mkl=lambda rows: 2.0))
    kernels.prepare("cpu")
    assert linear_rows._plan == Plan(range(0), range(1, linear_rows.RUNGS[-1] + 1))


def test_measure_times_every_implementation_at_every_rung(monkeypatch):
    """On smaller weights than the real measurement's, so the test stays quick."""
    monkeypatch.setattr(linear_rows, "WEIGHTS", 1)
    monkeypatch.setattr(linear_rows, "OUT_FEATURES", 64)
    monkeypatch.setattr(linear_rows, "IN_FEATURES", 32)
    calls = {"cpp": [], "panel": []}

    def kernel(x, weight):
        calls["cpp"].append(len(x))
        return F.linear(x, weight)

    def panel(x, packed, out_features):
        calls["panel"].append(len(x))
        assert packed.shape == (32, 64) and out_features == 64  # what `pack` made of the weight
        return x @ packed

    times = linear_rows.measure(kernel, panel, lambda weight: weight.T)
    few_rows = [rows for rows in linear_rows.RUNGS if rows <= linear_rows.FEW_ROWS_LAST_RUNG]
    assert sorted(times) == sorted(linear_rows.RUNGS) and few_rows != list(linear_rows.RUNGS)
    assert all(set(t) == ({"panel", "cpp", "mkl"} if rows in few_rows else {"panel", "mkl"})
               and all(0 < v < 1 for v in t.values()) for rows, t in times.items())
    assert sorted(set(calls["panel"])) == sorted(linear_rows.RUNGS)
    assert sorted(set(calls["cpp"])) == few_rows


def test_mkl_takes_the_rows_past_where_it_beats_the_panel_kernel_twice():
    """As on an Intel Xeon: the panel kernel wins decode-sized rows, MKL prefill-sized ones; the
    few-row kernel, timed only up to its last rung, keeps the span it won there."""
    times = rung_times(cpp=lambda rows: 0.5 if rows <= 16 else 2.0,
                       panel=lambda rows: 0.5 if rows <= 256 else 1.2)
    for rows in linear_rows.RUNGS:
        if rows > linear_rows.FEW_ROWS_LAST_RUNG:
            del times[rows]["cpp"]
    assert linear_rows.plan_of_times(times) == Plan(range(1, 257), range(1, 17))


def test_dispatch_gives_each_kernel_the_rows_of_its_span(monkeypatch):
    """Packed weights: the panel kernel within its span; plain ones: the few-row kernel within
    its span; MKL elsewhere."""
    monkeypatch.setattr(linear_rows, "_plan", Plan(range(4, 17), range(2, 9)))
    module, called = cpu_kernels.build(), []

    def spied(name):
        return lambda *args: called.append(name) or getattr(module, name)(*args)

    spy = SimpleNamespace(panel_linear=spied("panel_linear"), small_rows_linear=spied("small_rows_linear"))
    monkeypatch.setattr(cpu_kernels, "build", lambda: spy)
    weight, bias = torch.randn(40, 16), torch.randn(40)
    packed = cpu_kernels.pack_panels(weight)
    panel, few_rows = ["panel_linear"], ["small_rows_linear"]
    for rows, with_panels, without in ((1, [], []), (2, [], few_rows), (4, panel, few_rows),
                                       (9, panel, []), (16, panel, []), (17, [], [])):
        x = torch.randn(rows, 16)
        for given, expected in ((packed, with_panels), (None, without)):
            called.clear()
            torch.testing.assert_close(kernels.linear(x, weight, bias, given), F.linear(x, weight, bias),
                                       atol=1e-5, rtol=1e-5)
            assert called == expected, (rows, given is not None)
