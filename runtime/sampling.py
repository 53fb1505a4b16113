"""Per-sequence sampling: parameters, their validation, and the sampler over a logits batch."""

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

import kernels
from runtime.numbers import python_number
from runtime.structured import canonical_json_schema, check_regex, choice_regex, grammar_of, keep_allowed


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): at 1e-6 a draw would only
# split ties. Above it we sample at the temperature given; vLLM 0.32 raises one under 0.01 to
# 0.01 (README).
SAMPLING_EPS = 1e-5
# The most logprobs and prompt_logprobs a request may ask for, unless the engine says otherwise
# (vLLM's default max_logprobs).
DEFAULT_MAX_LOGPROBS = 20
_FP32_MAX = torch.finfo(torch.float32).max
_FP32_SMALLEST = 2.0 ** -149  # its smallest positive (subnormal) value


def over_max_logprobs(wanted: int | None, max_logprobs: int) -> bool:
    """Whether `wanted` logprobs (or prompt_logprobs) are more than `max_logprobs` allows (-1:
    any number)."""
    return wanted is not None and max_logprobs != -1 and wanted > max_logprobs


def _tuple_of(name: str, value) -> tuple:
    """A list-valued field as a tuple: None is empty, a lone string a list of one (stop strings
    and bad words); anything else must be an iterable that is no text or mapping."""
    if value is None:
        return ()
    if isinstance(value, str) and name in ("stop", "bad_words"):
        return (value,)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list, got {value!r}")
    try:
        return tuple(value)
    except TypeError:  # iterable by its type, not as it is: a 0-d numpy array
        raise ValueError(f"{name} must be a list, got {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # below SAMPLING_EPS = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM has it) = off
    min_p: float = 0.0  # drop tokens less likely than this times the likeliest one; 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # the text leaves special tokens out (stop strings see it so)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None = off; k >= 0 = the chosen token's plus the top k
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (scoring)
    # Keep only the prompt's last this many tokens; -1: as many as leave room for one generated
    # token (the context's length less one, vLLM's OpenAI server's rule).
    truncate_prompt_tokens: int | None = None
    min_tokens: int = 0  # before this many, EOS, stop_token_ids and stop strings do not end it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict works
    # vLLM's: the only tokens that may be chosen (empty: any), and words never to be completed
    # (each word's last token is banned wherever the output ends with the rest of it; a word
    # counts as it tokenizes alone and after a space).
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    # Penalties on tokens already there, as vLLM applies them (neutral values = off):
    repetition_penalty: float = 1.0  # a seen token's logit (prompt or output): / if > 0, * if < 0
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    presence_penalty: float = 0.0  # minus this once the token is in the output
    # Structured output (runtime/structured.py), one at most: the completion is JSON matching
    # this schema (a mapping, or JSON text; held as canonical JSON text), text this regex
    # matches, or one of these choices; it ends where the grammar does.
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] = ()

    def __post_init__(self):
        # numpy's numbers (a column's values) as Python's, which the checks below take.
        for f in fields(self):
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, bool(value) if isinstance(value, np.bool_) and f.type is bool
                               else python_number(value))
        # Normalise list inputs so params stay hashable and picklable; None is none (vLLM's).
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            items = _tuple_of(name, getattr(self, name))
            object.__setattr__(self, name, tuple(map(python_number, items)))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", canonical_json_schema(self.json_schema))
        if self.regex is not None:
            check_regex(self.regex)
        if (not isinstance(self.choice, (list, tuple))
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"choice must be a list of non-empty strings, got {self.choice!r}")
        object.__setattr__(self, "choice", tuple(self.choice))
        if sum(map(bool, (self.json_schema, self.regex, self.choice))) > 1:
            raise ValueError("json_schema, regex and choice must be given one at most")
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if type(self.top_k) is int and self.top_k == -1:  # vLLM's other "off"
            object.__setattr__(self, "top_k", 0)
        _check_int("top_k", self.top_k, minimum=0)
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:  # int64's range (OpenAI's and vLLM's) and uint64's
            _check_int("seed", self.seed, minimum=-(1 << 63))
            if self.seed >= 1 << 64:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:  # ids past the vocabulary never come: ignored
            _check_int("stop_token_ids", token_id, minimum=0)
            if token_id >= 1 << 63:  # nor held as a token id (int64) is
                raise ValueError(f"stop_token_ids must be < 2**63, got {token_id}")
        for token_id in self.allowed_token_ids:
            _check_int("allowed_token_ids", token_id, minimum=0)
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("n", self.n, minimum=1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for as many as the context "
                                 "holds, got 0")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:  # OpenAI's range
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether its tokens are chosen from adjusted logits (min_tokens, bias, penalties,
        allowed tokens, bad words, structured output)."""
        return bool(self.min_tokens or self.logit_bias or self.repetition_penalty != 1
                    or self.frequency_penalty or self.presence_penalty or self.structured
                    or self.allowed_token_ids or self.bad_words)

    @property
    def structured(self) -> bool:
        """Whether it asks for structured output (json_schema, regex or choice)."""
        return self.json_schema is not None or self.regex is not None or bool(self.choice)

    @property
    def structured_field(self) -> str | None:
        """The field its structured output came from (an error names it), or None."""
        return ("json_schema" if self.json_schema is not None else "regex" if self.regex is not None
                else "choice" if self.choice else None)

    @property
    def grammar(self) -> str | None:
        """The llguidance grammar its structured output asks for, or None."""
        if self.json_schema is not None:
            return grammar_of(json_schema=self.json_schema)
        if self.regex is not None or self.choice:
            return grammar_of(regex=self.regex if self.regex is not None else choice_regex(self.choice))
        return None

    @property
    def argmax_only(self) -> bool:
        """Whether a token needs nothing but the argmax of the raw logits (which a model may
        screen for instead of computing them all)."""
        return self.greedy and self.logprobs is None and not self.adjusts_logits


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs: hashable, and one form for equal biases."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        token, value = map(python_number, item)
        _check_int("logit_bias", token, minimum=0)
        _check_number("logit_bias", value)
        if not -100 <= value <= 100:  # OpenAI's range
            raise ValueError(f"logit_bias must be in [-100, 100], got {value} for token {token}")
        pairs.append((token, value))
    if len({token for token, _ in pairs}) < len(pairs):
        raise ValueError(f"logit_bias must give each token once, got {bias!r}")
    return tuple(sorted(pairs))


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range: it would overflow the logits' math
        return False


def _short(value) -> str:
    """repr(value), cut short: a number may have hundreds of digits."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    error: str | None = None  # this row could not be sampled (token_id is then -1)
    # The error is the request's own doing: its values leave no token to choose, so running it
    # again cannot help (else the logits were broken: NaN from a failing model, say).
    invalid: bool = False


