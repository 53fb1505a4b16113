"""Records: every kind of bad record becomes a Rejected that names the problem, defaults and
per-record fields combine as documented, OpenAI Batch API lines map onto our fields, and output
rows survive Parquet and JSONL round trips unchanged."""

import base64
import datetime
import json
import math
import random
from collections.abc import Mapping
from typing import NamedTuple

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen_beam.records import MAX_NESTING, Parsed, Rejected, check_defaults, parse_record
from batchgen_beam.rows import (LOGPROB_FLOOR, OUTPUT_SCHEMA, completion_row, error_row, row_to_arrow_dict,
                                row_to_json)
from batchgen_beam.io import parquet_records
from runtime.request import ChatOptions, Completion, Request, SampleOutput, Timings
from runtime.sampling import SamplingParams
from output_rows import arrow_to_rows, row_from_json, rows_to_arrow

ROW_KEYS = ["id", "text", "token_ids", "finish_reason", "stop_reason", "stop_token_id",
            "prompt_tokens", "completion_tokens", "error", "error_type", "samples", "logprobs", "top_logprobs",
            "prompt_token_ids", "prompt_logprobs", "prompt_ranks", "prompt_top_logprobs", "queue_s", "first_token_s", "total_s", "chat", "echo",
            "passthrough"]


def rec(**fields):
    return {"id": "r1", "prompt": "Hello", **fields}


def chat_line(body=None, **top):
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
            **(body or {})}
    return {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body,
            **top}


