"""Input records → engine requests (DESIGN.md §5); batchgen_beam/rows.py makes the output rows.

Pure Python: no Beam, no model math. A problem with a record never raises: it becomes a
`Rejected` (then an error row) whose message starts with the field at fault, e.g.
"temperature: must be a finite number, got 'hot'". A mistake of the caller (bad transform-wide
defaults) raises ValueError instead, since it would reject every record.

`parse_record` accepts:
- a mapping in our format: `id`, `prompt` (or vLLM's `prompt_token_ids`, a tokenized one) or
  `messages`, optional sampling fields
  (`SAMPLING_FIELDS`) and chat fields (`CHAT_FIELDS`); every other key passes through to the
  output row untouched;
- a mapping in the OpenAI Batch API format (`custom_id`, `method`, `url`, `body`), told apart
  by having no `id` (a record of ours may pass a `custom_id` or `body` field through);
- a JSON line (str, or bytes in UTF-8; a leading byte-order mark is dropped) holding either;
- with `fallback_id`: a bare prompt (str or bytes), as from a text file, which has no ids;
- a `Rejected` that a reader made of a record it could not read (batchgen_beam/io.py's CSV
  rows with more cells than their header), returned as it is.

Choices:
- An integer id (BigQuery / Parquet keys often are) becomes str(id), a whole float too (pandas'
  column of int ids with a gap); bools, other floats and empty or blank strings are rejected,
  and the rejected row's passthrough keeps the id it gave, to trace it back by.
- A job's default seed seeds each record by its id (`record_seed`): the same prompt under n
  ids must not draw one sample n times.
- A field that is None counts as absent, so a column that is null in some rows means "use the
  default" there. The flip side: a record cannot switch a default seed or logprobs back off.
  NaN in a sampling field counts as absent too: it is pandas' missing value (and pyarrow's
  from_pandas reads it as null). A whole float in an integer field (2.0: pandas keeps a column
  of ints with gaps as float64, some JSON writers print it so) counts as that int; 2.5 does not.
- OpenAI body keys: harmless ones (`model`, `user`, ...) are ignored; keys that would change the
  output (`tools`, `suffix`, ...) are accepted only at their no-op value; any other key is
  rejected, naming it, rather than silently not honoured. `echo` is carried to the row as its
  `echo` column, the text the output puts before each choice's (`rows.echo_text`): a completion's
  prompt (with `logprobs` its tokens come first too, so `prompt_logprobs` defaults to
  `logprobs`: vLLM's rule), a chat's last message where the answer continues it (vLLM's rule).
  `response_format` (`json_object`: any
  JSON object; `json_schema`: its schema) and vLLM's `guided_json` become our `json_schema`,
  vLLM's `guided_regex` and `guided_choice` our `regex` and `choice`, and so does vLLM 0.32's
  `structured_outputs` (`json`, `regex`, `choice`, `json_object`).
- Passthrough values that strict JSON cannot hold (dates, decimals from Parquet or BigQuery,
  NaN and infinities, mapping keys that are not strings or numbers) are written as their str()
  in output rows (rows.py) rather than failing the pipeline or writing a bare NaN. Bytes are written in
  base64, as BigQuery and protobuf's JSON mapping write them.
- Text fields (id, prompt, a message's role and content, a text part's type and text) given
  as bytes, as some Parquet writers store strings, are decoded as UTF-8; bytes that are not
  UTF-8 reject the record.
- A message of role "developer" (OpenAI's newer name for system instructions) reaches the
  engine as it is: the engine gives it to a chat template that does not know it as a system
  message, as vLLM does (runtime/chat.py).
- A message's content may be OpenAI's list of text parts (the engine joins them by newlines
  unless the chat template loops over parts itself, as vLLM does); any other part (an image)
  rejects the record.
- numpy scalars and arrays (pandas and DataFrame sources hold them) count as the Python values
  they hold, and a namedtuple or `beam.Row` as a mapping of its fields.
- A record nested deeper than `MAX_NESTING` levels is an error row: writing its passthrough
  (json, pyarrow) could recurse past Python's stack limit inside the write step.
- A value no check foresaw still gives an error row ("record: could not be validated ..."),
  never an exception that would stop the pipeline.
- Text that UTF-8 cannot hold (a lone surrogate, which JSON's "\\ud800" escape makes) rejects
  the record, naming the field: no tokenizer or output file takes it. The field is left out of
  the error row's passthrough, which must be writable; so is an int too long for Python to
  write as text (over 4,300 digits). A JSON line whose bytes are not all UTF-8 is rejected
  whole, with its id where the id itself reads.
"""

import hashlib
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from runtime.request import ChatOptions, Request
from runtime.sampling import SamplingParams

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "n", "logprobs", "prompt_logprobs", "ignore_eos", "min_tokens",
                   "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty",
                   "truncate_prompt_tokens", "json_schema", "regex", "choice",
                   "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "bad_words")
