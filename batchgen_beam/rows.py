"""Output rows (DESIGN.md §5): a completion or an error as one row of `OUTPUT_SCHEMA`, and that
row as Arrow and as a JSON line.

Pure Python: no Beam, no model math. Every input record yields one row: `completion_row` for a
record the engine answered (an engine error included), `error_row` for one that did not run.
Passthrough values that strict JSON cannot hold (dates, decimals, NaN and infinities, mapping
keys that are not strings or numbers) are written as their str(), bytes in base64; the row's own
non-finite logprobs as `LOGPROB_FLOOR` in JSON (Parquet keeps them).
"""

import base64
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa

from batchgen_beam.records import Parsed, Rejected, json_key, named_as_given
from runtime.request import Completion, Timings, content_text


def completion_row(parsed: Parsed, completion: Completion) -> dict:
    """The output row of a record the engine answered (an engine error included)."""
    if completion.error is not None or completion.finish_reason == "error":
        return _row(parsed.id, parsed.passthrough, chat=parsed.messages is not None,
                    prompt_tokens=completion.prompt_tokens,
                    error=named_as_given(completion.error, parsed.names) if completion.error
                    else "the engine failed without a message",
                    error_type="record" if completion.invalid else "engine", timings=completion.timings)
    outputs = completion.outputs
    if parsed.echo_only:  # the token generated is shown nowhere; usage counts it, as vLLM's does
        outputs = [replace(o, token_ids=[], text="", logprobs=o.logprobs and [], top_logprobs=o.top_logprobs and [])
                   for o in outputs]
    first = outputs[0]
    samples = None
    if parsed.params.n > 1:
        samples = [{"text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason,
                    **_stop_columns(o.stop_reason),
                    "logprobs": _list_or_none(o.logprobs), "top_logprobs": _ranked(o.top_logprobs)}
                   for o in outputs[1:]]
    return _row(parsed.id, parsed.passthrough, chat=parsed.messages is not None,
                echo=echo_text(parsed), text=first.text, token_ids=first.token_ids,
                finish_reason=first.finish_reason, stop_reason=first.stop_reason,
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens, samples=samples,
                logprobs=_list_or_none(first.logprobs), top_logprobs=_ranked(first.top_logprobs),
                prompt_token_ids=completion.prompt_token_ids, prompt_logprobs=completion.prompt_logprobs,
                prompt_ranks=completion.prompt_ranks,
                prompt_top_logprobs=_ranked(completion.prompt_top_logprobs), timings=completion.timings)


def echo_text(parsed: Parsed) -> str | None:
    """What an OpenAI line asking `echo` shows before each choice's text, vLLM's rule: a
    completion's prompt; a chat's last message where the answer continues its turn (the
    template opens no new one, or that message is the assistant's), its text parts joined by
    newlines; else "". None where echo was not asked."""
    if not parsed.echo:
        return None
    if parsed.messages is None:
        return parsed.prompt
    last = parsed.messages[-1]
    if parsed.chat.add_generation_prompt and last["role"] != "assistant":
        return ""
    return content_text(last.get("content") or "")


def _stop_columns(stop_reason: int | str | None) -> dict:
    """vLLM's stop_reason (a stop string or a stop token id) as two typed columns."""
    return {"stop_reason": stop_reason if isinstance(stop_reason, str) else None,
            "stop_token_id": stop_reason if isinstance(stop_reason, int) else None}


def _list_or_none(values) -> list | None:
    return None if values is None else list(values)


def _ranked(top: list[dict[int, float] | None] | None) -> list[list[dict] | None] | None:
    """Per position, the top logprobs ({token id: logprob}) as [{"token_id", "logprob"}, ...],
    likeliest first (a column type Parquet and JSON both hold); None stays None."""
    if top is None:
        return None
    return [None if at is None else [{"token_id": token, "logprob": logprob} for token, logprob in
                                     sorted(at.items(), key=lambda item: -item[1])] for at in top]


def error_row(rejected_or_id: Rejected | str | None, message: str | None = None,
              passthrough: Mapping | None = None) -> dict:
    """The output row of a record that did not run: from a Rejected (whose message and
    passthrough the arguments may replace), or from an id and a message."""
    if isinstance(rejected_or_id, Rejected):
        rejected = rejected_or_id
        return _row(rejected.id, rejected.passthrough if passthrough is None else passthrough,
                    error=message or rejected.error, error_type="record")
    if message is None:
        raise TypeError("error_row: a message is required unless a Rejected is given")
    return _row(rejected_or_id, passthrough, error=message, error_type="record")


