"""Output rows as OpenAI Batch API output lines (batchgen_beam/openai_batch.py) and the token
texts their logprobs show (runtime.tokenizer.TokenTexts)."""

import json
import math

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from batchgen_beam.openai_batch import response_line
from batchgen_beam.records import parse_record
from batchgen_beam.rows import completion_row, error_row, row_to_json
from runtime.request import Completion, SampleOutput, Timings
from runtime.tokenizer import TokenTexts
from helpers import CallCounter
from output_rows import arrow_to_rows, row_from_json, rows_to_arrow
from tiny_models import make_tiny_tokenizer

TIMINGS = Timings(submitted=1.0, first_scheduled=1.5, first_token=2.0, finished=3.0)
TEXTS = {5: "Hel", 6: "lo", 7: "!", 9: " there", 11: "\ufffd"}


class FakeTexts:
    """TokenTexts' interface over a table, checking each position read lies in the completion."""

    def __init__(self, table):
        self.table = table

    def __call__(self, completion):
        def text(token_id, position):
            assert 0 <= position < len(completion)
            return self.table(token_id, position)
        return text

    def decoded(self, token_id):
        return f"<{token_id}>"


def texts():
    return FakeTexts(lambda token_id, position: TEXTS[token_id])


def chat_record(**body):
    return {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "Hi"}], **body}}


def text_record(**body):
    return {"custom_id": "q-2", "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt-x", "prompt": "Say", **body}}


def line_of(record, *outputs, prompt_tokens=4, **completion):
    row = completion_row(parse_record(record), Completion("r", list(outputs), prompt_tokens, TIMINGS,
                                                          **completion))
    line = response_line(row, model="m", created=1234, token_texts=texts)
    json.dumps(line, allow_nan=False)  # strict JSON
    return line


def test_a_chat_row_is_a_chat_completion_with_openai_logprobs():
    line = line_of(chat_record(logprobs=True, top_logprobs=2),
                   SampleOutput(0, [5, 6, 7], "Hello!", "stop", [-0.5, -0.25, -math.inf],
                                [{5: -0.5, 9: -1.5}, {6: -0.25, 7: -2.0}, {7: -math.inf, 9: -math.inf}],
                                stop_reason="\n"))
    assert line["custom_id"] == "q-1" and line["error"] is None
    assert line["id"].startswith("batch_req_")
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    body = response["body"]
    assert body["id"].startswith("chatcmpl-")
    assert {k: body[k] for k in ("object", "created", "model", "usage")} == {
        "object": "chat.completion", "created": 1234, "model": "m",
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": "Hello!", "refusal": None}
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "\n")
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hel", "lo", "!"]
    assert content[0] == {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
                          "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                                           {"token": " there", "logprob": -1.5,
                                            "bytes": list(b" there")}]}
    # JSON has no -inf: vLLM's stand-in.
    assert content[2]["logprob"] == -9999.0
    assert [t["logprob"] for t in content[2]["top_logprobs"]] == [-9999.0, -9999.0]


def test_a_prompt_row_is_a_text_completion_with_legacy_logprobs():
    line = line_of(text_record(logprobs=1, n=2, temperature=1.0),
                   SampleOutput(0, [5, 6], "Hello", "length", [-0.5, -0.25], [{5: -0.5}, {7: -0.125}]),
                   SampleOutput(1, [9, 11], " there\ufffd", "stop", [-1.5, -3.0], [{5: -0.5}, {11: -3.0}],
                                stop_reason=11))
    body = line["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    first, second = body["choices"]
    assert (first["index"], first["text"], first["finish_reason"], first["stop_reason"]) == (0, "Hello", "length", None)
    assert first["logprobs"] == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.25],
                                 # the top one, and the chosen one where it is not
                                 "top_logprobs": [{"Hel": -0.5}, {"!": -0.125, "lo": -0.25}],
                                 "text_offset": [0, 3]}
    assert list(first["logprobs"]["top_logprobs"][1]) == ["lo", "!"]  # the chosen one first, as vLLM
    assert (second["index"], second["stop_reason"]) == (1, 11)  # a stop token id
    assert second["logprobs"]["text_offset"] == [0, 6]


def test_rows_read_back_from_jsonl_and_parquet_give_the_same_line(tmp_path):
    """JSONL holds -inf and NaN as text ("-inf", "nan"); JSON lines hold neither: -9999.0."""
    row = completion_row(parse_record(text_record(logprobs=1)),
                         Completion("r", [SampleOutput(0, [5, 6], "Hello", "length", [-math.inf, math.nan],
                                                       [{5: -math.inf}, {7: -0.5}])], 4, TIMINGS))
    lines = [response_line(r, model="m", created=0, token_texts=texts)["response"]["body"]["choices"]
             for r in (row, row_from_json(row_to_json(row)), arrow_to_rows(rows_to_arrow([row]))[0])]
    assert lines[0] == lines[1] == lines[2]
    assert lines[0][0]["logprobs"]["token_logprobs"] == [-9999.0, -9999.0]
    json.dumps(lines[0], allow_nan=False)


def test_logprobs_without_top_ones_and_no_logprobs():
    line = line_of(chat_record(logprobs=True), SampleOutput(0, [7], "!", "length", [-0.125]))
    [entry] = line["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert entry["top_logprobs"] == []
    line = line_of(text_record(logprobs=0), SampleOutput(0, [7], "!", "length", [-0.125]))
    assert line["response"]["body"]["choices"][0]["logprobs"]["top_logprobs"] == [{"!": -0.125}]

    def untouched():
        raise AssertionError("no logprobs: no token text needed")

    row = completion_row(parse_record(chat_record()),
                         Completion("r", [SampleOutput(0, [7], "!", "length")], 4, TIMINGS))
    choice = response_line(row, model="m", created=0, token_texts=untouched)["response"]["body"]["choices"][0]
    assert choice["logprobs"] is None


@pytest.mark.parametrize("record, named", [
    (chat_record(max_completion_tokens=0), "body.max_completion_tokens: must be >= 1"),
    (text_record(max_tokens=0.5), "body.max_tokens: "),
    (chat_record(structured_outputs={"regex": "("}), "body.structured_outputs.regex: must be a regular expression"),
    (chat_record(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}),
     "body.response_format: must be a schema"),
    (text_record(guided_choice=[]), "body.guided_choice: "),
    (chat_record(max_tokens=-1, max_completion_tokens=None), "body.max_tokens: "),  # null: not given
    (text_record(guided_choice=[""], guided_regex=None, response_format=None), "body.guided_choice: "),
])
def test_a_line_s_error_names_the_body_key_it_gave_not_the_field_it_became(record, named):
    assert parse_record(record).error.startswith(named)


def test_an_error_the_engine_finds_names_the_body_key_too():
    """Past the engine's max_logprobs, a token id past its vocabulary: found only at submit."""
    for record, error, named in (
            (chat_record(logprobs=True, top_logprobs=21), "logprobs: must be <= the engine's max_logprobs, 20",
             "body.top_logprobs: must be <= "),
            (text_record(prompt=[5, 99999]), "prompt_token_ids must be a list of integers in [0, 384)",
             "body.prompt must be a list of integers"),
            (chat_record(), "the engine failed while this request was in flight", "the engine failed")):
        row = completion_row(parse_record(record), Completion.failed("r", error, TIMINGS))
        assert row["error"].startswith(named), row["error"]


