"""Reading input records and writing output rows, local or gs:// (anything Beam's FileSystems
opens).

`ReadRecords(pattern, format=None)` yields what `Generate` takes:
- ``jsonl`` (``.jsonl``, ``.json``, ``.ndjson``): each non-blank line as raw bytes. Decoding and
  JSON parsing happen in `Generate`, so a line that is not UTF-8 or not JSON becomes an error
  row instead of failing the pipeline. Lines end as `ReadFromText` ends them (at ``\n`` or
  ``\r\n``). Each file is read whole by one worker, so that a compressed one cut short fails
  the job (see below); `Generate` spreads the records over its keys after.
- ``parquet`` (``.parquet``, ``.pq``): each row as a dict of its columns. A column of
  times (timestamps, dates, times of day, durations; or of lists or structs holding them)
  that Python's datetime cannot hold whole (nanoseconds, as pandas writes ``datetime64[ns]``;
  a year past 9999) has its times read as Arrow's text of them; a
  file that names a column twice makes each of its rows an error row (which of the two would
  the record take?).
- ``csv`` (``.csv``) and ``tsv`` (``.tsv``): each row under a header row as a dict of its
  non-empty cells (an empty cell is an absent field, so the default applies). Cells are text,
  except in the `messages` and sampling columns, where a cell that parses as JSON of a type the
  field takes is read as JSON (``256``, ``0.7``, ``["\n\n"]``, ``{"50256": -100}``) and any
  other stays text (a stop string such as ``END`` or ``5``; `regex` and `json_schema` cells are
  always text). A row without an ``id`` column gets ``<name>:<n>``, `<name>` as for
  text files and `<n>` its row number under the header. A row with more cells than the header
  becomes an error row; one with fewer lacks the last fields; a cell that is not UTF-8 rejects
  the record, naming its column. Quoting is CSV's in both formats (pandas writes TSV so): a
  quoted cell may hold delimiters, line breaks and doubled quotes; a quote inside an unquoted
  cell (``5'10"``) is that character. Text after a quoted cell's closing quote, or a quoted
  cell that never closes, makes that row an error row saying where, rather than a guess at
  what it meant. Each file is read whole by one worker, as text files are (a row may span
  lines, inside quotes).
- ``text`` (``.txt``, ``.text``): one prompt per non-blank line (ended by ``\n``, ``\r\n`` or a
  lone ``\r``), as
  ``{"id": "<name>:<line>", "prompt": line}``. `<line>` is the 1-based line number in the file
  (blank lines count, so it is the number an editor shows) and `<name>` is the file's path below
  the pattern's fixed directory: the base name for a plain path or a ``dir/*.txt`` glob, and
  ``a/p.txt`` / ``b/p.txt`` for ``dir/*/p.txt``, so ids are unique across the matched files and
  stable from run to run. To know line numbers, each text file is read whole by one worker (a
  byte-range split would not know how many lines came before it); files of prompts are small
  next to the generation they feed. Content hashes were the alternative, but two equal lines
  would share an id, and ids must be unique. A line that is not UTF-8 becomes an error row.
Text, CSV and TSV files are UTF-8, or UTF-16 or UTF-32 where a byte-order mark says so.
Compressed files (``.gz``, ``.bz2``, ``.xz``, ``.zst``, ...) are read transparently and the
format is inferred from the extension under the compression one; pass `format` for any other
name. A compressed file cut short, or not the compression its name says, fails the job with a
ValueError naming it (`batchgen_beam/compressed.py`), where Beam's reader would stop at the cut.

`WriteRows(prefix, format="parquet")` writes output rows as Parquet (`OUTPUT_SCHEMA`) or JSONL
shards ``<prefix>-SSSSS-of-NNNNN.<format>``, or as OpenAI Batch API output lines (format
``openai``, shards ``.jsonl``, `batchgen_beam/openai_batch.py`), and returns the PCollection of
the written files' names.
"""

import codecs
import csv
import io
import json
import os
import posixpath
import re
import sys
import time
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.fileio import EmptyMatchTreatment
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.parquetio import ReadFromParquetBatched, WriteToParquet, _ParquetSink
from apache_beam.io.textio import WriteToText, _TextSink
import pyarrow as pa
import pyarrow.compute as pc