def completions_line(**body):
    return {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Once", **body}}


# (raw input, the Rejected's id, fragments its message must contain)
BAD_RECORDS = {
    # Lines that are not records at all.
    "undecodable bytes": (b'{"id": "a", "prompt": "caf\xe9"}', "a", ["not valid UTF-8"]),
    "undecodable bytes, no id": (b'{"prompt": "caf\xe9"}', None, ["not valid UTF-8"]),
    "invalid JSON": ('{"id": "a", "prompt": ', None, ["invalid JSON"]),
    # json keeps a repeated key's last value: which was meant is not ours to guess.
    "a key given twice": ('{"id": "a", "prompt": "x", "prompt": "y"}', "a", ["key 'prompt' given twice"]),
    "the id given twice": (b'{"id": "a", "id": "b", "custom_id": "c", "prompt": "x"}', None,
                           ["key 'id' given twice"]),  # custom_id: a record's passthrough field
    "a key given twice after a byte-order mark": (b'\xef\xbb\xbf{"id": "a", "n": 1, "n": 2}', "a",
                                                  ["key 'n' given twice"]),
    "a key UTF-8 cannot hold given twice": ('{"id": "a", "prompt": "x", "\\ud800": 1, "\\ud800": 2}', "a",
                                            ["key '\\ud800' given twice"]),
    "a body's key given twice": ('{"custom_id": "c", "method": "POST", "url": "/v1/completions", '
                                 '"body": {"prompt": "x", "echo": true, "echo": false}}', "c",
                                 ["key 'echo' given twice"]),
    "empty line": ("", None, ["invalid JSON"]),
    "JSON nested past the parser's depth": ('{"id": "a", "prompt": "x", "tag": ' + "[" * 100_000
                                            + "]" * 100_000 + "}", None, ["JSON nested too deeply"]),
    "integer past int()'s digit limit": ('{"id": "a", "prompt": "x", "n": ' + "9" * 10_000 + "}", None,
                                         ["invalid JSON", "digits"]),
    "JSON array": ('[{"id": "a"}]', None, ["must be an object", "got list"]),
    "JSON null": ("null", None, ["must be an object", "got null"]),
    "not a mapping": (42, None, ["must be an object", "got int"]),
    # Ids.
    "missing id": ({"prompt": "Hi"}, None, ["id: missing"]),
    "null id": ({"id": None, "prompt": "Hi"}, None, ["id: missing"]),
    "float id": (rec(id=1.5), None, ["id: must be a string", "got float"]),
    "bool id": (rec(id=True), None, ["id: must be a string", "got bool"]),
    "list id": (rec(id=["a"]), None, ["id: must be a string", "got list"]),
    "empty id": (rec(id=""), None, ["id: must not be empty"]),
    "blank id": (rec(id="  "), None, ["id: must not be empty"]),
    # Prompts.
    "no prompt or messages": ({"id": "r1"}, "r1", ["prompt: missing", "messages"]),
    "prompt and messages": (rec(messages=[{"role": "user", "content": "Hi"}]), "r1",
                            ["prompt, messages", "not both"]),
    "empty prompt": (rec(prompt=""), "r1", ["prompt: must not be empty"]),
    "whitespace prompt": (rec(prompt=" \n\t"), "r1", ["prompt: must not be empty"]),
    "int prompt": (rec(prompt=7), "r1", ["prompt: must be a string", "got int"]),
    "list prompt": (rec(prompt=["a", "b"]), "r1", ["prompt: must be a string", "got list"]),
    # Messages.
    "messages a string": ({"id": "r1", "messages": "Hi"}, "r1",
                          ["messages: must be a list", "got str"]),
    "messages empty": ({"id": "r1", "messages": []}, "r1", ["messages: must not be empty"]),
    "message not an object": ({"id": "r1", "messages": ["Hi"]}, "r1",
                              ["messages[0]: must be an object", "got str"]),
    "message without role": ({"id": "r1", "messages": [{"content": "Hi"}]}, "r1",
                             ["messages[0].role: missing"]),
    "message unknown role": ({"id": "r1", "messages": [{"role": "user", "content": "Hi"},
                                                       {"role": "robot", "content": "Beep"}]},
                             "r1", ["messages[1].role: must be one of", "'robot'"]),
    "message without content": ({"id": "r1", "messages": [{"role": "user"}]}, "r1",
                                ["messages[0].content: missing"]),
    "message content an object": ({"id": "r1", "messages": [
        {"role": "user", "content": {"type": "text", "text": "Hi"}}]}, "r1",
        ["messages[0].content: must be a string or a list of text parts", "got dict"]),
    "message content no parts": ({"id": "r1", "messages": [{"role": "user", "content": []}]}, "r1",
                                 ["messages[0].content: must not be an empty list"]),
    "message image part": ({"id": "r1", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, "r1",
        ["messages[0].content[1]: only text parts are supported", "'image_url'"]),
    "message part not an object": ({"id": "r1", "messages": [{"role": "user", "content": ["Hi"]}]},
                                   "r1", ["messages[0].content[0]: only text parts", "got str"]),
    "message part text not a string": ({"id": "r1", "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, "r1",
        ["messages[0].content[0].text: must be a string", "got int"]),
    "message part extra key": ({"id": "r1", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]}, "r1",
        ["messages[0].content[0].cache_control: not supported"]),
    "message extra key": ({"id": "r1", "messages": [
        {"role": "user", "content": "Hi", "name": "bob"}]}, "r1",
        ["messages[0].name: not supported"]),
    # Sampling fields: wrong types.
    "bool max_tokens": (rec(max_tokens=True), "r1", ["max_tokens: must be an integer", "True"]),
    "fractional max_tokens": (rec(max_tokens=3.5), "r1", ["max_tokens: must be an integer", "3.5"]),
    "string max_tokens": (rec(max_tokens="32"), "r1", ["max_tokens: must be an integer", "'32'"]),
    "string temperature": (rec(temperature="hot"), "r1",
                           ["temperature: must be a finite number, got 'hot'"]),
    "numeric-string top_p": (rec(top_p="0.9"), "r1", ["top_p: must be a finite number"]),
    "inf top_p": (rec(top_p=math.inf), "r1", ["top_p: must be a finite number"]),
    "Infinity from a JSON line": ('{"id": "r1", "prompt": "Hi", "temperature": Infinity}', "r1",
                                  ["temperature: must be a finite number"]),
    "int past a float": (rec(temperature=10 ** 400), "r1", ["temperature: must be a finite number"]),
    "int past str's digits": (rec(top_p=10 ** 5000), "r1", ["top_p: an integer of over 4300 digits"]),
    "empty choice": (rec(choice=[]), "r1", ["choice: must list at least one choice"]),
    "float seed": (rec(seed=1.5), "r1", ["seed: must be an integer"]),
    "bool top_k": (rec(top_k=False), "r1", ["top_k: must be an integer"]),
    "string n": (rec(n="2"), "r1", ["n: must be an integer"]),
    "bool logprobs": (rec(logprobs=True), "r1", ["logprobs: must be an integer"]),
    "int stop": (rec(stop=5), "r1", ["stop: must be a string or a list", "got int"]),
    "dict stop": (rec(stop={"a": 1}), "r1", ["stop: must be a string or a list", "got dict"]),
    "non-string stop item": (rec(stop=["a", 3]), "r1", ["stop: must be non-empty strings"]),
    "empty stop string": (rec(stop=""), "r1", ["stop: must be non-empty strings"]),
    "string stop_token_ids": (rec(stop_token_ids="12"), "r1",
                              ["stop_token_ids: must be a list of integers", "got str"]),
    "non-int stop token": (rec(stop_token_ids=[1, "2"]), "r1",
                           ["stop_token_ids: must be an integer", "'2'"]),
    "string ignore_eos": (rec(ignore_eos="yes"), "r1", ["ignore_eos: must be a bool"]),
    # Sampling fields: out of range.
    "zero max_tokens": (rec(max_tokens=0), "r1", ["max_tokens: must be >= 1, got 0"]),
    "negative temperature": (rec(temperature=-0.5), "r1", ["temperature: must be >= 0"]),
    "top_p above 1": (rec(top_p=1.5), "r1", ["top_p: must be in (0, 1]"]),
    "zero top_p": (rec(top_p=0), "r1", ["top_p: must be in (0, 1]"]),
    "negative top_k": (rec(top_k=-2), "r1", ["top_k: must be >= 0"]),
    "seed past uint64": (rec(seed=1 << 64), "r1", ["seed: must be < 2**64"]),
    "zero n": (rec(n=0), "r1", ["n: must be >= 1"]),
    "negative logprobs": (rec(logprobs=-1), "r1", ["logprobs: must be >= 0"]),
    "zero repetition_penalty": (rec(repetition_penalty=0), "r1", ["repetition_penalty: must be > 0"]),
    "string logit_bias": (rec(logit_bias="7:5"), "r1", ["logit_bias: must map token ids to numbers"]),
    "min_tokens above max_tokens": (rec(min_tokens=9, max_tokens=4), "r1",
                                    ["min_tokens: must be <= max_tokens (4), got 9"]),
    "string presence_penalty": (rec(presence_penalty="1"), "r1",
                                ["presence_penalty: must be a finite number"]),
    "presence_penalty below -2": (rec(presence_penalty=-3), "r1",
                                  ["presence_penalty: must be in [-2, 2], got -3"]),
    # OpenAI Batch API lines.
    "openai without custom_id": ({"method": "POST", "url": "/v1/completions",
                                  "body": {"prompt": "Hi"}}, None, ["custom_id: missing"]),
    "openai without body": ({"custom_id": "c9", "prompt": "Hi"}, "c9", ["body: missing",
                                                                    "a record of ours has id"]),
    "openai GET": (chat_line(method="GET"), "c1", ['method: must be "POST"', "'GET'"]),
    "openai no method": ({k: v for k, v in chat_line().items() if k != "method"}, "c1",
                         ["method: must be"]),
    "openai embeddings url": (chat_line(url="/v1/embeddings"), "c1",
                              ["url: must be one of", "/v1/embeddings"]),
    "openai list url": (chat_line(url=["/v1/completions"]), "c1", ["url: must be one of"]),
    "openai body a string": (chat_line() | {"body": "{}"}, "c1",
                             ["body: must be an object", "got str"]),
    "openai chat without messages": (chat_line({"messages": None}), "c1",
                                     ["body.messages: missing", "/v1/chat/completions"]),
    "openai completions without prompt": (completions_line(prompt=None), "c2",
                                          ["body.prompt: missing"]),
    "openai prompt on chat": (chat_line({"prompt": "Hi"}), "c1",
                              ["body.prompt: not supported for /v1/chat/completions"]),
    "openai tools": (chat_line({"tools": [{"type": "function"}]}), "c1",
                     ["body.tools: not supported"]),
    "openai response_format of another type": (chat_line({"response_format": {"type": "xml"}}), "c1",
                                               ["body.response_format: must be of type text"]),
    "openai json_schema without a schema": (
        chat_line({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}), "c1",
        ["body.response_format.json_schema: must hold a schema object"]),
    "openai response_format and guided_choice": (
        chat_line({"response_format": {"type": "json_object"}, "guided_choice": ["a", "b"]}),
        "c1", ["body.guided_choice, body.response_format: give one"]),
    "choice a string": ({"id": "c", "prompt": "Hi", "choice": "yes"}, "c",
                        ["choice: must be a list of non-empty strings"]),
    "json_schema not a schema": ({"id": "j", "prompt": "Hi", "json_schema": {"type": "nonsense"}}, "j",
                                 ["json_schema: must be a schema the grammar engine compiles"]),
    "json_schema not json": ({"id": "j", "prompt": "Hi", "json_schema": "{oops"}, "j",
                             ["json_schema: must be a JSON schema", "not JSON"]),
    "openai echo not a bool": (completions_line(echo="yes"), "c2", ["body.echo: must be true or false", "'yes'"]),
    "openai echo of token ids": (completions_line(prompt=[1, 2], echo=True), "c2",
                                 ["body.echo: needs the prompt as text"]),
    "openai several prompts": (completions_line(prompt=["a", "b"]), "c2",
                               ["body.prompt: must hold one prompt", "list of 2", "its own line"]),
    "openai token ids mixed with text": (completions_line(prompt=[1, "b"]), "c2", ["token ids or of prompts, not both"]),
    "openai empty prompt list": (completions_line(prompt=[]), "c2", ["body.prompt: must be a non-empty list"]),
    "token ids not a list": ({"id": "t", "prompt_token_ids": "1 2"}, "t", ["prompt_token_ids: must be a non-empty list"]),
    "token id negative": ({"id": "t", "prompt_token_ids": [3, -1]}, "t", ["integers >= 0", "-1"]),
    "token id a bool": ({"id": "t", "prompt_token_ids": [True]}, "t", ["integers >= 0", "True"]),
    "token id a fraction": ({"id": "t", "prompt_token_ids": [1.5]}, "t", ["integers >= 0", "1.5"]),
    "token ids and a prompt": ({"id": "t", "prompt": "x", "prompt_token_ids": [1]}, "t",
                               ["prompt, prompt_token_ids: give one of them"]),
    "openai chat echo not a bool": (chat_line({"echo": 1}), "c1", ["body.echo: must be true or false", "1"]),
    "openai logit_bias not a token": (chat_line({"logit_bias": {"the": 5}}), "c1",
                                      ["logit_bias: must be an integer", "'the'"]),
    "openai logit_bias out of range": (chat_line({"logit_bias": {"7": -101}}), "c1",
                                       ["logit_bias: must be in [-100, 100]"]),
    "openai frequency_penalty out of range": (chat_line({"frequency_penalty": 2.5}), "c1",
                                              ["frequency_penalty: must be in [-2, 2], got 2.5"]),
    "openai unknown key": (chat_line({"reasoning_effort": "high"}), "c1",
                           ["body.reasoning_effort: not supported"]),
    "openai chat logprobs int": (chat_line({"logprobs": 3}), "c1",
                                 ["body.logprobs: must be true or false"]),
    "openai top_logprobs alone": (chat_line({"top_logprobs": 3}), "c1",
                                  ["body.top_logprobs: needs logprobs: true"]),
    "openai max tokens differ": (chat_line({"max_tokens": 10, "max_completion_tokens": 20}),
                                 "c1", ["max_completion_tokens", "max_tokens", "differ"]),
    "openai bad temperature": (chat_line({"temperature": "warm"}), "c1",
                               ["temperature: must be a finite number, got 'warm'"]),
    "openai bad message": (chat_line({"messages": [{"role": "user"}]}), "c1",
                           ["messages[0].content: missing"]),
    # Text UTF-8 cannot hold: lone surrogates, as JSON's \u escapes make them.
    "lone surrogate in a JSON prompt": ('{"id": "a", "prompt": "x \\ud800"}', "a",
                                        ["prompt: not valid Unicode text", "U+D800 at index 2"]),
    "lone surrogate in the id": ('{"id": "a\\udcff", "prompt": "x"}', None,
                                 ["id: not valid Unicode text"]),
    "lone surrogate in a message": (rec(prompt=None, messages=[{"role": "user", "content": "\ud83d"}]),
                                    "r1", ["messages[0].content: not valid Unicode text"]),
    "lone surrogate in an openai body": (chat_line({"messages": [{"role": "user", "content": "\ud800"}]}),
                                         "c1", ["body.messages[0].content: not valid Unicode text"]),
    "lone surrogate in a stop string": (rec(stop=["ok", "\udfff"]), "r1", ["stop[1]: not valid"]),
    "lone surrogate in a passthrough value": (rec(meta={"k": ["ok", "\udcff"]}), "r1",
                                              ["meta.k[1]: not valid Unicode text"]),
    "lone surrogate in a key": (rec(**{"x\ud800": 1}), "r1", ["key 'x\\ud800': not valid"]),
    # numpy values where a string or a no-op value is due: no truth-value error, a field error.
    "numpy array method": (chat_line(method=np.array(["POST", "GET"])), "c1", ['method: must be "POST"']),
    "numpy array role": (rec(prompt=None, messages=[{"role": np.array(["user"]), "content": "Hi"}]), "r1",
                         ["messages[0].role: must be one of"]),
    "numpy scalar tools": (chat_line({"tools": np.float32(2.0)}), "c1", ["body.tools: not supported"]),
    "numpy array max tokens": (chat_line({"max_tokens": np.array([3, 4]), "max_completion_tokens": 3}), "c1",
                               ["differ"]),
}


@pytest.mark.parametrize("raw, want_id, fragments", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_bad_record_is_rejected_with_a_message_naming_the_problem(raw, want_id, fragments):
    got = parse_record(raw)
    assert isinstance(got, Rejected), got
    assert got.id == want_id
    for fragment in fragments:
        assert fragment in got.error, (fragment, got.error)
    row = error_row(got)
    assert (row["finish_reason"], row["error"], row["text"]) == ("error", got.error, None)
    rows_to_arrow([row])  # every error row can be written
    row_to_json(row).encode("utf-8")


def test_unparseable_lines_keep_a_preview_of_the_raw_input():
    assert parse_record("{oops" + "x" * 500).passthrough == {"raw": "{oops" + "x" * 195}
    undecodable = parse_record(b"\xff" + b"y" * 300)
    assert undecodable.passthrough["raw"].startswith("\\xffyyy")
    assert parse_record("[1, 2]").passthrough == {"raw": "[1, 2]"}
    assert parse_record(10 ** 5000).passthrough == {"raw": "<a int too long to show>"}


def test_vllm_request_fields_we_cannot_honour_are_refused_unless_no_ops():
    """A record written for vLLM must not silently get something else than it asked for."""
    for field, value in [("best_of", 3), ("use_beam_search", True), ("length_penalty", 0.5),
                         ("chat_template", "{{ x }}")]:
        parsed = parse_record({"id": "a", "prompt": "Hi", field: value})
        assert isinstance(parsed, Rejected) and parsed.error.startswith(f"{field}: not supported (only ")
    for field, value in [("guided_json", {"type": "object"}), ("structured_outputs", {"regex": "a+"}),
                         ("response_format", {"type": "json_object"})]:
        assert parse_record({"id": "a", "prompt": "Hi", field: value}).error == \
            f"{field}: a field of OpenAI Batch bodies; a record of ours gives json_schema, regex or choice"
    no_ops = {"best_of": 1, "use_beam_search": False, "length_penalty": np.float64(1.0),
              "chat_template": "", "spaces_between_special_tokens": True}
    parsed = parse_record({"id": "a", "prompt": "Hi", **no_ops})
    assert isinstance(parsed, Parsed) and set(parsed.passthrough) == set(no_ops)


def test_allowed_token_ids_and_bad_words_are_vllm_s():
    parsed = parse_record({"id": "a", "prompt": "Hi", "allowed_token_ids": np.array([5, 9]), "bad_words": ["no", "never"]})
    assert (parsed.params.allowed_token_ids, parsed.params.bad_words) == ((5, 9), ("no", "never"))
    assert parse_record({"id": "a", "prompt": "Hi", "bad_words": "no"}).params.bad_words == ("no",)
    assert parse_record({"id": "a", "prompt": "Hi", "allowed_token_ids": [], "bad_words": None}).params == SamplingParams()
    line = {"custom_id": "q", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Hi", "allowed_token_ids": [3.0], "bad_words": ["x"]}}
    assert parse_record(line).params == SamplingParams(max_tokens=16, allowed_token_ids=[3], bad_words=["x"])
    for field, value, error in [("allowed_token_ids", 5, "allowed_token_ids: must be a list of integers, got int"),
                                ("allowed_token_ids", [1.5], "allowed_token_ids: must be an integer"),
                                ("bad_words", {"a": 1}, "bad_words: must be a string or a list of strings"),
                                ("bad_words", ["ok", ""], "bad_words: must be non-empty strings")]:
        got = parse_record({"id": "a", "prompt": "Hi", field: value})
        assert isinstance(got, Rejected) and got.error.startswith(error), got


THINKING = {"enable_thinking": False}


def test_chat_fields_say_how_messages_become_the_prompt():
    chat = [{"role": "user", "content": "Hi"}]
    parsed = parse_record({"id": "a", "messages": chat, "chat_template_kwargs": THINKING})
    assert parsed.chat == ChatOptions(template_kwargs=THINKING)
    assert parsed.to_request().chat == parsed.chat and parsed.passthrough == {}
    continued = [*chat, {"role": "assistant", "content": "Hello"}]
    parsed = parse_record({"id": "a", "messages": continued, "add_generation_prompt": False,
                           "continue_final_message": True})
    assert parsed.chat == ChatOptions(add_generation_prompt=False, continue_final_message=True)
    body = {"model": "m", "messages": chat, "chat_template_kwargs": THINKING, "add_generation_prompt": True}
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": body}
    assert parse_record(line).chat == ChatOptions(template_kwargs=THINKING)
    assert parse_record({"id": "a", "messages": chat}).chat == ChatOptions()


def test_a_record_s_template_variables_add_to_the_job_s():
    chat = [{"role": "user", "content": "Hi"}]
    job = check_defaults({"chat_template_kwargs": {"enable_thinking": False, "tone": "dry"},
                          "add_generation_prompt": True})
    parsed = parse_record({"id": "a", "messages": chat, "chat_template_kwargs": {"tone": "warm"}}, job)
    assert parsed.chat == ChatOptions(template_kwargs={"enable_thinking": False, "tone": "warm"})
    assert parse_record({"id": "a", "messages": chat}, job).chat.template_kwargs == {"enable_thinking": False, "tone": "dry"}
    # a prompt is not rendered: the job's chat fields pass it by
    assert parse_record({"id": "a", "prompt": "Hi"}, job).chat == ChatOptions()


@pytest.mark.parametrize("record, error", [
    ({"id": "a", "prompt": "Hi", "chat_template_kwargs": THINKING},
     "chat_template_kwargs: only for messages (a prompt is not rendered by a chat template)"),
    ({"id": "a", "prompt": "Hi", "continue_final_message": True}, "continue_final_message: only for messages"),
    ({"id": "a", "messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True},
     "continue_final_message: must come with add_generation_prompt false"),
    ({"id": "a", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": "thinking"},
     "chat_template_kwargs: must map names to values"),
    ({"id": "a", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs: must hold template variables, not ['tokenize']"),
    ({"id": "a", "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": "no"},
     "add_generation_prompt: must be a bool"),
    ({"custom_id": "q", "method": "POST", "url": "/v1/completions",
      "body": {"model": "m", "prompt": "Hi", "chat_template_kwargs": THINKING}},
     "body.chat_template_kwargs: not supported (only {} is)"),
])
def test_chat_fields_that_cannot_be_honoured_are_error_rows(record, error):
    got = parse_record(record)
    assert isinstance(got, Rejected) and got.error.startswith(error), got


def test_template_variables_from_parquet_struct_and_map_columns(tmp_path):
    """A struct column gives each row every row's keys, null where it set none: null is absent,
    so the job's value stands. A map column gives key-value pairs."""
    chat = [{"role": "user", "content": "Hi"}]
    rows = [{"id": "a", "prompt": None, "messages": chat, "chat_template_kwargs": {"enable_thinking": True}},
            {"id": "b", "prompt": None, "messages": chat, "chat_template_kwargs": {"tone": "warm"}},
            {"id": "c", "prompt": "Hi", "messages": None, "chat_template_kwargs": {}}]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    job = check_defaults({"chat_template_kwargs": {"enable_thinking": False}})
    a, b, c = (parse_record(r, job) for r in parquet_records(pq.read_table(path)))
    assert a.chat.template_kwargs == {"enable_thinking": True}
    assert b.chat.template_kwargs == {"enable_thinking": False, "tone": "warm"}
    assert isinstance(c, Parsed) and c.chat == ChatOptions()
    as_map = pa.table({"id": ["d"], "messages": [chat],
                       "chat_template_kwargs": pa.array([[("enable_thinking", False)]], pa.map_(pa.string(), pa.bool_()))})
    [d] = (parse_record(r) for r in parquet_records(as_map))
    assert d.chat.template_kwargs == {"enable_thinking": False}


def test_chat_fields_at_their_defaults_pass_a_prompt_record():
    for record in ({"id": "a", "prompt": "Hi", "chat_template_kwargs": {}, "add_generation_prompt": True,
                    "continue_final_message": False},
                   {"custom_id": "q", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "m", "prompt": "Hi", "add_generation_prompt": True}}):
        assert parse_record(record).chat == ChatOptions()


def test_bad_chat_defaults_fail_at_construction():
    with pytest.raises(ValueError, match="defaults: continue_final_message: must come with add_generation_prompt false"):
        check_defaults({"continue_final_message": True})
    with pytest.raises(ValueError, match="defaults: chat_template_kwargs: must map names to values"):
        check_defaults({"chat_template_kwargs": ["enable_thinking"]})


def test_a_rejected_record_keeps_its_passthrough():
    got = parse_record(rec(temperature="hot", source={"file": "a.jsonl", "line": 3}))
    assert got == Rejected("r1", "temperature: must be a finite number, got 'hot'",
                           {"source": {"file": "a.jsonl", "line": 3}})


def test_text_utf8_cannot_hold_leaves_only_its_own_field_out_of_the_passthrough():
    got = parse_record(rec(note="fine ✓", bad={"deep": "\ud800"}, tags=[1, 2]))
    assert got.id == "r1" and got.error.startswith("bad.deep: not valid Unicode text")
    assert got.passthrough == {"note": "fine ✓", "tags": [1, 2]}
    # A surrogate pair (an astral character written as two JSON escapes) is valid text.
    assert parse_record('{"id": "a", "prompt": "\\ud83d\\ude00"}').prompt == "\U0001F600"


def test_valid_record_keeps_other_fields_untouched():
    nested = {"tags": ["x", {"deep": [1, 2.5, None, True]}], "note": "ünïcødé ✓"}
    got = parse_record({"id": "r1", "prompt": "Hi", "max_tokens": 8, "meta": nested, "k": None})
    assert isinstance(got, Parsed)
    assert (got.id, got.prompt, got.messages) == ("r1", "Hi", None)
    assert got.passthrough == {"meta": nested, "k": None}
    assert got.params == SamplingParams(max_tokens=8)


def test_integer_ids_become_strings():
    assert parse_record({"id": 17, "prompt": "Hi"}).id == "17"
    assert parse_record({"id": 17.0, "prompt": "Hi"}).id == "17"  # pandas: int ids with a gap
    assert parse_record({"id": math.nan, "prompt": "Hi"}).error.startswith("id: missing")


def test_a_record_rejected_for_its_id_keeps_the_id_it_gave():
    """Its row has no id, so the value it gave is what a user traces it back by."""
    for raw, key in (({"id": ["a"], "prompt": "Hi"}, "id"), ({"id": 1.5, "prompt": "Hi"}, "id"),
                     (chat_line() | {"custom_id": " "}, "custom_id")):
        got = parse_record(raw)
        assert isinstance(got, Rejected) and got.id is None
        assert got.passthrough[key] == raw[key], raw


def test_a_0_d_numpy_array_counts_as_the_value_it_holds():
    """np.asarray(4), a 0-d tensor's .numpy(): its tolist() is the value, which was then iterated
    ("'int' object is not iterable" failed the record) or split (np.array("abc") → ['a', 'b', 'c'])."""
    got = parse_record({"id": "a", "prompt": np.array("Hi"), "max_tokens": np.array(4),
                        "temperature": np.array(0.25), "note": np.array("abc"), "stop": np.array(["x"])})
    assert isinstance(got, Parsed), got
    assert got.prompt == "Hi" and got.params.max_tokens == 4 and got.params.temperature == 0.25
    assert got.passthrough["note"] == "abc" and got.params.stop == ("x",)


def test_numpy_values_count_as_the_python_values_they_hold():
    # What a pandas or DataFrame source hands over.
    got = parse_record({"id": np.int64(7), "prompt": np.str_("Hi"), "max_tokens": np.int64(5),
                        "temperature": np.float32(0.5), "ignore_eos": np.bool_(True),
                        "stop": np.array(["x", "y"]), "stop_token_ids": np.array([3, 4]),
                        "meta": {"scores": np.arange(3), "day": np.datetime64("2024-05-01")}})
    assert isinstance(got, Parsed), got
    assert got.id == "7" and got.prompt == "Hi"
    assert got.params == SamplingParams(max_tokens=5, temperature=0.5, ignore_eos=True, stop=("x", "y"),
                                        stop_token_ids=(3, 4))
    assert type(got.params.max_tokens) is int and type(got.params.ignore_eos) is bool
    assert got.passthrough["meta"]["scores"] == [0, 1, 2]
    row = completion_row(got, Completion("7", [SampleOutput(0, [1], "ok", "stop")], 1, Timings(0.0)))
    assert arrow_to_rows(rows_to_arrow([row]))[0]["passthrough"]["meta"] == {"scores": [0, 1, 2],
                                                                              "day": "2024-05-01"}


def test_a_byte_order_mark_before_a_json_line_is_ignored():
    # Editors on Windows start UTF-8 files with one; it reaches the first line's record.
    line = '{"id": "a", "prompt": "Hi"}'
    for raw in (b"\xef\xbb\xbf" + line.encode(), "\ufeff" + line):
        got = parse_record(raw)
        assert isinstance(got, Parsed) and (got.id, got.prompt) == ("a", "Hi"), got
    assert parse_record(b"\xef\xbb\xbfHi", fallback_id="t:1").prompt == "Hi"


def test_text_fields_given_as_bytes_are_utf8():
    # Parquet writers that store strings as plain binary give bytes.
    got = parse_record({"id": b"a", "prompt": "caf\u00e9".encode(), "n": 1})
    assert isinstance(got, Parsed) and (got.id, got.prompt) == ("a", "caf\u00e9"), got
    chat = parse_record({"id": "c", "messages": [{"role": b"user", "content": b"Hi"}]})
    assert chat.messages == [{"role": "user", "content": "Hi"}], chat
    for record, problem in (({"id": "a", "prompt": b"caf\xe9"}, "prompt: not valid UTF-8"),
                            ({"id": b"\xff", "prompt": "x"}, "id: not valid UTF-8"),
                            ({"id": "a", "messages": [{"role": "user", "content": b"\xc3"}]},
                             "messages[0].content: not valid UTF-8")):
        assert parse_record(record).error.startswith(problem), record
    # Any field of ours: a binary column of stop strings reads as text; a CSV cell that is not
    # UTF-8 (io hands it on as bytes) says so, not that bytes are the wrong type.
    assert parse_record({"id": "a", "prompt": "x", "stop": b"END"}).params.stop == ("END",)
    for field in ("prompt_token_ids", "messages", "stop", "temperature"):
        got = parse_record({"id": "a", field: b"[1,\xff2]"})
        assert got.error.startswith(f"{field}: not valid UTF-8"), got


def _nested(depth: int):
    value = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_a_record_nested_past_the_limit_is_an_error_row_that_can_be_written():
    # One level below the limit: a record as usual. The record itself is the first level.
    fine = parse_record({"id": "a", "prompt": "Hi", "deep": _nested(MAX_NESTING - 1)})
    assert isinstance(fine, Parsed), fine
    # Past it, whatever the depth (a Python object deeper than repr or json can walk too):
    # an error row, which writes.
    for depth in (MAX_NESTING, 5 * MAX_NESTING, 3000):
        for raw in ({"id": "a", "prompt": "Hi", "deep": _nested(depth)},
                    '{"id": "a", "prompt": "Hi", "deep": ' + "[" * depth + "]" * depth + "}"):
            got = parse_record(raw)
            assert isinstance(got, Rejected) and "nested" in got.error, (depth, got)
            readable = isinstance(raw, dict) or depth < 3000  # json reads no text that deep at all
            assert got.id == ("a" if readable else None)  # its row is still the record's
            json.loads(row_to_json(error_row(got)))
            rows_to_arrow([error_row(got)])
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": _nested(3000)}}
    assert parse_record(line).id == "c"
    assert parse_record({"id": _nested(3000), "prompt": "Hi"}).id is None  # no valid id to carry


def test_a_namedtuple_or_beam_row_is_a_record():
    class Prompted(NamedTuple):
        id: str
        prompt: str
        max_tokens: int

    for raw in (Prompted("r1", "Hi", 4), beam.Row(id="r1", prompt="Hi", max_tokens=4)):
        assert parse_record(raw) == Parsed("r1", "Hi", None, SamplingParams(max_tokens=4))


def test_nested_beam_rows_and_namedtuples_are_records_too():
    """A schema'd PCollection with a repeated struct column holds messages as beam.Rows."""
    class Message(NamedTuple):
        role: str
        content: str

    for message in (beam.Row(role="user", content="Hi"), Message("user", "Hi")):
        got = parse_record(beam.Row(id="r1", messages=[message], meta=beam.Row(source="a", line=3)))
        assert isinstance(got, Parsed), got
        assert got.messages == [{"role": "user", "content": "Hi"}]
        assert got.passthrough == {"meta": {"source": "a", "line": 3}}


class _Broken(Mapping):
    """A mapping that fails when read: a record no check foresees."""

    def __getitem__(self, key):
        raise RuntimeError("connection lost")

    def __iter__(self):
        return iter(["id", "prompt"])

    def __len__(self):
        return 2


def test_a_record_that_fails_in_an_unforeseen_way_is_still_an_error_row():
    got = parse_record(_Broken())
    assert isinstance(got, Rejected) and got.id is None
    assert got.error == "record: could not be validated (RuntimeError: connection lost)"
    rows_to_arrow([error_row(got)])


def _odd_value(rng: random.Random, depth: int = 0):
    """A value a real source might put in any field, numpy's and JSON's corner cases included."""
    leaves = [None, True, 0, -1, 2**70, 1.5, math.nan, -math.inf, "", " ", "Hi", "\ud800", "😀",
              b"\xff", np.int64(3), np.float32(0.5), np.bool_(False), np.array([1, 2]), np.array([]),
              np.datetime64("2024-01-01"), datetime.date(2024, 1, 1), {1, 2}, ("a",), object()]
    if depth < 2 and rng.random() < 0.3:
        odd_key = rng.choice([(1, 2), datetime.date(2024, 1, 1), None, 1.5, math.nan, frozenset({1}), 7])
        return rng.choice([[_odd_value(rng, depth + 1)],
                           {"role": _odd_value(rng, depth + 1), "content": _odd_value(rng, depth + 1)},
                           {odd_key: _odd_value(rng, depth + 1)}])
    return rng.choice(leaves)


def test_no_record_of_odd_values_raises_and_every_row_can_be_written():
    rng = random.Random(0)
    keys = ["id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
            "stop_token_ids", "n", "logprobs", "ignore_eos", "meta"]
    body_keys = ["messages", "prompt", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                 "temperature", "tools", "frequency_penalty", "n", "seed", "stop"]
    for _ in range(2000):
        if rng.random() < 0.7:
            record = {k: _odd_value(rng) for k in rng.sample(keys, rng.randrange(1, 6))}
            record.setdefault("id", rng.choice(["r1", 3, _odd_value(rng)]))
        else:
            body = {k: _odd_value(rng) for k in rng.sample(body_keys, rng.randrange(1, 4))}
            record = chat_line(body, method=rng.choice(["POST", _odd_value(rng)]))
        got = parse_record(record)
        assert "could not be validated" not in getattr(got, "error", ""), (record, got)
        row = (error_row(got) if isinstance(got, Rejected) else
               completion_row(got, Completion(got.id, [SampleOutput(0, [1], "ok", "stop")], 1, Timings(0.0))))
        rows_to_arrow([row])
        # Strict JSON, which other readers than Python's take: no bare NaN or Infinity.
        json.loads(row_to_json(row).encode("utf-8"), parse_constant=_refuse)
        json.loads(row_to_arrow_dict(row)["passthrough"], parse_constant=_refuse)


def _refuse(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_passthrough_that_strict_json_cannot_hold_is_written_as_text():
    record = {"id": "a", "prompt": "Hi", "score": math.nan, "bounds": [-math.inf, 1.0],
              "by_pair": {(1, 2): "x", datetime.date(2024, 1, 2): "y", 3: "z"}}
    row = completion_row(parse_record(record), Completion("a", [SampleOutput(0, [1], "ok", "stop")], 1,
                                                          Timings(0.0)))
    expected = {"score": "nan", "bounds": ["-inf", 1.0], "by_pair": {"(1, 2)": "x", "2024-01-02": "y", "3": "z"}}
    assert json.loads(row_to_json(row), parse_constant=_refuse)["passthrough"] == expected
    assert json.loads(row_to_arrow_dict(row)["passthrough"], parse_constant=_refuse) == expected


def test_a_logprob_json_cannot_hold_is_written_as_the_floor_keeping_its_column_floats():
    """-inf: a token a grammar rules out, among the top ones asked for; NaN: a broken model.
    As text ("-inf") the column would be two types for the JSONL's readers; Parquet keeps them."""
    inf = -math.inf
    output = SampleOutput(0, [1, 2], "ok", "stop", logprobs=[-0.5, math.nan],
                          top_logprobs=[{1: -0.5, 7: inf}, {2: math.nan, 3: inf}])
    row = completion_row(parse_record({"id": "a", "prompt": "Hi", "logprobs": 2, "n": 2, "note": inf}),
                         Completion("a", [output, output], 1, Timings(0.0)))
    line = json.loads(row_to_json(row), parse_constant=_refuse)
    assert line["logprobs"] == [-0.5, LOGPROB_FLOOR]
    assert line["top_logprobs"] == [[{"token_id": 1, "logprob": -0.5}, {"token_id": 7, "logprob": LOGPROB_FLOOR}],
                                    [{"token_id": 2, "logprob": LOGPROB_FLOOR}, {"token_id": 3, "logprob": LOGPROB_FLOOR}]]
    assert line["samples"][0]["logprobs"] == [-0.5, LOGPROB_FLOOR]
    assert line["samples"][0]["top_logprobs"] == line["top_logprobs"]
    assert line["passthrough"] == {"note": "-inf"}  # the record's own values: as the passthrough's rule says
    assert rows_to_arrow([row]).column("top_logprobs").to_pylist()[0][0][1]["logprob"] == inf


def test_keys_json_would_write_alike_are_refused_not_written_twice():
    """1 and "1", True and "true", None and "null", a date and its text: a row's JSON would name
    the key twice and its readers keep one (an input JSON line that names a key twice is
    refused likewise). Top-level fields leave the passthrough; nested ones take their field."""
    for a, b, text in ((1, "1", "'1'"), (True, "true", "'true'"), (None, "null", "'null'"),
                       (datetime.date(2024, 1, 2), "2024-01-02", "'2024-01-02'")):
        got = parse_record({"id": "a", "prompt": "Hi", a: "x", b: "y", "kept": 1})
        assert isinstance(got, Rejected) and got.id == "a", got
        assert got.error == f"keys {a!r} and {b!r} would be written as one JSON key, {text}"
        assert got.passthrough == {"kept": 1}
        row = error_row(got)
        assert json.loads(row_to_json(row))["passthrough"] == json.loads(row_to_arrow_dict(row)["passthrough"]) \
            == {"kept": 1}
        nested = parse_record({"id": "a", "prompt": "Hi", "meta": {a: "x", b: "y"}, "kept": 1})
        assert nested.error.startswith(f"meta: keys {a!r} and {b!r}") and nested.passthrough == {"kept": 1}
    assert isinstance(parse_record({"id": "a", "prompt": "Hi", 1: "x", 2: "y"}), Parsed)


def test_messages_are_normalised_copies():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""},
                {"role": "assistant", "content": "Ok", "tool_calls": None}]
    got = parse_record({"id": "m", "messages": messages})
    assert got.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": ""},
                            {"role": "assistant", "content": "Ok"}]
    assert got.prompt is None
    assert got.to_request() == Request("m", messages=got.messages, params=SamplingParams())


def test_a_developer_message_reaches_the_engine_as_it_is():
    """OpenAI's newer name for system instructions: the engine knows whether the chat template
    takes it (runtime/chat.py), as vLLM's renderer does."""
    got = parse_record(json.dumps(chat_line({"messages": [{"role": "developer", "content": "Be brief."},
                                                          {"role": "user", "content": "Hi"}]})))
    assert isinstance(got, Parsed), got
    assert got.messages == [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_a_nan_prompt_or_messages_is_absent():
    """pandas' DataFrame of prompt rows and chat rows holds NaN in each row's other column."""
    chat = [{"role": "user", "content": "Hi"}]
    as_prompt = parse_record({"id": "p", "prompt": "Hi", "messages": float("nan")})
    as_chat = parse_record({"id": "c", "prompt": np.float64("nan"), "messages": chat})
    assert isinstance(as_prompt, Parsed) and as_prompt.prompt == "Hi" and as_prompt.messages is None
    assert isinstance(as_chat, Parsed) and as_chat.messages == chat and as_chat.prompt is None
    neither = parse_record({"id": "n", "prompt": float("nan"), "messages": float("nan")})
    assert isinstance(neither, Rejected) and neither.error.startswith("prompt: missing")


def test_text_content_parts_reach_the_engine_as_parts():
    """The engine joins them or not, by the chat template (tests/test_engine_api.py)."""
    parts = [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour", "cache_control": None}]
    got = parse_record(json.dumps(chat_line({"messages": [{"role": "user", "content": parts}]})))
    assert isinstance(got, Parsed), got
    assert got.messages == [{"role": "user", "content": [{"type": "text", "text": "Translate:"},
                                                         {"type": "text", "text": "bonjour"}]}]


def test_text_parts_stored_as_bytes_are_text():
    """Parquet writers that store strings as binary do so in a list of structs too."""
    parts = [{"type": b"text", "text": "Translate:".encode()}, {"type": "text", "text": b"bonjour"}]
    got = parse_record({"id": "r1", "messages": [{"role": b"user", "content": parts}]})
    assert isinstance(got, Parsed), got
    assert got.messages == [{"role": "user", "content": [{"type": "text", "text": "Translate:"},
                                                         {"type": "text", "text": "bonjour"}]}]
    bad = parse_record({"id": "r1", "messages": [{"role": "user", "content": [{"type": "text", "text": b"\xff"}]}]})
    assert isinstance(bad, Rejected) and bad.error.startswith("messages[0].content[0].text: not valid UTF-8")


def test_every_sampling_field_reaches_the_params():
    got = parse_record(rec(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3,
                           stop=["\n", "END"], stop_token_ids=[2, 7], n=3, logprobs=2,
                           ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5,
                           presence_penalty=-0.25, min_tokens=2, logit_bias={"4": 1.5},
                           truncate_prompt_tokens=100, prompt_logprobs=1))
    assert got.params == SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40,
                                        seed=3, stop=("\n", "END"), stop_token_ids=(2, 7), n=3,
                                        logprobs=2, ignore_eos=True, repetition_penalty=1.2,
                                        frequency_penalty=0.5, presence_penalty=-0.25, min_tokens=2,
                                        logit_bias={4: 1.5}, truncate_prompt_tokens=100, prompt_logprobs=1)
    assert parse_record(rec(stop="###")).params.stop == ("###",)
    assert got.passthrough == {}


def test_record_fields_override_defaults_and_none_means_use_the_default():
    defaults = {"max_tokens": 64, "temperature": 0.5, "seed": 9, "stop": ["\n"]}
    got = parse_record(rec(temperature=0.0, max_tokens=None, top_k=5, seed=9), defaults)
    assert got.params == SamplingParams(max_tokens=64, temperature=0.0, seed=9, stop=("\n",),
                                        top_k=5)
    assert parse_record(rec(seed=3), defaults).params == SamplingParams(max_tokens=64, temperature=0.5,
                                                                        seed=3, stop=("\n",))
    assert parse_record(rec()).params == SamplingParams()
    assert defaults == {"max_tokens": 64, "temperature": 0.5, "seed": 9, "stop": ["\n"]}


def test_a_jobs_seed_seeds_each_record_by_its_id():
    """The same prompt under n ids (best-of-n by duplication) must not draw one sample n times;
    the same record draws the same sample every run; a record's own seed is taken as it is."""
    defaults = {"temperature": 1.0, "seed": 9}
    seeds = {rid: parse_record({"id": rid, "prompt": "Hi"}, defaults).params.seed
             for rid in ("a", "b", "c", "9")}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= seed < 2 ** 64 for seed in seeds.values())
    assert parse_record({"id": "a", "prompt": "Other"}, defaults).params.seed == seeds["a"]
    assert parse_record({"id": "b", "prompt": "Hi"}, {"seed": 10}).params.seed != seeds["b"]
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "Hi"}]}})
    assert parse_record(line, defaults).params.seed == seeds["a"]  # an OpenAI line by its custom_id
    assert parse_record({"id": "a", "prompt": "Hi", "seed": 9}, defaults).params.seed == 9
    assert parse_record("Hi", defaults, fallback_id="line-1").params.seed not in seeds.values()


