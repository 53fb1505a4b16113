"""`Generate`: records in, output rows out, with sequences resident in the engine across bundles.

Records are validated, then spread over sharded keys. For each key a stateful DoFn keeps every
pending record in BagState while its sequence runs in the machine's engine; a record's row is
emitted from `process` as soon as it is done, in the same bundle that drops it from state (so a
retried bundle neither loses nor repeats a row), and an event-time timer at the window's end
flushes the rest. Nothing depends on processing-time timers, which batch runners may never fire
(DESIGN.md §4). A bundle never waits for its own stragglers, only for engine capacity.
"""

import dataclasses
import uuid
import zlib
from typing import Any

import apache_beam as beam
from apache_beam.typehints import KV
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, TimerSpec, on_timer

from batchgen_beam.engine_client import EngineClient, EngineConfig
from batchgen_beam.records import Parsed, check_defaults, completion_row, error_row, parse_record

METRICS_NAMESPACE = "batchgen"


def shard_of(request_id: str, num_shards: int) -> int:
    """Stable across processes (unlike hash())."""
    return zlib.crc32(request_id.encode()) % num_shards


class EngineMetrics:
    """Beam metrics for rows and for the engine behind them."""

    def __init__(self):
        self.finished = Metrics.counter(METRICS_NAMESPACE, "sequences_finished")
        self.tokens = Metrics.counter(METRICS_NAMESPACE, "tokens_generated")
        self.errors = Metrics.counter(METRICS_NAMESPACE, "errors")
        self.queue_depth = Metrics.gauge(METRICS_NAMESPACE, "engine_queue_depth")
        self.tokens_per_step = Metrics.distribution(METRICS_NAMESPACE, "tokens_per_step")
        # The engine process that answered; on one machine min == max: all shared one engine.
        self.engine_pid = Metrics.distribution(METRICS_NAMESPACE, "engine_pid")
        self._seen = (0, 0)  # engine (steps, tokens) at the last report

    def row(self, row: dict) -> None:
        self.finished.inc()
        self.tokens.inc(row["completion_tokens"])
        if row["error"] is not None:
            self.errors.inc()

    def engine(self, info: dict | None) -> None:
        if not info:
            return
        self.queue_depth.set(info["waiting"])
        self.engine_pid.update(info["pid"])
        steps, tokens = info["steps"], info["decode_tokens"] + info["prefill_tokens"]
        if steps > self._seen[0]:
            self.tokens_per_step.update((tokens - self._seen[1]) // (steps - self._seen[0]))
        self._seen = (steps, tokens)


class _GenerateFn(beam.DoFn):
    PENDING = BagStateSpec("pending", PickleCoder())  # Parsed records whose rows are not out yet
    FLUSH = TimerSpec("flush", TimeDomain.WATERMARK)

    def __init__(self, config: EngineConfig, num_shards: int, max_in_flight: int, namespace: str):
        self._config, self._num_shards = config, num_shards
        self._max_in_flight, self._namespace = max_in_flight, namespace

    def setup(self):
        self._client = EngineClient.shared(self._config)
        self._metrics = EngineMetrics()
        self._recovered: set[int] = set()

    def _request_id(self, parsed: Parsed) -> str:
        # Two Generate transforms may share an engine and reuse record ids.
        return f"{self._namespace}:{parsed.id}"

    def process(self, element, window=beam.DoFn.WindowParam,
                pending=beam.DoFn.StateParam(PENDING), flush=beam.DoFn.TimerParam(FLUSH)):
        shard, parsed = element
        if not isinstance(parsed, Parsed):
            yield self._row(error_row(parsed))
            return
        if shard not in self._recovered:
            # First sight of this key in this process: a failed attempt or a dead worker may
            # have left records in state that no engine is running; resubmit them by id.
            self._recovered.add(shard)
            self._submit(list(pending.read()))
        flush.set(window.max_timestamp())
        pending.add(parsed)
        self._client.wait_for_capacity(self._max_in_flight)
        self._submit([parsed])
        prefix = f"{self._namespace}:"
        done_shards = {shard_of(rid[len(prefix):], self._num_shards)
                       for rid in self._client.done_ids() if rid.startswith(prefix)}
        if shard in done_shards:
            yield from self._emit_done(pending, wait=False)
        else:
            self._metrics.engine(self._client.last_info)

    @on_timer(FLUSH)
    def flush(self, pending=beam.DoFn.StateParam(PENDING)):
        records = list(pending.read())
        self._submit(records)
        yield from self._emit_done(pending, wait=True)

    def _submit(self, records: list[Parsed]) -> None:
        self._client.submit([dataclasses.replace(p.to_request(), id=self._request_id(p))
                             for p in records if not self._client.knows(self._request_id(p))])

    def _emit_done(self, pending, wait: bool):
        """Emit the rows of this key's finished records and drop them from state."""
        records = list(pending.read())
        ids = [self._request_id(p) for p in records]
        done = self._client.wait_all(ids) if wait else self._client.take(ids)
        if done:
            pending.clear()
            for parsed, request_id in zip(records, ids):
                if request_id in done:
                    yield self._row(completion_row(parsed, done[request_id]))
                else:
                    pending.add(parsed)
        self._metrics.engine(self._client.last_info)

    def _row(self, row: dict) -> dict:
        self._metrics.row(row)
        return row


class Generate(beam.PTransform):
    """Records (dicts, OpenAI Batch lines, JSON text lines) → output rows, one per input record.

    `model`: a local HF directory, gs://..., or None for the default model. Sampling keywords
    (max_tokens, temperature, ...) are transform-wide defaults that each record may override;
    `engine_args` go to `runtime.Engine` (max_num_seqs, kv_cache_bytes, ...).
    """

    def __init__(self, model: str | None = None, *, num_shards: int = 16, max_in_flight: int = 1024,
                 engine_args: dict | None = None, **sampling_defaults):
        super().__init__()
        self._config = EngineConfig.of(model, **(engine_args or {}))
        self._defaults = sampling_defaults
        check_defaults(sampling_defaults)  # a bad default fails here, not on a worker
        self._num_shards, self._max_in_flight = num_shards, max_in_flight

    def expand(self, records):
        defaults, shards = self._defaults, self._num_shards

        def keyed(record: Any):
            parsed = parse_record(record, defaults)
            # Rejected records carry no request: any shard will do to emit their error rows.
            return (shard_of(str(parsed.id), shards), parsed)

        return (records
                | "Validate" >> beam.Map(keyed).with_output_types(KV[int, Any])
                | "Generate" >> beam.ParDo(_GenerateFn(self._config, shards, self._max_in_flight,
                                                       uuid.uuid4().hex[:8])))
