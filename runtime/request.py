"""What callers hand the engine and what they get back."""

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.sampling import SamplingParams


# apply_chat_template's own parameters: what it does with the text, not what the template reads
# (tools and documents it checks and renders itself: a record's tools are taken only empty).
_NOT_TEMPLATE_VARIABLES = frozenset({
    "conversation", "messages", "chat_template", "tokenize", "add_generation_prompt", "tools", "documents",
    "continue_final_message", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


@dataclass(frozen=True)
class ChatOptions:
    """How `messages` become a prompt, as vLLM's chat requests say it: `template_kwargs` are
    variables the chat template reads (e.g. Qwen 3's {"enable_thinking": false});
    `add_generation_prompt` opens the assistant's turn after the messages;
    `continue_final_message` leaves the last message (the assistant's start of an answer) open,
    for the completion to continue it (it needs add_generation_prompt false)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self):
        if not isinstance(self.template_kwargs, Mapping) or not all(isinstance(k, str) for k in self.template_kwargs):
            raise ValueError(f"chat_template_kwargs must map names to values, got {self.template_kwargs!r}")
        reserved = sorted(_NOT_TEMPLATE_VARIABLES & self.template_kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs must hold template variables, not {reserved}"
                             " (add_generation_prompt and continue_final_message are fields of their own)")
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs))
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message must come with add_generation_prompt false: "
                             "a turn of the assistant's cannot be both continued and opened")


def content_texts(content) -> list[str] | None:
    """A message content's texts: a string, or OpenAI's non-empty list of text parts
    ({"type": "text", "text": ...}); None for anything else."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list) or not content or not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return None
    return [p["text"] for p in content]


def content_text(content: str | list[dict]) -> str:
    """A message's content as one text: a string as it is, OpenAI's text parts joined by
    newlines (vLLM's rule, for a template that takes strings only)."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


@dataclass
class Request:
    """One generation request. Give `prompt` (text), `messages` (chat, rendered with the
    tokenizer's chat template as `chat` says; a message's content is a string or OpenAI's list
    of text parts) or `prompt_token_ids`."""
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    chat: ChatOptions = field(default_factory=ChatOptions)


def check_request_types(request) -> None:
    """TypeError for what cannot run as a request: no Request, an id that is no string (1 and
    "1" would name the same sequences), params that are no SamplingParams."""
    if not isinstance(request, Request):
        raise TypeError(f"requests are runtime.Request objects, got {type(request).__name__}")
    if not isinstance(request.id, str):
        raise TypeError(f"request ids are strings, got {request.id!r}")
    if not isinstance(request.params, SamplingParams):
        raise TypeError(f"request {request.id!r}: params must be SamplingParams")


def request_list(requests) -> list[Request]:
    """generate()'s argument as a list: any iterable of Requests, a generator too. None, a
    lone Request and a string are refused rather than read as no requests or as characters."""
    refusal = TypeError(f"requests are an iterable of runtime.Request objects, got {type(requests).__name__}")
    if isinstance(requests, (Request, str, bytes, Mapping)):
        raise refusal
    try:
        iterator = iter(requests)
    except TypeError:
        raise refusal from None
    requests = list(iterator)
    for request in requests:
        check_request_types(request)
    return requests


@dataclass
class SampleOutput:
    """One of a request's n samples."""
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length" or "error"
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass
class Timings:
    """Seconds on the engine's clock (time.perf_counter)."""
    submitted: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    _CARRIED = ("first_scheduled", "first_token")  # what a request in flight has passed

    def carried(self) -> dict[str, float | None]:
        """What a migrated request takes along: its age and its times since submission, which
        another process's clock (another machine's too) rebuilds them from (`arrived`)."""
        since = {name: None if getattr(self, name) is None else getattr(self, name) - self.submitted
                 for name in self._CARRIED}
        return {"age": time.perf_counter() - self.submitted, **since}

    @classmethod
    def arrived(cls, carried: dict[str, float | None]) -> "Timings":
        """The timings of a request that arrived with `carried`, on this process's clock; the
        time it spent in transit is not counted."""
        submitted = time.perf_counter() - carried["age"]
        return cls(submitted, **{name: None if carried[name] is None else submitted + carried[name]
                                 for name in cls._CARRIED})


@dataclass
class Completion:
    id: str
    outputs: list[SampleOutput]
    prompt_tokens: int
    timings: Timings
    error: str | None = None
    # The error is the request's own doing (a prompt too long, values the engine cannot take):
    # running it again cannot help. Else the engine failed it.
    invalid: bool = False
    # With prompt_logprobs: the prompt's token ids, each prompt token's logprob and rank (vLLM's:
    # how many tokens are at least as likely; None for the first, which has no context), and
    # with prompt_logprobs=k > 0 the top k at each position (None first too).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def failed(cls, request_id: str, error: str, timings: Timings | None = None,
               prompt_tokens: int = 0, *, invalid: bool = False) -> "Completion":
        """A request that ends in an error: one empty output whose finish_reason is "error"."""
        return cls(request_id, [SampleOutput(0, [], "", "error")], prompt_tokens,
                   timings or Timings(submitted=time.perf_counter()), error=error, invalid=invalid)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    # Shorthands for the common n = 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason if self.outputs else "error"

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs if self.outputs else None


class CompletionWaiter:
    """Collects the completions of one blocking generate() call."""

    def __init__(self, ids: list[str]):
        self.pending = set(ids)
        self.results: dict[str, Completion] = {}
        self.done = threading.Event()

    def add(self, completion: Completion) -> None:
        self.results[completion.id] = completion
        self.pending.discard(completion.id)
        if not self.pending:
            self.done.set()