# How a record's messages become its prompt (runtime.request.ChatOptions): vLLM's chat fields.
CHAT_FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
_CHAT_NO_OP = {"chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False}
ROLES = ("system", "user", "assistant", "developer")
_STRUCTURED = {"json_schema", "regex", "choice"}  # structured output: one kind at most
# Sampling fields that take an integer (a whole float counts, see _whole).
_INTEGER_FIELDS = {"max_tokens", "top_k", "seed", "n", "logprobs", "prompt_logprobs", "min_tokens",
                   "truncate_prompt_tokens"}
_TOKEN_ID = re.compile(r"-?[0-9]+")  # a logit_bias key (JSON keys are text)
RAW_PREVIEW_CHARS = 200
MAX_NESTING = 32  # levels of mappings and lists in a record: far past any real one

_NATIVE_KEYS = {"id", "prompt", "prompt_token_ids", "messages", *SAMPLING_FIELDS, *CHAT_FIELDS}
# vLLM's request fields we cannot honour, accepted only at the value that makes them a no-op:
# a record written for vLLM must not silently get something else than it asked for.
_NATIVE_NO_OP = {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0,
                 "spaces_between_special_tokens": True, "chat_template": ""}
_OPENAI_KEYS = {"custom_id", "method", "url", "body"}
# Per endpoint: the body key holding the input, and the endpoint-specific keys we understand.
_OPENAI_URLS = {
    "/v1/chat/completions": ("messages", {"messages", "max_tokens", "max_completion_tokens",
                                          "logprobs", "top_logprobs", "echo", *CHAT_FIELDS}),
    "/v1/completions": ("prompt", {"prompt", "max_tokens", "logprobs", "echo"}),
}
# Body keys that ask for structured output: OpenAI's response_format and vLLM's guided_json
# (our json_schema), vLLM's guided_regex and guided_choice (our regex and choice), and vLLM
# 0.32's structured_outputs, which holds one of json, regex, choice or json_object.
_OPENAI_FORMATS = {"response_format", "guided_json", "guided_regex", "guided_choice", "structured_outputs"}
_STRUCTURED_OUTPUTS_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                             "json_object": "json_schema"}  # theirs: ours
# Its options: our JSON is compact whichever way disable_any_whitespace asks (both are valid
# JSON); the others would change what is allowed, so only their defaults pass.
_STRUCTURED_OUTPUTS_DEFAULTS = {"disable_additional_properties": False}
# Body keys that map one to one onto ours; top_k, min_p, stop_token_ids, ignore_eos, min_tokens,
# prompt_logprobs, repetition_penalty, truncate_prompt_tokens, include_stop_str_in_output,
# skip_special_tokens, allowed_token_ids and bad_words are vLLM's extensions of the API, so
# files written for vLLM work too.
_OPENAI_SAMPLING = {"temperature", "top_p", "seed", "stop", "n", "top_k", "min_p",
                    "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "prompt_logprobs", "truncate_prompt_tokens",
                    "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "bad_words"}
# Body keys that do not affect the generated text.
_OPENAI_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options",
                   "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
# Body keys we cannot honour, accepted only at the value that makes them a no-op.
_OPENAI_NO_OP = {"best_of": 1, "suffix": "", "stream": False, "tools": [],
                 "tool_choice": "none", "modalities": ["text"]}
# A body may carry vLLM's request fields as well (files written for vLLM), on the same terms
# (the chat fields, at their defaults, in a completion's too).
_BODY_NO_OP = {**_NATIVE_NO_OP, **_OPENAI_NO_OP, **_CHAT_NO_OP}


@dataclass
class Parsed:
    """A valid record, ready for the engine."""
    id: str
    prompt: str | None
    messages: list[dict] | None
    params: SamplingParams
    passthrough: dict = field(default_factory=dict)
    chat: ChatOptions = field(default_factory=ChatOptions)
    echo: bool = False  # an OpenAI line's: its output shows the input first (echo_text)
    prompt_token_ids: list[int] | None = None  # a tokenized prompt, given instead of prompt
    # echo with max_tokens 0: the prompt alone (vLLM's: its one token generated is dropped)
    echo_only: bool = False
    # Our fields by the names the record gave them (an OpenAI line's body keys): for its errors.
    names: Mapping[str, str] = field(default_factory=dict)

    def to_request(self) -> Request:
        return Request(self.id, prompt=self.prompt, messages=self.messages, params=self.params, chat=self.chat,
                       prompt_token_ids=self.prompt_token_ids)

    @cached_property
    def request_digest(self) -> str:
        """Short, stable across processes: equal for records that ask the engine the same."""
        return hashlib.blake2b(repr(self.to_request()).encode("utf-8", "backslashreplace"),
                               digest_size=8).hexdigest()


@dataclass
class Rejected:
    """A record that cannot run; it becomes an error row. `id` is None when none was found."""
    id: str | None
    error: str
    passthrough: dict = field(default_factory=dict)


class _Invalid(Exception):
    """One record's problem; the message starts with the field at fault."""


def parse_record(raw: Any, defaults: Mapping[str, Any] | None = None,
                 fallback_id: str | None = None) -> Parsed | Rejected:
    """Validate and normalise one input record. `defaults` are transform-wide sampling fields that
    the record's own fields override. `fallback_id` is the id of a bare-string prompt: when it is
    given, a str or bytes `raw` is the prompt itself, not a JSON line (mappings ignore it)."""
    base = check_defaults(defaults)
    if isinstance(raw, Rejected):
        return raw
    try:
        record = _to_mapping(raw, fallback_id)
    except _Invalid as bad:
        return Rejected(_id_of_unread(raw), str(bad), {"raw": _preview(raw)})
    try:
        if _nests_deeper(record, MAX_NESTING):
            # Checking it (or writing its row: json, pyarrow, repr) would recurse past Python's
            # stack limit.
            return Rejected(_id_of_rejected(record), f"record: nested deeper than {MAX_NESTING} levels",
                            {"raw": _preview(raw)})
        return _parse_mapping(plain(record), base)
    except Exception as exc:  # noqa: BLE001 - one odd record must not stop the pipeline
        return Rejected(_id_of_rejected(record), _writable(f"record: could not be validated "
                                                           f"({type(exc).__name__}: {exc})"), {"raw": _preview(raw)})


def check_defaults(defaults: Mapping[str, Any] | None) -> dict:
    """The sampling and chat fields `defaults` sets (None = not set), checked. Raises ValueError:
    a bad default is the caller's mistake. Transforms call this at construction to fail early."""
    defaults = plain(dict(defaults or {}))  # numpy values, as a record's own are taken
    unknown = sorted(set(defaults) - set(SAMPLING_FIELDS) - set(CHAT_FIELDS))
    if unknown:
        raise ValueError(f"defaults: unknown fields {unknown}; "
                         f"known: {', '.join((*SAMPLING_FIELDS, *CHAT_FIELDS))}")
    nan = [k for k, v in defaults.items() if isinstance(v, float) and math.isnan(v)]
    if nan:  # NaN in a record is pandas' missing value; as a job's default it is a mistake
        raise ValueError(f"defaults: {nan[0]}: must be a finite number, got nan")
    chat = {k: defaults[k] for k in CHAT_FIELDS if defaults.get(k) is not None}
    if "chat_template_kwargs" in chat:
        chat["chat_template_kwargs"] = _template_kwargs(chat["chat_template_kwargs"])
    try:
        given = _sampling_fields(defaults)
        SamplingParams(**given)
        _chat_options_of(chat)
    except (_Invalid, ValueError) as exc:
        raise ValueError(f"defaults: {_field_message(exc)}") from None
    return {**given, **chat}


def default_sampling_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """The sampling parameters checked defaults give a record that sets none of its own."""
    return SamplingParams(**{k: v for k, v in defaults.items() if k in SAMPLING_FIELDS})


def _to_mapping(raw: Any, fallback_id: str | None) -> Mapping:
    raw = _utf8(raw, "record")
    if isinstance(raw, str):
        raw = raw.removeprefix("\ufeff")  # a file's first line may carry a byte-order mark
        if fallback_id is not None:
            return {"id": fallback_id, "prompt": raw}
        try:
            raw = loads_record(raw)
        except RepeatedKey as exc:
            raise _Invalid(f"record: {exc}") from None
        except ValueError as exc:  # bad JSON, or an integer too long for int() (CPython's limit)
            raise _Invalid(f"record: invalid JSON ({exc})") from None
        except RecursionError:
            raise _Invalid("record: JSON nested too deeply to read") from None
    if _is_record(raw):
        raw = raw._asdict()
    if not isinstance(raw, Mapping):
        raise _Invalid(f"record: must be an object with an id and a prompt or messages, "
                       f"got {_type_name(raw)}")
    return raw


class RepeatedKey(ValueError):
    """A JSON object that names a key twice."""


def loads_record(text: str | bytes) -> Any:
    """A JSON line's value, refusing an object that names a key twice: json keeps the last one
    silently, and which was meant is not ours to guess (nor is a Parquet or CSV column named
    twice)."""
    return json.loads(text, object_pairs_hook=_distinct_keys)


def _distinct_keys(pairs: list[tuple[str, Any]]) -> dict:
    record = dict(pairs)
    if len(record) < len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKey(f"key {_writable(_show(key))} given twice in one object")
            seen.add(key)
    return record


def _id_of_unread(raw: Any) -> str | None:
    """The id of a JSON line rejected whole (its bytes not all UTF-8, or a key given twice),
    where the id itself reads and is given once (so its error row carries it); else None."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "surrogateescape")
    if not isinstance(raw, str):
        return None
    try:  # every object as its (key, value) pairs
        pairs = json.loads(raw.removeprefix("\ufeff"), object_pairs_hook=list)
    except (ValueError, RecursionError):
        return None
    if not isinstance(pairs, list) or not all(isinstance(p, tuple) for p in pairs):
        return None
    keys = [name for name, _ in pairs]
    key = "id" if "id" in keys else "custom_id"  # an OpenAI line's, only where there is no id (is_openai_line)
    values = [value for name, value in pairs if name == key]
    return _readable_id(values[0], key) if len(values) == 1 else None


def _id_of_rejected(record: Mapping) -> str | None:
    """The id of a record rejected whole (nested too deep, or an unforeseen failure), where
    the id itself is valid; else None."""
    try:  # the record failed once already: reading it may too
        key = "id" if "id" in record else "custom_id"
        return _readable_id(record[key], key) if key in record else None
    except Exception:  # noqa: BLE001 - its row goes without an id
        return None


def _readable_id(value: Any, key: str) -> str | None:
    """`value` as an id, where it is a valid one (a str, an int, a whole float); else None."""
    if isinstance(value, (str, int, float)) and _unwritable(value, key) is None:
        try:
            return _check_id(value, key)
        except _Invalid:
            pass
    return None


def plain(value: Any) -> Any:
    """value with numpy numbers, bools, text and arrays of them as the Python values they hold,
    and beam.Rows and namedtuples as dicts, in nested mappings and lists too. Other numpy values
    (datetimes) stay: their item() would lose the type."""
    if _is_record(value):  # a nested beam.Row (a repeated struct column) or namedtuple
        value = value._asdict()
    if isinstance(value, np.generic) and value.dtype.kind in "biufcUS":
        return value.item()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufcUSO":
        # A 0-d array (np.asarray(4), a 0-d tensor's .numpy()) holds one value, not a list.
        return plain(value.item()) if value.ndim == 0 else [plain(item) for item in value.tolist()]
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list) or type(value) is tuple:
        return type(value)(plain(item) for item in value)
    return value


def _same(value: Any, expected: Any) -> bool:
    """value == expected, and False where the comparison gives no plain bool (pandas' NA)."""
    return (value == expected) is True


_CONTAINERS = (Mapping, list, tuple, np.ndarray)


def _is_record(value: Any) -> bool:
    """A namedtuple or a beam.Row (of a schema'd PCollection): a record, not a list."""
    return hasattr(value, "_asdict") and not isinstance(value, type)


def _is_container(value: Any) -> bool:
    return isinstance(value, _CONTAINERS) or _is_record(value)


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether mappings, lists and arrays nest deeper than `limit` in value, found without
    recursion."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if _is_record(item):
            children = item._asdict().values()
        elif isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, np.ndarray) and item.dtype.kind == "O":
            children = item.ravel().tolist()
        elif isinstance(item, np.ndarray):  # numbers or text: no need to visit each one
            if depth + item.ndim > limit:
                return True
            continue
        else:
            continue
        if depth == limit:
            return True
        pending.extend((child, depth + 1) for child in children if _is_container(child))
    return False


def _preview(raw: Any) -> str:
    if isinstance(raw, bytes):
        return raw[:RAW_PREVIEW_CHARS].decode("utf-8", "backslashreplace")
    if not isinstance(raw, str):
        try:
            raw = repr(raw)
        except RecursionError:
            raw = f"<a {type(raw).__name__} nested too deeply to show>"
        except ValueError:  # an int past Python's digit limit for str()
            raw = f"<a {type(raw).__name__} too long to show>"
    return _writable(raw[:RAW_PREVIEW_CHARS])


def _writable(text: str) -> str:
    """text with anything UTF-8 cannot hold shown as a backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _unwritable(value: Any, where: str) -> str | None:
    """The problem with the first value in `value` (keys and items of nested mappings and lists
    included) that no output row can hold, or None: a string UTF-8 cannot hold, or an int past
    the digits Python writes as text."""
    digits = sys.get_int_max_str_digits()  # 0: no limit
    if isinstance(value, int) and digits and value.bit_length() > 3 * digits:
        try:
            str(value)
        except ValueError:
            return f"{_writable(where)}: an integer of over {digits} digits"
        return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{_writable(where)}: not valid Unicode text (lone surrogate "
                    f"U+{ord(value[exc.start]):04X} at index {exc.start})")
        return None
    if isinstance(value, Mapping):
        if clashes := _clashing_keys(value, where):
            return next(iter(clashes.values()))
        items = [(k, f"{where} key {k!r}") for k in value] + [(v, f"{where}.{k}") for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(v, f"{where}[{i}]") for i, v in enumerate(value)]
    else:
        return None
    return next((p for v, w in items if (p := _unwritable(v, w)) is not None), None)


def json_key(key: Any) -> Any:
    """`key` as a mapping key json.dumps takes: str, int, finite float, bool and None as they are
    (it writes them as text itself), any other as its str()."""
    as_is = key is None or isinstance(key, (str, int)) or isinstance(key, float) and math.isfinite(key)
    return key if as_is else str(key)


def _clashing_keys(mapping: Mapping, where: str | None = None) -> dict[Any, str]:
    """The keys of `mapping` that a row's JSON would write alike (1 and "1", True and "true",
    None and "null"), each with the problem: the row would name that key twice, and readers
    keep one of them."""
    if all(isinstance(key, str) for key in mapping):  # the common case: distinct as written
        return {}
    by_text: dict[str, list] = {}
    for key in mapping:
        text = key if isinstance(key, str) else next(iter(json.loads(json.dumps({json_key(key): 0}))))
        by_text.setdefault(text, []).append(key)
    prefix = "" if where is None else f"{_writable(where)}: "
    return {key: f"{prefix}keys {' and '.join(_show(k) for k in keys)} would be written as one JSON "
                 f"key, {_show(text)}"
            for text, keys in by_text.items() if len(keys) > 1 for key in keys}


def _check_no_ops(record: Mapping) -> None:
    """Fields of vLLM's requests and OpenAI's bodies that a record of ours does not take."""
    for key in _OPENAI_FORMATS:
        if not is_missing(record.get(key)):
            raise _Invalid(f"{key}: a field of OpenAI Batch bodies; a record of ours gives "
                           f"json_schema, regex or choice")
    for key, no_op in _NATIVE_NO_OP.items():
        value = record.get(key)
        if not is_missing(value) and not _is_no_op(value, no_op):
            raise _Invalid(f"{key}: not supported (only {no_op!r} is), got {_show(value)}")


def _is_no_op(value: Any, no_op: Any) -> bool:
    # (an empty numpy array from Parquet compares to [] as no bool)
    return _same(value, no_op) or _is_empty(value) and _is_empty(no_op)


def _is_empty(value: Any) -> bool:
    return isinstance(value, _CONTAINERS + (str,)) and len(value) == 0


def is_openai_line(record: Mapping) -> bool:
    """A record of ours must have an id, which OpenAI lines never have at the top level, or have
    as null (a Parquet file of both kinds) beside their method and body object: so our records
    may carry passthrough fields named "body" or "custom_id"."""
    if "id" not in record:
        return "custom_id" in record or "body" in record
    return (is_missing(record["id"]) and not is_missing(record.get("method"))
            and isinstance(record.get("body"), Mapping))


def _parse_mapping(record: Mapping, base: dict) -> Parsed | Rejected:
    openai = is_openai_line(record)
    id_key, consumed = ("custom_id", _OPENAI_KEYS) if openai else ("id", _NATIVE_KEYS)
    unwritable = {k: p for k, v in record.items()
                  if (p := _unwritable(k, f"key {_show(k)}") or _unwritable(v, str(k)))}
    unwritable.update(_clashing_keys(record))
    passthrough = {k: v for k, v in record.items() if k not in consumed and k not in unwritable}
    record_id = None
    body = record.get("body") if openai else None
    names = _openai_names(body) if isinstance(body, Mapping) else {}
    try:
        if id_key in unwritable:
            raise _Invalid(unwritable[id_key])
        record_id = _check_id(record.get(id_key), id_key)
        if unwritable:
            raise _Invalid(next(iter(unwritable.values())))
        if not openai:
            _check_no_ops(record)
        fields = _openai_fields(record) if openai else _as_text(record, consumed)
        prompt, messages, prompt_token_ids = _check_prompt(fields)
        echo = openai and _openai_echo(record["body"])
        if echo and prompt_token_ids is not None:
            raise _Invalid("body.echo: needs the prompt as text (this one is token ids)")
        echo_only = echo and messages is None and _asks_no_tokens(fields["max_tokens"])
        if echo_only:
            fields = {**fields, "max_tokens": 1}  # vLLM's echo alone: one token generated, shown nowhere
        params = _params(fields, base, record_id)
        chat = _chat_options(fields, base, messages is not None)
        if echo and params.prompt_logprobs is None:
            # vLLM's rule: echo scores the prompt, as many top ones as a completion's logprobs
            # (the job's, where the line gives none) or a chat's top_logprobs (0 if none) ask
            scored = params.logprobs if messages is None else params.logprobs or 0
            params = _with_prompt_logprobs(params, scored)
    except _Invalid as bad:
        if record_id is None and record.get(id_key) is not None and id_key not in unwritable:
            passthrough = {id_key: record[id_key], **passthrough}  # what the row can be traced by
        return Rejected(record_id, named_as_given(str(bad), names), passthrough)
    return Parsed(record_id, prompt, messages, params, passthrough, chat, echo, prompt_token_ids, echo_only,
                  names)


def _utf8(value: Any, where: str) -> Any:
    """Bytes as the text they hold in UTF-8 (Parquet writers that store strings as plain binary
    give bytes); other values as they are."""
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _as_text(record: Mapping, keys) -> dict:
    """record with the bytes of its `keys` as the text they hold: a Parquet column of strings
    stored as binary, or a CSV cell that is not UTF-8, which says so rather than its type."""
    return {k: _utf8(v, str(k)) if k in keys else v for k, v in record.items()}


def _check_id(value: Any, key: str) -> str:
    value = _utf8(value, key)
    if is_missing(value):
        raise _Invalid(f"{key}: missing (every record needs an id; its row carries it)")
    value = _whole(value)  # pandas keeps a column of int ids with a gap as floats
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise _Invalid(f"{key}: must be a string, got {_type_name(value)}")
    if not value.strip():
        raise _Invalid(f"{key}: must not be empty")
    return value


def _check_prompt(fields: Mapping) -> tuple[str | None, list[dict] | None, list[int] | None]:
    """The record's prompt, messages or prompt token ids (one of them; the others None)."""
    # NaN is absent: a DataFrame of prompt rows and chat rows holds it in the other column.
    given = {k: fields[k] for k in ("prompt", "messages", "prompt_token_ids") if not is_missing(fields.get(k))}
    if not given:
        raise _Invalid("prompt: missing (give prompt, a string, or messages, a chat list, or "
                       "prompt_token_ids, a tokenized prompt)")
    if len(given) > 1:
        raise _Invalid(f"{', '.join(given)}: give one of them, not both")
    if "messages" in given:
        return None, _check_messages(given["messages"]), None
    if "prompt_token_ids" in given:
        return None, None, _check_token_ids(given["prompt_token_ids"], "prompt_token_ids")
    prompt = _utf8(given["prompt"], "prompt")
    if not isinstance(prompt, str):
        raise _Invalid(f"prompt: must be a string, got {_type_name(prompt)}")
    if not prompt.strip():
        raise _Invalid("prompt: must not be empty or only whitespace")
    return prompt, None, None


