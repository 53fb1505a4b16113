"""`Generate`: records in, output rows out, with sequences resident in the engine across bundles.

Records are validated, then spread over sharded keys. For each key a stateful DoFn keeps every
pending record in BagState while its sequence runs in the machine's engine; a record's row is
emitted from `process` as soon as it is done, in the same bundle that drops it from state (so a
retried bundle neither loses nor repeats a row), and an event-time timer at the window's end
flushes the rest. Correctness rests on no processing-time timer, which batch runners may
never fire (DESIGN.md §4). A bundle never waits for its own stragglers, only for engine capacity.

Unbounded inputs (streaming): a window may end only when the job drains (the global window), so
there a processing-time timer also emits each key's finished rows every `poll_interval_s` while
any are pending. Bounded inputs run without it.

Stragglers (`straggler_timeout_s`): the flush then waits at most that long. Records still
running are taken out of the engine (their tokens so far and RNG state) and leave as
continuations instead of rows, re-keyed to other shards; a second stage resumes each where it
stopped — prefilling prompt and generated tokens, which greedy decoding continues token for
token — and emits its row. So a worker left with long sequences at the end hands them to the
others, and each record still gets exactly one row: from the first stage or from the second.
"""

import dataclasses
import threading
import time
import uuid
import weakref
import zlib
from collections import Counter, defaultdict
from typing import Any, Callable

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput
from apache_beam.typehints import KV
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import StandardOptions
from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner, SwitchingDirectRunner
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, TimerSpec, on_timer
from apache_beam.utils.windowed_value import WindowedValue

from batchgen_beam.engine_client import EngineClient, EngineConfig
from batchgen_beam.records import Parsed, check_defaults, parse_record
from batchgen_beam.rows import completion_row, error_row
from runtime.numbers import check_number, check_whole

METRICS_NAMESPACE = "batchgen"
CONTINUATIONS = "continuations"  # the first stage's output of records handed to the second
CONTINUED = "#continued"  # the second stage keys a record by its id plus this: other shards


@dataclasses.dataclass
class Continuation:
    """A record whose sequence left an engine unfinished: `state` is Engine.migrate_out's."""
    parsed: Parsed
    state: dict


def _parsed(item: Parsed | Continuation) -> Parsed:
    return item.parsed if isinstance(item, Continuation) else item


def _records(pending) -> list[Parsed | Continuation]:
    """The records held in a stage's state (each is held with its timestamp)."""
    return [record for record, _ in pending.read()]


def engine_request_id(namespace: str, parsed: Parsed, key_suffix: str = "") -> str:
    """The engine's id for a record: its namespace, its key (the record's id plus the stage's
    suffix) and a digest of what it asks. Records that share an id but not a request (ids are
    not always unique in real data) each run; identical ones, as a retried bundle resubmits,
    run once."""
    return f"{namespace}:{parsed.id}{key_suffix}#{parsed.request_digest}"


