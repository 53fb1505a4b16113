"""A sequence as an event-driven coroutine.

The runtime owns every sequence and advances it only by sending it an event; the sequence
applies the event to its own state and yields its status back. Illegal transitions (a token
for a suspended sequence, say) raise at once instead of corrupting state.

    WAITING -> PREFILLING -> DECODING <-> SUSPENDED      (PREFILLING <-> SUSPENDED too)
    PREFILLING/DECODING/SUSPENDED -> WAITING             (evicted: KV dropped, recomputed)
    any live state -> FINISHED | MIGRATED                (MIGRATED: continues in another engine)
"""

import functools
from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable

import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from runtime.sampling import SampledToken, SamplingParams, logit_bias_tensors
from runtime.speculate import NgramIndex
from runtime.structured import Grammars, consume
from runtime.tokenizer import TextStream


class Status(Enum):
    WAITING = auto()
    PREFILLING = auto()
    DECODING = auto()
    SUSPENDED = auto()
    FINISHED = auto()
    MIGRATED = auto()


class Event(Enum):
    ADMITTED = auto()
    PREFILLED = auto()  # payload: tokens whose KV a non-final prefill chunk computed
    TOKEN = auto()  # payload: SampledToken; every pending token's KV is now computed
    PAGE_BOUNDARY = auto()  # payload: the new block count
    SUSPENDED = auto()
    RESUMED = auto()
    EVICTED = auto()
    MIGRATED = auto()
    FINISHED = auto()  # ended from outside (its request failed or was withdrawn); payload: finish_reason


_LIVE = {Status.PREFILLING, Status.DECODING}
_ALLOWED = {
    Event.ADMITTED: {Status.WAITING},
    Event.PREFILLED: {Status.PREFILLING},
    Event.TOKEN: _LIVE,
    Event.PAGE_BOUNDARY: _LIVE,
    Event.SUSPENDED: _LIVE,
    Event.RESUMED: {Status.SUSPENDED},
    Event.EVICTED: _LIVE | {Status.SUSPENDED},
    Event.MIGRATED: _LIVE | {Status.WAITING, Status.SUSPENDED},
    Event.FINISHED: _LIVE | {Status.WAITING, Status.SUSPENDED},
}


@dataclass(frozen=True)
class StopRule:
    """Engine-wide facts a sequence needs to decide when it is done."""
    eos_token_ids: frozenset[int]
    max_model_len: int
    detokenize: Callable[[list[int], bool], str] | None  # (token ids, skip_special_tokens)
    grammars: Grammars | None = None  # for sequences with structured output (needs a tokenizer)
    # The tokenizers library's tokenizer, for decoding text as tokens arrive (TextStream);
    # None: `detokenize` decodes the whole completion each token.
    decoder: Tokenizer | None = None
    # The tokenizer's EOS: a completion it ends has no stop_reason. The model's other EOS ids
    # (generation_config's) are stop tokens to vLLM, which reports them as the stop_reason.
    tokenizer_eos: int | None = None


# The fields of export_state's state that from_state reads, and their types.
_STATE_TYPES = {"sample_index": int, "token_ids": list, "num_prompt_tokens": int, "params": SamplingParams,
                "rng_state": dict, "logprobs": list, "top_logprobs": list, "prompt_logprobs": list,
                "prompt_ranks": list, "prompt_top_logprobs": list, "counters": dict, "forked": bool}