def _check_token_ids(ids: Any, where: str) -> list[int]:
    """A tokenized prompt: a non-empty list of token ids (the engine checks them against the
    model's vocabulary)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise _Invalid(f"{where}: must be a non-empty list of token ids, got {_show(ids)}")
    for token in ids:
        token = _whole(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _Invalid(f"{where}: must be a list of token ids (integers >= 0), got {_show(token)} in it")
    return [_whole(token) for token in ids]


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise _Invalid(f"messages: must be a list of {{role, content}} objects, "
                       f"got {_type_name(messages)}")
    if not messages:
        raise _Invalid("messages: must not be empty")
    return [_check_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _check_message(where: str, message: Any) -> dict:
    if not isinstance(message, Mapping):
        raise _Invalid(f"{where}: must be an object with role and content, "
                       f"got {_type_name(message)}")
    role = _utf8(message.get("role"), f"{where}.role")
    content = _utf8(message.get("content"), f"{where}.content")
    if role is None:
        raise _Invalid(f"{where}.role: missing")
    if not isinstance(role, str) or role not in ROLES:
        raise _Invalid(f"{where}.role: must be one of {', '.join(ROLES)}, "
                       f"got {_show(role)}")
    if content is None:
        raise _Invalid(f"{where}.content: missing")
    # Keys like "name" or "tool_calls" mean something we would silently drop.
    extra = [k for k, v in message.items() if k not in ("role", "content") and v is not None]
    if extra:
        raise _Invalid(f"{where}.{extra[0]}: not supported (a message has only role and content)")
    return {"role": role, "content": _check_content(f"{where}.content", content)}


def _check_content(where: str, content: Any) -> str | list[dict]:
    """A string, or OpenAI's list of content parts when all are text (kept as a list: the engine
    hands it to a chat template that loops over parts and joins the parts by newlines for one
    that takes a string, as vLLM does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise _Invalid(f"{where}: must be a string or a list of text parts, got {_type_name(content)}")
    if not content:
        raise _Invalid(f"{where}: must not be an empty list")
    parts = []
    for i, part in enumerate(content):
        kind = _utf8(part.get("type"), f"{where}[{i}].type") if isinstance(part, Mapping) else None
        if not isinstance(part, Mapping) or not _same(kind, "text"):
            raise _Invalid(f"{where}[{i}]: only text parts are supported, "
                           f"got {_show(kind) if isinstance(part, Mapping) else _type_name(part)}")
        text = _utf8(part.get("text"), f"{where}[{i}].text")
        if not isinstance(text, str):
            raise _Invalid(f"{where}[{i}].text: must be a string, got {_type_name(text)}")
        extra = [k for k, v in part.items() if k not in ("type", "text") and v is not None]
        if extra:
            raise _Invalid(f"{where}[{i}].{extra[0]}: not supported (a text part has only type and text)")
        parts.append({"type": "text", "text": text})
    return parts


