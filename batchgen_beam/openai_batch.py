"""Output rows as OpenAI Batch API output lines: what OpenAI's Batch API and `vllm run-batch`
write, for readers of those files.

Pure Python: no Beam, no model math. A row becomes one line:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`.
- A chat row (`row["chat"]`) gets a `chat.completion` body, a prompt row a `text_completion`
  one: the endpoints OpenAI Batch lines name (`/v1/chat/completions` needs messages,
  `/v1/completions` a prompt), so a line's answer has the shape its request asked for.
- `choices` holds the n samples; each carries vLLM's `stop_reason` (the stop string or stop
  token id that ended it, null for the tokenizer's EOS token) beside `finish_reason`.
- Logprobs take each endpoint's shape, with each token's text (runtime.tokenizer.TokenTexts);
  a -inf logprob is written as -9999.0, as vLLM writes it, since JSON has no infinity. A
  completion's `top_logprobs` hold the chosen token too, as OpenAI's spec has them; chat's hold
  the top ones alone.
- A line asked with `echo` shows the row's `echo` (rows.echo_text) before each choice's
  text; a completion's, with logprobs, the prompt's tokens before the choice's too (vLLM's
  shape: the first with no logprob and null top ones).
- A record that failed has OpenAI's HTTP error shape: status 400 and an
  `invalid_request_error` where the record was at fault (`error_type` "record": it did not
  parse, or the engine refused its prompt or values), 500 and a `server_error` where the
  engine failed it (a retry may succeed); the row's message is `body.error.message`.
- Prompt logprobs (scoring) take vLLM's shape, the body's `prompt_logprobs` for chat and each
  choice's for a completion: per prompt token, null for the first, then {token id: {"logprob",
  "rank", "decoded_token"}}, the prompt token first (its rank: how many tokens are at least as
  likely), then the top ones ranked 1, 2, ...; a prompt token among them keeps its place and
  takes the top one's rank. Token texts follow the same rules, read after the prompt's
  first token (as vLLM reads them).
"""

import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from batchgen_beam.rows import LOGPROB_FLOOR

if TYPE_CHECKING:  # transformers: loaded only where a row needs token texts
    from runtime.tokenizer import TokenTexts



def response_line(row: Mapping, *, model: str, created: int,
                  token_texts: Callable[[], "TokenTexts"] | None = None) -> dict:
    """The OpenAI Batch output line for one output row. `token_texts()` gives the model's
    runtime.tokenizer.TokenTexts: `texts(completion)(token_id, position)` is the text of a token
    at a position of the completion's tokens (or of the prompt's); it is called only for rows
    with logprobs or prompt_logprobs, which need it."""
    if row["error"] is None and row["prompt_logprobs"] is not None and row.get("prompt_token_ids") is None:
        return _error_line(row, 400, "invalid_request_error",  # a row written before they were columns
                           "prompt_logprobs: this row has no prompt_token_ids, which OpenAI's output "
                           "format keys them by; rerun it")
    if (row["error"] is None and row.get("echo") is not None and not row.get("chat")
            and row["logprobs"] is not None and row["prompt_logprobs"] is None):
        return _error_line(row, 400, "invalid_request_error",  # records.parse_record scores them
                           "echo: this row's prompt was not scored, which its logprobs list first; rerun it")
    if row["error"] is not None:
        if row.get("error_type") == "record":  # .get: rows written before it was a column
            return _error_line(row, 400, "invalid_request_error", row["error"])
        return _error_line(row, 500, "server_error", row["error"])
    chat = row.get("chat")
    samples = [row, *(row["samples"] or [])]
    wanted = row["prompt_logprobs"] is not None or any(sample["logprobs"] is not None for sample in samples)
    token_texts = token_texts() if wanted else None
    if chat:
        choices = [_chat_choice(index, sample, token_texts, row) for index, sample in enumerate(samples)]
    else:
        # The echoed prompt's tokens, listed before every choice's (whose logprobs ask the same).
        echoed = _echoed(row, token_texts) if row.get("echo") is not None and row["logprobs"] is not None else []
        choices = [_text_choice(index, sample, token_texts, row.get("echo"), echoed)
                   for index, sample in enumerate(samples)]
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": row["prompt_tokens"],
                      "completion_tokens": row["completion_tokens"],
                      "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}}
    if row["prompt_logprobs"] is not None:
        scored = _prompt_logprobs(row, token_texts)
        for holder in [body] if chat else body["choices"]:
            holder["prompt_logprobs"] = scored
    return _line(row, 200, body)


def _line(row: Mapping, status: int, body: dict) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row["id"],
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None}


def _error_line(row: Mapping, status: int, kind: str, message: str) -> dict:
    return _line(row, status, {"error": {"message": message, "type": kind, "param": None,
                                         "code": None}})


