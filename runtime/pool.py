"""`EnginePool`: several engines pulling from shared work, idle ones taking work from busy ones.

One engine per process (spawned; on a CPU box each with its own torch threads), driven by
runtime/pool_worker.py. In batch inference output lengths show only at run time, so a split
fixed up front leaves some engines idle while others grind through long sequences, and the job
waits for the slowest. The pool fixes that two ways:
- split="shared": requests wait in the pool's queue, ordered by `policy` (aged as the engines'
  admission orders are, runtime/scheduler.py), and each goes to the least loaded engine with
  a free slot (an engine holds at most its max_num_seqs), so work is
  bound to an engine as late as possible. split="static": request i goes to engine
  i % num_engines when submitted (or to the engine named) — a static partition, such as Beam's
  keyed sharding gives; the baseline.
- reallocate=True: when one engine's expected remaining work is under half another's (an idle
  engine's is zero), the busier one donates requests — waiting, suspended or running — to even
  the two out (runtime/rebalance.py). Running ones take their KV and RNG state along
  (`Engine.migrate_out(with_kv=True)`) and go on exactly where they stopped, so every output is
  what one engine alone would give (up to floating-point differences between batch shapes).

Loads are expected remaining output tokens: each engine's own estimate, reported about every
`report_interval` seconds, plus what the pool sent it since. Per engine, `stats()` gives the
queue, running set, counters and migrations, and `idle(start, end)` the time it had nothing to run.
"""

import contextlib
import multiprocessing
import pickle
import queue
import threading
import time
import traceback
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from runtime import pool_worker
from runtime.engine import Engine
from runtime.estimate import EstimateOrder, LengthEstimator, exact_length
from runtime.numbers import check_number, check_whole, is_whole
from runtime.rebalance import QUEUE_ORDERS
from runtime.request import Completion, CompletionWaiter, Request, check_request_types, request_list
from runtime.sampling import SamplingParams
from runtime.scheduler import OVERDUE_AFTER_BATCHES

SPLITS = ("shared", "static")
STEAL_BELOW = 0.5  # an engine takes work once its load is under this fraction of another's
DECLINED_PAUSE = 0.5  # seconds before asking an engine again that had nothing worth giving
HISTORY = 100_000  # samples kept per engine for timeline() and idle()


def _is_index(value, size: int) -> bool:
    """Whether `value` is an integer (numpy's too; not a bool) in [0, size)."""
    return is_whole(value, 0) and value < size


def _unsendable(requests: list[Request]) -> dict[str, str]:
    """Why each request that cannot be pickled (a message carrying a function, say) cannot go
    to an engine process, by id. Checked here because an inbox pickles on its feeder thread,
    which drops a failing command, and every request in it, with only a traceback on stderr."""
    errors = {}
    for request in requests:
        try:
            pickle.dumps(request)
        except Exception as exc:
            errors[request.id] = (f"the request cannot be sent to an engine process: it does not "
                                  f"pickle ({type(exc).__name__}: {exc})")
    return errors


def idle_seconds(transitions, start: float, end: float) -> tuple[float, float]:
    """From an engine's (time, busy) transitions: seconds idle within [start, end], and of those
    the tail: from its last busy moment to `end`."""
    idle, busy, since, last_busy = 0.0, False, start, None
    for t, now_busy in transitions:
        t = min(max(t, start), end)
        if busy:
            last_busy = t
        else:
            idle += t - since
        busy, since = now_busy, t
    if busy:
        last_busy = end
    else:
        idle += end - since
    return idle, end - (last_busy if last_busy is not None else start)