def _params(fields: Mapping, base: dict, record_id: str) -> SamplingParams:
    given = _sampling_fields(fields)
    base = {k: v for k, v in base.items() if k in SAMPLING_FIELDS}
    if given.keys() & _STRUCTURED:  # a record's structure replaces the job's, of whatever kind
        base = {k: v for k, v in base.items() if k not in _STRUCTURED}
    if "seed" in base and "seed" not in given:
        base = {**base, "seed": record_seed(base["seed"], record_id)}
    try:
        return SamplingParams(**{**base, **given})
    except ValueError as exc:
        raise _Invalid(_field_message(exc)) from None


def _with_prompt_logprobs(params: SamplingParams, prompt_logprobs: int | None) -> SamplingParams:
    try:
        return replace(params, prompt_logprobs=prompt_logprobs)
    except ValueError as exc:
        raise _Invalid(_field_message(exc)) from None


def _chat_options(fields: Mapping, base: dict, chat: bool) -> ChatOptions:
    """The record's chat fields over the job's; a record's template variables add to the job's.
    A prompt record takes them only at their defaults (a prompt is not rendered)."""
    given = {k: fields[k] for k in CHAT_FIELDS if not is_missing(fields.get(k))}
    if "chat_template_kwargs" in given:
        given["chat_template_kwargs"] = _template_kwargs(given["chat_template_kwargs"])
    if not chat:
        for key, value in given.items():
            if not _is_no_op(value, _CHAT_NO_OP[key]):
                raise _Invalid(f"{key}: only for messages (a prompt is not rendered by a chat template), "
                               f"got {_show(value)}")
        return ChatOptions()
    options = {**{k: v for k, v in base.items() if k in CHAT_FIELDS}, **given}
    if isinstance(given.get("chat_template_kwargs"), Mapping):
        options["chat_template_kwargs"] = {**base.get("chat_template_kwargs", {}), **given["chat_template_kwargs"]}
    return _chat_options_of(options)