def _stop_reason(sample: Mapping) -> str | int | None:
    return sample["stop_reason"] if sample["stop_reason"] is not None else sample["stop_token_id"]


def _chat_choice(index: int, sample: Mapping, token_texts, row: Mapping) -> dict:
    logprobs = None
    if sample["logprobs"] is not None:
        text = token_texts(sample["token_ids"])
        logprobs = {"content": [
            {**_chat_token(text(token, at), logprob),
             "top_logprobs": [_chat_token(text(top["token_id"], at), top["logprob"]) for top in tops]}
            for at, token, logprob, tops in _positions(sample)]}
    content = (row.get("echo") or "") + sample["text"]  # .get: rows written before it was a column
    return {"index": index, "message": {"role": "assistant", "content": content, "refusal": None},
            "logprobs": logprobs, "finish_reason": sample["finish_reason"],
            "stop_reason": _stop_reason(sample)}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _text_choice(index: int, sample: Mapping, token_texts, echo: str | None,
                 echoed: list[tuple[str, float | None, list[tuple[str, float]]]]) -> dict:
    logprobs = None
    if sample["logprobs"] is not None:
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset, text = 0, token_texts(sample["token_ids"])
        generated = ((text(token, at), logprob, [(text(top["token_id"], at), top["logprob"]) for top in tops])
                     for at, token, logprob, tops in _positions(sample))
        for token, logprob, tops in [*echoed, *generated]:
            logprobs["tokens"].append(token)
            logprobs["token_logprobs"].append(None if logprob is None else _finite(logprob))
            # The chosen one, then the top ones, as OpenAI's spec has it ("up to logprobs + 1")
            # and in vLLM's order; where two show the same text, the chosen one's logprob
            # (vLLM's overwrites it).
            logprobs["top_logprobs"].append(
                None if logprob is None else {token: _finite(logprob),
                                              **{t: _finite(lp) for t, lp in tops if t != token}})
            logprobs["text_offset"].append(offset)
            offset += len(token)
    return {"index": index, "text": (echo or "") + sample["text"], "logprobs": logprobs,
            "finish_reason": sample["finish_reason"], "stop_reason": _stop_reason(sample)}


def _echoed(row: Mapping, token_texts) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    """An echoed prompt's tokens as a completion's logprobs list them, vLLM's way: per token its
    text, logprob and top ones; the first has no logprob, and its text is its bytes decoded
    alone; the top ones are the first `asked` (the body's logprobs) of the prompt logprobs
    other than the prompt token (which vLLM lists first and keeps `asked` + 1 of)."""
    # As many as a generated position holds; none generated (echo with max_tokens 0): all of
    # the prompt logprobs', which default to the body's logprobs.
    asked = len((row["top_logprobs"] or [[]])[0] or []) if row["token_ids"] else None
    prompt = row["prompt_token_ids"]
    text = token_texts(prompt[1:])
    tops = row["prompt_top_logprobs"] or [None] * len(prompt)
    positions = [(token_texts.decoded(prompt[0]), None, [])]
    for at in range(1, len(prompt)):
        others = [top for top in tops[at] or [] if top["token_id"] != prompt[at]][slice(asked)]
        positions.append((text(prompt[at], at - 1), row["prompt_logprobs"][at],
                          [(text(top["token_id"], at - 1), top["logprob"]) for top in others]))
    return positions


def _prompt_logprobs(row: Mapping, token_texts) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token after the first, its logprob and rank and the top
    ones ranked 1, 2, ..., keyed by token id, each with its text."""
    prompt = row["prompt_token_ids"]
    text = token_texts(prompt[1:])
    tops = row["prompt_top_logprobs"] or [None] * len(prompt)
    scored: list[dict | None] = [None]
    for position in range(1, len(prompt)):
        ranked = [(prompt[position], row["prompt_logprobs"][position], row["prompt_ranks"][position]),
                  *((top["token_id"], top["logprob"], rank) for rank, top in enumerate(tops[position] or [], 1))]
        scored.append({token: {"logprob": _finite(logprob), "rank": rank,
                               "decoded_token": text(token, position - 1)}
                       for token, logprob, rank in ranked})
    return scored


def _positions(sample: Mapping):
    """Per generated token: its position, its id, its logprob and the top logprobs there."""
    ids = sample["token_ids"]
    tops = sample["top_logprobs"] or [None] * len(ids)
    for position, (token, logprob, top) in enumerate(zip(ids, sample["logprobs"], tops, strict=True)):
        yield position, token, logprob, top or []


def _finite(logprob: float | str) -> float:
    """A logprob JSON can hold: -inf and NaN (NaN logits: a broken model or an fp16 overflow)
    as LOGPROB_FLOOR."""
    logprob = float(logprob)
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR
