"""pipelines.generate end to end on the DirectRunner: JSONL / Parquet / text in, Parquet / JSONL
out, local and gs:// (through the GCS emulator), one row per record, error rows for bad ones.

The fast tests run the Beam tests' tiny chat model with the same engine arguments
(beam_helpers), so one engine process, started once per session, serves them all."""

import bz2
import codecs
import gzip
import io
import json
import lzma
import os
import re
import sys
import time
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zstandard
import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.testing.util import assert_that, equal_to

from batchgen_beam.io import (MalformedRow, ReadRecords, WriteRows, _fixed_dir, delimited_rows,
                              file_records, infer_format, text_lines)
from batchgen_beam.records import Rejected
from batchgen_beam.rows import OUTPUT_SCHEMA, error_row
from beam_helpers import ENGINE_ARGS, IN_MEMORY, chat_model_dir
from output_rows import row_from_arrow_dict, row_from_json, rows_to_arrow
from pipelines import generate as cli
from runtime import Engine, Request, SamplingParams
from runtime.tokenizer import load_tokenizer

ENGINE_FLAGS = ["--kv_cache_mb", str(ENGINE_ARGS["kv_cache_bytes"] >> 20),
                "--num_threads", str(ENGINE_ARGS["num_threads"])]


@pytest.fixture(scope="module")
def chat_model(tiny_chat):
    assert cli.engine_args_of(cli.parse_args(ENGINE_FLAGS)[0]) == ENGINE_ARGS  # the same engine
    return chat_model_dir(tiny_chat)


def run(chat_model, *args, progress=False):
    argv = [*args, "--model", str(chat_model), *ENGINE_FLAGS, "--max_tokens", "6"]
    return cli.main(argv if progress else [*argv, "--no_progress"])


GOOD = [{"id": "a", "prompt": "What is photosynthesis?"},
        {"id": "b", "messages": [{"role": "user", "content": "Name three rivers."}], "tag": 7},
        {"id": "c", "prompt": "Say hi", "max_tokens": 3, "meta": {"k": [1, 2]}},
        {"custom_id": "d", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "Once upon a time", "max_tokens": 4}}]
BAD = {b"not json": None,                                  # no id to be found
       b"\xff\xfe{\"id\": \"x\"}": None,                   # not UTF-8
       json.dumps({"id": "e", "prompt": ""}).encode(): "e",  # empty prompt
       json.dumps({"id": "f"}).encode(): "f",               # no prompt
       json.dumps({"id": "g", "prompt": "x", "temperature": "hot"}).encode(): "g",
       b'{"id": "h", "prompt": "x \\ud800", "tag": "\\udcff"}': "h"}  # lone surrogates


@pytest.fixture(scope="module")
def jsonl_input(tmp_path_factory):
    lines = [json.dumps(r).encode() for r in GOOD[:2]] + [b"", b"   "] + list(BAD)
    lines += [json.dumps(r).encode() for r in GOOD[2:]]
    path = tmp_path_factory.mktemp("input") / "records.jsonl"
    # A byte-order mark first, as Windows editors write: the first record is still good.
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(lines[:3]) + b"\n" + b"\n".join(lines[3:]) + b"\n")
    return path


def read_parquet(files) -> pa.Table:
    assert files and all(f.endswith(".parquet") for f in files)
    return pa.concat_tables([pq.read_table(f) for f in files])


def read_jsonl(files) -> list[dict]:
    assert files and all(f.endswith(".jsonl") for f in files)
    rows = []
    for name in files:
        with open(name, encoding="utf-8") as f:
            rows += [row_from_json(line) for line in f if line.strip()]
    return rows


def check_schema(table: pa.Table) -> None:
    assert table.schema.names == OUTPUT_SCHEMA.names
    for field in OUTPUT_SCHEMA:
        got = table.schema.field(field.name)
        assert got.type == field.type, field.name
        assert got.nullable == field.nullable, field.name


def check_rows(rows: list[dict], summary: dict) -> dict:
    """One row per non-blank input line: the good ones generated, the bad ones error rows."""
    assert len(rows) == len(GOOD) + len(BAD) == summary["records"]
    by_id = {r["id"]: r for r in rows if r["id"] is not None}
    for record in GOOD:
        row = by_id[record.get("id") or record.get("custom_id")]
        assert row["error"] is None and row["finish_reason"] in ("stop", "length")
        assert 1 <= row["completion_tokens"] == len(row["token_ids"]) <= 6
        assert row["prompt_tokens"] > 0 and isinstance(row["text"], str)
    assert by_id["c"]["completion_tokens"] <= 3 and by_id["d"]["completion_tokens"] <= 4
    assert by_id["b"]["passthrough"] == {"tag": 7}
    assert by_id["c"]["passthrough"] == {"meta": {"k": [1, 2]}}
    errors = [r for r in rows if r["error"] is not None]
    assert len(errors) == len(BAD) == summary["errors"]
    assert all(r["finish_reason"] == "error" and r["completion_tokens"] == 0 for r in errors)
    assert sorted(r["id"] for r in errors if r["id"]) == ["e", "f", "g", "h"]
    assert "prompt: missing" in by_id["f"]["error"] and "temperature" in by_id["g"]["error"]
    messages = sorted(r["error"] for r in errors if r["id"] is None)
    assert messages[0].startswith("record: invalid JSON")
    assert messages[1].startswith("record: not valid UTF-8")
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    return by_id


def test_jsonl_to_parquet_and_to_jsonl(chat_model, jsonl_input, tmp_path):
    summary = run(chat_model, "--input", str(jsonl_input), "--output", str(tmp_path / "pq/gen"),
                  progress=True)
    assert summary["state"] == "DONE" and summary["format"] == "parquet"
    table = read_parquet(summary["output_files"])
    check_schema(table)
    from_parquet = check_rows([row_from_arrow_dict(r) for r in table.to_pylist()], summary)

    summary = run(chat_model, "--input", str(jsonl_input), "--output", str(tmp_path / "js/gen"),
                  "--format", "jsonl")
    rows = read_jsonl(summary["output_files"])
    assert all(list(r) == OUTPUT_SCHEMA.names for r in rows)
    check_schema(rows_to_arrow(rows))  # every value fits its column's type
    from_jsonl = check_rows(rows, summary)
    # Greedy: the same records give the same tokens whichever the output format.
    assert {k: r["token_ids"] for k, r in from_jsonl.items()} == {
        k: r["token_ids"] for k, r in from_parquet.items()}


def test_openai_format_answers_each_record_with_an_openai_batch_line(chat_model, jsonl_input, tmp_path):
    summary = run(chat_model, "--input", str(jsonl_input), "--output", str(tmp_path / "oa/gen"),
                  "--format", "openai", "--logprobs", "2")
    assert summary["state"] == "DONE" and summary["format"] == "openai"
    assert summary["output_files"] and all(f.endswith(".jsonl") for f in summary["output_files"])
    lines = []
    for name in summary["output_files"]:
        with open(name, encoding="utf-8") as f:
            lines += [json.loads(line) for line in f if line.strip()]
    assert len(lines) == len(GOOD) + len(BAD) == summary["records"]
    by_id = {line["custom_id"]: line for line in lines}
    objects = {"a": "text_completion", "b": "chat.completion", "c": "text_completion", "d": "text_completion"}
    for custom_id, kind in objects.items():
        response = by_id[custom_id]["response"]
        body = response["body"]
        assert response["status_code"] == 200 and body["object"] == kind
        [choice] = body["choices"]
        text = choice["message"]["content"] if kind == "chat.completion" else choice["text"]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
        if kind == "chat.completion":
            tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
            assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])
        else:
            tokens = choice["logprobs"]["tokens"]
            offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
            assert choice["logprobs"]["text_offset"] == offsets
        assert len(tokens) == usage["completion_tokens"]
        at = 0  # tokens that are whole characters appear in the text, in order (EOS: not)
        for token in (t for t in tokens if "\ufffd" not in t and choice["finish_reason"] == "length"):
            at = text.index(token, at) + len(token)
    errors = [line for line in lines if line["response"]["status_code"] != 200]
    assert len(errors) == len(BAD) and all(line["response"]["status_code"] == 400 for line in errors)
    assert "temperature" in by_id["g"]["response"]["body"]["error"]["message"]