def _template_kwargs(value: Any) -> Any:
    """chat_template_kwargs as a mapping without missing values: a Parquet struct column gives
    each row every row's keys, null where it set none (null is absent, as in every field); a map
    column gives key-value pairs. Another value is left for ChatOptions to refuse."""
    if isinstance(value, (list, tuple)) and all(isinstance(i, (list, tuple)) and len(i) == 2 for i in value):
        value = dict(value)
    if isinstance(value, Mapping):
        return {k: v for k, v in value.items() if not is_missing(v)}
    return value


def _chat_options_of(options: Mapping) -> ChatOptions:
    try:
        return ChatOptions(template_kwargs=options.get("chat_template_kwargs", {}),
                           add_generation_prompt=options.get("add_generation_prompt", True),
                           continue_final_message=options.get("continue_final_message", False))
    except ValueError as exc:
        raise _Invalid(_field_message(exc)) from None


def record_seed(job_seed: int, record_id: str) -> int:
    """The seed a record without its own draws with under a job's seed: derived from both, so
    records with other ids (the same prompt under n ids, say) draw other samples, while a
    record always draws the same (vLLM's engine seed also gives each request its own stream)."""
    digest = hashlib.blake2b(f"{job_seed}\0{record_id}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")  # 64 bits: the engine's generators take them all