@dataclass
class _Engine:
    process: multiprocessing.Process
    inbox: object
    capacity: int = 0
    report: dict = field(default_factory=dict)  # the latest
    in_flight: dict[str, float] = field(default_factory=dict)  # request id -> its expected tokens
    commands: int = 0  # commands sent; a report says how many it has handled
    unacked: list[tuple[int, float]] = field(default_factory=list)  # (command number, tokens)
    # Donated to it, not yet received: request id -> tokens. The donor's notice and the taker's
    # receipt come from two processes, in either order; a receipt first leaves a negative entry.
    arriving: dict[str, float] = field(default_factory=dict)
    awaiting_donation: bool = False  # asked to donate, or to take, and the donor has not answered
    declined_at: float = float("-inf")
    transitions: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    timeline: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    def load(self) -> float:
        handled = self.report.get("commands", 0)
        self.unacked = [(n, tokens) for n, tokens in self.unacked if n > handled]
        return (self.report.get("remaining_tokens", 0.0) + sum(t for _, t in self.unacked)
                + sum(t for t in self.arriving.values() if t > 0))

    def in_donation(self) -> bool:
        return self.awaiting_donation or any(t > 0 for t in self.arriving.values())

    def live(self) -> int:
        return sum(self.report.get(k, 0) for k in ("waiting", "running", "suspended"))

    def send(self, command: tuple, tokens: float = 0.0) -> None:
        self.commands += 1
        if tokens:
            self.unacked.append((self.commands, tokens))
        self.inbox.put(command)