def test_openai_format_writes_prompt_logprobs_as_vllm_does(chat_model, jsonl_input, tmp_path):
    """The rows' scores in vLLM's shape: per prompt token after the first, the token with its
    logprob and rank, then the top one; the prompt tokens' texts join into the prompt's."""
    flags = ("--input", str(jsonl_input), "--prompt_logprobs", "1", "--max_tokens", "1")
    rows = run(chat_model, *flags, "--output", str(tmp_path / "rows/gen"), "--format", "jsonl")
    rows = {r["id"]: r for r in read_jsonl(rows["output_files"])}
    summary = run(chat_model, *flags, "--output", str(tmp_path / "oa/gen"), "--format", "openai")
    lines = {line["custom_id"]: line for line in read_jsonl(summary["output_files"])}
    tokenizer = load_tokenizer(chat_model)
    for custom_id in ("a", "b", "c", "d"):
        row, body = rows[custom_id], lines[custom_id]["response"]["body"]
        scored = body["prompt_logprobs"] if row["chat"] else body["choices"][0]["prompt_logprobs"]
        prompt = row["prompt_token_ids"]
        assert len(prompt) == len(scored) == row["prompt_tokens"] and scored[0] is None
        for position in range(1, len(prompt)):
            token, *top = scored[position].items()
            assert token[0] == str(prompt[position])
            assert token[1]["logprob"] == pytest.approx(row["prompt_logprobs"][position], abs=1e-5)
            assert token[1]["rank"] == row["prompt_ranks"][position] >= 1
            best = row["prompt_top_logprobs"][position][0]
            ranked_first = scored[position][str(best["token_id"])]
            assert ranked_first["rank"] == 1 and ranked_first["logprob"] == pytest.approx(best["logprob"], abs=1e-5)
            assert len(top) == (best["token_id"] != prompt[position])
        texts = "".join(at[str(token)]["decoded_token"] for at, token in zip(scored[1:], prompt[1:]))
        assert texts == tokenizer.decode(prompt[1:])