def _key_of(request_id: str, namespace: str) -> str:
    """engine_request_id's key part, or "" for an id of another namespace."""
    prefix = f"{namespace}:"
    return request_id[len(prefix):].rpartition("#")[0] if request_id.startswith(prefix) else ""


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
        self.continuations = Metrics.counter(METRICS_NAMESPACE, "continuations")
        # Engine (steps, tokens) at the last report; None before the first, which only sets
        # it: the engine's counters are its life's, earlier jobs' steps included.
        self._seen: tuple[int, int] | None = None

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
        if self._seen is not None and steps > self._seen[0]:
            self.tokens_per_step.update((tokens - self._seen[1]) // (steps - self._seen[0]))
        self._seen = (steps, tokens)


class _LiveJobs:
    """The batch jobs (by a token of their pipeline) with Generate DoFns set up in this process,
    how many, and the namespaces of their Generate transforms (with their engines).

    A batch job's DoFns are torn down when it ends, failed or not. A failed job leaves its
    requests in the engine, where a retried bundle of the same job picks them up. Once another
    job sets up here while none of the failed job's DoFns live, no retry is coming (a notebook
    re-running a fixed cell): its requests are cancelled rather than left running ahead of the
    new job's. Streaming jobs take no part: the DirectRunner runs them on a runner that sets
    DoFns up and tears them down around every bundle, so none alive does not mean over."""

    _lock = threading.Lock()  # held while cancelling: a retry setting up meanwhile resubmits after
    _alive: Counter[str] = Counter()
    _namespaces: defaultdict[str, dict[str, EngineConfig]] = defaultdict(dict)

    @classmethod
    def set_up(cls, job: str, namespace: str, config: EngineConfig) -> None:
        with cls._lock:
            cls._alive[job] += 1  # first: its teardown follows, whatever the cancels do
            cls._namespaces[job][namespace] = config
            for over in [j for j in cls._namespaces if not cls._alive[j]]:
                del cls._alive[over]  # a process running job after job keeps none of theirs
                for ns, cfg in cls._namespaces.pop(over).items():
                    EngineClient.shared(cfg).cancel(f"{ns}:")

    @classmethod
    def torn_down(cls, job: str) -> None:
        with cls._lock:
            cls._alive[job] -= 1


_job_tokens: "weakref.WeakKeyDictionary[beam.Pipeline, str]" = weakref.WeakKeyDictionary()


def _job_of(pipeline: beam.Pipeline) -> str:
    """A token for the job this pipeline runs, shared by its Generate transforms; running the
    same Pipeline object again retries the same job."""
    return _job_tokens.setdefault(pipeline, uuid.uuid4().hex[:8])


class _GenerateFn(beam.DoFn):
    """A stage's logic, over its state (`pending`: the records, Parsed or Continuation, whose
    rows are not out yet, each with its event timestamp) and its window-end timer (`flush`);
    `stateful_stage` declares them. A row leaves with its record's timestamp, whichever
    record's processing or which timer emits it."""

    def __init__(self, config: EngineConfig, num_shards: int, max_in_flight: int, namespace: str,
                 straggler_timeout_s: float | None = None, shard_suffix: str = "", job: str | None = None):
        self._config, self._num_shards = config, num_shards
        self._max_in_flight, self._namespace = max_in_flight, namespace
        self._straggler_timeout_s = straggler_timeout_s  # None: wait for all (the last stage)
        self._shard_suffix = shard_suffix  # records are keyed by shard_of(id + this), and named so
        self._job = job  # a batch job's token (_LiveJobs); None: not tracked

    def setup(self):
        self._client = EngineClient.shared(self._config).connect()
        self._metrics = EngineMetrics()
        self._recovered: set[int] = set()
        self._tracked = self._job is not None  # a failed setup may have no teardown
        if self._tracked:
            _LiveJobs.set_up(self._job, self._namespace, self._config)

    def teardown(self):
        if getattr(self, "_tracked", False):
            _LiveJobs.torn_down(self._job)

    def _request_id(self, item: Parsed | Continuation) -> str:
        # Two Generate transforms may share an engine and reuse record ids; the second stage's
        # ids differ from the first's, so no client mistakes one for the other.
        return engine_request_id(self._namespace, _parsed(item), self._shard_suffix)

    def _process(self, element, window, timestamp, pending, flush):
        shard, parsed = element
        if not isinstance(parsed, (Parsed, Continuation)):
            yield self._row(error_row(parsed))
            return
        if shard not in self._recovered:
            # First sight of this key in this process: a failed attempt or a dead worker may
            # have left records in state that no engine is running; resubmit them by id.
            self._recovered.add(shard)
            self._submit(_records(pending))
        flush.set(window.max_timestamp())
        pending.add((parsed, timestamp))
        self._client.wait_for_capacity(self._max_in_flight)
        self._submit([parsed])
        done_keys = {_key_of(rid, self._namespace) for rid in self._client.done_ids()}
        done_shards = {shard_of(key, self._num_shards) for key in done_keys if key}
        if shard in done_shards:
            yield from self._emit_done(pending, window, wait=False)
        else:
            self._metrics.engine(self._client.last_info)

    def _flush(self, pending, window):
        self._submit(_records(pending))
        if self._straggler_timeout_s is not None:
            yield from self._emit_done(pending, window, wait=False, timeout=self._straggler_timeout_s)
            yield from self._hand_off(pending, window)
        yield from self._emit_done(pending, window, wait=True)

    def _hand_off(self, pending, window):
        """Emit this key's records still running as continuations and drop them from state."""
        held = list(pending.read())
        states = self._client.migrate_out([self._request_id(r) for r, _ in held])
        if not states:
            return
        pending.clear()
        for record, timestamp in held:
            state = states.get(self._request_id(record))
            if state is None:  # finished meanwhile: its row comes out below
                pending.add((record, timestamp))
            else:
                self._metrics.continuations.inc()
                # The second stage continues it under its own id (the sequences follow it).
                continued_id = engine_request_id(self._namespace, _parsed(record), CONTINUED)
                state = {**state, "request_id": continued_id}
                yield TaggedOutput(CONTINUATIONS, WindowedValue(Continuation(_parsed(record), state),
                                                                timestamp, (window,)))

    def _submit(self, records: list[Parsed | Continuation]) -> None:
        fresh = [r for r in records if not self._client.knows(self._request_id(r))]
        self._client.submit([dataclasses.replace(r.to_request(), id=self._request_id(r))
                             for r in fresh if isinstance(r, Parsed)])
        self._client.resume([r.state for r in fresh if isinstance(r, Continuation)])

    def _emit_done(self, pending, window, wait: bool, timeout: float = 0.0):
        """Emit the rows of this key's finished records and drop them from state: all of them
        (wait), or those done within `timeout`. Each leaves in `window`, its record's (state is
        per key and window): a row given only its timestamp would be assigned windows afresh by
        the input's WindowFn (a sliding window's record in each window its timestamp falls in,
        a merged session's in a session of its own, a WindowFn reading the record failing)."""
        held = list(pending.read())
        ids = [self._request_id(r) for r, _ in held]
        if wait:
            done = self._client.wait_all(ids)
        else:
            done = self._client.take(ids)
            deadline = time.monotonic() + timeout
            while len(done) < len(ids) and time.monotonic() < deadline:
                done.update(self._client.take(set(ids) - done.keys(), deadline - time.monotonic()))
        if done:
            pending.clear()
            for (record, timestamp), request_id in zip(held, ids):
                if request_id in done:
                    yield WindowedValue(self._row(completion_row(_parsed(record), done[request_id])),
                                        timestamp, (window,))
                else:
                    pending.add((record, timestamp))
        self._metrics.engine(self._client.last_info)

    def _row(self, row: dict) -> dict:
        self._metrics.row(row)
        return row


class _StreamingGenerateFn(_GenerateFn):
    """The first stage on an unbounded input: besides the window-end flush, a processing-time
    timer (`poll`) emits the key's finished rows every `poll_interval_s` while any are pending,
    so a row waits neither for its window to end nor for its key's next record. `clock` reads
    the runner's processing time, which the timer is set by."""

    def __init__(self, *args, poll_interval_s: float, clock: Callable[[], float], **kwargs):
        super().__init__(*args, **kwargs)
        self._poll_interval_s, self._clock = poll_interval_s, clock

    def _process(self, element, window, timestamp, pending, flush, poll):
        yield from super()._process(element, window, timestamp, pending, flush)
        poll.set(self._clock() + self._poll_interval_s)

    def _poll(self, pending, poll, window):
        # The key may have moved here from a failed worker: resubmit what no engine runs.
        self._submit(_records(pending))
        yield from self._emit_done(pending, window, wait=False)
        if next(iter(pending.read()), None) is not None:
            poll.set(self._clock() + self._poll_interval_s)


def stateful_stage(logic: type[_GenerateFn], names: str) -> type[_GenerateFn]:
    """`logic` as a stateful DoFn whose state and timers are named after `names`. Each stage of
    each Generate transform needs names of its own: where two stateful stages share them, the
    DirectRunner (Beam 2.77) fires one's timers on the other's DoFn, and the records one holds
    never come out (two Generate transforms reading one PCollection lost rows)."""
    pending_spec = BagStateSpec(f"pending_{names}", PickleCoder())
    flush_spec = TimerSpec(f"flush_{names}", TimeDomain.WATERMARK)

    class Stage(logic):
        def process(self, element, window=beam.DoFn.WindowParam, timestamp=beam.DoFn.TimestampParam,
                    pending=beam.DoFn.StateParam(pending_spec),
                    flush=beam.DoFn.TimerParam(flush_spec)):
            return self._process(element, window, timestamp, pending, flush)

        @on_timer(flush_spec)
        def flush(self, pending=beam.DoFn.StateParam(pending_spec), window=beam.DoFn.WindowParam):
            return self._flush(pending, window)

    if not issubclass(logic, _StreamingGenerateFn):
        return Stage
    poll_spec = TimerSpec(f"poll_{names}", TimeDomain.REAL_TIME)

    class StreamingStage(Stage):  # its flush timer too, and a poll timer for rows done meanwhile
        def process(self, element, window=beam.DoFn.WindowParam, timestamp=beam.DoFn.TimestampParam,
                    pending=beam.DoFn.StateParam(pending_spec),
                    flush=beam.DoFn.TimerParam(flush_spec), poll=beam.DoFn.TimerParam(poll_spec)):
            return self._process(element, window, timestamp, pending, flush, poll)

        @on_timer(poll_spec)
        def poll(self, pending=beam.DoFn.StateParam(pending_spec), poll=beam.DoFn.TimerParam(poll_spec),
                 window=beam.DoFn.WindowParam):
            return self._poll(pending, poll, window)
    return StreamingStage


def _check_runner(records) -> None:
    """ValueError where the runner would lose rows: Beam's BundleBasedDirectRunner delivers
    what timers emit after a downstream GroupByKey has run (the job fails) and drops their
    counters; the DirectRunner runs a streaming job on it, where a bounded input's window
    closes at once, so the rows its window-end flush emits are dropped as late."""
    runner, pipeline = records.pipeline.runner, records.pipeline
    if isinstance(runner, BundleBasedDirectRunner):
        raise ValueError("Generate cannot run on Beam's BundleBasedDirectRunner, which loses "
                         "what a timer emits; use the DirectRunner (or the FnApiRunner)")
    if (isinstance(runner, SwitchingDirectRunner) and records.is_bounded
            and pipeline.options.view_as(StandardOptions).streaming):
        raise ValueError("Generate on a bounded input (files) in streaming mode on the "
                         "DirectRunner would lose the rows emitted when its window closes: "
                         "run it without --streaming")


@beam.typehints.with_output_types(dict)
class Generate(beam.PTransform):
    """Records (dicts, OpenAI Batch lines, JSON text lines) → output rows, one per input record.

    `model`: a local HF directory, gs://..., or None for the default model. Sampling and chat
    keywords (max_tokens, temperature, ..., chat_template_kwargs) are transform-wide defaults
    that each record may override;
    `engine_args` go to `runtime.Engine` (max_num_seqs, kv_cache_bytes, ...).
    `straggler_timeout_s`: at the end of input, wait at most this long for a key's records, then
    continue the unfinished ones in a second stage on other keys (module docstring); None: wait.
    `poll_interval_s`: on an unbounded input (or with the `streaming` option), how often each
    key's finished rows are emitted between its records; bounded inputs ignore it. `clock`: the
    runner's processing time in seconds, which that poll is timed by (as GroupIntoBatches'):
    the wall clock, except under a TestStream, whose processing time starts at 0 and moves only
    as it advances it (pass `clock=lambda: 0.0` there, or no poll ever fires).
    """

    def __init__(self, model: str | None = None, *, num_shards: int = 16, max_in_flight: int = 1024,
                 engine_args: dict | None = None, straggler_timeout_s: float | None = None,
                 poll_interval_s: float = 1.0, clock: Callable[[], float] = time.time,
                 **sampling_defaults):
        super().__init__()
        self._config = EngineConfig.of(model, **(engine_args or {}))
        self._defaults = sampling_defaults
        check_defaults(sampling_defaults)  # a bad default fails here, not on a worker
        check_whole("num_shards", num_shards, 1)
        check_whole("max_in_flight", max_in_flight, 1)
        if straggler_timeout_s is not None:
            check_number("straggler_timeout_s", straggler_timeout_s, 0)
        check_number("poll_interval_s", poll_interval_s, 0, above=True)
        if not callable(clock):
            raise ValueError(f"clock must be a function returning seconds, got {clock!r}")
        self._num_shards, self._max_in_flight = num_shards, max_in_flight
        self._straggler_timeout_s, self._poll_interval_s = straggler_timeout_s, poll_interval_s
        self._clock = clock

    def expand(self, records):
        _check_runner(records)
        defaults, shards = self._defaults, self._num_shards
        namespace = uuid.uuid4().hex[:8]
        # State and timer names of this transform's own (stateful_stage), stable from run to
        # run (a streaming job's update maps state by name): from its place in the pipeline.
        names = f"{zlib.crc32(records.pipeline._current_transform().full_label.encode()):08x}"

        def keyed(record: Any):
            parsed = parse_record(record, defaults)
            # Rejected records carry no request: any shard will do to emit their error rows.
            return (shard_of(str(parsed.id), shards), parsed)

        validated = records | "Validate" >> beam.Map(keyed).with_output_types(KV[int, Any])
        streaming = not records.is_bounded or records.pipeline.options.view_as(StandardOptions).streaming
        job = None if streaming else _job_of(records.pipeline)
        config = self._config.current()  # the model folder as this pipeline finds it
        first_stage_args = (config, shards, self._max_in_flight, namespace, self._straggler_timeout_s)
        if streaming:
            first_stage = stateful_stage(_StreamingGenerateFn, names)(
                *first_stage_args, poll_interval_s=self._poll_interval_s, clock=self._clock)
        else:
            first_stage = stateful_stage(_GenerateFn, names)(*first_stage_args, job=job)
        # Rows are dicts, declared on every step: a pipeline that requires each step's output
        # type (--type_check_strictness=ALL_REQUIRED) builds. With stragglers the first stage
        # emits their continuations too, which a runtime type check holds to the ParDo's hint.
        if self._straggler_timeout_s is None:
            return validated | "Generate" >> beam.ParDo(first_stage).with_output_types(dict)
        first = validated | "Generate" >> beam.ParDo(first_stage).with_output_types(Any).with_outputs(
            CONTINUATIONS, main="rows").with_output_types(dict)
        second_stage = stateful_stage(_GenerateFn, names + "_continued")(
            config, shards, self._max_in_flight, namespace, None, CONTINUED, job)
        continued = (first[CONTINUATIONS]
                     # Other shards than the first stage's: the stragglers of one key spread out.
                     | "Rekey" >> beam.Map(lambda c: (shard_of(c.parsed.id + CONTINUED, shards), c)
                                           ).with_output_types(KV[int, Any])
                     | "Continue" >> beam.ParDo(second_stage).with_output_types(dict))
        return (first.rows, continued) | "Rows" >> beam.Flatten().with_output_types(dict)