class EnginePool:
    """`num_engines` engines of `model`, `threads_per_engine` torch threads each; `engine_args`
    go to each `Engine` (admission defaults to `policy`). `reallocate` may be switched between
    jobs. Close it (or use it as a context manager) to end the engine processes."""

    def __init__(self, model: str | Path | None = None, *, num_engines: int = 2,
                 threads_per_engine: int = 1, split: str = "shared", reallocate: bool = True,
                 policy: str = "adaptive", min_steal_tokens: float = 64,
                 report_interval: float = 0.1, start_timeout: float = 600.0, **engine_args):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if policy not in QUEUE_ORDERS:
            raise ValueError(f"policy must be one of {sorted(QUEUE_ORDERS)}, got {policy!r}")
        check_whole("num_engines", num_engines, 1)
        check_whole("threads_per_engine", threads_per_engine, 1)
        if not isinstance(reallocate, bool):
            raise ValueError(f"reallocate must be True or False, got {reallocate!r}")
        for name, value, floor in (("report_interval", report_interval, 1e-3),
                                   ("start_timeout", start_timeout, 1e-3),
                                   ("min_steal_tokens", min_steal_tokens, 0)):
            check_number(name, value, floor)
        Engine.check_args(**engine_args)  # here, not in each engine process
        self.split, self.reallocate, self.policy = split, reallocate, policy
        self.min_steal_tokens = min_steal_tokens
        self.estimator = LengthEstimator()  # learned from every engine's completions
        engine_args.setdefault("admission", policy)

        context = multiprocessing.get_context("spawn")
        self._outbox = context.Queue()
        inboxes = [context.Queue() for _ in range(num_engines)]
        self._engines = [_Engine(context.Process(
            target=pool_worker.run, name=f"batchgen-pool-engine-{i}", daemon=True,
            args=(i, model, engine_args, threads_per_engine, inboxes, self._outbox, report_interval)),
            inboxes[i]) for i in range(num_engines)]
        for engine in self._engines:
            engine.process.start()

        self._lock = threading.Lock()  # everything below, and the engines' bookkeeping
        self._queue: list[Request] = []  # shared split: not yet sent to an engine
        self._queued_at: dict[str, int] = {}  # by id: requests dispatched when it joined (aging)
        self._queue_order = EstimateOrder(self.estimator, reads_estimate=policy == "adaptive",
                                          joined_at=lambda request: self._queued_at[request.id])
        self._params: dict[str, SamplingParams] = {}  # in flight: submitted, not yet completed
        self._results: queue.Queue[Completion] = queue.Queue()
        self._waiters: dict[str, CompletionWaiter] = {}
        self._next_static = 0
        self._failure: str | None = None
        self._closing = threading.Event()
        self._await_ready(start_timeout)
        if policy != "fifo":  # the engines' capacities are known once they are ready
            self._queue_order.overdue_after = OVERDUE_AFTER_BATCHES * sum(e.capacity for e in self._engines)
        self._thread = threading.Thread(target=self._serve, name="batchgen-pool", daemon=True)
        self._thread.start()

    def _await_ready(self, timeout: float) -> None:
        deadline, ready = time.monotonic() + timeout, set()
        while len(ready) < len(self._engines):
            try:
                message = self._outbox.get(timeout=0.5)
            except queue.Empty:
                message = self._silent_exit(ready)
            if message is None:
                if time.monotonic() < deadline:
                    continue
                self.close()
                raise RuntimeError(f"engine pool: only {len(ready)} of {len(self._engines)} "
                                   f"engines started within {timeout} s")
            if message[0] in ("refused", "failed"):
                self.close()
                error = ValueError if message[0] == "refused" else RuntimeError
                raise error(f"engine {message[1]} failed to start: {message[2]}")
            if message[0] == "ready":
                _, index, report = message
                self._engines[index].capacity = report["capacity"]
                self._record(index, report)
                ready.add(index)

    def _silent_exit(self, ready: set[int]):
        """A process killed while loading (the OOM killer, most often) sends nothing: raise
        when one has exited, unless its last words ("failed", with why) were still on the way."""
        exited = [(i, e.process.exitcode) for i, e in enumerate(self._engines)
                  if i not in ready and e.process.exitcode is not None]
        if not exited:
            return None
        try:
            return self._outbox.get(timeout=0.5)
        except queue.Empty:
            self.close()
            raise RuntimeError(f"engine pool: engine process(es) exited while starting "
                               f"(index, exit code): {exited}") from None

    # ---- submitting and collecting --------------------------------------------------------
    def submit(self, request: Request, engine: int | None = None) -> None:
        """Queue a request; with split="static", `engine` pins it to that engine."""
        self._submit([request], None if engine is None else [engine])

    def _submit(self, requests: list[Request], engines: list[int] | None,
                waiter: CompletionWaiter | None = None) -> None:
        for request in requests:
            check_request_types(request)
        if engines is not None:
            if self.split != "static":
                raise ValueError('engines can be named only with split="static"')
            if len(engines) != len(requests) or not all(_is_index(e, len(self._engines)) for e in engines):
                raise ValueError(f"need one engine index (an int) in [0, {len(self._engines)}) per request")
        unsendable = _unsendable(requests)
        with self._lock:
            self._note_exited()
            self._raise_failure()
            clash = [r.id for r in requests if r.id in self._params]
            if clash or len({r.id for r in requests}) != len(requests):
                raise ValueError(f"request ids already in flight or repeated: {clash[:5]}")
            for request in requests:
                self._params[request.id] = request.params
                if waiter is not None:
                    self._waiters[request.id] = waiter
            for request_id, error in unsendable.items():
                self._complete(None, Completion.failed(request_id, error, invalid=True))
            if self.split == "shared":
                queued = [r for r in requests if r.id not in unsendable]
                self._queue.extend(queued)
                self._queued_at.update((r.id, self._queue_order.taken) for r in queued)
                self._queue_order.joined()
                self._dispatch()
                return
            if engines is None:
                engines = [(self._next_static + i) % len(self._engines) for i in range(len(requests))]
                self._next_static += len(requests)
            batches = defaultdict(list)
            for request, index in zip(requests, engines):
                if request.id not in unsendable:
                    batches[index].append(request)
            for index, batch in batches.items():
                self._send_requests(index, batch)

    def generate(self, requests: list[Request], engines: list[int] | None = None) -> list[Completion]:
        """Submit all, wait for all; results in request order. With split="static", `engines`
        may name each request's engine (default: request i to engine i % num_engines)."""
        requests = request_list(requests)
        if not requests:
            return []
        waiter = CompletionWaiter([r.id for r in requests])
        self._submit(requests, engines, waiter)
        try:
            while not waiter.done.wait(0.1):
                with self._lock:
                    self._note_exited()
                    self._raise_failure()
        finally:
            with self._lock:
                for request in requests:
                    if self._waiters.get(request.id) is waiter:
                        del self._waiters[request.id]
        return [waiter.results[r.id] for r in requests]

    def poll(self, timeout: float | None = None) -> list[Completion]:
        """Completions finished so far (of requests not collected by generate()), waiting up to
        `timeout` for one when there are none yet (None: while anything is in flight)."""
        if timeout is not None:
            check_number("timeout", timeout, 0)
        completions = self._drain()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not completions:
            with self._lock:
                self._note_exited()
                self._raise_failure()
                if timeout is None and not self._params:
                    break
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                completions.append(self._results.get(timeout=wait))
            except queue.Empty:
                pass
        return completions + self._drain()

    def _drain(self) -> list[Completion]:
        completions = []
        while True:
            try:
                completions.append(self._results.get_nowait())
            except queue.Empty:
                return completions

    def has_unfinished(self) -> bool:
        return bool(self._params)

    # ---- the coordinator ------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                message = self._outbox.get(timeout=0.2)
            except queue.Empty:
                message = None
            with self._lock:
                try:
                    if message is not None:
                        self._handle(message)
                    self._note_exited()
                    self._dispatch()
                    self._rebalance()
                except BaseException:  # callers get it instead of waiting forever
                    self._failure = f"the pool's coordinator failed:\n{traceback.format_exc()}"
                    return

    def _note_exited(self) -> None:
        """An engine process that exited fails the pool. Callers waiting look too: one killed
        midway through a message leaves the coordinator waiting for its rest for good."""
        dead = [i for i, e in enumerate(self._engines) if e.process.exitcode is not None]
        for i in dead:  # what is on its way to it stays so: Python's exit would wait for its
            self._engines[i].inbox.cancel_join_thread()  # feeder, blocked on a pipe nobody reads
        if dead and self._failure is None and not self._closing.is_set():
            self._failure = f"engine process(es) {dead} exited"

    def _handle(self, message: tuple) -> None:
        kind, index = message[0], message[1]
        engine = self._engines[index]
        if kind == "failed":
            self._failure = f"engine {index} failed:\n{message[2]}"
            return
        self._record(index, message[-1])
        if kind == "update":
            for completion in message[2]:
                self._complete(index, completion)
        elif kind == "donated":
            taker = self._engines[message[2]]
            engine.awaiting_donation = taker.awaiting_donation = False
            if not message[3]:
                engine.declined_at = time.monotonic()
            for request_id in message[3]:
                tokens = engine.in_flight.pop(request_id, None)
                if tokens is not None:  # else it already finished at the taker
                    taker.in_flight[request_id] = tokens
                if taker.arriving.pop(request_id, None) is None:
                    taker.arriving[request_id] = tokens or 0.0
        elif kind == "received":
            for request_id in message[2]:
                if engine.arriving.pop(request_id, None) is None:
                    engine.arriving[request_id] = -1.0

    def _record(self, index: int, report: dict) -> None:
        engine = self._engines[index]
        engine.transitions.extend(report.pop("transitions"))
        engine.report = report
        engine.timeline.append({k: report[k] for k in ("t", "busy", "waiting", "running", "suspended",
                                                       "remaining_tokens")})

    def _complete(self, index: int | None, completion: Completion) -> None:
        """`index`: the engine that ran it; None for one the pool could not send to any."""
        params = self._params.pop(completion.id, None)
        if params is None:
            self._failure = f"request {completion.id!r} completed twice (last by engine {index})"
            return
        for engine in self._engines:  # normally `index`; a donation notice may still be on its way
            engine.in_flight.pop(completion.id, None)
        if not exact_length(params):
            for output in completion.outputs:
                if output.finish_reason in ("stop", "length"):
                    self.estimator.observe(len(output.token_ids), natural=output.finish_reason == "stop")
        waiter = self._waiters.pop(completion.id, None)
        if waiter is not None:
            waiter.add(completion)
        else:
            self._results.put(completion)

    def _expected(self, request: Request) -> float:
        return self.estimator.remaining(request.params, 0) * request.params.n

    def _send_requests(self, index: int, requests: list[Request]) -> None:
        engine = self._engines[index]
        expected = {r.id: self._expected(r) for r in requests}
        engine.in_flight.update(expected)
        engine.send(("submit", requests), sum(expected.values()))

    def _dispatch(self) -> None:
        """Shared split: hand queued requests, in policy order, to the least loaded engines with
        a free slot."""
        if not self._queue or self._failure:
            return
        self._queue_order.sort(self._queue, QUEUE_ORDERS[self.policy])
        loads = [e.load() for e in self._engines]
        # Samples, as max_num_seqs counts them; a request above it goes to an empty engine.
        room = [e.capacity - sum(self._params[rid].n for rid in e.in_flight) for e in self._engines]
        empty = [not e.in_flight for e in self._engines]
        batches = defaultdict(list)
        while self._queue:
            n = self._queue[0].params.n
            free = [i for i in range(len(self._engines)) if room[i] >= n or (empty[i] and room[i] > 0)]
            if not free:
                break
            request = self._queue.pop(0)
            del self._queued_at[request.id]
            self._queue_order.took()
            index = min(free, key=lambda i: loads[i])
            batches[index].append(request)
            loads[index] += self._expected(request)
            room[index] -= n
            empty[index] = False
        for index, batch in batches.items():
            self._send_requests(index, batch)

    def _rebalance(self) -> None:
        """Pair the least loaded engine with the most loaded one and have the latter donate,
        while some pair is uneven enough; one donation per engine at a time."""
        if not self.reallocate or self._queue or self._failure:
            return
        now = time.monotonic()
        free = [e for e in self._engines if not e.in_donation()]
        while len(free) >= 2:
            taker = min(free, key=_Engine.load)
            donors = [e for e in free if e is not taker and e.live() >= 2
                      and now - e.declined_at >= DECLINED_PAUSE]
            if not donors:
                return
            donor = max(donors, key=_Engine.load)
            if donor.load() - taker.load() < self.min_steal_tokens or \
                    taker.load() > STEAL_BELOW * donor.load():
                return
            donor.send(("donate", self._engines.index(taker), taker.load(), self.min_steal_tokens))
            donor.awaiting_donation = taker.awaiting_donation = True
            free = [e for e in free if e is not donor and e is not taker]

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"engine pool failed: {self._failure}")

    # ---- metrics --------------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """Per engine, its latest report: waiting / running / suspended requests, expected
        remaining tokens, busy, steps and tokens, requests migrated in and out."""
        with self._lock:
            return [{**e.report, "in_flight": len(e.in_flight)} for e in self._engines]

    def idle(self, start: float, end: float) -> list[dict]:
        """Per engine, seconds (time.monotonic) within [start, end] it had nothing to run, and
        of those the tail, after it last ran something."""
        with self._lock:
            spans = [idle_seconds(list(e.transitions), start, end) for e in self._engines]
        return [{"idle_s": idle, "tail_idle_s": tail} for idle, tail in spans]

    def timeline(self) -> list[list[dict]]:
        """Per engine, its reports over time: t, busy, waiting, running, suspended, remaining_tokens."""
        with self._lock:
            return [list(e.timeline) for e in self._engines]

    # ---- shutting down --------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:  # callers still waiting in generate() or poll() get it, not a hang
            if self._failure is None:
                self._failure = "it was closed"
        self._closing.set()
        for engine in self._engines:
            if engine.process.is_alive():
                engine.inbox.put(("stop",))
        # A process exits only once its queues' pipes took what it put: its last updates, and
        # states it donated to an engine that stopped first. Read and dropped here, else each
        # waited out its join on a full pipe and was terminated (10 s an engine, mid-write).
        deadline = time.monotonic() + 10
        while any(e.process.is_alive() for e in self._engines) and time.monotonic() < deadline:
            for stopped_reader in [self._outbox, *(e.inbox for e in self._engines if not e.process.is_alive())]:
                _drain(stopped_reader)
        for engine in self._engines:
            if engine.process.is_alive():
                engine.process.terminate()
            engine.process.join(5)
            # What is still on its way to an engine that has gone stays so: Python's exit would
            # wait for its inbox's feeder thread, blocked on a pipe nobody reads any more.
            engine.inbox.cancel_join_thread()

    def __enter__(self) -> "EnginePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drain(messages) -> None:
    """Read and drop what a queue holds, until it stays empty for a moment."""
    with contextlib.suppress(queue.Empty):
        while True:
            messages.get(timeout=0.05)