def test_failed_records_have_openai_s_http_error_shape():
    rejected = parse_record(chat_record(temperature="hot"))
    line = response_line(error_row(rejected), model="m", created=0)
    assert line["custom_id"] == "q-1" and line["error"] is None
    assert line["response"]["status_code"] == 400
    error = line["response"]["body"]["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("body.temperature:")
    assert set(error) == {"message", "type", "param", "code"}

    refused = completion_row(parse_record(chat_record()),
                             Completion.failed("r", "prompt has 9 tokens; the context holds 8", invalid=True))
    line = response_line(refused, model="m", created=0)
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["type"] == "invalid_request_error"

    failed = completion_row(parse_record(chat_record()), Completion.failed("r", "engine crashed"))
    line = response_line(failed, model="m", created=0)
    assert line["response"]["status_code"] == 500
    assert line["response"]["body"]["error"]["type"] == "server_error"
    assert line["response"]["body"]["error"]["message"] == "engine crashed"

    unparsed = parse_record(b"not json", fallback_id=None)
    assert response_line(error_row(unparsed), model="m", created=0)["custom_id"] is None


def prompt_texts():
    """Token texts that name the token and the position read, to check what is read where."""
    return FakeTexts(lambda token_id, position: f"{token_id}@{position}")


def test_prompt_logprobs_take_vllm_s_shape():
    """Per prompt token after the first: the token (its rank as given), then the top ones ranked
    1, 2, ...; one of them that is the prompt token keeps its place and takes its top rank.
    Chat: in the body; a completion: in each choice. Texts are read after the first token."""
    scored = dict(prompt_token_ids=[3, 5, 9], prompt_logprobs=[None, -1.5, -math.inf],
                  prompt_ranks=[None, 1, 40], prompt_top_logprobs=[None, {5: -1.5, 6: -1.75}, {7: -0.5, 6: -1.0}])
    want = [None,
            {5: {"logprob": -1.5, "rank": 1, "decoded_token": "5@0"},
             6: {"logprob": -1.75, "rank": 2, "decoded_token": "6@0"}},
            {9: {"logprob": -9999.0, "rank": 40, "decoded_token": "9@1"},
             7: {"logprob": -0.5, "rank": 1, "decoded_token": "7@1"},
             6: {"logprob": -1.0, "rank": 2, "decoded_token": "6@1"}}]
    samples = [SampleOutput(0, [7], "!", "length"), SampleOutput(1, [9], " there", "length")]
    for record, holders in ((chat_record(prompt_logprobs=2), lambda body: [body]),
                            (text_record(prompt_logprobs=2, n=2, temperature=1.0), lambda body: body["choices"])):
        row = completion_row(parse_record(record), Completion("r", samples[:record["body"].get("n", 1)],
                                                              3, TIMINGS, **scored))
        for read_back in (row, row_from_json(row_to_json(row)), arrow_to_rows(rows_to_arrow([row]))[0]):
            body = response_line(read_back, model="m", created=0, token_texts=prompt_texts)["response"]["body"]
            for holder in holders(body):
                assert holder["prompt_logprobs"] == want
                assert [list(at) for at in holder["prompt_logprobs"][1:]] == [[5, 6], [9, 7, 6]]  # in vLLM's order
            assert json.loads(json.dumps(body, allow_nan=False))["choices"]  # strict JSON, int keys as text


def test_prompt_logprobs_zero_give_the_prompt_tokens_alone():
    line = line_of(text_record(prompt_logprobs=0), SampleOutput(0, [7], "!", "length"), prompt_tokens=2,
                   prompt_token_ids=[3, 5], prompt_logprobs=[None, -2.0], prompt_ranks=[None, 4])
    [choice] = line["response"]["body"]["choices"]
    assert choice["prompt_logprobs"] == [None, {5: {"logprob": -2.0, "rank": 4, "decoded_token": "Hel"}}]


def test_a_row_with_prompt_logprobs_but_no_prompt_ids_is_an_error_line_not_a_line_without_them():
    row = completion_row(parse_record(text_record(prompt_logprobs=0)),
                         Completion("r", [SampleOutput(0, [7], "!", "length")], 2, TIMINGS,
                                    prompt_logprobs=[None, -2.0], prompt_ranks=[None, 4]))
    del row["prompt_token_ids"]  # a row an earlier release wrote
    line = response_line(row, model="m", created=0, token_texts=texts)
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["message"].startswith("prompt_logprobs:")


def test_each_line_has_ids_of_its_own():
    record = chat_record()
    lines = [line_of(record, SampleOutput(0, [7], "!", "length")) for _ in range(3)]
    for key in (lambda l: l["id"], lambda l: l["response"]["request_id"],
                lambda l: l["response"]["body"]["id"]):
        assert len({key(l) for l in lines}) == 3


# ---- TokenTexts ----

def shown(texts, ids):
    text = texts(ids)
    return [text(token, position) for position, token in enumerate(ids)]


def test_token_texts_of_a_byte_level_tokenizer(tmp_path):
    tokenizer = make_tiny_tokenizer(tmp_path)
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(" hello world", add_special_tokens=False)
    assert shown(texts, ids) == [tokenizer.decode([i]) for i in ids]
    assert "".join(shown(texts, ids)) == " hello world"
    assert texts([tokenizer.eos_token_id])(tokenizer.eos_token_id, 0) == tokenizer.eos_token


def test_a_character_split_across_tokens_shows_whole_on_the_token_that_completes_it(tmp_path):
    """vLLM's rule: the pieces before show as "", so the tokens' texts join into the text."""
    tokenizer = make_tiny_tokenizer(tmp_path)
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("a漢b😀", add_special_tokens=False)
    pieces = shown(texts, ids)
    assert "".join(pieces) == "a漢b😀"
    assert pieces.count("") == 2 + 3 and "漢" in pieces and "😀" in pieces  # 3 + 4 bytes, a token each
    # An alternative at a position is read in the same context: here, another last byte.
    last = pieces.index("漢")
    other = tokenizer.encode("漣", add_special_tokens=False)  # 漢 and 漣 share their first two bytes
    assert texts(ids)(other[-1], last) == "漣"
    # A piece that nothing before it helps finish: "".
    assert texts(ids[last:])(ids[last], 0) == ""


def byte_level_tokenizer(pieces: list[bytes]):
    """A byte-level BPE tokenizer whose tokens are these byte strings (GPT-2's byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    backend = Tokenizer(models.BPE(vocab={"".join(char[b] for b in piece): i for i, piece in enumerate(pieces)},
                                   merges=[]))
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_a_token_that_ends_one_character_and_starts_the_next():
    """Byte-level merges inside a run of CJK text may straddle two characters: [e6 bc] [a2 e6]
    [bc a2] is 漢漢. The run shows whole on the token that ends it (vLLM's show "" then "\ufffd漢")."""
    han = "漢".encode()
    tokenizer = byte_level_tokenizer([han[:2], han[2:] + han[:1], han[1:], b"a", han[2:] + han[:2], han[2:]])
    assert tokenizer.decode([0, 1, 2, 3]) == "漢漢a"
    assert shown(TokenTexts(tokenizer), [0, 1, 2, 3]) == ["", "", "漢漢", "a"]
    # Longer runs than the guard against broken bytes allows still show whole: [a2 e6 bc] ...
    long_run = [0, *[4] * (TokenTexts.MAX_STALLED + 4), 5]
    assert shown(TokenTexts(tokenizer), long_run) == [""] * (len(long_run) - 1) + ["漢" * (TokenTexts.MAX_STALLED + 5)]


def test_token_texts_of_a_long_run_cost_a_bounded_number_of_decodes_each():
    """A run of tokens that each end one character and start the next (prompt ids chosen so,
    or a degenerate output) decoded every suffix at every position: hours for one row of a few
    thousand tokens. It breaks at MAX_RUN tokens, the character across each break showing
    nowhere (vLLM's rule for bytes no token completes)."""
    han = "漢".encode()
    tokenizer = byte_level_tokenizer([han[:2], han[2:] + han[:1], han[1:], b"a", han[2:] + han[:2], han[2:]])
    decodes = CallCounter(tokenizer, "decode")
    run = [0, *[4] * 300, 5]
    texts = shown(TokenTexts(tokenizer), run)
    assert len(decodes) <= 2 * TokenTexts.MAX_RUN * len(run), len(decodes)
    breaks = len(run) // TokenTexts.MAX_RUN
    assert "".join(texts) == "漢" * (301 - breaks)  # one character lost at each break
    assert texts[TokenTexts.MAX_RUN - 1] == "漢" * (TokenTexts.MAX_RUN - 1)  # the first run, whole


def test_a_token_that_finishes_text_and_starts_a_character_shows_on_the_one_completing_it():
    """vLLM's rule: ' \xed' (a space and the first byte of 한) shows "", the token completing
    the character shows " 한"."""
    han = "한".encode()
    tokenizer = byte_level_tokenizer([b"a", b" " + han[:1], han[1:], b"b"])
    assert shown(TokenTexts(tokenizer), [0, 1, 2, 3]) == ["a", "", " 한", "b"]


def test_bytes_no_token_completes_are_left_out_of_the_next_character():
    """A prompt's tokens read from its second token on (prompt_logprobs) may start inside a
    character: its stray bytes show nowhere, the next character shows alone (vLLM's rule)."""
    east, capital = "東".encode(), "京".encode()
    tokenizer = byte_level_tokenizer([east[1:], capital[:2], capital[2:], "亭".encode()[2:]])
    text = TokenTexts(tokenizer)([0, 1, 2])
    assert [text(t, p) for p, t in enumerate([0, 1, 2])] == ["", "", "京"]
    assert text(3, 2) == "亭"  # 京 and 亭 share their first two bytes


def test_a_character_the_completion_never_finishes_is_not_in_its_tokens():
    """Cut by max_tokens, or by EOS: the text holds the character back (vLLM's incremental
    decoder does), and so do the tokens; EOS shows as itself."""
    han = "한".encode()
    tokenizer = byte_level_tokenizer([b"a", b" " + han[:1], han[1:], b"b", b"<eos>"])
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    eos = tokenizer.eos_token_id
    assert shown(TokenTexts(tokenizer), [0, 1]) == ["a", ""]
    assert shown(TokenTexts(tokenizer), [0, 1, eos]) == ["a", "", "<eos>"]


def test_an_alternative_that_does_not_continue_the_character_shows_its_own_text():
    han = "한".encode()
    tokenizer = byte_level_tokenizer([b"a", b" " + han[:1], han[1:], b" b", b"<eos>"])
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    text = TokenTexts(tokenizer)([0, 1, 2])
    assert (text(3, 2), text(tokenizer.eos_token_id, 2), text(2, 2)) == (" b", "<eos>", " 한")
    # At a character boundary, an alternative that would leave one unfinished shows "".
    assert text(1, 0) == ""
    # Where EOS cut the character, an alternative to EOS may still complete it.
    assert TokenTexts(tokenizer)([0, 1, tokenizer.eos_token_id])(2, 2) == " 한"


def sentencepiece_tokenizer():
    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "\u2581\u2581\u2581\u2581": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_token_texts_keep_a_sentencepiece_piece_s_leading_spaces():
    tokenizer = sentencepiece_tokenizer()
    assert tokenizer.decode([2]) == "world"  # decoding a piece alone drops its space
    ids = [1, 2, 3, 4]
    assert [TokenTexts(tokenizer).alone(i) for i in ids] == [" Hello", " world", "!", "    "]
    assert "".join(shown(TokenTexts(tokenizer), ids)) == " Hello world!    "


def test_spaces_are_restored_by_the_metaspace_pre_tokenizer_s_own_marker():
    """vLLM's rule: the marker is the Metaspace pre-tokenizer's replacement character; pieces of
    other tokenizers that start with "\u2581" are shown as they decode."""
    vocab = {"<unk>": 0, "_world": 1, "\u2581x": 2}
    underscore = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    underscore.pre_tokenizer = pre_tokenizers.Metaspace(replacement="_")
    underscore.decoder = decoders.Metaspace(replacement="_")
    assert TokenTexts(PreTrainedTokenizerFast(tokenizer_object=underscore, unk_token="<unk>")).alone(1) == " world"
    plain = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=plain, unk_token="<unk>")
    assert TokenTexts(fast).alone(2) == fast.decode([2])


def test_token_texts_without_a_tokenizer_name_the_id():
    assert TokenTexts(None)([42])(42, 0) == "token_id:42"


def test_echo_puts_the_prompt_before_each_choice_s_text():
    record = text_record(echo=True, n=2, temperature=1.0)
    parsed = parse_record(record)
    assert parsed.echo and parsed.params.prompt_logprobs is None  # no logprobs asked: none scored
    row = completion_row(parsed, Completion("r", [SampleOutput(0, [7], "!", "length"),
                                                  SampleOutput(1, [9], " there", "length")], 2, TIMINGS))
    assert row["echo"] == "Say"
    for read_back in (row, row_from_json(row_to_json(row)), arrow_to_rows(rows_to_arrow([row]))[0]):
        body = response_line(read_back, model="m", created=0, token_texts=texts)["response"]["body"]
        assert [c["text"] for c in body["choices"]] == ["Say!", "Say there"]
        assert [c["logprobs"] for c in body["choices"]] == [None, None]
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert completion_row(parse_record(text_record(echo=False)),
                          Completion("r", [SampleOutput(0, [7], "!", "length")], 2, TIMINGS))["echo"] is None


def test_echo_with_logprobs_scores_the_prompt_and_lists_its_tokens_first():
    """vLLM's shape: the prompt's tokens, the first with no logprob and no top ones, then the
    completion's; text offsets run on across both; the prompt logprobs default to `logprobs`."""
    parsed = parse_record(text_record(echo=True, logprobs=1))
    assert parsed.params.prompt_logprobs == 1
    line = line_of(text_record(echo=True, logprobs=1),
                   SampleOutput(0, [7], "!", "length", [-0.5], [{7: -0.5, 9: -1.0}]), prompt_tokens=3,
                   prompt_token_ids=[5, 6, 9], prompt_logprobs=[None, -2.0, -0.25], prompt_ranks=[None, 3, 1],
                   prompt_top_logprobs=[None, {7: -0.5}, {9: -0.25}])
    [choice] = line["response"]["body"]["choices"]
    assert choice["text"] == "Say!"
    assert choice["logprobs"] == {"tokens": ["<5>", "lo", " there", "!"],  # the first decoded alone
                                  "token_logprobs": [None, -2.0, -0.25, -0.5],
                                  "top_logprobs": [None, {"!": -0.5, "lo": -2.0}, {" there": -0.25},
                                                   {" there": -1.0, "!": -0.5}],
                                  "text_offset": [0, 3, 5, 11]}
    assert choice["prompt_logprobs"][1] == {6: {"logprob": -2.0, "rank": 3, "decoded_token": "lo"},
                                            7: {"logprob": -0.5, "rank": 1, "decoded_token": "!"}}


def test_echoed_prompt_tokens_show_as_many_top_ones_as_logprobs_asks():
    """Where prompt_logprobs asks more than logprobs, a prompt position shows the first `logprobs`
    top ones other than the prompt token, and the prompt token (vLLM keeps logprobs + 1 of
    its prompt logprobs, the prompt token first)."""
    line = line_of(text_record(echo=True, logprobs=1, prompt_logprobs=3),
                   SampleOutput(0, [7], "!", "length", [-0.5], [{7: -0.5}]), prompt_tokens=3,
                   prompt_token_ids=[5, 6, 9], prompt_logprobs=[None, -0.1, -3.0], prompt_ranks=[None, 1, 3],
                   prompt_top_logprobs=[None, {6: -0.1, 7: -2.5, 9: -3.5}, {5: -0.2, 7: -0.3, 9: -3.0}])
    [choice] = line["response"]["body"]["choices"]
    assert choice["logprobs"]["top_logprobs"][1:3] == [{"!": -2.5, "lo": -0.1}, {"Hel": -0.2, " there": -3.0}]


@pytest.mark.parametrize("messages, options, shown", [
    ([{"role": "user", "content": "Hi"}], {}, ""),  # a new assistant turn: nothing to repeat
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer"}], {}, "The answer"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}],
     {"add_generation_prompt": False, "continue_final_message": True}, "The"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     {"add_generation_prompt": False}, "a\nb"),
])
def test_chat_echo_repeats_the_last_message_where_the_answer_continues_it(messages, options, shown):
    """vLLM's rule: the last message's content goes before each choice's where the answer is in
    its turn (no generation prompt opens another, or it is the assistant's)."""
    record = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": messages, "echo": True, **options}}
    assert parse_record(record).params.prompt_logprobs == 0  # vLLM's: echo scores the prompt
    line = line_of(record, SampleOutput(0, [9], " there", "length"))
    assert line["response"]["body"]["choices"][0]["message"]["content"] == shown + " there"
    record["body"]["echo"] = False
    assert parse_record(record).params.prompt_logprobs is None
    assert line_of(record, SampleOutput(0, [9], " there", "length"))["response"]["body"]["choices"][0][
        "message"]["content"] == " there"


def test_echo_with_max_tokens_zero_shows_the_prompt_alone():
    """vLLM's scoring request: one token is generated and shown nowhere (usage counts it)."""
    record = text_record(echo=True, max_tokens=0, logprobs=1)
    parsed = parse_record(record)
    assert parsed.echo_only and parsed.params.max_tokens == 1 and parsed.params.prompt_logprobs == 1
    line = line_of(record, SampleOutput(0, [7], "!", "length", [-0.5], [{7: -0.5}]), prompt_tokens=2,
                   prompt_token_ids=[5, 6], prompt_logprobs=[None, -2.0], prompt_ranks=[None, 3],
                   prompt_top_logprobs=[None, {9: -0.5}])
    body = line["response"]["body"]
    [choice] = body["choices"]
    assert choice["text"] == "Say" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["<5>", "lo"], "token_logprobs": [None, -2.0],
                                  "top_logprobs": [None, {" there": -0.5, "lo": -2.0}], "text_offset": [0, 3]}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    for refused in (text_record(max_tokens=0), chat_record(echo=True, max_tokens=0), text_record(echo=True, max_tokens=False)):
        assert "max_tokens" in parse_record(refused).error