def test_echo_lists_the_prompt_before_the_completion_as_vllm_does(chat_model, tmp_path):
    """A completion line with echo and logprobs: the prompt's text before the completion's, its
    tokens (the first with no logprob) before the completion's, their logprobs the row's
    prompt logprobs; one without logprobs gets the text alone."""
    lines = [{"custom_id": f"e{logprobs}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once upon a time", "echo": True, "max_tokens": 3,
                       **({} if logprobs is None else {"logprobs": logprobs})}} for logprobs in (None, 1)]
    path = tmp_path / "echo.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = run(chat_model, "--input", str(path), "--output", str(tmp_path / "rows/gen"), "--format", "jsonl")
    rows = {r["id"]: r for r in read_jsonl(rows["output_files"])}
    summary = run(chat_model, "--input", str(path), "--output", str(tmp_path / "oa/gen"), "--format", "openai")
    bodies = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(summary["output_files"])}
    tokenizer = load_tokenizer(chat_model)
    for custom_id, row in rows.items():
        assert row["echo"] == "Once upon a time"
        [choice] = bodies[custom_id]["choices"]
        assert choice["text"] == "Once upon a time" + row["text"]
    assert bodies["eNone"]["choices"][0]["logprobs"] is None and rows["eNone"]["prompt_logprobs"] is None
    row, [choice] = rows["e1"], bodies["e1"]["choices"]
    prompt, logprobs = row["prompt_token_ids"], choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + len(row["token_ids"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(prompt)] == pytest.approx(row["prompt_logprobs"][1:], abs=1e-5)
    assert logprobs["token_logprobs"][len(prompt):] == pytest.approx(row["logprobs"], abs=1e-5)
    assert "".join(logprobs["tokens"][:len(prompt)]) == tokenizer.decode(prompt)
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"][1:])


def test_a_tokenized_prompt_runs_as_its_text_does(chat_model, tmp_path):
    """Token ids (vLLM's prompt_token_ids; an OpenAI completion's prompt as ids), from JSONL, a
    Parquet list column and a CSV cell, give the text prompt's greedy answer; ids the model has no
    embedding for give that record's error row."""
    ids = load_tokenizer(chat_model).encode("Once upon a time")
    records = [{"id": "text", "prompt": "Once upon a time"}, {"id": "ids", "prompt_token_ids": ids},
               {"custom_id": "openai", "method": "POST", "url": "/v1/completions", "body": {"prompt": ids}},
               {"id": "outside", "prompt_token_ids": [*ids, 10 ** 6]}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = {r["id"]: r for r in read_jsonl(run(chat_model, "--input", str(path), "--output",
                                                str(tmp_path / "js/gen"), "--format", "jsonl")["output_files"])}
    assert rows["text"]["error"] is None and rows["text"]["token_ids"]
    for name in ("ids", "openai"):
        assert rows[name]["token_ids"] == rows["text"]["token_ids"] and rows[name]["text"] == rows["text"]["text"]
        assert rows[name]["prompt_tokens"] == len(ids)
    assert rows["outside"]["error_type"] == "record" and "prompt_token_ids" in rows["outside"]["error"]
    table = pa.table({"id": ["pq"], "prompt_token_ids": pa.array([ids], pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "in.parquet")
    summary = run(chat_model, "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "pq/gen"),
                  "--format", "jsonl")
    [row] = read_jsonl(summary["output_files"])
    assert row["token_ids"] == rows["text"]["token_ids"]
    (tmp_path / "in.csv").write_text(f'id,prompt_token_ids\ncsv,"{json.dumps(ids)}"\n')
    summary = run(chat_model, "--input", str(tmp_path / "in.csv"), "--output", str(tmp_path / "csv/gen"),
                  "--format", "jsonl")
    [row] = read_jsonl(summary["output_files"])
    assert row["token_ids"] == rows["text"]["token_ids"]  # the cell read as JSON, as other list fields


def test_chat_fields_render_the_prompt_as_transformers_does(chat_model, tmp_path):
    """A record's continue_final_message and the job's template variables reach the template:
    the prompt the engine ran is transformers' rendering of the same messages."""
    chat = [{"role": "user", "content": "Name a river."}]
    started = [*chat, {"role": "assistant", "content": "The river"}]
    records = [{"id": "plain", "messages": chat},
               {"id": "continued", "messages": started, "add_generation_prompt": False,
                "continue_final_message": True},
               {"id": "prompt", "prompt": "Name a river."}]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = run(chat_model, "--input", str(data), "--output", str(tmp_path / "out/gen"), "--format", "jsonl",
                  "--prompt_logprobs", "0", "--max_tokens", "1", "--chat_template_kwargs", '{"enable_thinking": false}')
    rows = {r["id"]: r for r in read_jsonl(summary["output_files"])}
    tokenizer = load_tokenizer(chat_model)

    def rendered(messages, **options):
        text = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False, **options)
        return tokenizer.encode(text, add_special_tokens=False)

    assert rows["plain"]["prompt_token_ids"] == rendered(chat, add_generation_prompt=True)
    assert rows["continued"]["prompt_token_ids"] == rendered(started, add_generation_prompt=False,
                                                             continue_final_message=True)
    assert tokenizer.decode(rows["continued"]["prompt_token_ids"]).endswith("The river")
    assert rows["prompt"]["error"] is None


def test_text_input_ids_are_file_and_line(chat_model, tmp_path):
    data = tmp_path / "in"
    (data / "x").mkdir(parents=True)
    (data / "y").mkdir()
    (data / "x" / "prompts.txt").write_bytes(
        b"Hello there\n\nHello there\n\xff bad line\r\nTell me a story\n")
    (data / "y" / "prompts.txt").write_bytes(b"\xef\xbb\xbfHello there")  # a byte-order mark, no final newline
    summary = run(chat_model, "--input", str(data / "*" / "prompts.txt"),
                  "--output", str(tmp_path / "out/gen"), "--format", "jsonl")
    rows = {r["id"]: r for r in read_jsonl(summary["output_files"])}
    assert sorted(rows) == ["x/prompts.txt:1", "x/prompts.txt:3", "x/prompts.txt:4",
                            "x/prompts.txt:5", "y/prompts.txt:1"]
    assert summary["records"] == 5 and summary["errors"] == 1
    assert rows["x/prompts.txt:4"]["error"] == "prompt: not valid UTF-8 (invalid start byte at byte 0)"
    # Equal prompts, distinct ids, the same greedy text.
    assert rows["x/prompts.txt:1"]["token_ids"] == rows["x/prompts.txt:3"]["token_ids"] \
        == rows["y/prompts.txt:1"]["token_ids"]
    assert rows["x/prompts.txt:5"]["error"] is None


CSV_ROWS = (b'prompt,max_tokens,stop,temperature,tag\r\n'
            b'Hello there,4,,,a\r\n'
            b'"Tell me a story\r\nin two lines",,END,,b\r\n'  # a cell over two lines; a stop string
            b'\r\n'                                             # blank: skipped
            b'Say hi,2.5,,,c\r\n'                                # a float max_tokens
            b'Say hi,3,,,d,extra\r\n'                            # more cells than the header
            b'\xff bad,2,,,e\r\n'                                # a prompt that is not UTF-8
            b',3,,,f\r\n'                                         # no prompt
            b'Say hi,3,"[""x"", ""y""]",0,g\r\n')                # a JSON list of stops; 0 as an int


@pytest.mark.parametrize("name", ["in.csv", "in.tsv.gz"])
def test_csv_and_tsv_rows_are_records(chat_model, tmp_path, name):
    data = b"\xef\xbb\xbf" + (CSV_ROWS if ".csv" in name else CSV_ROWS.replace(b",", b"\t"))
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert cli.count_records(str(tmp_path / name), infer_format(name)) == 7
    summary = run(chat_model, "--input", str(tmp_path / name), "--output", str(tmp_path / "out/gen"),
                  "--format", "jsonl")
    rows = {r["id"]: r for r in read_jsonl(summary["output_files"])}
    ids = [f"{name}:{n}" for n in range(1, 8)]
    assert sorted(rows) == ids and summary["records"] == 7 and summary["errors"] == 4
    assert [rows[i]["passthrough"].get("tag") for i in ids] == ["a", "b", "c", None, "e", "f", "g"]
    assert rows[ids[0]]["error"] is None and rows[ids[0]]["completion_tokens"] <= 4
    assert rows[ids[1]]["error"] is None and rows[ids[6]]["error"] is None
    assert rows[ids[2]]["error"].startswith("max_tokens: must be")
    assert rows[ids[3]]["error"] == f"{name}: row 4 has 6 cells, the header 5"
    assert rows[ids[4]]["error"].startswith("prompt: not valid UTF-8")
    assert rows[ids[5]]["error"].startswith("prompt: missing")


def test_a_cell_of_json_naming_a_key_twice_is_an_error_row():
    """As a JSON line's: json would keep the last value."""
    data = b'prompt,logit_bias,tag\nHi,"{""5"": 1, ""5"": -100}",a\nHi,"{""5"": 1}",b\n'
    first, second = file_records(io.BytesIO(data), "in.csv", "csv")
    assert first == Rejected("in.csv:1", "in.csv: row 1: key '5' given twice in one object")
    assert second == {"prompt": "Hi", "logit_bias": {"5": 1}, "tag": "b", "id": "in.csv:2"}


def test_quoting_mistakes_and_long_cells_are_error_rows_not_guesses(chat_model, tmp_path):
    """A stray quote and a quoted cell that never closes each give their row an error row that
    says where; a cell past the csv module's 128 KiB default is a prompt like any other (here
    too long for the model: an error row too); the rows between still run."""
    path = tmp_path / "in.tsv"
    path.write_bytes(b'prompt\ttag\n'
                     b'Hello there\ta\n'
                     b'"Quoted" title: explain\tb\n'                # a quote inside an unquoted cell
                     + b"long " * 40_000 + b'\tc\n'                   # 200 kB
                     b'Say hi\td\n'
                     b'"never closed\te\nSay hi\tf\n')            # takes in the rest of the file
    assert cli.count_records(str(path), "tsv") == 5
    summary = run(chat_model, "--input", str(path), "--output", str(tmp_path / "out/gen"),
                  "--format", "jsonl")
    rows = {r["id"]: r for r in read_jsonl(summary["output_files"])}
    assert sorted(rows) == [f"in.tsv:{n}" for n in range(1, 6)] and summary["errors"] == 3
    assert rows["in.tsv:1"]["error"] is None and rows["in.tsv:4"]["error"] is None
    assert rows["in.tsv:2"]["error"].startswith("in.tsv: row 2 (line 3): a quote inside a cell must be doubled")
    assert rows["in.tsv:3"]["error"].startswith("prompt has ")  # read whole, then too long
    assert rows["in.tsv:5"]["error"] == ("in.tsv: row 5 (line 6): the quoted cell opened on line 6 "
                                         "or after never closes, so the rest of the file was read into it")


def test_a_header_with_broken_quoting_rejects_its_file_row_by_row(tmp_path):
    header, rows = delimited_rows(io.BytesIO(b'"id" x,prompt\na,hi\nb,yo\n'), "csv")
    assert isinstance(header, MalformedRow) and header.line == 1
    assert list(rows) == [["a", "hi"], ["b", "yo"]]
    path = tmp_path / "in.csv"
    path.write_bytes(b'"id" x,prompt\na,hi\nb,yo\n')
    with beam.Pipeline() as p:
        records = p | ReadRecords(str(path)) | beam.Map(lambda r: (r.id, r.error))
        assert_that(records, equal_to([(f"in.csv:{n}", 'in.csv: the header row (line 1) cannot be read: '
                                        'a quote inside a cell must be doubled, and only a whole cell '
                                        'quoted (\',\' expected after \'"\')') for n in range(3)]))


def test_sampling_cells_are_json_only_where_the_field_takes_that_json(tmp_path):
    path = tmp_path / "in.csv"
    path.write_bytes(b'id,prompt,stop,regex,max_tokens,ignore_eos,tag\n'
                     b'a,Hi,5,123,3,true,7\n'
                     b'b,Hi,"[""x"", ""y""]",a+,null,,\n')
    with beam.Pipeline() as p:
        assert_that(p | ReadRecords(str(path)), equal_to([
            {"id": "a", "prompt": "Hi", "stop": "5", "regex": "123", "max_tokens": 3,
             "ignore_eos": True, "tag": "7"},
            {"id": "b", "prompt": "Hi", "stop": ["x", "y"], "regex": "a+", "max_tokens": "null"}]))


def test_a_header_naming_a_column_twice_is_not_read():
    header, rows = delimited_rows(io.BytesIO(b"\nid,tag,prompt,tag\na,1,hi,2\n"), "csv")
    assert header == MalformedRow(2, "it names 'tag' twice") and list(rows) == [["a", "1", "hi", "2"]]


def test_parquet_columns_named_twice_reject_each_row(tmp_path):
    table = pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(["hi", "yo"]), pa.array(["x", "y"])],
                                 names=["id", "prompt", "prompt"])
    pq.write_table(table, tmp_path / "in.parquet")
    with beam.Pipeline() as p:
        records = p | ReadRecords(str(tmp_path / "in.parquet")) | beam.Map(lambda r: (r.id, r.error))
        assert_that(records, equal_to([(None, "record: its Parquet file names the column(s) prompt twice")] * 2))


def test_parquet_nanosecond_times_python_cannot_hold_are_read_as_text(tmp_path):
    """pandas writes datetime64[ns]: whole microseconds are datetimes, anything finer text."""
    import datetime

    times = pa.array([1_700_000_000_000_000_000, 1_700_000_000_123_456_789, None], pa.timestamp("ns"))
    whole = pa.array([1_700_000_000_000_001_000, None, None], pa.timestamp("ns"))
    nested = pa.array([[{"t": 1_700_000_000_123_456_789}], [], None],
                      pa.list_(pa.struct([("t", pa.timestamp("ns"))])))
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["hi"] * 3, "at": times, "whole": whole,
                             "nested": nested}), tmp_path / "in.parquet")
    with beam.Pipeline() as p:
        assert_that(p | ReadRecords(str(tmp_path / "in.parquet")), equal_to([
            {"id": "a", "prompt": "hi", "at": "2023-11-14 22:13:20.000000000",
             "whole": datetime.datetime(2023, 11, 14, 22, 13, 20, 1),
             "nested": [{"t": "2023-11-14 22:13:20.123456789"}]},
            {"id": "b", "prompt": "hi", "at": "2023-11-14 22:13:20.123456789", "whole": None, "nested": []},
            {"id": "c", "prompt": "hi", "at": None, "whole": None, "nested": None}]))


def test_parquet_times_out_of_pythons_range_are_read_as_text(tmp_path):
    """A year past 9999 or before 1, or a duration past timedelta's, fails the row's conversion
    to Python (OverflowError): its column is read as text, and no record is lost."""
    far = 253_402_300_800 * 10**6  # 10000-01-01 in microseconds
    columns = {"id": ["a", "b"], "prompt": ["hi", "yo"],
               "at": pa.array([far, 0], pa.timestamp("us")),
               "day": pa.array([2_932_897 + 100, 0], pa.date32()),
               "early": pa.array([-62_135_596_800 * 10**6 - 10**6, None], pa.timestamp("us", tz="UTC")),
               "span": pa.array([2**62, 5], pa.duration("s")),
               "nested": pa.array([[{"t": far}], None], pa.list_(pa.struct([("t", pa.timestamp("us"))])))}
    pq.write_table(pa.table(columns), tmp_path / "in.parquet")
    with beam.Pipeline() as p:
        assert_that(p | ReadRecords(str(tmp_path / "in.parquet")), equal_to([
            {"id": "a", "prompt": "hi", "at": "10000-01-01 00:00:00.000000", "day": "10000-04-10",
             "early": "0000-12-31 23:59:59.000000Z", "span": "4611686018427387904",
             "nested": [{"t": "10000-01-01 00:00:00.000000"}]},
            {"id": "b", "prompt": "yo", "at": "1970-01-01 00:00:00.000000", "day": "1970-01-01",
             "early": None, "span": "5", "nested": None}]))


COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress, ".deflate": zlib.compress,
            ".zst": lambda data: zstandard.ZstdCompressor().compress(data)}
PLAIN_FILES = {  # name: (bytes, the records ReadRecords reads, given the name it has)
    "in.jsonl": (b'\xef\xbb\xbf{"id": "a"}\r\n\r\n{"id": "b", "prompt": "y"}\r{"c": 3}\n  \nlast\r',
                 lambda name: [b'\xef\xbb\xbf{"id": "a"}', b'{"id": "b", "prompt": "y"}\r{"c": 3}', b"last\r"]),
    "in.txt": (b"one\r\ntwo\n\nthree", lambda name: [{"id": f"{name}:{n}", "prompt": p}
                                                    for n, p in ((1, "one"), (2, "two"), (4, "three"))]),
    "in.csv": (b'id,prompt\na,"two\nlines"\nb,hi\n', lambda name: [{"id": "a", "prompt": "two\nlines"},
                                                                   {"id": "b", "prompt": "hi"}])}


@pytest.mark.parametrize("extension", sorted(COMPRESS))
def test_compressed_files_read_as_their_plain_bytes_do(tmp_path, extension):
    """Each format, through each compression Beam tells by extension: the plain file's records
    (JSONL's lines split as ReadFromText splits a plain file's), two streams one after the
    other read as one file, an empty file as no records; the progress bar's count is theirs
    (compressed JSONL was counted as Beam's reader gives it, which cannot be iterated: no
    total)."""
    compress = COMPRESS[extension]
    with beam.Pipeline() as p:
        for name, (data, records) in PLAIN_FILES.items():
            packed = name + extension
            (tmp_path / name).write_bytes(data)
            (tmp_path / packed).write_bytes(compress(data[:9]) + compress(data[9:]))
            for read in (name, packed):
                assert cli.count_records(str(tmp_path / read), infer_format(read)) == len(records(read)), read
                assert_that(p | f"Read {read}" >> ReadRecords(str(tmp_path / read)), equal_to(records(read)),
                            label=f"Check {read}")
        (tmp_path / ("empty.jsonl" + extension)).write_bytes(b"")
        assert_that(p | "Read empty" >> ReadRecords(str(tmp_path / ("empty.jsonl" + extension))),
                    equal_to([]), label="Check empty")


def test_a_file_whose_name_holds_glob_characters_reads_as_itself(tmp_path):
    """Written as a glob of itself ('[[]'), the file is read, and not the ones its name would
    match as a glob (Beam's file-splitting reader matched the name again: another file's lines)."""
    for name, record in (("data[1].jsonl", '{"id": "bracket"}'), ("data1.jsonl", '{"id": "plain"}'),
                         ("st*r.jsonl", '{"id": "star"}'), ("stXr.jsonl", '{"id": "X"}')):
        (tmp_path / name).write_text(record + "\n")
    with beam.Pipeline() as p:
        assert_that(p | "Bracket" >> ReadRecords(str(tmp_path / "data[[]1].jsonl")),
                    equal_to([b'{"id": "bracket"}']), label="CheckBracket")
        assert_that(p | "Star" >> ReadRecords(str(tmp_path / "st[*]r.jsonl")),
                    equal_to([b'{"id": "star"}']), label="CheckStar")


@pytest.mark.parametrize("name", ["in.jsonl.gz", "in.txt.bz2", "in.csv.xz", "in.jsonl.zst"])
def test_a_compressed_file_cut_short_fails_the_job_naming_it(tmp_path, name):
    """Beam's reader takes the cut for the end of the file: the records past it were lost
    without a word."""
    plain = name.rsplit(".", 1)[0]
    data = PLAIN_FILES[plain][0] * 50
    (tmp_path / name).write_bytes(COMPRESS["." + name.rsplit(".", 1)[1]](data)[:-12])
    with pytest.raises(Exception, match=re.escape(name) + ": its .* data ends before its stream does"):
        with beam.Pipeline() as p:
            _ = p | ReadRecords(str(tmp_path / name))


def test_text_lines_end_at_lone_carriage_returns_too():
    lines = list(text_lines(io.BytesIO(b"\xef\xbb\xbfone\rtwo\r\n\rthree\n\xff\r")))
    assert lines == [(1, "one"), (2, "two"), (4, "three"), (5, b"\xff")]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_files_with_a_byte_order_mark_are_decoded(encoding):
    """Excel's "Unicode Text" export is UTF-16 TSV; Notepad's "Unicode" UTF-16 text."""
    bom = {"utf-16-be": codecs.BOM_UTF16_BE}.get(encoding, b"")
    data = bom + "id\tprompt\na\tcafé\r\n".encode(encoding)
    header, rows = delimited_rows(io.BytesIO(data), "tsv")
    assert header == ["id", "prompt"] and list(rows) == [["a", "café"]]
    assert list(text_lines(io.BytesIO(data))) == [(1, "id\tprompt"), (2, "a\tcafé")]


def test_json_schema_flag_and_record_field(chat_model, tmp_path):
    """--json_schema for every record, a record's own json_schema over it, and a bad schema: an
    error row for that record alone."""
    flag_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                   "additionalProperties": False}
    own_schema = {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3}
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "flag", "prompt": "Say hi", "max_tokens": 40},
        {"id": "own", "prompt": "Say hi", "max_tokens": 40, "json_schema": own_schema},
        {"id": "bad", "prompt": "Say hi", "json_schema": {"type": 7}}]))
    summary = run(chat_model, "--input", str(path), "--output", str(tmp_path / "out/gen"),
                  "--format", "jsonl", "--json_schema", json.dumps(flag_schema))
    rows = {r["id"]: r for r in read_jsonl(summary["output_files"])}
    assert summary["errors"] == 1 and rows["bad"]["error"].startswith("json_schema: must be")
    value = json.loads(rows["flag"]["text"])
    assert rows["flag"]["finish_reason"] == "stop" and set(value) == {"ok"} and isinstance(value["ok"], bool)
    value = json.loads(rows["own"]["text"])
    assert rows["own"]["finish_reason"] == "stop" and 1 <= len(value) <= 3 and set(value) <= {"x", "y"}


def test_parquet_input_with_chat_template(chat_model, tmp_path):
    path = tmp_path / "records.parquet"
    pq.write_table(pa.Table.from_pylist(
        [{"id": 1, "prompt": "Say hi", "max_tokens": None},
         {"id": 2, "prompt": "Say hi", "max_tokens": 2},
         {"id": 3, "prompt": None, "max_tokens": None}]), path)
    plain = run(chat_model, "--input", str(path), "--output", str(tmp_path / "plain/gen"))
    chat = run(chat_model, "--input", str(path), "--output", str(tmp_path / "chat/gen"), "--chat")
    assert plain["records"] == chat["records"] == 3 and plain["errors"] == chat["errors"] == 1
    plain_rows = {r["id"]: r for r in read_parquet(plain["output_files"]).to_pylist()}
    chat_rows = {r["id"]: r for r in read_parquet(chat["output_files"]).to_pylist()}
    assert plain_rows["3"]["error"].startswith("prompt: missing")
    assert chat_rows["2"]["completion_tokens"] <= 2
    # The template wraps the prompt in role markers: more prompt tokens.
    assert chat_rows["1"]["prompt_tokens"] > plain_rows["1"]["prompt_tokens"]


def test_gcs_input_and_output(chat_model, jsonl_input, gcs_emulator):
    started = time.perf_counter()
    bucket = gcs_emulator.bucket("pipeline-io")
    bucket.blob("in/records.jsonl").upload_from_filename(jsonl_input)
    summary = run(chat_model, "--input", "gs://pipeline-io/in/*.jsonl",
                  "--output", "gs://pipeline-io/out/gen", progress=True)
    assert summary["output_files"] and all(
        f.startswith("gs://pipeline-io/out/gen-") for f in summary["output_files"])
    names = sorted(b.name for b in gcs_emulator.client().list_blobs("pipeline-io", prefix="out/"))
    assert names == sorted(f[len("gs://pipeline-io/"):] for f in summary["output_files"])
    tables = [pq.read_table(pa.BufferReader(bucket.blob(n).download_as_bytes())) for n in names]
    table = pa.concat_tables(tables)
    check_schema(table)
    check_rows([row_from_arrow_dict(r) for r in table.to_pylist()], summary)
    assert time.perf_counter() - started < 60


def test_a_gcs_model_writes_openai_lines_with_its_tokenizer(chat_model, jsonl_input, gcs_emulator, tmp_path):
    """The OpenAI writer finds a gs:// model's folder (the engine's cached copy) for its token
    texts."""
    uri = gcs_emulator.upload_dir(chat_model, "gs://models/chat-openai")
    summary = cli.main(["--input", str(jsonl_input), "--output", str(tmp_path / "out/gen"), "--format",
                        "openai", "--model", uri, *ENGINE_FLAGS, "--max_tokens", "3", "--logprobs", "1",
                        "--no_progress"])
    lines = [json.loads(line) for f in summary["output_files"] for line in open(f)]
    assert len(lines) == summary["records"]
    answered = [line["response"]["body"] for line in lines if line["response"]["status_code"] == 200]
    assert answered and all(body["model"] == uri for body in answered)
    assert all(isinstance(token, str) for body in answered for choice in body["choices"]
                            for token in (choice["logprobs"].get("tokens")
                                          or [t["token"] for t in choice["logprobs"]["content"]]))


# --- pieces ------------------------------------------------------------------------------------

def test_formats_from_extensions():
    assert infer_format("a/b.jsonl") == infer_format("gs://b/x/*.json") == "jsonl"
    assert infer_format("x.JSONL.gz") == "jsonl" and infer_format("x.parquet") == "parquet"
    assert infer_format("p.txt") == infer_format("p.text.bz2") == "text"
    with pytest.raises(ValueError, match="format"):
        infer_format("data/*")
    assert infer_format("gs://b/rows.csv") == "csv" and infer_format("rows.tsv.gz") == "tsv"
    with pytest.raises(ValueError, match="format must be one of"):
        ReadRecords("x.jsonl", format="xlsx")
    with pytest.raises(ValueError, match="format must be one of"):
        WriteRows("out/x", format="text")
    with pytest.raises(ValueError, match=r"num_shards \(0: the runner decides\) must be a whole number >= 0"):  # --output_shards -1
        WriteRows("out/x", num_shards=-1)
    assert _fixed_dir("gs://b/d/*/p.txt") == "gs://b/d/" and _fixed_dir("d/p.txt") == "d/"
    assert _fixed_dir("p.txt") == "" and _fixed_dir("/a/b[0-9].txt") == "/a/"


def test_as_chat():
    wrapped = cli.as_chat(b'{"id": "a", "prompt": "hi", "seed": 3}')
    assert wrapped == {"id": "a", "seed": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert cli.as_chat({"id": "a", "prompt": "hi"})["messages"][0]["content"] == "hi"
    # A passthrough field named custom_id, and a null messages (Parquet's column of the chat
    # rows beside this prompt row), leave it a prompt record.
    assert cli.as_chat({"id": "a", "prompt": "hi", "custom_id": "c7"}) == {
        "id": "a", "custom_id": "c7", "messages": [{"role": "user", "content": "hi"}]}
    for null in (None, float("nan")):
        assert cli.as_chat({"id": "a", "prompt": "hi", "messages": null}) == {
            "id": "a", "messages": [{"role": "user", "content": "hi"}]}
    # A Parquet column of strings stored as binary gives bytes.
    assert cli.as_chat({"id": "a", "prompt": "hé".encode()}) == {
        "id": "a", "messages": [{"role": "user", "content": "hé"}]}
    # Whatever would not validate, or is not a bare prompt, passes unchanged (so Generate's
    # error names the record's own fields).
    for raw in (b"not json", b"\xff", {"id": "a", "prompt": ""}, {"id": "a", "prompt": 3},
                {"id": "a", "prompt": b"\xff"}, {"id": "a", "prompt": "hi", "prompt_token_ids": [5]},
                b'{"id": "a", "prompt": "x", "prompt": "y"}',
                {"id": "a", "messages": []}, {"custom_id": "a", "body": {"prompt": "x"}}, [1],
                "[" * 100_000 + "]" * 100_000):  # too deep for json: Generate's error row says so
        assert cli.as_chat(raw) is raw


def test_input_that_would_fail_the_job_is_refused_before_it_runs(tmp_path):
    """Read as Parquet: a file that is not Parquet, or is cut short, wherever the glob puts it
    (Beam's reader fails the whole job on it). Any format: a directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a"], "prompt": ["hi"]}), tmp_path / "a.parquet")
    whole = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "recs.csv").write_text("id,prompt\na,hi\n")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "a.parquet").write_bytes(whole)
    (tmp_path / "cut" / "b.parquet").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "dir").mkdir()
    (tmp_path / "plain.jsonl.gz").write_text('{"id": "a", "prompt": "hi"}\n')  # named as what it is not
    (tmp_path / "gz.csv.bz2").write_bytes(gzip.compress(b"id,prompt\na,hi\n"))
    for pattern, fmt, problem in (("*.csv", "parquet", "recs.csv: not a whole Parquet file"),
                                  ("cut/*.parquet", "parquet", "b.parquet: not a whole Parquet file"),
                                  ("dir", "jsonl", "dir: a directory, not a file"),
                                  ("plain.jsonl.gz", "jsonl", "plain.jsonl.gz: not gzip data"),
                                  ("gz.csv.bz2", "csv", "gz.csv.bz2: not bzip2 data")):
        with pytest.raises(ValueError, match=problem):
            cli.main(["--input", str(tmp_path / pattern), "--input_format", fmt, "--no_progress",
                      "--output", str(tmp_path / "out/gen")])
    for pattern in ("typo.txt", "none*.csv", "typo?.tsv", "none*.jsonl", "none*.parquet"):
        with pytest.raises(FileNotFoundError, match="no input files match .*" + re.escape(pattern)):
            cli.main(["--input", str(tmp_path / pattern), "--input_format", fmt, "--no_progress",
                      "--output", str(tmp_path / "out/gen")])
    (tmp_path / "data[1].jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(FileNotFoundError, match=re.escape("a file has that very name, but Beam reads")):
        cli.main(["--input", str(tmp_path / "data[1].jsonl"), "--no_progress", "--output", str(tmp_path / "out/gen")])
    assert not (tmp_path / "out").exists()


def test_output_that_could_not_be_written_is_refused_before_it_runs(tmp_path):
    (tmp_path / "recs.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    (tmp_path / "a-file").write_text("")
    for output, problem in (("", "output prefix is empty"),
                            (f"{tmp_path}/", "is a directory; give a file name prefix in it"),
                            (str(tmp_path / "a-file" / "gen"), "its folder cannot be made"),
                            (str(tmp_path / "runs[2024]" / "gen"), "holds '\\[', which Beam's file writers"),
                            # A local delete of an earlier shard would glob: another job's files too.
                            (str(tmp_path / "gen*"), "holds '\\*', which Beam's file writers read as a glob"),
                            (str(tmp_path / "run?" / "gen"), "holds '\\?'")):
        with pytest.raises(ValueError, match=problem):
            cli.main(["--input", str(tmp_path / "recs.jsonl"), "--no_progress", "--output", output])
    with pytest.raises(ValueError, match="read as a glob"):  # the Python API's writer alike
        WriteRows(str(tmp_path / "gen*"), "jsonl")


def test_job_defaults_the_engine_cannot_honour_are_refused_before_the_run(chat_model, jsonl_input, tmp_path):
    """Known once the engine is up: every record would be an error row. (More than
    --max_logprobs allows is refused before, with the flags: test_argument_handling.)"""
    for flags, problem in ((["--logprobs", "100000", "--max_logprobs", "-1"], "--logprobs: must be <= the vocabulary's"),
                           (["--prompt_logprobs", "100000", "--max_logprobs", "-1"],
                            "--prompt_logprobs: must be <= the vocabulary's")):
        with pytest.raises(ValueError, match=problem):
            run(chat_model, "--input", str(jsonl_input), "--output", str(tmp_path / "gen"), *flags)
    assert not list(tmp_path.glob("gen*"))


def test_paths_with_no_folder_read_and_replace_in_the_current_one(chat_model, jsonl_input, tmp_path, monkeypatch):
    """Beam's local match finds nothing for a glob with no folder in it ("*.jsonl"): the input
    was refused as matching nothing, and an earlier run's shards under "gen" stayed."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(jsonl_input, tmp_path / "part-1.jsonl")
    first = run(chat_model, "--input", "part-*.jsonl", "--output", "gen", "--output_shards", "3")
    second = run(chat_model, "--input", "part-*.jsonl", "--output", "gen", "--output_shards", "1")
    assert first["records"] == second["records"] == len(jsonl_input.read_bytes().splitlines()) - 2
    assert sorted(p.name for p in tmp_path.glob("gen*")) == ["gen-00000-of-00001.parquet"]
    assert len(second["removed_files"]) == 3


def test_a_rerun_leaves_only_its_own_shards(chat_model, jsonl_input, tmp_path):
    """An earlier run's shards under the prefix, with another count, would read as this run's
    rows (twice over); other files whose names merely start with the prefix stay."""
    out = tmp_path / "out"
    first = run(chat_model, "--input", str(jsonl_input), "--output", str(out / "gen"), "--output_shards", "3")
    (out / "gen-v2-00000-of-00002.parquet").write_bytes(b"another job's")
    second = run(chat_model, "--input", str(jsonl_input), "--output", str(out / "gen"), "--output_shards", "1")
    assert len(first["output_files"]) == 3 and len(second["output_files"]) == 1
    assert second["removed_files"] == sorted(os.path.abspath(f) for f in first["output_files"])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [os.path.basename(second["output_files"][0]), "gen-v2-00000-of-00002.parquet"])
    assert "removed 3 shard file(s)" in cli.format_summary(second)


@pytest.mark.parametrize("format", ["parquet", "jsonl"])
def test_a_rerun_of_as_many_shards_of_the_same_size_replaces_them(format, tmp_path):
    """Beam keeps an existing shard whose checksum (on local disk, its size) equals the new
    one's: a rerun whose rows differ only in a tag of the same length kept the earlier run's;
    and it deletes only the earlier shards of the count that got data, so a rerun with shards
    left empty kept (or lost) some."""
    prefix = str(tmp_path / "out" / "gen")
    for tag in ("RUN_A", "RUN_B") * 4:  # which shards get rows, and so their sizes, vary by run
        rows = [error_row(f"r{i}", "a bad record", {"tag": tag}) for i in range(4)]
        with beam.Pipeline(options=PipelineOptions(IN_MEMORY)) as pipeline:
            _ = pipeline | beam.Create(rows) | WriteRows(prefix, format, num_shards=3)
        shards = sorted((tmp_path / "out").iterdir())
        assert [p.name for p in shards] == [f"gen-0000{i}-of-00003.{format}" for i in range(3)]
        if format == "parquet":
            read = [json.loads(row["passthrough"]) for shard in shards for row in pq.read_table(shard).to_pylist()]
        else:
            read = [json.loads(line)["passthrough"] for shard in shards for line in open(shard)]
        assert read == [{"tag": tag}] * 4


def test_an_openai_writer_whose_model_is_no_folder_fails_before_writing_any_row(tmp_path):
    """`model` names the folder (or gs:// prefix) the rows came from; a model's name instead
    failed only at the first row with logprobs, after every record had been generated."""
    rows = [error_row("r0", "a bad record", {})]  # no logprobs: its tokenizer would not be needed
    with pytest.raises(FileNotFoundError, match="model directory .*SmolLM2-135M-Instruct does not exist"):
        with beam.Pipeline(options=PipelineOptions(IN_MEMORY)) as pipeline:
            _ = pipeline | beam.Create(rows) | WriteRows(str(tmp_path / "gen"), "openai",
                                                         model="SmolLM2-135M-Instruct")


def test_an_output_prefix_under_home_is_written_there(chat_model, jsonl_input, tmp_path, monkeypatch):
    """"--output=~/..." reaches the program unexpanded (no shell expands "~" after "=")."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    summary = run(chat_model, "--input", str(jsonl_input), "--output=~/out/gen")
    assert summary["output_files"] and all(
        f.startswith(str(tmp_path / "home" / "out" / "gen-")) for f in summary["output_files"])
    assert not (tmp_path / "~").exists()


def test_engine_flags_configure_the_jobs_engine(chat_model, tmp_path):
    """--dtype and --max_model_len (with the scheduling flags beside them) reach the engine that
    runs the job: a record's logprobs are those of a bfloat16 engine's, and a prompt that fits the
    model's context but not --max_model_len is an error row."""
    short = {"id": "short", "prompt": "Name a colour.", "max_tokens": 3, "logprobs": 1}
    long = {"id": "long", "prompt": " ".join(["word"] * 40)}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (short, long)))
    flags = ["--dtype", "bfloat16", "--max_model_len", "24", "--admission", "longest_first",
             "--preemption", "evict", "--no_prefix_caching", "--host_kv_mb", "1"]
    summary = run(chat_model, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out/gen"),
                  "--format", "jsonl", *flags)
    rows = {r["id"]: r for r in read_jsonl(summary["output_files"])}
    assert rows["long"]["finish_reason"] == "error" and "24" in rows["long"]["error"], rows["long"]
    with Engine(chat_model, dtype=torch.bfloat16, max_model_len=24, **ENGINE_ARGS) as engine:
        [bf16] = engine.generate([Request("short", prompt=short["prompt"],
                                          params=SamplingParams(max_tokens=3, logprobs=1))])
    with Engine(chat_model, **ENGINE_ARGS) as engine:
        [fp32] = engine.generate([Request("short", prompt=short["prompt"],
                                          params=SamplingParams(max_tokens=3, logprobs=1))])
    assert rows["short"]["token_ids"] == bf16.token_ids
    assert rows["short"]["logprobs"] == pytest.approx(bf16.logprobs, abs=1e-6)
    assert rows["short"]["logprobs"] != pytest.approx(fp32.logprobs, abs=1e-4)  # bf16 is not fp32