def test_a_pandas_column_of_ints_with_gaps_reads_as_ints_and_defaults():
    """pandas holds a column of ints with a missing value as float64, the gap as NaN (as do
    Parquet files written from it, and JSON writers that print 2.0)."""
    rows = [{"id": "a", "prompt": "Hi", "max_tokens": np.float64(8), "temperature": np.nan,
             "stop_token_ids": np.array([5.0])},  # what DataFrame.to_dict("records") gives
            {"id": "b", "prompt": "Yo", "max_tokens": np.float64("nan"), "temperature": 0.5}]
    got = [parse_record(row, {"max_tokens": 3}) for row in rows]
    assert got[0].params == SamplingParams(max_tokens=8, stop_token_ids=(5,))
    assert isinstance(got[0].params.max_tokens, int)
    assert got[1].params == SamplingParams(max_tokens=3, temperature=0.5)
    assert parse_record('{"id": "j", "prompt": "Hi", "n": 2.0, "seed": 1e3}').params == \
        SamplingParams(n=2, seed=1000)


def test_a_records_structured_output_replaces_the_jobs_of_another_kind():
    defaults = {"json_schema": {"type": "object"}, "max_tokens": 8}
    got = parse_record(rec(choice=["yes", "no"]), defaults)
    assert got.params.choice == ("yes", "no") and got.params.json_schema is None
    assert got.params.max_tokens == 8
    assert parse_record(rec(), defaults).params.json_schema is not None
    assert "one at most" in parse_record(rec(choice=["a"], regex="b+"), defaults).error