from batchgen_beam.compressed import compression_of, decompressed
from batchgen_beam.model_sources import check_local_folders, check_text_path, resolve_model
from batchgen_beam.openai_batch import response_line
from batchgen_beam.records import CHAT_FIELDS, SAMPLING_FIELDS, Rejected, RepeatedKey, loads_record
from batchgen_beam.rows import OUTPUT_SCHEMA, row_to_arrow_dict, row_to_json
from runtime.default_model import DEFAULT_MODEL_NAME
from runtime.numbers import check_whole

INPUT_FORMATS = ("jsonl", "parquet", "text", "csv", "tsv")
OUTPUT_FORMATS = ("parquet", "jsonl", "openai")

_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
               ".parquet": "parquet", ".pq": "parquet",
               ".txt": "text", ".text": "text", ".csv": "csv", ".tsv": "tsv"}
_DELIMITERS = {"csv": ",", "tsv": "\t"}
# CSV columns whose cells are read as JSON where they parse as a value of a type the field
# takes: the numbers (and the flags: JSON's true is an int here), lists and objects. Any other
# cell stays text: "5" or "null" as a stop string, a regex, a schema (which is JSON text).
_LISTS_AND_OBJECTS = {"messages": list, "stop": (str, list), "stop_token_ids": list,
                      "logit_bias": dict, "choice": list, "chat_template_kwargs": dict,
                      "allowed_token_ids": list, "bad_words": (str, list), "prompt_token_ids": list}
_TEXT_FIELDS = ("regex", "json_schema")
_JSON_CELLS = {**{field: (int, float) for field in (*SAMPLING_FIELDS, *CHAT_FIELDS)
                  if field not in _TEXT_FIELDS}, **_LISTS_AND_OBJECTS}
# Compressions Beam's file readers detect from the name (CompressionTypes.AUTO).
_COMPRESSION_EXTENSIONS = (".gz", ".bz2", ".deflate", ".zst", ".zstd", ".lzma", ".xz")
_WILDCARD = re.compile(r"[*?\[{]")


def infer_format(pattern: str) -> str:
    """The input format that the pattern's extension names; ValueError when it names none."""
    name = pattern.lower()
    for compression in _COMPRESSION_EXTENSIONS:
        if name.endswith(compression):
            name = name[:-len(compression)]
            break
    for extension, fmt in _EXTENSIONS.items():
        if name.endswith(extension):
            return fmt
    raise ValueError(f"cannot tell the format of {pattern!r} from its extension "
                     f"({', '.join(_EXTENSIONS)}); give format= one of {', '.join(INPUT_FORMATS)}")


def check_input(pattern: str, fmt: str) -> None:
    """FileNotFoundError where the pattern matches nothing; ValueError, naming the file, for
    input that would fail the whole job at run time rather than give error rows: a directory
    (give a glob of its files), in Parquet a file without Parquet's magic bytes at both ends
    (pyarrow's "magic bytes" error; a truncated file too), and a compressed file whose first
    bytes are not the compression its name says. The other formats read any bytes: what is
    wrong in them becomes error rows."""
    matched = FileSystems.match([absolute_path(pattern)])[0].metadata_list
    if not matched:
        hint = ""
        if "[" in pattern and os.path.exists(os.path.expanduser(pattern)):
            hint = (" (a file has that very name, but Beam reads the input as a glob, where '[' "
                    "starts a set of characters: write each '[' of the name as '[[]')")
        raise FileNotFoundError(f"no input files match {pattern!r}{hint}")
    for meta in matched:
        if os.path.isdir(meta.path):
            raise ValueError(f"{meta.path}: a directory, not a file; give its files, e.g. "
                             f"{os.path.join(meta.path, '*')!r}")
        if fmt == "parquet":
            _check_parquet_file(meta.path, meta.size_in_bytes)
        elif compression_of(meta.path):
            with open_input(meta.path) as f:
                f.read(1)  # a name that lies about the bytes