def test_argument_handling(capsys):
    args, beam_args = cli.parse_args(["--input", "x.jsonl", "--temperature", "0.5",
                                      "--temp_location", "/tmp/t", "--stop", "a", "--stop", "b"])
    assert beam_args == ["--runner=DirectRunner", "--temp_location", "/tmp/t"]
    assert cli.sampling_defaults_of(args) == {"max_tokens": 64, "temperature": 0.5,
                                              "stop": ["a", "b"]}
    assert cli.engine_args_of(args) == {}  # the engine's defaults: the same engine as others'
    args, _ = cli.parse_args(["--include_stop_str_in_output", "--keep_special_tokens"])
    assert {k: v for k, v in cli.sampling_defaults_of(args).items()
            if k in ("include_stop_str_in_output", "skip_special_tokens")} == {
        "include_stop_str_in_output": True, "skip_special_tokens": False}
    args, _ = cli.parse_args(["--choice", "yes", "--choice", "no", "--regex", "[a-z]+"])
    assert {k: v for k, v in cli.sampling_defaults_of(args).items() if k in ("choice", "regex")} == {
        "choice": ["yes", "no"], "regex": "[a-z]+"}
    args, _ = cli.parse_args(["--repetition_penalty", "1.2", "--frequency_penalty", "0.5",
                              "--presence_penalty", "-0.5", "--min_tokens", "4"])
    assert cli.sampling_defaults_of(args) == {"max_tokens": 64, "temperature": 0.0, "repetition_penalty": 1.2,
                                              "frequency_penalty": 0.5, "presence_penalty": -0.5,
                                              "min_tokens": 4}
    with pytest.raises(ValueError, match="json_schema"):
        cli.main(["--input", "x.jsonl", "--json_schema", "{not json", "--no_progress"])
    args, _ = cli.parse_args(["--chat_template_kwargs", '{"enable_thinking": false}'])
    assert cli.sampling_defaults_of(args)["chat_template_kwargs"] == {"enable_thinking": False}
    for bad in ("{oops", "[1]", '{"a": 1, "a": 2}'):
        with pytest.raises(SystemExit):
            cli.parse_args(["--chat_template_kwargs", bad])
    args, beam_args = cli.parse_args(["--runner", "FnApiRunner", "--kv_cache_mb", "2"])
    assert beam_args == ["--runner", "FnApiRunner"]
    assert cli.engine_args_of(args) == {"kv_cache_bytes": 2 << 20}
    args, _ = cli.parse_args(["--device", "cuda", "--weight_budget_mb", "300", "--weights_in_host_memory"])
    assert cli.engine_args_of(args) == {"device": "cuda", "weight_budget_bytes": 300 << 20,
                                        "weights_in_host_memory": True}
    assert cli.engine_args_of(cli.parse_args(["--no_greedy_screen"])[0]) == {"greedy_screen": False}
    assert cli.engine_args_of(cli.parse_args(["--no_ngram_drafts"])[0]) == {"ngram_drafts": False}
    args, _ = cli.parse_args(["--dtype", "bfloat16", "--max_model_len", "512", "--host_kv_mb", "3",
                              "--admission", "longest_first", "--preemption", "evict", "--no_prefix_caching"])
    assert cli.engine_args_of(args) == {"dtype": torch.bfloat16, "max_model_len": 512, "host_kv_bytes": 3 << 20,
                                        "admission": "longest_first", "preemption": "evict",
                                        "enable_prefix_caching": False}
    assert cli.engine_args_of(cli.parse_args(["--lora", "/a/adapter"])[0]) == {"lora": "/a/adapter"}
    assert cli.engine_args_of(cli.parse_args(["--lora", "gs://b/adapter"])[0]) == {"lora": "gs://b/adapter"}
    assert cli.model_label(cli.parse_args(["--lora", "/a/adapter"])[0]) == \
        "default (SmolLM2-135M-Instruct) + LoRA /a/adapter"
    assert cli.model_label(cli.parse_args(["--model", "/m"])[0]) == "/m"
    for flags in (["--weight_budget_mb", "300"], ["--device", "cuda"]):  # one of the two missing
        with pytest.raises(SystemExit):
            cli.parse_args([*flags, "--weights_in_host_memory"])
    with pytest.raises(SystemExit):  # refused here, not once the engine's process has started
        cli.parse_args(["--lora", "/a/adapter", "--weight_budget_mb", "300"])
    assert "--lora with --weight_budget_mb" in capsys.readouterr().err
    assert cli._is_local("DirectRunner") and not cli._is_local("DataflowRunner")
    from apache_beam.runners.runner import create_runner
    assert cli._runner_kind(type(create_runner("TestDataflowRunner"))) == "DataflowRunner"
    for mistyped in (["--temprature", "0.9"], ["--n=2"],  # Beam would drop them with a warning
                     ["prompts.jsonl"], ["-temperature", "0.9"], ["--temperature", "0.9", "1.0"],
                     # a word after a Beam flag that takes no value is no value of it
                     ["--save_main_session", "prompts.jsonl"], ["--streaming", "prompts.jsonl"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--input", "x.jsonl", *mistyped, "--direct_num_workers=2"])
        assert "unrecognized arguments" in capsys.readouterr().err
    # More logprobs than --max_logprobs allows: refused here, not once the engine has started.
    for flags in (["--logprobs", "21"], ["--prompt_logprobs", "3", "--max_logprobs", "2"]):
        with pytest.raises(SystemExit):
            cli.parse_args(flags)
        assert "more than --max_logprobs allows" in capsys.readouterr().err
    for flags in (["--logprobs", "20"], ["--logprobs", "500", "--max_logprobs", "-1"],
                  ["--prompt_logprobs", "30", "--max_logprobs", "30"]):
        cli.parse_args(flags)
    for flags, said in ((["--output_shards", "-1"], "argument --output_shards: must be >= 0, got -1"),
                        (["--num_key_shards", "0"], "argument --num_key_shards: must be >= 1, got 0"),
                        (["--kv_cache_mb", "-1"], "argument --kv_cache_mb: must be >= 0, got -1"),
                        (["--max_model_len", "1"], "argument --max_model_len: must be >= 2, got 1"),
                        (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
                        (["--admission", "lifo"], "argument --admission: invalid choice: 'lifo'"),
                        (["--max_logprobs", "1.5"], "argument --max_logprobs: must be a whole number, got '1.5'")):
        with pytest.raises(SystemExit):
            cli.parse_args(flags)
        assert said in capsys.readouterr().err
    with pytest.raises(ValueError, match="give --input_format"):
        cli.prepare(["--input", "x.data", "--no_progress"])
    # Beam's flags keep their values, negative numbers and `--flag=value` ones included.
    _, beam_args = cli.parse_args(["--runner", "DirectRunner", "--direct_num_workers", "2",
                                   "--max_num_workers", "-1", "--job_name=x"])
    assert beam_args == ["--runner", "DirectRunner", "--direct_num_workers", "2", "--max_num_workers", "-1",
                         "--job_name=x"]
    with pytest.raises(ValueError, match="temperature"):
        cli.main(["--input", "x.jsonl", "--temperature", "-1", "--no_progress"])


@pytest.mark.parametrize("flags,why", [
    (["--temperature", "-1"], "temperature: must be >= 0"),
    (["--input", "/no/such/input.jsonl"], "no input files match"),
    (["--model", "/no/such/model"], "model directory /no/such/model does not exist"),
    (["--lora", "/no/such/adapter"], "LoRA adapter directory /no/such/adapter does not exist"),
    (["--lora", str(Path(__file__).parent)], "has no adapter_config.json"),  # a folder of something else
    (["--kv_cache_mb", "0"], "could not start: ValueError: kv_cache_bytes=0 holds fewer than 2 blocks "),
    (["--kv_cache_mb", "0"], "(kv_cache_bytes is --kv_cache_mb MiB)"),
    (["--runner", "NoSuchRunner"], "--runner: Unexpected pipeline runner: NoSuchRunner"),
    # A Latin-1 byte in a file name under a UTF-8 locale: Beam's coders failed on it, unnamed.
    *((["--" + flag, "/tmp/lat\udce9in1/x.jsonl"], f"--{flag} '/tmp/lat\\udce9in1/x.jsonl': the path is not UTF-8 text")
      for flag in ("input", "output", "model", "lora"))])
def test_the_command_refuses_a_job_it_cannot_run_with_a_line_not_a_traceback(flags, why, monkeypatch, capsys):
    """As argparse refuses a bad flag: status 2 and the reason (a missing adapter came from the
    crash of the process that would have held the engine; an engine that cannot start names its
    own error, not Beam's multi-page report of the process's crash)."""
    monkeypatch.setattr(sys, "argv", ["generate", *flags, "--no_progress"])
    with pytest.raises(SystemExit) as exited:
        cli.cli()
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m pipelines.generate: error: ") and why in error, error


@pytest.mark.parametrize("runner_flags,remote", [
    (["--runner=DataflowRunner"], True),
    (["--runner=FlinkRunner", "--environment_type=DOCKER"], True),
    (["--runner=PortableRunner", "--environment_type=PROCESS"], True),
    (["--runner=FlinkRunner", "--environment_type=LOOPBACK"], False),  # the SDK workers run here
    (["--runner=DirectRunner"], False)])
def test_local_paths_are_refused_where_the_workers_run_elsewhere(tmp_path, runner_flags, remote):
    """Workers elsewhere read no such file: a JSONL or Parquet input gave no records, and the
    job succeeded empty; its output went to the workers' own disks."""
    options = PipelineOptions(runner_flags)
    runner = options.view_as(StandardOptions).runner
    assert cli._workers_see_this_disk(runner, options) is not remote
    cli.check_paths_for_workers({"--input": "gs://b/in.jsonl", "--output": "gs://b/out"}, runner, options)
    if remote:
        with pytest.raises(ValueError, match=r"--input .*in.jsonl' is a local path, which the workers of"):
            cli.check_paths_for_workers({"--input": str(tmp_path / "in.jsonl")}, runner, options)
        with pytest.raises(ValueError, match="--output 'out/gen' is a local path"):
            cli.main(["--input", "gs://b/in.jsonl", "--output", "out/gen", "--no_progress", *runner_flags])
        with pytest.raises(ValueError, match="--model 'my-model' is a local path"):
            cli.main(["--model", "my-model", "--output", "gs://b/out", "--no_progress", *runner_flags])


@pytest.mark.parametrize("name", ["direct", "SwitchingDirect", "TestDirectRunner"])
def test_beams_short_names_of_the_direct_runner_run_here(chat_model, jsonl_input, tmp_path, name):
    """Beam makes its DirectRunner of these; the job refused them as remote runners whose
    workers could not read the local --input."""
    summary = run(chat_model, "--input", str(jsonl_input), "--output", str(tmp_path / "gen"), f"--runner={name}")
    assert summary["records"] > 0 and summary["state"] == "DONE"


def test_the_bundled_prompts_travel_in_the_pipeline_to_workers_elsewhere(chat_model, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_workers_see_this_disk", lambda runner, options: False)
    monkeypatch.setattr(cli, "check_paths_for_workers", lambda paths, runner, options: None)
    monkeypatch.setattr(cli, "ReadRecords", lambda *args: pytest.fail("read the launcher's file"))
    summary = run(chat_model, "--output", str(tmp_path / "gen"))
    assert summary["records"] == 255  # (the tiny model's context is too short for some: error rows)


class _FakeClient:
    def __init__(self):
        self.calls = 0

    def info(self):
        self.calls += 1
        return {"finished": 10 + 2 * self.calls, "generated_tokens": 100 * self.calls,
                "running": 1}


def test_progress_bar_polls_the_engine():
    client = _FakeClient()
    with cli.Progress(client, lambda: 5, interval=0.01) as progress:
        time.sleep(0.2)
        assert progress.bar.total == 5 and 0 < progress.bar.n <= 5
        progress.finish(7)  # rejected records count too
        assert progress.bar.n == progress.bar.total == 7
    assert client.calls > 2


@pytest.mark.slow
def test_default_run_on_the_bundled_prompts(tmp_path, monkeypatch):
    """`python -m pipelines.generate` with no arguments: the bundled prompts on the default
    model, chat template applied, 64 greedy tokens each, Parquet under ./output/."""
    monkeypatch.chdir(tmp_path)
    summary = cli.main([])
    assert summary["records"] == 255 and summary["errors"] == 0
    files = [(tmp_path / f).resolve() for f in summary["output_files"]]  # as given: ./output/...
    assert files and all(f.parent == (tmp_path / "output").resolve()
                         and f.name.startswith("generations-") for f in files)
    table = read_parquet([str(f) for f in files])
    check_schema(table)
    assert table.num_rows == 255 and len(set(table.column("id").to_pylist())) == 255
    assert max(table.column("completion_tokens").to_pylist()) <= 64
    assert summary["completion_tokens"] == sum(table.column("completion_tokens").to_pylist())