def test_a_record_bad_field_is_its_own_fault_even_with_defaults():
    got = parse_record(rec(top_p=2), {"top_p": 0.9})
    assert isinstance(got, Rejected) and got.error.startswith("top_p: must be in (0, 1]")


@pytest.mark.parametrize("defaults, fragment", [
    ({"temprature": 0.5}, "unknown fields ['temprature']"),
    ({"temperature": "hot"}, "defaults: temperature: must be a finite number"),
    ({"max_tokens": 0}, "defaults: max_tokens: must be >= 1"),
    ({"stop": 3}, "defaults: stop: must be a string or a list"),
    ({"top_p": math.nan}, "defaults: top_p: must be a finite number, got nan"),  # --top_p nan
])
def test_bad_defaults_raise_because_they_are_the_callers_mistake(defaults, fragment):
    with pytest.raises(ValueError) as info:
        parse_record(rec(), defaults)
    assert fragment in str(info.value)
    with pytest.raises(ValueError):
        check_defaults(defaults)


def test_check_defaults_returns_the_fields_set():
    assert check_defaults(None) == {}
    # numpy values, as a record's own fields take them
    assert check_defaults({"seed": np.int64(7), "temperature": np.float32(0.5)}) == {"seed": 7, "temperature": 0.5}
    assert check_defaults({"seed": None, "n": 2}) == {"n": 2}