class Sequence:
    def __init__(self, seq_id: str, request_id: str, sample_index: int, token_ids: list[int],
                 num_prompt_tokens: int, params: SamplingParams, generator: np.random.Generator,
                 stop_rule: StopRule, grammar: llguidance.LLMatcher | None = None):
        """grammar: its structured output's matcher, where one is at hand (a forked sample's
        copy of sample 0's); else compiled here."""
        self.seq_id, self.request_id, self.sample_index = seq_id, request_id, sample_index
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.generator = generator
        self.stop_rule = stop_rule
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # of the full blocks, in order
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        # prompt_logprobs: of prompt tokens 1, 2, ... (token 0 has none), filled as prefill goes.
        self.prompt_logprobs: list[float] = []
        self.prompt_ranks: list[int] = []
        self.prompt_top_logprobs: list[dict[int, float]] = []
        self.text: str | None = None  # set when a stop string cut it, else at finish
        # The completion's text as stop strings see it, built as tokens arrive, and how many
        # generated tokens it holds (made at the first check: a migrated sequence rebuilds it).
        self._stop_text = None
        self._stop_text_tokens = 0
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string or stop token id that ended it (None for EOS).
        self.stop_reason: int | str | None = None
        self.counters = dict.fromkeys(("preemptions", "suspends", "evictions", "migrations"), 0)
        self.queued_at = 0  # the scheduler's admissions when it last joined the waiting queue (aging)
        self.forked = sample_index > 0  # only sample 0 of an n > 1 request forks the others
        # Its structured output's matcher, fed every token generated (before a migration too).
        if grammar is None and params.grammar:
            grammar = stop_rule.grammars.matcher(params.grammar, self.generated_ids)
        self.grammar = grammar
        self._status_before_suspend = Status.PREFILLING
        self._coroutine = self._lifecycle()
        next(self._coroutine)

    @functools.cached_property
    def _stops_by_last_char(self) -> dict[str, list[tuple[int, str]]]:
        """Its stop strings (with their place in the list) by their last character."""
        by_last: dict[str, list[tuple[int, str]]] = {}
        for order, stop in enumerate(self.params.stop):
            by_last.setdefault(stop[-1], []).append((order, stop))
        return by_last

    @functools.cached_property
    def logit_bias(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Its params' logit bias as tensors, made at its first sampled step, not every step."""
        return logit_bias_tensors(self.params.logit_bias) if self.params.logit_bias else None

    @functools.cached_property
    def permitted(self) -> torch.Tensor | None:
        """Its params' allowed_token_ids as a tensor, made once likewise."""
        return torch.tensor(self.params.allowed_token_ids, dtype=torch.long) if self.params.allowed_token_ids else None

    @functools.cached_property
    def ngrams(self) -> NgramIndex:
        """Where its n-grams ended, for drafts; built at its first draft, as its tokens grow."""
        return NgramIndex()

    @functools.cached_property
    def _stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.params.stop_token_ids)  # a long tuple would be scanned every token

    @functools.cached_property
    def ending_ids(self) -> torch.Tensor:
        """The tokens that would end it (its stop_token_ids and EOS), which min_tokens bans at
        each step before it: made once, as a long list takes milliseconds to turn into one."""
        return torch.tensor(sorted({*self.params.stop_token_ids, *self.stop_rule.eos_token_ids}), dtype=torch.long)

    # ---- the coroutine -------------------------------------------------------------------
    def send(self, event: Event, payload=None) -> Status:
        if self.status not in _ALLOWED[event]:
            raise RuntimeError(f"sequence {self.seq_id}: event {event.name} in status {self.status.name}")
        status = self._coroutine.send((event, payload))
        if status in (Status.FINISHED, Status.MIGRATED):
            # Its frame holds self: without it, a finished sequence is freed as soon as it is
            # dropped, not at the next full garbage collection (its grammar matcher's native
            # memory, which the collector does not see, waited with it: +450 MB at peak).
            self._coroutine.close()
            self._coroutine = None
        return status

    def end(self, reason: str) -> None:
        """End it from outside (its request failed or was withdrawn) unless it has ended. Its
        coroutine is closed either way: one that raised (the error that failed the request)
        takes no more events."""
        if self.status in (Status.FINISHED, Status.MIGRATED):
            return
        if self._coroutine.gi_frame is not None:
            self.send(Event.FINISHED, reason)
        else:
            self.finish_reason, self.status, self._coroutine = reason, Status.FINISHED, None

    def _lifecycle(self):
        event, payload = yield self.status
        while True:
            if event is Event.ADMITTED:
                self.status = Status.PREFILLING
            elif event is Event.PREFILLED:
                self.num_computed += payload
            elif event is Event.TOKEN:
                self.status = Status.DECODING
                self._append(payload)
            elif event is Event.SUSPENDED:
                self._status_before_suspend = self.status
                self.status = Status.SUSPENDED
                self.counters["suspends"] += 1
            elif event is Event.RESUMED:
                self.status = self._status_before_suspend
            elif event is Event.EVICTED:
                self.status = Status.WAITING
                self.num_computed = 0
                self.counters["evictions"] += 1
            elif event is Event.MIGRATED:
                self.status = Status.MIGRATED
                self.counters["migrations"] += 1
            elif event is Event.FINISHED:
                self.finish_reason = payload
                self.status = Status.FINISHED
            # PAGE_BOUNDARY changes nothing here: the scheduler decides at page boundaries.
            if self.status in (Status.FINISHED, Status.MIGRATED):
                yield self.status  # terminal: send() closes it; any further event is rejected above
                return
            event, payload = yield self.status

    def _append(self, sampled: SampledToken) -> None:
        self.num_computed = len(self.token_ids)
        if self.grammar is not None:
            consume(self.grammar, sampled.token_id)
        self.token_ids.append(sampled.token_id)
        if self.params.logprobs is not None:
            self.logprobs.append(sampled.logprob)
            if self.params.logprobs:
                self.top_logprobs.append(sampled.top_logprobs)
        reason = self._stop_reason(sampled.token_id)
        if reason is not None:
            self.finish_reason = reason
            self.status = Status.FINISHED

    def _stop_reason(self, token: int) -> str | None:
        p, rule = self.params, self.stop_rule
        eos = not p.ignore_eos and token in rule.eos_token_ids
        grammar_done = self.grammar is not None and self.grammar.is_stopped()
        if (eos or token in self._stop_token_ids) and (self.num_generated >= p.min_tokens or grammar_done):
            # (the sampler kept them out before min_tokens, unless the grammar allowed nothing
            # else: then too they end the sequence as themselves). vLLM's text leaves the ending
            # token's out, unless asked to keep the stop: then a stop string its text completes
            # wins, as vLLM checks stop strings on the text after its stop tokens.
            if p.include_stop_str_in_output and p.stop and self.num_generated > p.min_tokens \
                    and self._hit_stop_string():
                return "stop"
            self.stop_reason = None if eos and token == rule.tokenizer_eos else token
            if rule.detokenize is not None and not p.include_stop_str_in_output:
                self.text = self.completion_text(self.generated_ids[:-1])
            return "stop"
        if grammar_done:
            if p.stop and self.num_generated > p.min_tokens:
                self._hit_stop_string()  # one completed by the same token still cuts the text
            return "stop"
        if p.stop and self.num_generated > p.min_tokens and self._hit_stop_string():
            return "stop"
        if self.num_generated >= p.max_tokens or len(self.token_ids) >= rule.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self) -> bool:
        """Whether a stop string ends in the text of the tokens generated since the last call;
        if one does, it cuts the text."""
        p = self.params
        if self._stop_text is None:
            self._stop_text = self._text_stream()
        stream = self._stop_text
        new_from = len(stream.text)
        for token in self.generated_ids[self._stop_text_tokens:]:
            stream.add(token)
            self._stop_text_tokens += 1
            if self._stop_text_tokens <= p.min_tokens:
                # vLLM's rule: under min_tokens a stop string counts only where it ends in the
                # text of a token after the min_tokens-th.
                new_from = len(stream.text)
        text = stream.text
        # A stop string that ends in the new text ends in one of its characters: only those
        # strings are searched (a record may give thousands, searched every token).
        candidates = [pair for char in set(text[new_from:]) for pair in self._stops_by_last_char.get(char, ())]
        found = [(at + len(stop), order, at) for order, stop in candidates
                 if (at := text.find(stop, max(0, new_from - len(stop) + 1))) >= 0]
        if not found:
            return False
        # The first to end, the first listed of those: the text then holds none of the stop
        # strings (vLLM takes the first listed that the new text holds, which may end later).
        end, order, at = min(found)
        self.stop_reason = p.stop[order]
        self.text = text[:end] if p.include_stop_str_in_output else text[:at]
        return True

    def completion_text(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (the first of its generated tokens, or all) as vLLM's
        incremental decoder leaves it after the prompt: a character still incomplete at the end
        is held back. The text stop strings were searched in where that has read just these
        tokens; else decoded now (its stop rule has a detokenizer)."""
        if self._stop_text is not None and self._stop_text_tokens == len(token_ids):
            return self._stop_text.text
        stream = self._text_stream()
        stream.extend(token_ids)
        return stream.text

    def _text_stream(self) -> TextStream:
        rule = self.stop_rule
        return TextStream(rule.detokenize, self.params.skip_special_tokens, rule.decoder, self.prompt_ids)

    # ---- views ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are still to be collected: its prefill must then compute every
        prompt token (no cached prefix) and hand back their hidden states. Sample 0 alone
        collects them; the samples forked from it report none."""
        return self.params.prompt_logprobs is not None and self.sample_index == 0 and \
            len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    # ---- migration -----------------------------------------------------------------------
    def export_state(self, kv: torch.Tensor | None = None) -> dict:
        """Everything another engine needs to continue this sequence exactly (picklable). With
        `kv` (its computed tokens' KV blocks, on the host) it arrives suspended, nothing to
        recompute; without, it recomputes its tokens' KV in one prefill."""
        state = {
            "seq_id": self.seq_id, "request_id": self.request_id, "sample_index": self.sample_index,
            "token_ids": list(self.token_ids), "num_prompt_tokens": self.num_prompt_tokens,
            "params": self.params, "rng_state": self.generator.bit_generator.state,
            "logprobs": list(self.logprobs), "top_logprobs": list(self.top_logprobs),
            "prompt_logprobs": list(self.prompt_logprobs), "prompt_ranks": list(self.prompt_ranks),
            "prompt_top_logprobs": list(self.prompt_top_logprobs),
            "counters": dict(self.counters), "forked": self.forked,
        }
        if kv is not None:
            resume = self._status_before_suspend if self.status is Status.SUSPENDED else self.status
            state.update(kv=kv, num_computed=self.num_computed, resume_status=resume.name)
        return state

    @staticmethod
    def state_error(state: dict, vocab_size: int) -> str | None:
        """What in a sequence's state is not as export_state makes it (a field missing or of
        another type, a token past the vocabulary), or None: what would fail a later step."""
        for name, kind in _STATE_TYPES.items():
            if not isinstance(state.get(name), kind) or kind is int and isinstance(state[name], bool):
                return f"a sequence's {name} must be of type {kind.__name__}"
        ids = state["token_ids"]
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            return f"a sequence's token_ids must be ints in [0, {vocab_size})"
        if not 1 <= state["num_prompt_tokens"] <= len(ids):
            return "a sequence's num_prompt_tokens must be in [1, its tokens]"
        return None

    @classmethod
    def from_state(cls, state: dict, stop_rule: StopRule) -> "Sequence":
        generator = np.random.Generator(np.random.PCG64())
        generator.bit_generator.state = state["rng_state"]
        seq = cls(state["seq_id"], state["request_id"], state["sample_index"],
                  list(state["token_ids"]), state["num_prompt_tokens"], state["params"],
                  generator, stop_rule)
        seq.logprobs, seq.top_logprobs = list(state["logprobs"]), list(state["top_logprobs"])
        seq.prompt_logprobs, seq.prompt_ranks = list(state["prompt_logprobs"]), list(state["prompt_ranks"])
        seq.prompt_top_logprobs = list(state["prompt_top_logprobs"])
        seq.counters, seq.forked = dict(state["counters"]), state["forked"]
        if "kv" in state:  # arrives as if suspended here: the engine parks the KV in the host tier
            seq.num_computed = state["num_computed"]
            seq._status_before_suspend = Status[state["resume_status"]]
            seq.status = Status.SUSPENDED
        return seq