@dataclass
class SampleRow:
    """What the sampler needs from one sequence that samples in this step."""
    params: SamplingParams
    generator: np.random.Generator | None = field(default=None)  # None: a greedy row
    # Its tokens so far, for penalties: the prompt, then what it generated.
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    # Tokens that may not be chosen now (they would end it before min_tokens); adjust_logits
    # skips ids past the vocabulary.
    banned: torch.Tensor | None = None
    allowed: torch.Tensor | None = None  # the only tokens its output's grammar allows now (a bitmask)
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # its logit_bias_tensors, made once
    permitted: torch.Tensor | None = None  # its allowed_token_ids as a tensor, made once
    bad_words: Sequence[tuple[int, ...]] = ()  # its bad_words' token ids


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
    """One token per row of logits [rows, vocab] (fp32), each with its own params and RNG.

    Logprobs are of the model's distribution (log-softmax of the raw logits; under structured
    output, of those its grammar allows), not of the penalised and temperature/top-k/top-p-
    processed one, as vLLM reports them by default. A row whose values fail comes back with
    `error` set rather than raising: one request's sampling must not stop the others in the
    batch.
    """
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    for i, row in enumerate(rows if want_logprobs else ()):
        if row.allowed is not None and row.params.logprobs is not None:
            # vLLM masks a structured output's logits before it takes logprobs: they are over
            # the tokens the grammar allows
            masked = logits[i].clone()
            keep_allowed(masked, row.allowed)
            logprobs[i] = torch.log_softmax(masked, dim=-1)
    chosen_from = logits  # what tokens are chosen from: the logits, adjusted where asked
    failed: dict[int, SampledToken] = {}
    if any(r.params.adjusts_logits for r in rows):
        chosen_from = logits.clone()
        for i, row in enumerate(rows):
            if row.params.adjusts_logits:
                try:
                    adjust_logits(chosen_from[i], row)
                except Exception as exc:  # noqa: BLE001 - the engine fails this row's request alone
                    failed[i] = SampledToken(-1, error=f"{type(exc).__name__}: {exc}")
                    continue
                if chosen_from[i].max() == float("-inf"):  # (greedy's argmax would take token 0)
                    # The request's own doing where the model gave some token a chance.
                    model_top = logits[i].max().item()
                    failed[i] = SampledToken(-1, invalid=True, error=(
                        "no token is left to choose: allowed_token_ids, bad_words, the output's "
                        "grammar, min_tokens, logit_bias and the penalties exclude them all")
                    ) if model_top > float("-inf") else SampledToken(-1, error=logits_failure(model_top))
    greedy_ids = kernels.argmax(chosen_from).tolist()
    out = []
    for i, row in enumerate(rows):
        if i in failed:
            out.append(failed[i])
            continue
        try:
            out.append(_sample_row(i, row, chosen_from, greedy_ids, logprobs))
        except LogitsFailure as exc:
            out.append(SampledToken(-1, error=str(exc)))
        except Exception as exc:  # noqa: BLE001 - the engine fails this row's request alone
            out.append(SampledToken(-1, error=f"{type(exc).__name__}: {exc}"))
    return out