def check_output(prefix: str) -> None:
    """ValueError for an output prefix the job could not write under, before it runs: empty,
    a directory (files would be named "-00000-of-…"), or a local folder that cannot be made
    or written."""
    if not prefix.strip():
        raise ValueError("output prefix is empty; give one, e.g. out/generations")
    _check_no_glob(prefix)
    if "://" in prefix:
        return  # gs://: the bucket's permissions are known when the job writes
    prefix = os.path.expanduser(prefix)
    if prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise ValueError(f"output prefix {prefix!r} is a directory; give a file name prefix in it, "
                         f"e.g. {os.path.join(prefix, 'generations')!r}")
    folder = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output prefix {prefix!r}: its folder cannot be made ({exc})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"output prefix {prefix!r}: its folder {folder} is not writable")


def _check_no_glob(prefix: str) -> None:
    """ValueError for an output prefix holding a glob's characters: Beam's writers find their
    temporary files by a glob of it ('[': the job would run, then fail to write), and a local
    delete of an earlier shard globs its path ('*', '?': it would delete other files too)."""
    if found := sorted(set(prefix) & set("*?[")):
        raise ValueError(f"output prefix {prefix!r} holds {', '.join(map(repr, found))}, which Beam's "
                         f"file writers read as a glob (a rerun would delete files it matches, or "
                         f"the job fail to write); rename it")


def _check_parquet_file(path: str, size: int) -> None:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise ValueError(f"{path}: not a whole Parquet file (it starts {head!r} and ends {tail!r}; "
                         f"Parquet starts and ends with b'PAR1'); name the input format, or the "
                         f"files by it")


def _check_format(fmt: str, known: tuple[str, ...]) -> str:
    if fmt not in known:
        raise ValueError(f"format must be one of {', '.join(known)}, got {fmt!r}")
    return fmt


class ReadRecords(beam.PTransform):
    """Input records from files matching `pattern`: JSONL lines (bytes), Parquet rows (dicts) or
    text lines (dicts with an id and a prompt); see the module docstring."""

    def __init__(self, pattern: str, format: str | None = None):
        super().__init__()
        check_text_path("input pattern", pattern)
        self.pattern = absolute_path(pattern)
        self.format = _check_format(format, INPUT_FORMATS) if format else infer_format(pattern)

    def expand(self, pbegin):
        if self.format == "parquet":
            return (pbegin
                    | "ReadParquet" >> ReadFromParquetBatched(self.pattern)
                    | "Rows" >> beam.FlatMap(parquet_records))
        files = (pbegin
                 # Every format fails alike on a pattern matching nothing (ReadFromParquet
                 # does; MatchFiles would run on with no records).
                 | "Match" >> fileio.MatchFiles(self.pattern, EmptyMatchTreatment.DISALLOW)
                 | "Open" >> fileio.ReadMatches())
        return files | "Records" >> beam.FlatMap(_read_file, _fixed_dir(self.pattern), self.format)


def parquet_records(table: pa.Table):
    """A Parquet table's rows as records (see the module docstring)."""
    names = table.column_names
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        for _ in range(table.num_rows):
            yield Rejected(None, f"record: its Parquet file names the column(s) {', '.join(twice)} twice")
        return
    columns = [(name, _python_values(table.column(name))) for name in names]
    for n in range(table.num_rows):
        yield {name: values[n] for name, values in columns}


def _python_values(column: pa.ChunkedArray) -> list:
    try:
        return column.to_pylist()
    except (pa.ArrowInvalid, ValueError, OverflowError):
        # A time no Python type holds: nanoseconds, a year past 9999 or before 1, a duration
        # past timedelta's days. The column's times are then read as Arrow writes them.
        text_type = _times_as_text(column.type)
        if text_type == column.type:
            raise
        return pc.cast(column, text_type).to_pylist()


def _times_as_text(arrow_type: pa.DataType) -> pa.DataType:
    """The type with every timestamp, date, time or duration in it (nested ones too) text."""
    if pa.types.is_temporal(arrow_type):
        return pa.string()
    if pa.types.is_map(arrow_type):
        return pa.map_(_times_as_text(arrow_type.key_type), _times_as_text(arrow_type.item_type))
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        make = pa.list_ if pa.types.is_list(arrow_type) else pa.large_list
        return make(arrow_type.value_field.with_type(_times_as_text(arrow_type.value_type)))
    if pa.types.is_fixed_size_list(arrow_type):
        return pa.list_(arrow_type.value_field.with_type(_times_as_text(arrow_type.value_type)),
                        arrow_type.list_size)
    if pa.types.is_struct(arrow_type):
        return pa.struct([field.with_type(_times_as_text(field.type)) for field in arrow_type])
    return arrow_type


