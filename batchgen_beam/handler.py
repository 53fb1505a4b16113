"""`BatchGenModelHandler`: drop-in generation for Beam's `RunInference`.

Each batch is submitted to the machine's engine as a whole and collected when done; the engine
keeps batching across every bundle, thread and process of the machine in the meantime. Prefer
`Generate` where rows should leave as soon as each finishes: RunInference emits a batch only
when its slowest prompt is done (DESIGN.md §4).
"""

import dataclasses
import hashlib
import os
import uuid
from collections.abc import Mapping
from typing import Any, Iterable, Sequence

from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from batchgen_beam.engine_client import EngineConfig, EngineLease
from batchgen_beam.generate import EngineMetrics
from batchgen_beam.records import Parsed, check_defaults, is_missing, is_openai_line, parse_record, plain
from batchgen_beam.rows import completion_row, error_row
from runtime.default_model import DEFAULT_MODEL_NAME
from runtime.numbers import check_whole

DEFAULT_MIN_BATCH_SIZE, DEFAULT_MAX_BATCH_SIZE = 32, 256


def as_record(example: Any) -> Any:
    """A prompt string, a record (a mapping, namedtuple or beam.Row) or a chat (a list of messages)
    → what parse_record takes; a record without an id (or with a null or NaN one) gets its
    content_id, as an OpenAI Batch line's `custom_id` where it is one. A string (or its UTF-8
    bytes) is a prompt, never a JSON line (json.loads those first). numpy values count as the
    Python values they hold, in the id too."""
    try:
        example = plain(example)  # namedtuples and beam.Rows as dicts too: records, not chats
    except Exception:  # noqa: BLE001 - nesting past the stack, a key plain() makes unhashable:
        pass  # parse_record gives the example as it is its error row
    if isinstance(example, (str, bytes)):
        return {"id": content_id(example), "prompt": example}
    if isinstance(example, (list, tuple)):
        return {"id": content_id(example), "messages": list(example)}
    if isinstance(example, Mapping):
        # A record of ours may carry a field named "body", but not an OpenAI request body nor a
        # custom_id: a line with a malformed body keeps its custom_id, its row says what is wrong.
        line = is_openai_line(example) and ("custom_id" in example or isinstance(example.get("body"), Mapping))
        key = "custom_id" if line else "id"
        if is_missing(example.get(key)):  # None and NaN count as absent, as for every record field
            return {**example, key: content_id(example)}
    return example


def content_id(example: Any) -> str:
    """The id of an example that has none, from its content: the same on every run, so a
    job's seed draws the same sample for it (records.record_seed), and another for another.
    An example Python cannot write out (an int past its digit limit, nesting past its
    recursion limit) gets one id for all such: its row is an error row (records._unwritable)."""
    try:
        content = repr(example)
    except (ValueError, RecursionError):
        content = f"<a {type(example).__name__} too large to write>"
    digest = hashlib.blake2b(content.encode("utf-8", "backslashreplace"), digest_size=8)
    return f"example-{digest.hexdigest()}"


# What Beam's ModelHandler takes besides the batch sizes: its BatchElements' other knobs, and
# its model sharing, which changes nothing here (one engine per machine serves every process).
_BEAM_ARGS = {"max_batch_duration_secs", "element_size_fn", "batch_length_fn", "batch_bucket_boundaries",
              "large_model", "model_copies"}
_BEAM_ARGS_REFUSED = {
    "max_batch_weight": "Beam 2.77's BatchElements does not take it (its ModelHandler passes it on, and "
                        "RunInference fails)",
    "env_vars": "not supported: Beam sets them in the SDK process, and the machine's one engine, shared by "
                "every pipeline, may have started before; set them in the workers' environment",
}