def test_json_lines_as_str_and_bytes():
    line = '{"id": "j1", "prompt": "Grüße 🌍", "temperature": 0.3, "extra": [1, {"a": null}]}'
    for raw in (line, line.encode("utf-8")):
        got = parse_record(raw)
        assert (got.id, got.prompt, got.params.temperature) == ("j1", "Grüße 🌍", 0.3)
        assert got.passthrough == {"extra": [1, {"a": None}]}


def test_bare_prompts_take_the_fallback_id():
    for raw in ('{"looks": "like json"}', '{"looks": "like json"}'.encode()):
        got = parse_record(raw, {"max_tokens": 4}, fallback_id="file.txt:12")
        assert got == Parsed("file.txt:12", '{"looks": "like json"}', None,
                             SamplingParams(max_tokens=4), {})
    assert parse_record({"id": "own", "prompt": "Hi"}, fallback_id="unused").id == "own"
    assert parse_record("Hi", fallback_id=" ") == Rejected(None, "id: must not be empty", {"id": " "})
    assert parse_record("  ", fallback_id="f1") == Rejected(
        "f1", "prompt: must not be empty or only whitespace", {})


def test_openai_chat_line():
    line = chat_line({"max_completion_tokens": 50, "temperature": 0.2, "top_p": 0.8, "seed": 4,
                      "stop": "\n\n", "n": 2, "logprobs": True, "top_logprobs": 3,
                      "user": "u-1", "store": False, "frequency_penalty": 0.4,
                      "presence_penalty": 0.0, "response_format": {"type": "text"},
                      "stream": False, "tools": None},
                     batch="b7")
    got = parse_record(json.dumps(line))
    assert isinstance(got, Parsed), got
    assert (got.id, got.prompt, got.messages) == ("c1", None, [{"role": "user", "content": "Hi"}])
    assert got.params == SamplingParams(max_tokens=50, temperature=0.2, top_p=0.8, seed=4,
                                        stop=("\n\n",), n=2, logprobs=3, frequency_penalty=0.4)
    assert got.passthrough == {"batch": "b7"}