def _fixed_dir(pattern: str) -> str:
    """The directory part of the pattern before its first wildcard, with a trailing "/"."""
    wildcard = _WILDCARD.search(pattern)
    head = pattern[:wildcard.start()] if wildcard else pattern
    cut = head.rfind("/")
    return head[:cut + 1] if cut >= 0 else ""


def _file_name(readable_file, fixed_dir: str) -> str:
    """The file's path below the pattern's fixed directory, or its base name."""
    path = readable_file.metadata.path
    name = path[len(fixed_dir):] if fixed_dir and path.startswith(fixed_dir) else ""
    return name or posixpath.basename(path.replace(os.sep, "/"))


def open_input(path: str):
    """The input file's bytes, decompressed where its extension names a compression."""
    stored = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    return decompressed(stored, path) if compression_of(path) else stored


def _read_file(readable_file, fixed_dir: str, fmt: str):
    with open_input(readable_file.metadata.path) as f:
        yield from file_records(f, _file_name(readable_file, fixed_dir), fmt)


def file_records(binary_file, name: str, fmt: str):
    """The records a JSONL, text, CSV or TSV file holds, as ReadRecords yields them (ids
    `<name>:<n>` where the format has none)."""
    if fmt == "jsonl":
        return jsonl_lines(binary_file)
    if fmt in _DELIMITERS:
        return _delimited_records(binary_file, name, fmt)
    return _text_records(binary_file, name)


def jsonl_lines(binary_file):
    """A JSONL file's non-blank lines as bytes, split as Beam's ReadFromText splits them (at
    "\n" or "\r\n"; a lone "\r" stays in its line)."""
    for line in binary_file:
        line = line[:-2] if line.endswith(b"\r\n") else line[:-1] if line.endswith(b"\n") else line
        if line.strip():
            yield line


def _text_records(binary_file, name: str):
    for number, prompt in text_lines(binary_file):
        # A line that is not UTF-8 stays bytes: `Generate` rejects the record with an error
        # row that carries the line's id ("prompt: not valid UTF-8 (...)").
        yield {"id": f"{name}:{number}", "prompt": prompt}


def text_lines(binary_file):
    """A text file's non-blank lines with their 1-based numbers, each as text, or as bytes where
    it is not UTF-8. Lines end at "\n", "\r\n" or a lone "\r", as editors count them."""
    text = _text_stream(binary_file, newline=None)
    for number, line in enumerate(text, start=1):
        line = line.rstrip("\n")
        if line.strip():
            yield number, _text_or_bytes(line)


# Byte-order marks of the Unicode encodings other than UTF-8 (Excel's "Unicode Text" export
# and Windows Notepad's "Unicode" are UTF-16), longest first: UTF-32's starts like UTF-16's.
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _text_stream(binary_file, newline: str | None) -> io.TextIOWrapper:
    """The file as text: UTF-8 (a byte-order mark dropped), or UTF-16 or UTF-32 where a
    byte-order mark says so. Bytes the encoding cannot decode are escaped (surrogateescape)."""
    buffered = io.BufferedReader(_RawReader(binary_file))
    start = buffered.peek(4)[:4]
    encoding = next((name for bom, name in _BOMS if start.startswith(bom)), "utf-8-sig")
    return io.TextIOWrapper(buffered, encoding=encoding, errors="surrogateescape", newline=newline)


class _RawReader(io.RawIOBase):
    """Any binary file with read() (not all have peek: a BytesIO has not) as a raw stream, for the
    BufferedReader over it that peeks at the byte-order mark and decodes as it reads."""

    def __init__(self, binary_file):
        self._file = binary_file

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._file.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


@dataclass(frozen=True)
class MalformedRow:
    """A row that cannot be read as a record (broken quoting; a header naming a column twice):
    `line` is where it starts, `reason` why."""
    line: int
    reason: str