def _row(id: str | None, passthrough: Mapping | None, *, chat: bool | None = None,
         echo: str | None = None, text: str | None = None,
         token_ids: Sequence[int] = (), finish_reason: str = "error",
         stop_reason: int | str | None = None, prompt_tokens: int = 0,
         completion_tokens: int = 0, error: str | None = None, error_type: str | None = None,
         samples: list[dict] | None = None,
         logprobs: list[float] | None = None, top_logprobs: list[list[dict]] | None = None,
         prompt_token_ids: list[int] | None = None,
         prompt_logprobs: list[float | None] | None = None,
         prompt_ranks: list[int | None] | None = None,
         prompt_top_logprobs: list[list[dict] | None] | None = None,
         timings: Timings | None = None) -> dict:
    return {"id": id, "text": text, "token_ids": list(token_ids), "finish_reason": finish_reason,
            **_stop_columns(stop_reason), "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "error": error, "error_type": error_type, "samples": samples, "logprobs": logprobs,
            "top_logprobs": top_logprobs,
            "prompt_token_ids": _list_or_none(prompt_token_ids), "prompt_logprobs": _list_or_none(prompt_logprobs),
            "prompt_ranks": _list_or_none(prompt_ranks), "prompt_top_logprobs": prompt_top_logprobs,
            **_durations(timings), "chat": chat, "echo": echo, "passthrough": dict(passthrough or {})}


def _durations(timings: Timings | None) -> dict:
    """Seconds from submission to first scheduling, to the first token and to the end."""
    if timings is None:
        return {"queue_s": None, "first_token_s": None, "total_s": None}

    def since_submitted(moment: float | None) -> float | None:
        return None if moment is None else moment - timings.submitted

    return {"queue_s": since_submitted(timings.first_scheduled),
            "first_token_s": since_submitted(timings.first_token),
            "total_s": since_submitted(timings.finished)}


# Per position: the top logprobs asked for, likeliest first.
_TOP_LOGPROBS = pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float64())])))
_SAMPLE = pa.struct([("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
                     ("finish_reason", pa.string()), ("stop_reason", pa.string()),
                     ("stop_token_id", pa.int64()), ("logprobs", pa.list_(pa.float64())),
                     ("top_logprobs", _TOP_LOGPROBS)])
OUTPUT_SCHEMA = pa.schema([
    pa.field("id", pa.string()),
    pa.field("text", pa.string()),
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("stop_reason", pa.string()),  # the stop string that ended it
    pa.field("stop_token_id", pa.int64()),  # or the stop_token_ids entry (EOS: neither)
    pa.field("prompt_tokens", pa.int64(), nullable=False),
    pa.field("completion_tokens", pa.int64(), nullable=False),
    pa.field("error", pa.string()),
    # "record": the record's own doing, which running it again cannot mend; "engine": the engine failed it
    pa.field("error_type", pa.string()),
    pa.field("samples", pa.list_(_SAMPLE)),
    pa.field("logprobs", pa.list_(pa.float64())),
    pa.field("top_logprobs", _TOP_LOGPROBS),
    # With prompt_logprobs: the prompt's tokens, each one's logprob and rank (null first: the
    # first token has none) and the top ones at each position (null first too).
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("prompt_logprobs", pa.list_(pa.float64())),
    pa.field("prompt_ranks", pa.list_(pa.int64())),
    pa.field("prompt_top_logprobs", _TOP_LOGPROBS),
    pa.field("queue_s", pa.float64()),
    pa.field("first_token_s", pa.float64()),
    pa.field("total_s", pa.float64()),
    pa.field("chat", pa.bool_()),  # messages (true) or a prompt (false); null: did not parse
    pa.field("echo", pa.string()),  # echo_text: what an OpenAI line asking echo shows first; null: not asked
    # JSON text: passthrough fields differ from record to record, a column type cannot.
    pa.field("passthrough", pa.string(), nullable=False),
])


def row_to_arrow_dict(row: dict) -> dict:
    """A row as OUTPUT_SCHEMA holds it (what Parquet writers take one record at a time)."""
    return {**row, "passthrough": _dumps(row["passthrough"])}


# What JSON writes for a logprob of -inf (a token a grammar or allowed_token_ids rules out) or
# NaN: it has no infinities, and a string would make a float column two types. OpenAI's and
# vLLM's floor.
LOGPROB_FLOOR = -9999.0


def row_to_json(row: dict) -> str:
    """One JSONL line; passthrough stays a nested object. Non-finite floats: the passthrough's
    as their text, the row's own (logprobs, its only ones) at LOGPROB_FLOOR."""
    return json.dumps({k: _json_safe(v, str if k == "passthrough" else lambda _: LOGPROB_FLOOR)
                       for k, v in row.items()}, ensure_ascii=False, allow_nan=False, default=str)


def _dumps(value: Any) -> str:
    return json.dumps(_json_safe(value), ensure_ascii=False, allow_nan=False, default=str)


def _json_safe(value: Any, non_finite: Callable[[float], Any] = str) -> Any:
    """value with what strict JSON cannot hold as its str(): NaN and infinities (Python's json
    would write a bare NaN, which other readers refuse; or as `non_finite` says) and mapping
    keys other than str, int, finite float, bool or None (which json.dumps refuses); bytes in
    base64 (their str() is a Python repr no reader decodes). Other values are left to
    default=str."""
    if isinstance(value, float) and not math.isfinite(value):
        return non_finite(value)
    if isinstance(value, Mapping):
        return {json_key(k): _json_safe(v, non_finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, non_finite) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode("ascii")
    return value