def _sampling_fields(fields: Mapping) -> dict:
    """The sampling fields that `fields` sets; None and NaN mean not set."""
    given = {k: fields[k] for k in SAMPLING_FIELDS if not is_missing(fields.get(k))}
    for key in given.keys() & _INTEGER_FIELDS:
        given[key] = _whole(given[key])
    for key in ("stop_token_ids", "allowed_token_ids"):
        if isinstance(given.get(key), (list, tuple)):
            given[key] = [_whole(token) for token in given[key]]
    if isinstance(given.get("choice"), (list, tuple)) and not given["choice"]:
        raise _Invalid("choice: must list at least one choice")
    # SamplingParams would iterate any iterable here: a dict's keys, a string's characters.
    if not isinstance(given.get("stop", ""), (str, list, tuple)):
        raise _Invalid(f"stop: must be a string or a list of strings, "
                       f"got {_type_name(given['stop'])}")
    for key in ("stop_token_ids", "allowed_token_ids"):
        if not isinstance(given.get(key, []), (list, tuple)):
            raise _Invalid(f"{key}: must be a list of integers, got {_type_name(given[key])}")
    if not isinstance(given.get("bad_words", ""), (str, list, tuple)):
        raise _Invalid(f"bad_words: must be a string or a list of strings, got {_type_name(given['bad_words'])}")
    if "logit_bias" in given:
        given["logit_bias"] = _logit_bias(given["logit_bias"])
    return given