def delimited_rows(binary_file, fmt: str):
    """A CSV or TSV file's header and an iterator over its rows (blank lines skipped): each a
    list of cells, or a MalformedRow where a quote breaks the format's rules (text after a
    quoted cell's closing quote, or a quoted cell that never closes and so takes in the rest of
    the file). The header is a MalformedRow too where its own quoting is broken or it names a
    column twice."""
    # surrogateescape: a cell that is not UTF-8 goes on (as bytes, see _text_or_bytes) for
    # `Generate` to reject naming its column; the file's other rows still run.
    text = _text_stream(binary_file, newline="")
    # strict: text after a closing quote is an error, not a silent guess at the cell. No size
    # limit on a cell (the csv module's default is 128 KiB): long documents are prompts too.
    csv.field_size_limit(sys.maxsize)
    reader = csv.reader(text, delimiter=_DELIMITERS[fmt], strict=True)

    def rows():
        while True:
            line = reader.line_num + 1
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                yield MalformedRow(line, _quoting_error(str(exc), line))
                continue
            if cells:
                yield cells

    found = rows()
    first = next(found, [])
    if isinstance(first, MalformedRow):
        return first, found
    header = [_text_or_bytes(column) for column in first]
    twice = sorted({repr(column) for column in header if header.count(column) > 1})
    if twice:  # which of the two cells would a record take? Not ours to guess.
        return MalformedRow(reader.line_num, f"it names {', '.join(twice)} twice"), found
    return header, found


def _quoting_error(message: str, line: int) -> str:
    if message == "unexpected end of data":
        return (f"the quoted cell opened on line {line} or after never closes, so the rest of "
                f"the file was read into it")
    return f"a quote inside a cell must be doubled, and only a whole cell quoted ({message})"


def _delimited_records(binary_file, name: str, fmt: str):
    header, rows = delimited_rows(binary_file, fmt)
    if isinstance(header, MalformedRow):  # its own error row, then one per row under it
        unread = f"{name}: the header row (line {header.line}) cannot be read: {header.reason}"
        yield Rejected(f"{name}:0", unread)
    for number, cells in enumerate(rows, start=1):
        fallback_id = f"{name}:{number}"
        if isinstance(header, MalformedRow):
            yield Rejected(fallback_id, unread)
        elif isinstance(cells, MalformedRow):
            yield Rejected(fallback_id, f"{name}: row {number} (line {cells.line}): {cells.reason}")
        elif len(cells) > len(header):
            yield Rejected(fallback_id, f"{name}: row {number} has {len(cells)} cells, the header "
                                        f"{len(header)}")
        else:
            try:
                record = {column: _cell(column, cell) for column, cell in zip(header, cells) if cell}
            except RepeatedKey as bad:  # in a cell of JSON: which value was meant is not ours to guess
                yield Rejected(fallback_id, f"{name}: row {number}: {bad}")
                continue
            record.setdefault("id", fallback_id)
            yield record