class LogitsFailure(ValueError):
    """A row's logits give no token (logits_failure says why)."""


def logits_failure(chosen: float) -> str | None:
    """Why a row of logits gives no token, judged by the logit a greedy row takes (argmax takes
    a NaN first, and finds only -inf where every logit is) or by a row's largest: NaN or -inf
    come from a failing model, whose every token would be noise. None where the row is fine
    (+inf too: a penalty past fp32's range or an fp16 overflow, which argmax takes first)."""
    if math.isnan(chosen):
        return "the model's logits are NaN (its weights hold NaN, or its activations overflowed)"
    if chosen == -math.inf:
        return "the model gave every token a logit of -inf"
    return None


def logit_bias_tensors(logit_bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """SamplingParams.logit_bias as (token ids, biases) tensors: a sequence makes them once, as a
    bias over the whole vocabulary takes tens of milliseconds to turn into tensors."""
    tokens, biases = zip(*logit_bias)
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(biases, dtype=torch.float32)


def adjust_logits(logits: torch.Tensor, row: SampleRow) -> None:
    """Adjust one row of logits [vocab] in place, in vLLM's order: tokens its structured
    output's grammar does not allow, tokens outside allowed_token_ids, the last token of a bad
    word whose rest the output ends with, and banned tokens (min_tokens) to -inf, the logit
    bias, the repetition penalty over prompt and output (transformers'
    RepetitionPenaltyLogitsProcessor, vLLM's), OpenAI's frequency and presence penalties over
    the output."""
    p, output_ids = row.params, row.output_ids

    def ids(tokens):
        return torch.tensor(list(tokens), dtype=torch.long, device=logits.device)

    if row.allowed is not None:
        keep_allowed(logits, row.allowed)
    # A grammar that allows only tokens min_tokens bans (those that end it) may end it before
    # min_tokens, as vLLM lets it; what else bans them all leaves nothing (an error row).
    grammar_ends = row.allowed is not None and row.banned is not None and _allows_only(logits, row.banned)
    if row.permitted is not None:
        permitted = row.permitted.to(logits.device)
        kept = logits[permitted]
        logits.fill_(float("-inf"))[permitted] = kept
    for word in row.bad_words:
        start = len(output_ids) - (len(word) - 1)
        if start >= 0 and tuple(output_ids[start:]) == word[:-1]:
            logits[word[-1]] = float("-inf")
    if row.banned is not None:
        banned = row.banned.to(logits.device)
        banned = banned[banned < logits.shape[-1]]
        before = logits[banned]
        logits[banned] = float("-inf")
        if grammar_ends:
            logits[banned] = before
    if p.logit_bias:
        tokens, biases = row.bias if row.bias is not None else logit_bias_tensors(p.logit_bias)
        logits[tokens.to(logits.device)] += biases.to(logits.device, logits.dtype)
    if p.repetition_penalty != 1:
        # Held inside fp32's positive range: one that rounds to 0 or inf there would make a
        # banned token's -inf * 0, a logit of 0 / 0 or an overflowed inf / inf NaN.
        penalty = min(max(p.repetition_penalty, _FP32_SMALLEST), _FP32_MAX)
        seen = ids(sorted({*row.prompt_ids, *output_ids}))
        values = logits[seen]
        logits[seen] = torch.where(values < 0, values * penalty, values / penalty)
    if output_ids and (p.frequency_penalty or p.presence_penalty):
        tokens, counts = ids(output_ids).unique(return_counts=True)
        logits[tokens] -= counts.to(logits.dtype) * p.frequency_penalty + p.presence_penalty


def _allows_only(logits: torch.Tensor, tokens: torch.Tensor) -> bool:
    """Whether every token logits [vocab] leaves choosable is one of `tokens`."""
    choosable = logits > float("-inf")
    choosable[tokens[tokens < logits.shape[-1]].to(logits.device)] = False
    return not bool(choosable.any())


def _sample_row(i: int, row: SampleRow, logits: torch.Tensor, greedy_ids: list[int],
                logprobs: torch.Tensor | None) -> SampledToken:
    p = row.params
    if p.greedy:
        token = greedy_ids[i]
        if (failure := logits_failure(logits[i, token].item())) is not None:
            raise LogitsFailure(failure)
    else:
        token = _sample_one(logits[i], p, row.generator)
    sampled = SampledToken(token)
    if p.logprobs is not None:
        sampled.logprob = logprobs[i, token].item()
        if p.logprobs:
            top = logprobs[i].topk(p.logprobs)
            sampled.top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist()))
    return sampled