class BatchGenModelHandler(ModelHandler[Any, PredictionResult, EngineLease]):
    """Examples: prompt strings, record dicts (DESIGN.md §5) or chat message lists. Inferences:
    output rows (a bad record gives an error row, never an exception). Per-record sampling and
    chat fields override the transform-wide `inference_args`."""

    def __init__(self, model: str | os.PathLike | None = None, *, min_batch_size: int | None = None,
                 max_batch_size: int | None = None, engine_args: dict | None = None, **kwargs):
        for name in sorted(kwargs.keys() & _BEAM_ARGS_REFUSED.keys()):
            value = kwargs[name]
            if not (value is None or isinstance(value, Mapping) and not value):  # Beam's defaults
                raise TypeError(f"BatchGenModelHandler: {name}: {_BEAM_ARGS_REFUSED[name]}")
            del kwargs[name]
        unknown = sorted(kwargs.keys() - _BEAM_ARGS)
        if unknown:  # Beam's ModelHandler would take them and do nothing with them
            raise TypeError(f"BatchGenModelHandler: unknown {unknown}: sampling and chat fields go in "
                            f"RunInference's inference_args, engine arguments in engine_args, and Beam's "
                            f"ModelHandler takes {', '.join(sorted(_BEAM_ARGS))}")
        for name, size in (("min_batch_size", min_batch_size), ("max_batch_size", max_batch_size)):
            if size is not None:
                check_whole(name, size, 1)
        if min_batch_size is not None and max_batch_size is not None and min_batch_size > max_batch_size:
            raise ValueError(f"min_batch_size ({min_batch_size}) must not be above max_batch_size ({max_batch_size})")
        # BatchElements would start at 1 and grow slowly; generation wants big batches at once.
        # A bound given alone moves the other's default out of its way (max_batch_size=8: a
        # minimum of 32 would refuse it).
        if min_batch_size is None:
            min_batch_size = min(DEFAULT_MIN_BATCH_SIZE, max_batch_size or DEFAULT_MIN_BATCH_SIZE)
        if max_batch_size is None:
            max_batch_size = max(DEFAULT_MAX_BATCH_SIZE, min_batch_size)
        super().__init__(min_batch_size=min_batch_size, max_batch_size=max_batch_size, **kwargs)
        self._config = EngineConfig.of(model, **(engine_args or {}))
        self._metrics: EngineMetrics | None = None  # made where batches run

    def load_model(self) -> EngineLease:
        # Not connected yet: under KeyedModelHandler with several models, Beam calls this while
        # holding the lock that connecting takes; the first batch connects. Beam drops the
        # lease when it replaces the model (an update, an evicted model per key): the engine
        # stops once no process uses it.
        return EngineLease(self._config.current())  # the model folder as it is now

    def update_model_path(self, model_path: str | None = None) -> None:
        """A new model from RunInference's `model_metadata_pcoll` side input: the batches after
        it run on that model's engine."""
        if model_path:
            self._config = EngineConfig.of(model_path, **dict(self._config.engine_args))

    def share_model_across_processes(self) -> bool:
        return False  # the client already shares one engine process per machine

    def model_copies(self) -> int:
        return 1  # the machine's one engine, whatever model_copies asked (a KeyedModelHandler refuses more)

    def validate_inference_args(self, inference_args: dict | None) -> None:
        check_defaults(inference_args)  # a bad transform-wide default fails before any record

    def run_inference(self, batch: Sequence[Any], model: EngineLease,
                      inference_args: dict | None = None) -> Iterable[PredictionResult]:
        batch_id = uuid.uuid4().hex[:12]
        parsed = [parse_record(as_record(example), inference_args) for example in batch]
        # Ids only need to be unique inside this batch's lifetime in the engine.
        request_ids = [f"{batch_id}:{i}" for i in range(len(batch))]
        done = model.run([dataclasses.replace(p.to_request(), id=rid)
                          for p, rid in zip(parsed, request_ids) if isinstance(p, Parsed)])
        rows = [completion_row(p, done[rid]) if isinstance(p, Parsed) else error_row(p)
                for p, rid in zip(parsed, request_ids)]
        self._metrics = self._metrics or EngineMetrics()
        for row in rows:
            self._metrics.row(row)
        self._metrics.engine(model.engine_info())
        model_id = _model_id(model.engine_config())
        return [PredictionResult(example, row, model_id) for example, row in zip(batch, rows)]

    def get_metrics_namespace(self) -> str:
        return "batchgen"


def _model_id(config: EngineConfig) -> str:
    """What each PredictionResult names as its model: the model, and the adapter merged in."""
    model = config.model or DEFAULT_MODEL_NAME
    lora = dict(config.engine_args).get("lora")
    return model if lora is None else f"{model} + LoRA {lora}"