def _text_or_bytes(text: str) -> str | bytes:
    """Text decoded with surrogateescape as it is, or as its bytes where they were not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: an undecodable byte, escaped
        return text.encode("utf-8", "surrogateescape")
    return text


def _cell(column: str | bytes, cell: str):
    value = _text_or_bytes(cell)
    if column in _JSON_CELLS and isinstance(value, str):
        try:
            parsed = loads_record(value)
        except RepeatedKey:
            raise
        except (ValueError, RecursionError):  # not JSON: text, such as a stop string
            return value
        return parsed if isinstance(parsed, _JSON_CELLS[column]) else value
    return value


def shards_under(prefix: str, suffix: str) -> list[str]:
    """The files named as WriteRows names its shards under `prefix`, any count, by absolute path."""
    prefix = absolute_path(prefix)
    shard = re.compile(re.escape(prefix) + r"-\d{5,}-of-\d{5,}" + re.escape(suffix))
    found = FileSystems.match([f"{prefix}-*-of-*{suffix}"])[0].metadata_list
    return sorted(path for path in map(absolute_path, (m.path for m in found)) if shard.fullmatch(path))


class _ReplacesEarlierShards:
    """A Beam file sink that, before renaming this run's shards into place, deletes every shard
    an earlier run left under the prefix, whatever their count. Beam's own deletes only those
    of the count that got data, and it keeps an existing shard whose checksum (on local disk,
    its size) equals the new one's: a rerun could keep an earlier run's rows, or lose its own."""

    def pre_finalize(self, init_result, writer_results):
        earlier = shards_under(self.file_path_prefix.get(), self.file_name_suffix.get())
        if earlier:
            FileSystems.delete(earlier)


class _ReplacingTextSink(_ReplacesEarlierShards, _TextSink):
    pass


class _ReplacingParquetSink(_ReplacesEarlierShards, _ParquetSink):
    pass


def _replacing_earlier_shards(write: WriteToText | WriteToParquet, sink: type):
    """`write` with its sink made `sink`, a subclass of the one it built that adds no state."""
    assert type(write._sink) in sink.__bases__, (type(write._sink), sink)
    write._sink.__class__ = sink
    return write


class WriteRows(beam.PTransform):
    """Output rows → ``<prefix>-SSSSS-of-NNNNN.parquet`` (`OUTPUT_SCHEMA`) or ``.jsonl`` files
    (one JSON object per line; format ``openai``: one OpenAI Batch output line per row, which
    names `model`, the model the rows came from (None: the default model, as `Generate`'s),
    and decodes logprobs' tokens with its tokenizer), replacing the shards an earlier run left under the prefix (any count). Returns
    the names of the files written."""

    def __init__(self, prefix: str, format: str = "parquet", num_shards: int = 0, *,
                 model: str | None = None):
        super().__init__()
        check_text_path("output prefix", prefix)
        _check_no_glob(prefix)
        self.prefix = absolute_path(prefix)
        self.format = _check_format(format, OUTPUT_FORMATS)
        check_whole("num_shards (0: the runner decides)", num_shards, 0)
        self.num_shards = num_shards
        self.model = model

    @property
    def suffix(self) -> str:
        return ".parquet" if self.format == "parquet" else ".jsonl"

    def existing_shards(self) -> list[str]:
        """The shards under this prefix now (an earlier run's, before this one writes)."""
        return shards_under(self.prefix, self.suffix)

    def expand(self, rows):
        if self.format == "parquet":
            write = WriteToParquet(self.prefix, OUTPUT_SCHEMA, file_name_suffix=self.suffix,
                                   num_shards=self.num_shards)
            return (rows
                    | "ToArrow" >> beam.Map(row_to_arrow_dict)
                    | "WriteParquet" >> _replacing_earlier_shards(write, _ReplacingParquetSink))
        if self.format == "openai":
            lines = rows | "ToOpenAI" >> beam.ParDo(_OpenAILines(self.model))
        else:
            lines = rows | "ToJson" >> beam.Map(row_to_json)
        write = WriteToText(self.prefix, file_name_suffix=self.suffix, num_shards=self.num_shards)
        return lines | "WriteJsonl" >> _replacing_earlier_shards(write, _ReplacingTextSink)


class _OpenAILines(beam.DoFn):
    """Rows → OpenAI Batch output lines. The model's tokenizer, which the token texts of
    logprobs and prompt logprobs need, is loaded on the first row that has them (the default
    model or a gs:// one fetched only then). A local `model` that is no model folder (its name,
    say) fails the job at setup, before it generates: not at construction, as a local folder may
    exist only on the workers."""

    def __init__(self, model: str | None):
        self._model = model
        self._name = DEFAULT_MODEL_NAME if model is None else model

    def setup(self):
        check_local_folders(self._model)
        self._token_texts = None

    def process(self, row):
        line = response_line(row, model=self._name, created=int(time.time()), token_texts=self._texts)
        yield json.dumps(line, ensure_ascii=False, allow_nan=False)

    def _texts(self):
        if self._token_texts is None:
            from runtime.tokenizer import TokenTexts, load_tokenizer  # transformers: only if needed
            self._token_texts = TokenTexts(load_tokenizer(resolve_model(self._model)))
        return self._token_texts


def absolute_path(path: str) -> str:
    """A local path or pattern made absolute, "~" expanded (a URI as it is), so names of one
    file compare equal, and Beam's local match finds a pattern with no folder in it ("*.jsonl",
    which it matches to nothing)."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))