def is_missing(value: Any) -> bool:
    """None, or NaN: pandas' missing value (a column of ints with a gap is float64 there), which
    pyarrow's from_pandas reads as null too."""
    return value is None or isinstance(value, float) and math.isnan(value)


def _whole(value: Any) -> Any:
    """A float with no fractional part as the int it holds (2.0 from a float column or a JSON
    writer); anything else as it is, for SamplingParams to judge."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _logit_bias(value: Any) -> list[tuple[Any, Any]]:
    """(token id, bias) pairs from OpenAI's {"token id": bias} (JSON keys are strings) or from
    Parquet's map column (a list of key-value pairs); SamplingParams checks the values."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, (list, tuple)) and len(i) == 2
                                                       for i in items):
        raise _Invalid(f"logit_bias: must map token ids to numbers, got {_show(value)}")

    def token_id(key):
        return int(key) if isinstance(key, str) and _TOKEN_ID.fullmatch(key) else key

    return [(token_id(key), bias) for key, bias in items]


def _field_message(exc: Exception) -> str:
    """SamplingParams says "top_p must be ..."; make it "top_p: must be ..." like ours."""
    name, sep, rest = str(exc).partition(" must ")
    return f"{name}: must {rest}" if sep and name in (*SAMPLING_FIELDS, *CHAT_FIELDS) else str(exc)


def _openai_fields(record: Mapping) -> dict:
    """An OpenAI Batch API line's request, as the fields of one of our records."""
    if "body" not in record:
        raise _Invalid("body: missing (an OpenAI Batch line has custom_id, method, url and body; "
                       "a record of ours has id and prompt or messages)")
    if not _same(record.get("method"), "POST"):
        raise _Invalid(f"method: must be \"POST\", got {_show(record.get('method'))}")
    url = record.get("url")
    if not isinstance(url, str) or url not in _OPENAI_URLS:
        raise _Invalid(f"url: must be one of {', '.join(_OPENAI_URLS)}, got {_show(url)}")
    body = record.get("body")
    if not isinstance(body, Mapping):
        raise _Invalid(f"body: must be an object, got {_type_name(body)}")
    input_key, endpoint_keys = _OPENAI_URLS[url]
    if is_missing(body.get(input_key)):
        raise _Invalid(f"body.{input_key}: missing (required by {url})")
    given = {k: v for k, v in body.items() if not is_missing(v) and k not in _OPENAI_IGNORED}
    for key, value in given.items():
        if key in endpoint_keys or key in _OPENAI_SAMPLING or key in _OPENAI_FORMATS:
            continue
        if key not in _BODY_NO_OP:
            raise _Invalid(f"body.{key}: not supported for {url}")
        if not _is_no_op(value, _BODY_NO_OP[key]):
            raise _Invalid(f"body.{key}: not supported (only {_BODY_NO_OP[key]!r} is), got {_show(value)}")
    fields = {k: v for k, v in given.items() if k in _OPENAI_SAMPLING or k in CHAT_FIELDS}
    if input_key == "prompt":
        fields.update(_openai_prompt(given["prompt"]))
    else:
        fields[input_key] = given[input_key]
    fields.update(_openai_structure(given))
    fields["max_tokens"] = _openai_max_tokens(given)
    fields["logprobs"] = _chat_logprobs(given) if input_key == "messages" else given.get("logprobs")
    return fields


def _openai_names(body: Mapping) -> dict[str, str]:
    """Our fields by the body keys an OpenAI line gave them as (null ones are not given): what
    its errors name."""
    given = sorted(k for k, v in body.items() if isinstance(k, str) and not is_missing(v))
    names = {k: f"body.{k}" for k in given}
    names["prompt_token_ids"] = "body.prompt"
    for key in _OPENAI_FORMATS.intersection(given):  # more than one is an error of its own
        names.update(dict.fromkeys(("json_schema", "regex", "choice"), f"body.{key}"))
    if isinstance(body.get("structured_outputs"), Mapping):
        names.update((ours, f"body.structured_outputs.{theirs}") for theirs, ours in _STRUCTURED_OUTPUTS_KINDS.items()
                     if not is_missing(body["structured_outputs"].get(theirs)))
    if "max_completion_tokens" in given:
        names["max_tokens"] = "body.max_completion_tokens"
    if "messages" in given and "top_logprobs" in given:
        names["logprobs"] = "body.top_logprobs"
    return names