def test_json_output_from_our_field_openai_response_format_and_vllm_guided_json():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    expected = SamplingParams(json_schema=schema)
    assert parse_record({"id": "x", "prompt": "Hi", "json_schema": schema}).params == expected
    assert parse_record({"id": "x", "prompt": "Hi", "json_schema": json.dumps(schema)}).params == expected
    named = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    assert parse_record(chat_line({"response_format": named})).params == SamplingParams(
        max_tokens=SamplingParams().max_tokens, json_schema=schema)
    assert parse_record(completions_line(guided_json=schema)).params.json_schema == expected.json_schema
    assert parse_record(chat_line({"response_format": {"type": "json_object"}})).params.json_schema \
        == '{"type": "object"}'
    assert parse_record(chat_line({"response_format": {"type": "text"}})).params.json_schema is None
    assert parse_record(chat_line({"guided_choice": ["yes", "no"]})).params.choice == ("yes", "no")
    assert parse_record(completions_line(guided_regex="[0-9]+")).params.regex == "[0-9]+"
    vllm = parse_record(completions_line(include_stop_str_in_output=True, skip_special_tokens=False))
    assert vllm.params.include_stop_str_in_output and not vllm.params.skip_special_tokens
    assert parse_record({"id": "x", "prompt": "Hi", "choice": ["a", "b"]}).params.choice == ("a", "b")