def _sample_one(logits: torch.Tensor, p: SamplingParams, generator: np.random.Generator) -> int:
    weights, ids = filtered_weights(logits, p)
    return draw(weights, ids, generator)


def filtered_weights(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution one row [vocab] draws from, unnormalised: temperature, then min-p, top-k
    and top-p (the order vLLM applies them: min-p measures the tokens before top-k and top-p cut
    them). Returns (weights, ids): where top-k or top-p cut, the weights of the tokens they keep,
    the largest first, and those tokens' ids; else weights over the whole vocabulary, ids None.

    Shifted so the largest logit is 0, the largest weight is 1: no temperature that samples
    (>= SAMPLING_EPS) overflows fp32, and a weight too small for it is one no draw would take.
    A temperature past fp32's range divides as its largest value (-inf / inf would be NaN). A
    penalty past fp32's range (repetition_penalty 1e-44) may push logits to +inf: those tokens
    alone are drawn, alike, as greedy would take the first (inf - inf would be NaN)."""
    top = logits.max()  # NaN where any logit is
    if (failure := logits_failure(top.item())) is not None:
        raise LogitsFailure(failure)
    if top == math.inf:
        scaled = torch.zeros_like(logits, dtype=torch.float32).masked_fill_(logits != top, float("-inf"))
    else:
        scaled = logits.float() - top
    scaled.div_(min(p.temperature, _FP32_MAX))
    if p.min_p > 0:  # a token's probability over the top one's is exp(its scaled logit)
        scaled.masked_fill_(scaled < math.log(p.min_p), float("-inf"))
    if p.top_k and p.top_k < scaled.numel():
        values, ids = _largest(scaled, p.top_k)
        weights = values.exp_()
    else:
        weights, ids = _exp_(scaled), None
    if p.top_p < 1.0:
        total = weights.sum()
        if ids is None:
            weights, ids = _largest_holding(weights, total, p.top_p * total)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        kept = max(1, int((weights.cumsum(-1) - weights < p.top_p * total).sum()))
        weights, ids = weights[:kept], ids[:kept]
    return weights, ids


# Just above ln 2^-126: below it, exp is under fp32's smallest normal number, a weight no
# draw would take.
_EXP_FLOOR = -87.0


def _exp_(scaled: torch.Tensor) -> torch.Tensor:
    """exp in place, 0 for values below _EXP_FLOOR (-inf too). torch's vectorised exp leaves
    its fast path for a vector holding any such value: over 49,152 tokens, a row masked by a
    grammar took twice as long, one at temperature 0.1 ninety times (0.9 ms)."""
    if not scaled.min() < _EXP_FLOOR:  # the common row (NaN too): exp alone
        return scaled.exp_()
    low = scaled < _EXP_FLOOR
    return scaled.clamp_(min=_EXP_FLOOR).exp_().masked_fill_(low, 0.0)


def _largest(scaled: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The count largest values, the largest first, and their ids; with every finite token tied
    with the last of them (a cut at a value keeps its ties, as transformers' and vLLM's do)."""
    values, ids = scaled.topk(count)
    ties = int((scaled >= values[-1]).sum()) if values[-1] > float("-inf") else count
    return scaled.topk(ties) if ties > count else (values, ids)


def _largest_holding(weights: torch.Tensor, total: torch.Tensor, mass: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights, the largest first, and their ids, among which are all those holding the first
    `mass` of their `total`: the tokens of probability at least the largest floor at which they
    hold it. Any other token is smaller than all of them, so the mass before it is past `mass`.
    A floor of 1e-2 leaves at most 100 tokens to sort, 1e-3 a thousand: sorting them instead of
    the vocabulary saves milliseconds a row."""
    for floor in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        above = weights >= floor * total
        held = torch.where(above, weights, 0).sum()
        if held >= mass and held > 0:  # (a top_p below fp32's smallest value makes mass 0)
            ids = above.nonzero()[:, 0]
            values, order = weights[ids].sort(descending=True)
            # The cut sums them in this order, which may round below `held`.
            if values.cumsum(-1)[-1] >= mass:
                return values, ids[order]
    return weights.sort(descending=True)


def draw(weights: torch.Tensor, ids: torch.Tensor | None, generator: np.random.Generator) -> int:
    """One token drawn with probability proportional to its weight (weights >= 0, not all 0).

    By inverting the cumulative weights at one uniform draw: torch.multinomial draws a random
    number per token (milliseconds a row). Both in float64: an fp32 uniform takes 2^24 values,
    too coarse for a token of probability 1e-6 among 49,152. The uniform comes from the
    sequence's generator, numpy's PCG64 on the host: it keeps the draw (and a migrated
    sequence's rng_state) alike on every device, and takes a seed's 64 bits whole, where a torch
    CPU generator keeps 32 of them (seeds 1 and 2**32 + 1 would draw alike)."""
    cumulative = weights.double().cumsum(-1)
    total = cumulative[-1:]
    if not bool(torch.isfinite(total) & (total > 0)):  # NaN logits, or none a token may take
        raise ValueError(f"no token can be drawn: the weights sum to {total.item()}")
    point = total * generator.random()
    # The first token whose cumulative weight passes the point: never one of weight 0.
    index = int(torch.searchsorted(cumulative, point, right=True))
    if index == cumulative.numel():  # the point rounded up to the total: the last token of weight > 0
        index = int(torch.searchsorted(cumulative, total))
    return index if ids is None else int(ids[index])