def named_as_given(message: str, names: Mapping[str, str]) -> str:
    """An error message that begins with one of our fields, naming it as the record gave it
    (an OpenAI line's body key): a user looks for what they wrote."""
    field = re.match(r"[a-z_]+(?=[: ])", message)
    return names[field.group()] + message[field.end():] if field and field.group() in names else message


def _asks_no_tokens(max_tokens: Any) -> bool:
    return not isinstance(max_tokens, bool) and _same(_whole(max_tokens), 0)


def _openai_prompt(prompt: Any) -> dict:
    """A completion body's prompt as our prompt or prompt_token_ids. OpenAI's API takes text,
    token ids, or a list of either for several prompts in one request: one, here, as each line
    answers with one row."""
    if not isinstance(prompt, list):
        return {"prompt": prompt}
    prompts = sum(isinstance(item, (str, list)) for item in prompt)
    if prompts == 0:
        return {"prompt_token_ids": _check_token_ids(prompt, "body.prompt")}
    if prompts < len(prompt):
        raise _Invalid("body.prompt: a list of token ids or of prompts, not both")
    if len(prompt) != 1:
        raise _Invalid(f"body.prompt: must hold one prompt (text or token ids), got a list of {len(prompt)}; "
                       f"give each prompt its own line")
    [one] = prompt
    return {"prompt_token_ids": _check_token_ids(one, "body.prompt[0]")} if isinstance(one, list) else {"prompt": one}


def _openai_echo(body: Mapping) -> bool:
    """A body's echo, checked."""
    echo = body.get("echo")
    if is_missing(echo):
        return False
    if not isinstance(echo, bool):
        raise _Invalid(f"body.echo: must be true or false, got {_show(echo)}")
    return bool(echo)


def _openai_structure(body: dict) -> dict:
    """The body's structured output as our json_schema, regex and choice (None: not asked)."""
    formats = {key: body[key] for key in _OPENAI_FORMATS if key in body}
    if len(formats) > 1:
        raise _Invalid(f"body.{', body.'.join(sorted(formats))}: give one")
    if "structured_outputs" in formats:
        return _vllm_structured_outputs(formats["structured_outputs"])
    return {"json_schema": _openai_json_schema(formats), "regex": formats.get("guided_regex"),
            "choice": formats.get("guided_choice")}


def _vllm_structured_outputs(spec: Any) -> dict:
    """vLLM's structured_outputs: one of json, regex, choice or json_object, and options."""
    where = "body.structured_outputs"
    if not isinstance(spec, Mapping):
        raise _Invalid(f"{where}: must be an object, got {_type_name(spec)}")
    given = {k: v for k, v in spec.items() if not is_missing(v)}
    for key, value in given.items():
        if key in _STRUCTURED_OUTPUTS_KINDS or key == "disable_any_whitespace":
            continue
        if key not in _STRUCTURED_OUTPUTS_DEFAULTS or not _same(value, _STRUCTURED_OUTPUTS_DEFAULTS[key]):
            raise _Invalid(f"{where}.{key}: not supported, got {_show(value)}")
    kinds = [k for k in _STRUCTURED_OUTPUTS_KINDS if k in given]
    if len(kinds) != 1:
        raise _Invalid(f"{where}: give exactly one of {', '.join(_STRUCTURED_OUTPUTS_KINDS)}, "
                       f"got {', '.join(kinds) or 'none'}")
    [kind] = kinds
    value = given[kind]
    if kind == "json_object":
        if not _same(value, True):
            raise _Invalid(f"{where}.json_object: must be true, got {_show(value)}")
        value = {"type": "object"}
    return {_STRUCTURED_OUTPUTS_KINDS[kind]: value}


def _openai_json_schema(formats: dict) -> Any:
    """response_format json_object (any JSON object) or json_schema (its schema), or vLLM's
    guided_json, as our json_schema; None for text."""
    if "guided_json" in formats:
        return formats["guided_json"]
    response_format = formats.get("response_format", {"type": "text"})
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise _Invalid(f"body.response_format.json_schema: must hold a schema object, got "
                           f"{_show(spec)}")
        return spec["schema"]
    raise _Invalid(f"body.response_format: must be of type text, json_object or json_schema, "
                   f"got {_show(response_format)}")


def _openai_max_tokens(body: dict) -> Any:
    # Chat has both names (max_tokens is the deprecated one); tools often write both, equal.
    values = [body[k] for k in ("max_completion_tokens", "max_tokens") if k in body]
    if len(values) == 2 and not _same(values[0], values[1]):
        raise _Invalid(f"body.max_completion_tokens, body.max_tokens: differ "
                       f"({_show(values[0])} and {_show(values[1])}); give one")
    return values[0] if values else None


def _chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs=true (+ top_logprobs=k) is our logprobs=k (0 without top_logprobs)."""
    wanted, top = body.get("logprobs"), _whole(body.get("top_logprobs"))
    if wanted is not None and not isinstance(wanted, bool):
        raise _Invalid(f"body.logprobs: must be true or false for chat, got {_show(wanted)}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise _Invalid(f"body.top_logprobs: must be an integer >= 0, got {_show(top)}")
    if top and not wanted:  # vLLM's rule: top_logprobs 0 asks for nothing
        raise _Invalid("body.top_logprobs: needs logprobs: true")
    if not wanted:
        return None
    return 0 if top is None else top


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _show(value: Any, limit: int = 60) -> str:
    """A value quoted in a message, cut short: it may be a whole tool schema or document."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
