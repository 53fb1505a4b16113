"""Per-sequence sampling: parameters, their validation, and the sampler over a logits batch."""

import math
from dataclasses import dataclass, field

import torch

import kernels


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None = off; k >= 0 = the chosen token's plus the top k

    def __post_init__(self):
        # Normalise list inputs so params stay hashable and picklable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("n", self.n, minimum=1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    error: str | None = None  # this row could not be sampled (token_id is then -1)


@dataclass
class SampleRow:
    """What the sampler needs from one sequence that samples in this step."""
    params: SamplingParams
    generator: torch.Generator | None = field(default=None)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
    """One token per row of logits [rows, vocab] (fp32), each with its own params and RNG.

    Logprobs are of the model's distribution (log-softmax of the raw logits), not of the
    temperature/top-k/top-p-processed one. A row whose values fail comes back with `error` set
    rather than raising: one request's sampling must not stop the others in the batch.
    """
    greedy_ids = kernels.argmax(logits).tolist()
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(_sample_row(i, row, logits, greedy_ids, logprobs))
        except Exception as exc:  # noqa: BLE001 - the engine fails this row's request alone
            out.append(SampledToken(-1, error=f"{type(exc).__name__}: {exc}"))
    return out


def _sample_row(i: int, row: SampleRow, logits: torch.Tensor, greedy_ids: list[int],
                logprobs: torch.Tensor | None) -> SampledToken:
    p = row.params
    token = greedy_ids[i] if p.greedy else _sample_one(logits[i], p, row.generator)
    sampled = SampledToken(token)
    if p.logprobs is not None:
        sampled.logprob = logprobs[i, token].item()
        if p.logprobs:
            top = logprobs[i].topk(p.logprobs)
            sampled.top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist()))
    return sampled


def _sample_one(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """Temperature, then top-k, then top-p (the order transformers applies them), then a draw.

    In float64 and shifted so the largest logit is 0: any positive temperature, however small,
    then scales to finite values or -inf, never inf or NaN (fp32 holds no 1e-300)."""
    scaled = (logits.double() - logits.max()) / p.temperature
    if p.top_k and p.top_k < scaled.numel():
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1).to(logits.dtype)
    return torch.multinomial(probs, 1, generator=generator).item()