def test_vllm_structured_outputs_in_an_openai_body():
    """vLLM 0.32's structured_outputs (it replaced the guided_* fields)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def params(spec):
        return parse_record(chat_line({"structured_outputs": spec})).params

    assert params({"json": schema}).json_schema == SamplingParams(json_schema=schema).json_schema
    assert params({"json": json.dumps(schema), "disable_any_whitespace": True}).json_schema == \
        SamplingParams(json_schema=schema).json_schema
    assert parse_record(completions_line(structured_outputs={"regex": "[0-9]+"})).params.regex == "[0-9]+"
    assert params({"choice": ["yes", "no"], "grammar": None}).choice == ("yes", "no")
    assert params({"json_object": True}).json_schema == '{"type": "object"}'
    for spec, fragment in (({"regex": "a", "choice": ["b"]}, "give exactly one of"),
                           ({}, "got none"), ("[0-9]+", "must be an object"),
                           ({"grammar": "root ::= 'a'"}, "structured_outputs.grammar: not supported"),
                           ({"choice": ["a"], "disable_additional_properties": True}, "not supported"),
                           ({"json_object": False}, "json_object: must be true")):
        assert fragment in parse_record(chat_line({"structured_outputs": spec})).error, spec
    both = chat_line({"structured_outputs": {"regex": "a"}, "guided_regex": "b"})
    assert "give one" in parse_record(both).error


def test_openai_chat_logprobs_mapping():
    assert parse_record(chat_line({"logprobs": True})).params.logprobs == 0
    assert parse_record(chat_line({"logprobs": False})).params.logprobs is None
    assert parse_record(chat_line({"logprobs": True, "top_logprobs": 5})).params.logprobs == 5
    both = chat_line({"max_tokens": 9, "max_completion_tokens": 9})
    assert parse_record(both).params.max_tokens == 9
    negative = parse_record(chat_line({"logprobs": True, "top_logprobs": -1}))
    assert negative.error == "body.top_logprobs: must be an integer >= 0, got -1"
    assert parse_record(chat_line({"logprobs": True, "top_logprobs": 2.0})).params.logprobs == 2
    assert parse_record(chat_line({"top_logprobs": 0})).params.logprobs is None  # vLLM allows it
    # NaN (pandas' missing value) in a body is absent, as in our records.
    assert parse_record(chat_line({"max_tokens": math.nan, "max_completion_tokens": 50})).params.max_tokens == 50


def test_openai_completions_line_with_vllm_extras():
    got = parse_record(completions_line(max_tokens=12, logprobs=2, echo=False, best_of=1,
                                        top_k=20, ignore_eos=True, stop_token_ids=[5],
                                        repetition_penalty=1.1),
                       {"temperature": 0.6})
    assert (got.id, got.prompt, got.messages) == ("c2", "Once", None)
    assert got.params == SamplingParams(max_tokens=12, temperature=0.6, logprobs=2, top_k=20,
                                        ignore_eos=True, stop_token_ids=(5,), repetition_penalty=1.1)


def test_openai_bodies_take_vllms_request_fields_at_their_no_op_values():
    """Files written for vLLM may spell out its defaults; other values still say why not."""
    defaults = {"add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {},
                "use_beam_search": False, "length_penalty": 1.0, "bad_words": []}
    assert parse_record(chat_line(defaults)).params == parse_record(chat_line({})).params
    assert parse_record(completions_line(use_beam_search=False, allowed_token_ids=[])).prompt == "Once"
    refused = parse_record(chat_line({"use_beam_search": True}))
    assert refused.error == "body.use_beam_search: not supported (only False is), got True"


def test_openai_lines_with_a_null_id_as_parquet_mixes_them_with_ours():
    """pyarrow fills a column a row lacks with nulls: OpenAI rows get id null, ours custom_id
    and body null."""
    ours = rec()
    line = chat_line({})
    mixed = pa.concat_tables([pa.Table.from_pylist([ours]), pa.Table.from_pylist([line])],
                             promote_options="default")
    got = [parse_record(row) for row in parquet_records(mixed)]
    assert [type(g) for g in got] == [Parsed, Parsed] and [g.id for g in got] == ["r1", "c1"]
    assert got[1].messages == [{"role": "user", "content": "Hi"}]
    for ours in ({"custom_id": None, "body": None}, {"custom_id": "crm-17", "body": "an email"},
                 {"body": {"text": "an email"}}):  # fields of its own named like OpenAI's
        missing = parse_record({"id": None, "prompt": "Hi", **ours})
        assert missing.error.startswith("id: missing") and missing.id is None
        assert missing.passthrough == ours


def test_logit_bias_from_json_objects_and_parquet_maps():
    """JSON object keys are strings; a Parquet map column reads as (key, value) pairs."""
    expected = ((7, -100.0), (50, 2.5))
    from_openai = parse_record(chat_line({"logit_bias": {"50": 2.5, "7": -100}, "min_tokens": 3}))
    assert from_openai.params.logit_bias == expected and from_openai.params.min_tokens == 3
    assert parse_record(rec(logit_bias={7: -100, 50: 2.5})).params.logit_bias == expected
    assert parse_record(rec(logit_bias=[("50", 2.5), ("7", -100.0)])).params.logit_bias == expected
    assert parse_record(rec(logit_bias={"-1": 5})).error.startswith("logit_bias: must be >= 0, got -1")


def test_a_record_of_ours_may_carry_fields_named_body_or_custom_id():
    got = parse_record(rec(body={"text": "an email"}, custom_id="crm-991"))
    assert isinstance(got, Parsed) and got.id == "r1"
    assert got.passthrough == {"body": {"text": "an email"}, "custom_id": "crm-991"}


# ---- Output rows ----

TIMINGS = Timings(submitted=100.0, first_scheduled=100.25, first_token=100.75, finished=103.5)


def test_completion_row_n1():
    parsed = parse_record(rec(logprobs=0, meta={"k": [1]}))
    completion = Completion("r1", [SampleOutput(0, [5, 6, 7], "abc", "stop", [-0.5, -1.25, -0.0])],
                            prompt_tokens=4, timings=TIMINGS)
    row = completion_row(parsed, completion)
    assert list(row) == ROW_KEYS
    assert row == {"id": "r1", "text": "abc", "token_ids": [5, 6, 7], "finish_reason": "stop",
                   "stop_reason": None, "stop_token_id": None, "prompt_tokens": 4, "completion_tokens": 3, "error": None, "error_type": None, "samples": None,
                   "logprobs": [-0.5, -1.25, -0.0], "top_logprobs": None, "prompt_token_ids": None,
                   "prompt_logprobs": None, "prompt_ranks": None, "prompt_top_logprobs": None, "queue_s": 0.25,
                   "first_token_s": 0.75, "total_s": 3.5, "chat": False, "echo": None, "passthrough": {"meta": {"k": [1]}}}


def test_a_scored_prompt_keeps_its_logprobs_through_parquet_and_jsonl(tmp_path):
    parsed = parse_record(rec(prompt_logprobs=0, max_tokens=1))
    completion = Completion("r1", [SampleOutput(0, [5], "a", "length")], 3, TIMINGS,
                            prompt_token_ids=[1, 8, 3], prompt_logprobs=[None, -2.5, -0.125],
                            prompt_ranks=[None, 7, 1])
    row = completion_row(parsed, completion)
    scored = {"prompt_token_ids": [1, 8, 3], "prompt_logprobs": [None, -2.5, -0.125], "prompt_ranks": [None, 7, 1]}
    for read_back in (row, arrow_to_rows(rows_to_arrow([row]))[0], row_from_json(row_to_json(row))):
        assert {name: read_back[name] for name in scored} == scored


def test_top_logprobs_reach_the_row_likeliest_first_through_parquet_and_jsonl():
    parsed = parse_record(rec(n=2, temperature=1.0, logprobs=2, prompt_logprobs=1))
    outputs = [SampleOutput(0, [5, 6], "ab", "stop", [-0.5, -2.0], [{5: -0.5, 9: -1.5}, {7: -0.25, 6: -2.0}],
                            stop_reason="\n\n"),
               SampleOutput(1, [9], "c", "stop", [-1.5], [{5: -0.5, 9: -1.5}], stop_reason=9)]
    completion = Completion("r1", outputs, 2, TIMINGS, prompt_logprobs=[None, -3.0],
                            prompt_top_logprobs=[None, {4: -0.75}])
    row = completion_row(parsed, completion)
    assert row["top_logprobs"] == [[{"token_id": 5, "logprob": -0.5}, {"token_id": 9, "logprob": -1.5}],
                                   [{"token_id": 7, "logprob": -0.25}, {"token_id": 6, "logprob": -2.0}]]
    assert row["prompt_top_logprobs"] == [None, [{"token_id": 4, "logprob": -0.75}]]
    [sample] = row["samples"]
    assert sample["logprobs"] == [-1.5] and sample["top_logprobs"] == row["top_logprobs"][:1]
    assert (row["stop_reason"], row["stop_token_id"]) == ("\n\n", None)
    assert (sample["stop_reason"], sample["stop_token_id"]) == (None, 9)
    assert arrow_to_rows(rows_to_arrow([row]))[0] == row
    assert row_from_json(row_to_json(row)) == row


def test_completion_row_n3_lists_the_other_samples():
    parsed = parse_record(rec(n=3, temperature=1.0, seed=1))
    outputs = [SampleOutput(0, [1, 2], "ab", "length"), SampleOutput(1, [3], "c", "stop", stop_reason=3),
               SampleOutput(2, [4, 5], "de", "length")]
    row = completion_row(parsed, Completion("r1", outputs, 2, TIMINGS))
    assert (row["text"], row["token_ids"], row["finish_reason"]) == ("ab", [1, 2], "length")
    assert row["completion_tokens"] == 5
    assert row["samples"] == [
        {"text": "c", "token_ids": [3], "finish_reason": "stop", "stop_reason": None, "stop_token_id": 3,
         "logprobs": None, "top_logprobs": None},
        {"text": "de", "token_ids": [4, 5], "finish_reason": "length", "stop_reason": None,
         "stop_token_id": None, "logprobs": None, "top_logprobs": None}]
    assert row["logprobs"] is None


def test_engine_error_completion_becomes_an_error_row():
    parsed = parse_record(rec(src="x"))
    completion = Completion("r1", [SampleOutput(0, [], "", "error")], 0,
                            Timings(submitted=5.0, finished=5.5),
                            error="prompt too long: 9000 tokens")
    row = completion_row(parsed, completion)
    assert row == {"id": "r1", "text": None, "token_ids": [], "finish_reason": "error",
                   "stop_reason": None, "stop_token_id": None, "prompt_tokens": 0, "completion_tokens": 0,
                   "error": "prompt too long: 9000 tokens", "error_type": "engine", "samples": None, "logprobs": None,
                   "top_logprobs": None, "prompt_token_ids": None, "prompt_logprobs": None,
                   "prompt_ranks": None, "prompt_top_logprobs": None,
                   "queue_s": None, "first_token_s": None, "total_s": 0.5, "chat": False, "echo": None,
                   "passthrough": {"src": "x"}}


def test_error_row_from_an_id_or_a_rejected():
    row = error_row("r9", "engine crashed", {"a": 1})
    assert list(row) == ROW_KEYS
    assert (row["id"], row["error"], row["passthrough"], row["token_ids"]) == \
        ("r9", "engine crashed", {"a": 1}, [])
    rejected = Rejected(None, "record: invalid JSON", {"raw": "{"})
    assert error_row(rejected)["passthrough"] == {"raw": "{"}
    assert error_row(rejected, "replaced", {})["error"] == "replaced"
    assert error_row(rejected, "replaced", {})["passthrough"] == {}
    assert row["chat"] is None and error_row(rejected)["chat"] is None  # did not parse
    assert row["error_type"] == error_row(rejected)["error_type"] == "record"
    with pytest.raises(TypeError):
        error_row("r9")


def test_a_row_says_whether_its_record_was_a_chat():
    done = Completion("r1", [SampleOutput(0, [5], "a", "stop")], 2, TIMINGS)
    chat = parse_record({"id": "c", "messages": [{"role": "user", "content": "Hi"}]})
    line = parse_record({"custom_id": "o", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": "Hi"}]}})
    text = parse_record({"custom_id": "t", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "Hi"}})
    assert completion_row(chat, done)["chat"] is True and completion_row(line, done)["chat"] is True
    assert completion_row(text, done)["chat"] is False
    failed = Completion.failed("r1", "engine crashed")
    assert completion_row(chat, failed)["chat"] is True  # an engine error: the record parsed
    assert completion_row(chat, failed)["error_type"] == "engine"
    refused = Completion.failed("r1", "prompt has 9000 tokens; the context holds 8192", invalid=True)
    assert completion_row(chat, refused)["error_type"] == "record"
    assert completion_row(chat, done)["error_type"] is None


def sample_rows():
    """Rows of every shape: n = 1 with logprobs, n = 3, engine error, rejected without an id,
    unicode, empty and nested passthrough, missing timings."""
    with_logprobs = completion_row(
        parse_record(rec(id="ü-1", logprobs=1, meta={"nested": {"list": [1, "two", None, 3.5]},
                                                     "flag": False})),
        Completion("ü-1", [SampleOutput(0, [11, 2**31 - 1], "日本語 — ok 🚀", "length",
                                        [-0.1234567890123, -7.5])], 6, TIMINGS))
    n3 = completion_row(
        parse_record(rec(id="n3", n=3)),
        Completion("n3", [SampleOutput(0, [1], "a", "stop"), SampleOutput(1, [], "", "stop"),
                          SampleOutput(2, [2, 3], "ç\n\"q\"", "length")], 1,
                   Timings(submitted=1.0, first_scheduled=1.5)))
    engine_error = completion_row(
        parse_record(rec(id="e")),
        Completion("e", [SampleOutput(0, [], "", "error")], 0, Timings(0.0), error="bad prompt"))
    rejected = error_row(parse_record(b"\xff{"))
    return [with_logprobs, n3, engine_error, rejected]


def test_rows_round_trip_through_parquet(tmp_path):
    rows = sample_rows()
    path = tmp_path / "out.parquet"
    pq.write_table(rows_to_arrow(rows), path)
    table = pq.read_table(path)
    assert table.schema.equals(OUTPUT_SCHEMA)
    back = arrow_to_rows(table)
    assert back == rows
    for got, want in zip(back, rows):
        assert list(got) == ROW_KEYS
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}


def test_rows_round_trip_through_jsonl(tmp_path):
    rows = sample_rows()
    path = tmp_path / "out.jsonl"
    path.write_text("".join(row_to_json(r) + "\n" for r in rows), encoding="utf-8")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(rows)
    assert "日本語" in lines[0] and '"nested": {' in lines[0]
    back = [row_from_json(line) for line in lines]
    assert back == rows
    for got, want in zip(back, rows):
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}


def test_empty_table_has_the_schema():
    table = rows_to_arrow([])
    assert table.num_rows == 0 and table.schema.equals(OUTPUT_SCHEMA)
    assert arrow_to_rows(table) == []


def test_passthrough_values_json_cannot_hold_are_written_as_text():
    row = error_row("d", "x", {"day": datetime.date(2024, 5, 1)})
    assert row_from_json(row_to_json(row))["passthrough"] == {"day": "2024-05-01"}
    assert arrow_to_rows(rows_to_arrow([row]))[0]["passthrough"] == {"day": "2024-05-01"}


def test_passthrough_bytes_are_written_in_base64():
    """As BigQuery and protobuf's JSON mapping write them (a Parquet binary column gives bytes)."""
    blob = bytes(range(256))
    record = {"id": "b", "prompt": "Hi", "blob": blob, "parts": [b"\xff\x00", np.bytes_(b"ok")]}
    row = error_row("b", "x", parse_record(record).passthrough)
    for written in (row_from_json(row_to_json(row)), arrow_to_rows(rows_to_arrow([row]))[0]):
        assert base64.b64decode(written["passthrough"]["blob"]) == blob
        assert [base64.b64decode(p) for p in written["passthrough"]["parts"]] == [b"\xff\x00", b"ok"]


