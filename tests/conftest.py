"""Shared fixtures: tiny models of each family (built once per session) and transformers as the
oracle on the same weights (each greedy continuation computed once per session).

`pytest` alone runs the fast suite: tests marked `slow` are skipped unless a `-m` expression is
given (`pytest -m slow`, `pytest -m "slow or not slow"`), as README.md describes."""

import os
import signal

# Triton runs the kernels of tests/test_triton_kernels.py on CPU tensors only in its interpreter,
# chosen when triton is first imported, and transformers imports it (through torch._dynamo) below.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import kernels

pytest_plugins = ["gcs_emulator"]  # the `gcs_emulator` fixture (tests/gcs_emulator.py)

from tiny_models import (ALL_FAMILIES, NEAR_TIE, assert_decisive, hf_greedy_with_margin, hf_model,
                         make_tiny_chat_model, make_tiny_model)

# The machine is shared: one thread keeps each test process to one core.
torch.set_num_threads(1)


def pytest_sessionstart(session):
    kernels.prepare("cpu")  # the C++ kernel's first build (~25 s) here, not inside a timed test


def pytest_collection_modifyitems(config, items):
    if config.getoption("markexpr"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with -m slow (or -m 'slow or not slow')")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


class TinyModels:
    """Lazily builds tiny model directories; each (family, overrides) once per session."""

    def __init__(self, tmp_path_factory):
        self._factory = tmp_path_factory
        self._dirs = {}
        self._hf = {}
        self._greedy = {}

    def dir(self, family: str, **overrides):
        assert family in ALL_FAMILIES, family
        key = (family, repr(sorted(overrides.items())))  # repr: list values too
        if key not in self._dirs:
            name = "-".join([family] + [f"{k}{v}" for k, v in sorted(overrides.items())])
            self._dirs[key] = make_tiny_model(family, self._factory.mktemp(name), **overrides)
        return self._dirs[key]

    def hf(self, family: str, **overrides):
        directory = self.dir(family, **overrides)
        if directory not in self._hf:
            self._hf[directory] = hf_model(directory)
        return self._hf[directory]

    def greedy(self, family: str, prompt_ids, max_new_tokens: int, **overrides):
        """transformers' greedy (tokens, logprobs) for this prompt, memoised; refuses a
        continuation with a near-tie (tiny_models.NEAR_TIE)."""
        tokens, logprobs, margin = self._greedy_with_margin(family, prompt_ids, max_new_tokens, **overrides)
        assert_decisive(margin, prompt_ids)
        return tokens, logprobs

    def decisive(self, family: str, prompt_ids, max_new_tokens: int, **overrides) -> bool:
        """Whether transformers' greedy continuation has no near-tie, so a test may use it."""
        return self._greedy_with_margin(family, prompt_ids, max_new_tokens, **overrides)[2] >= NEAR_TIE

    def _greedy_with_margin(self, family, prompt_ids, max_new_tokens, **overrides):
        key = (self.dir(family, **overrides), tuple(prompt_ids), max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = hf_greedy_with_margin(self.hf(family, **overrides), list(prompt_ids),
                                                      max_new_tokens)
        return self._greedy[key]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory)


class TinyChatModels:
    """Lazily builds tiny models with a tokenizer and chat template (tiny_models.make_tiny_chat_model),
    each (family, overrides) once per session, so test modules can share one model directory (and so
    one engine process, which the directory and engine arguments identify)."""

    def __init__(self, tmp_path_factory):
        self._factory = tmp_path_factory
        self._dirs = {}

    def dir(self, family: str, **overrides):
        assert family in ALL_FAMILIES, family
        key = (family, repr(sorted(overrides.items())))  # repr: list values too
        if key not in self._dirs:
            name = "-".join(["chat", family] + [f"{k}{v}" for k, v in sorted(overrides.items())])
            self._dirs[key] = make_tiny_chat_model(family, self._factory.mktemp(name), **overrides)
        return self._dirs[key]


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> TinyChatModels:
    return TinyChatModels(tmp_path_factory)


@pytest.fixture
def interruptible():
    """SIGINT raising KeyboardInterrupt, as an interactive session has it, for tests that stand
    in for the stop button with _thread.interrupt_main: a process started in the background (a
    CI job from a non-interactive shell) inherits SIGINT ignored, and a handler wrapping that
    (Beam's job server installs one) swallows the interrupt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