@pytest.mark.parametrize("record", [
    {"id": "t", "prompt_token_ids": [5, 6, 7]},
    {"id": "t", "prompt_token_ids": np.array([5, 6, 7])},  # a Parquet list column through pandas
    {"id": "t", "prompt_token_ids": [5.0, 6, 7]},  # a JSON writer's whole floats
    {"id": "t", "prompt_token_ids": (5, 6, 7)},  # an in-memory record's tuple, as messages may be
    {"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6, 7]}},
    {"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": [[5, 6, 7]]}},
])
def test_a_tokenized_prompt_reaches_the_engine_as_token_ids(record):
    parsed = parse_record(record)
    assert parsed.prompt is None and parsed.prompt_token_ids == [5, 6, 7]
    request = parsed.to_request()
    assert request.prompt_token_ids == [5, 6, 7] and request.prompt is None
    assert parse_record({"id": "t", "prompt_token_ids": [5, 6, 8]}).request_digest != parsed.request_digest


def test_an_openai_prompt_in_a_one_item_list_is_that_prompt():
    parsed = parse_record({"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["Hi"]}})
    assert parsed.prompt == "Hi" and parsed.prompt_token_ids is None


def test_echo_scores_the_prompt_with_the_logprobs_the_job_gives():
    """vLLM's rule, prompt_logprobs default to the logprobs: the job's too, where the line has none."""
    line = {"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "echo": True}}
    assert parse_record(line, {"logprobs": 2}).params.prompt_logprobs == 2
    assert parse_record(line).params.prompt_logprobs is None
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}], "echo": True}}
    assert parse_record(chat, {"logprobs": 3}).params.prompt_logprobs == 3
    assert parse_record(chat).params.prompt_logprobs == 0
    assert parse_record(line, {"logprobs": 2, "prompt_logprobs": 4}).params.prompt_logprobs == 4
