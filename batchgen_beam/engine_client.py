"""One engine per worker machine, fed by every SDK process and bundle thread.

The engine lives in its own process (Beam's MultiProcessShared with spawn_process), wrapped in
an `EngineService` whose calls are coarse (submit many, poll many) because every argument and
result is pickled across the process boundary. Each SDK process holds one `EngineClient` per
engine configuration; it remembers what it submitted until the result is taken, so when the
engine process dies it starts a new one and resubmits what was resident. The engine process
stops when the last client leaves it: a RunInference model replaced (a model update, a model
per key evicted) lets go of its `EngineLease`.
"""

import dataclasses
import fcntl
import functools
import gc
import hashlib
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from apache_beam.utils.multi_process_shared import MultiProcessShared

from batchgen_beam.model_sources import model_location
from kernels import linear_rows
from runtime.request import Completion, Request

log = logging.getLogger(__name__)

# Errors a proxy call raises when the engine process is gone.
_ENGINE_GONE = (EOFError, ConnectionError, BrokenPipeError, OSError)
# Restarts of a dead engine process in a row (as it starts, or as one call finds it gone).
MAX_ENGINE_DEATHS = 3
# A request in flight through this many deaths of the engine process is a suspect: suspects run
# again apart from each other, in halves of the suspects' group, each half split again where it
# kills the engine once more, so that a request that crashes the engine whenever it runs ends
# alone as an error completion and takes no request in flight beside it down with it.
SUSPECT_DEATHS = 2
# The owner of a request whose client left while it ran (EngineService.leave).
_NO_CLIENT = "<left>"
# Seconds the last RunInference engine of a process that no lease uses waits before its client
# leaves: the next pipeline of a notebook or script takes it up. (Beam's shared-object cache
# drops the last pipeline's model as the next one sets up, just before it loads its own: each
# pipeline reloaded.) An engine let go while another is in use, or while another is taken up (a
# model update, a model per key evicted), leaves at once: two engines' memory was not asked for.
IDLE_LEASE_GRACE_S = 60.0


def _finishes_when_interrupted(method):
    """Run this client method where an interrupt cannot cut it short. KeyboardInterrupt (a
    notebook's stop button) reaches only the main thread: there, a call to the engine cut short
    would lose its reply (the completions or states it carried, which the engine counts as
    handed over), leave that reply unread on the connection, or leave the client's records half
    updated. So from the main thread the method runs on the client's own thread and the caller
    waits for it: an interrupt stops the wait, not the work."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return method(self, *args, **kwargs)
        return self._worker.submit(method, self, *args, **kwargs).result()
    return run


class _SuspectsTurn:
    """The machine's turn to run suspects, one client at a time. A suspect that kills the
    engine alone is to blame only where no other client's suspects ran beside it: another SDK
    process's, which this client's bookkeeping cannot see (two lone suspects in one engine, an
    innocent one and a poison, both ended as errors). A lock file per engine; the system
    releases it where its process dies."""

    def __init__(self, tag: str):
        self._path = os.path.join(tempfile.gettempdir(), f"{tag}.suspects.lock")
        self._file = None

    def take(self) -> bool:
        """Whether this client has the turn now (taken here if free)."""
        if self._file is None:
            file = open(self._path, "a")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                return False
            self._file = file
        return True

    def give_back(self) -> None:
        if self._file is not None:
            self._file.close()  # closing it unlocks it
            self._file = None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What identifies an engine: the same config on one machine means the same engine."""
    model: str | None = None  # local directory or gs://...; None = the default model
    engine_args: tuple[tuple[str, Any], ...] = ()  # runtime.Engine keyword arguments
    # What the local model and adapter folders held when the pipeline was built: one saved
    # again in place (a notebook's new fine-tune) is another engine, not the one loaded before.
    local_revision: str | None = None

    @classmethod
    def of(cls, model: str | os.PathLike | None = None, **engine_args) -> "EngineConfig":
        """Unknown engine arguments raise here, at pipeline construction, not on a worker.
        Arguments at their defaults are left out and local model and adapter folders named
        absolute (model_sources.model_location), so every spelling of a configuration is one."""
        from runtime import Engine

        engine_args = Engine.canonical_args(**engine_args)
        if engine_args.get("lora") is not None:
            engine_args["lora"] = model_location(engine_args["lora"], "LoRA adapter")
        return cls(model_location(model), tuple(sorted(engine_args.items()))).current()

    def current(self) -> "EngineConfig":
        """This config with its local folders as they are now (a transform built before a
        folder was saved again, used in a pipeline after, gets the new weights' engine)."""
        return dataclasses.replace(self, local_revision=_local_revision(self.model, dict(self.engine_args).get("lora")))

    @property
    def tag(self) -> str:
        return "batchgen-engine-" + hashlib.sha1(repr(self).encode()).hexdigest()[:16]


def _local_revision(*folders: str | None) -> str | None:
    """A digest of the names, sizes and modification times of the files in those of `folders`
    that are local directories (a gs:// model is a new version under a new prefix); None if
    none is."""
    local = [os.path.expanduser(folder) for folder in folders if folder is not None]
    local = [folder for folder in local if os.path.isdir(folder)]
    if not local:
        return None
    digest = hashlib.sha1()
    for folder in local:
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_file():
                    stat = entry.stat()
                    digest.update(f"{folder}/{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


class EngineStartError(RuntimeError):
    """The engine process could not start (its engine arguments, its model or its memory), in
    one line: Beam's shared-process wrapper reports the engine's own error with the engine
    process's whole traceback."""

    def __init__(self, config: EngineConfig, error: str):
        self.error = error
        super().__init__(f"the engine for {config.model or 'the default model'} could not start: {error}")

    @classmethod
    def from_report(cls, config: EngineConfig, report: str) -> "EngineStartError":
        lines = report.rstrip().splitlines()
        # The exception ("ValueError: kv_cache_bytes=0 holds ...", maybe several lines, the
        # later ones indented) is the first line flush left after the traceback's last frame
        # (its '  File "..."' line, then its indented source and carets); a report without a
        # frame is all message.
        frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
        if not frames:
            return cls(config, "\n".join(lines))
        start = next((i for i in range(frames[-1] + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        return cls(config, "\n".join(lines[start:]))


class EngineService:
    """The engine process's face: routes each completion to the client that owns its request.

    Request ids are global. A client that submits an id another client already has in flight
    takes it over instead of running it twice: a Beam timer often fires in another SDK process
    than the one whose `process` submitted the record."""

    def __init__(self, config: EngineConfig):
        # The engine process resolves gs:// models and adapters.
        from batchgen_beam.model_sources import resolve_adapter, resolve_model
        from runtime import Engine

        kwargs = dict(config.engine_args)
        kwargs.setdefault("num_threads", os.cpu_count())
        if kwargs.get("lora") is not None:
            kwargs["lora"] = resolve_adapter(kwargs["lora"])
        self._new_engine = functools.partial(Engine, resolve_model(config.model), **kwargs)
        self.engine = self._new_engine().start()
        self.engine_failures = 0
        # Held while a call uses the engine, so a failed engine is replaced between calls.
        self._engine_lock = threading.RLock()
        self._ready = threading.Condition()  # guards everything below
        self._owner: dict[str, str] = {}  # request id -> client, from submit until acknowledged
        self._outboxes: dict[str, dict[str, Completion]] = defaultdict(dict)
        # Handed to their client but not yet taken by it: another client may still take them over.
        self._delivered: dict[str, Completion] = {}
        self._taken: dict[str, list[str]] = defaultdict(list)  # ids other clients took over
        self._finished = self._generated_tokens = 0  # completions routed, and their tokens
        self._migrated_out = 0  # requests taken out unfinished (continued elsewhere)
        self._clients: set[str] = set()  # joined and not left
        self._last_info = self._info()
        threading.Thread(target=self._route, name="batchgen-router", daemon=True).start()

    def join(self, client_id: str) -> None:
        with self._ready:
            self._clients.add(client_id)

    def leave(self, client_id: str) -> int:
        """The client has no more use for this engine; returns how many clients still have.
        What it was owed is dropped (the engine may serve other clients long after): its
        completions, taken or not (acknowledgements ride on a poll that will not come), and
        those of its requests still running once they finish, unless a retry claims them."""
        with self._ready:
            self._clients.discard(client_id)
            self._taken.pop(client_id, None)
            finished = {*self._outboxes.pop(client_id, {}), *self._delivered}
            for request_id in [rid for rid, owner in self._owner.items() if owner == client_id]:
                if request_id in finished:
                    self._delivered.pop(request_id, None)
                    del self._owner[request_id]
                else:
                    self._owner[request_id] = _NO_CLIENT
            return len(self._clients)

    def _route(self) -> None:
        while True:
            try:
                completions = self.engine.poll(timeout=0.2)
            except RuntimeError:
                if self.engine.failure is None:
                    raise
                completions = None  # replaced once out of this handler: its traceback holds the engine
            if completions is None:
                self._replace_failed_engine()
                continue
            for completion in completions:
                try:
                    self._deliver(completion)
                except Exception:  # noqa: BLE001 - routing must outlive a bug in one delivery
                    log.exception("batchgen router: could not deliver the completion of %r", completion.id)

    def _replace_failed_engine(self) -> None:
        """The engine's loop died (a bug): every request in flight gets an error completion
        saying so, rather than waiting forever, and a fresh engine takes the requests after.
        The failed one is dropped first, so its memory (the KV cache) is free for the fresh one;
        if even so none can be built, this process exits, and clients start another."""
        with self._engine_lock:
            failed, failure = self.engine, self.engine.failure
            # As text: a log record keeping the exception would keep its frames' engine alive.
            log.error("batchgen engine loop failed; failing the requests in flight and starting a "
                      "new engine\n%s", "".join(traceback.format_exception(failure)))
            reason = f"{type(failure).__name__}: {failure}"
            for completion in failed.finished():  # finished before it failed: delivered as they are
                self._deliver(completion)
            with self._ready:
                done = set(self._delivered).union(*(box.keys() for box in self._outboxes.values()))
                in_flight = [rid for rid in self._owner if rid not in done]
            for request_id in in_flight:
                self._deliver(Completion.failed(request_id, f"the engine failed while this request was "
                                                            f"in flight ({reason}); it was restarted"))
            self.engine = failed = failure = None  # the failure's frames hold the engine too
            gc.collect()
            try:
                self.engine = self._new_engine().start()
            except BaseException:  # noqa: BLE001 - clients restart a process that is gone
                log.exception("batchgen: no new engine could be started; exiting the engine process, "
                              "so that clients start a fresh one and resubmit their requests")
                os._exit(1)
            self.engine_failures += 1

    def _deliver(self, completion: Completion) -> None:
        with self._ready:
            self._finished += 1
            self._generated_tokens += completion.completion_tokens
            owner = self._owner[completion.id]
            if owner == _NO_CLIENT:  # its client left (see leave)
                del self._owner[completion.id]
                return
            self._outboxes[owner][completion.id] = completion
            self._ready.notify_all()

    def _claim(self, client_id: str, request_ids: list[str]) -> set[str]:
        """Make client_id the owner of these ids; returns those no client had in flight."""
        fresh = set()
        with self._ready:
            for request_id in request_ids:
                owner = self._owner.get(request_id)
                if owner is None:
                    self._owner[request_id] = client_id
                    fresh.add(request_id)
                elif owner != client_id:
                    self._owner[request_id] = client_id
                    if owner != _NO_CLIENT:
                        self._taken[owner].append(request_id)
                    finished = (self._outboxes.get(owner, {}).pop(request_id, None)
                                or self._delivered.pop(request_id, None))
                    if finished is not None:
                        self._outboxes[client_id][request_id] = finished
                    self._ready.notify_all()
        return fresh

    def submit(self, client_id: str, requests: list[Request]) -> None:
        # self.engine is read at each call: a failed engine may have been replaced meanwhile.
        self._start(client_id, requests, lambda request: request.id,
                    lambda request: self.engine.submit(request), refusal_is_the_requests=True)

    def resume(self, client_id: str, states: list[dict]) -> None:
        """Continue requests another engine (or an earlier attempt) migrated out, from their
        tokens: their KV is recomputed in one prefill."""
        self._start(client_id, states, lambda state: state["request_id"],
                    lambda state: self.engine.migrate_in(state), refusal_is_the_requests=False)

    def _start(self, client_id: str, items: list, id_of, start, refusal_is_the_requests: bool) -> None:
        """Start the items no client has in flight, each id once; one the engine refuses (a
        ValueError: stop strings without a tokenizer, a state it could never finish) completes
        as an error: a request's own (values it cannot honour), a state's the engine's (one
        that an engine of the same configuration moved out should fit)."""
        with self._engine_lock:
            fresh = self._claim(client_id, [id_of(item) for item in items])
            for item in items:
                request_id = id_of(item)
                if request_id not in fresh:
                    continue
                fresh.discard(request_id)  # an id given twice runs once
                try:
                    start(item)
                except ValueError as bad:
                    self._deliver(Completion.failed(request_id, str(bad), invalid=refusal_is_the_requests))

    def reset_prefix_cache(self) -> int:
        with self._engine_lock:
            return self.engine.reset_prefix_cache()

    def check_params(self, params) -> None:
        with self._engine_lock:
            self.engine.check_params(params)

    def migrate_out(self, client_id: str, request_ids: list[str]) -> dict[str, dict]:
        """Take this client's requests that are still running out of the engine: their states
        (tokens so far and RNG, no KV), by id. A request that already finished is not among
        them; its completion reaches the client as usual."""
        with self._ready:
            owned = [rid for rid in request_ids if self._owner.get(rid) == client_id]
        states = {}
        with self._engine_lock:
            for request_id in owned:
                try:
                    states[request_id] = self.engine.migrate_out(request_id)
                except KeyError:
                    continue
                with self._ready:
                    del self._owner[request_id]
                    self._migrated_out += 1
        return states

    def poll(self, client_id: str, timeout: float, taken: list[str]
             ) -> tuple[list[Completion], list[str], dict]:
        """Acknowledge the completions this client has taken; return its new finished ones
        (waiting up to timeout for something), the ids other clients took over from it, and
        the engine's counters."""
        with self._ready:
            for request_id in taken:
                if self._owner.get(request_id) == client_id:
                    del self._owner[request_id]
                    self._delivered.pop(request_id, None)
            self._ready.wait_for(lambda: self._outboxes[client_id] or self._taken[client_id], timeout)
            finished = self._outboxes.pop(client_id, {})
            self._delivered.update(finished)
            taken_over = self._taken.pop(client_id, [])
        # info() takes the engine lock: never inside _ready, which a replacement takes inside it.
        return list(finished.values()), taken_over, self.info(wait=False)

    def info(self, wait: bool = True) -> dict:
        """The engine's counters; without `wait`, the last ones read while another call holds
        the engine (a submit tokenising a huge prompt must not hold up every client's rows)."""
        if self._engine_lock.acquire(blocking=wait):  # a failed engine may be being replaced
            try:
                self._last_info = self._info()
            finally:
                self._engine_lock.release()
        return self._last_info

    def _info(self) -> dict:
        return {"pid": os.getpid(), "steps": self.engine.stats.steps,
                "decode_tokens": self.engine.stats.decode_tokens,
                "prefill_tokens": self.engine.stats.prefill_tokens,
                **self.engine.sequence_counts(), "finished": self._finished,
                "generated_tokens": self._generated_tokens, "migrated_out": self._migrated_out,
                "engine_failures": self.engine_failures,
                "screened_rows": self.engine.stats.screened_rows,
                "screen_misses": self.engine.stats.screen_misses,
                "linear_plan": linear_rows.described()}


class EngineClient:
    """This process's handle on the machine's engine. Thread-safe; get it with `shared()`, for
    the life of the process, or through an `EngineLease`, which lets the engine go once unused."""

    _instances: dict[EngineConfig, "EngineClient"] = {}
    _instances_lock = threading.Lock()
    _leases: Counter[EngineConfig] = Counter()  # leases alive in this process, by config
    _idle: dict[EngineConfig, object] = {}  # a config no lease uses, in its grace: its grace's token

    @classmethod
    def shared(cls, config: EngineConfig) -> "EngineClient":
        """The client of this config, kept for the life of this process."""
        with cls._instances_lock:
            client = cls._instance(config)
            client._pinned = True
            return client

    @classmethod
    def _instance(cls, config: EngineConfig) -> "EngineClient":  # with _instances_lock held
        if config not in cls._instances:
            cls._instances[config] = cls(config)
        return cls._instances[config]

    @classmethod
    def _release_lease(cls, config: EngineConfig) -> None:
        """A lease was dropped: with none left and no pinned use, the client leaves, at once
        where another engine is in use here, else after IDLE_LEASE_GRACE_S unless a lease is
        taken meanwhile (see _take_lease)."""
        with cls._instances_lock:  # held while leaving: a new client of it waits for the engine to stop
            cls._leases[config] -= 1
            if not cls._may_leave(config):
                return
            if any(count > 0 for count in cls._leases.values()):
                cls._leave_now(config)
                return
            cls._idle[config] = grace = object()
        time.sleep(IDLE_LEASE_GRACE_S)  # (on a thread of its own: _release_on_a_thread)
        with cls._instances_lock:
            if cls._idle.get(config) is grace:
                del cls._idle[config]
                if cls._may_leave(config):
                    cls._leave_now(config)

    @classmethod
    def _take_lease(cls, config: EngineConfig) -> "EngineClient":
        """A lease's client: an idle one of this config is taken up; idle ones of others leave."""
        with cls._instances_lock:
            for other in [c for c in cls._idle if c != config]:
                del cls._idle[other]
                if cls._may_leave(other):
                    cls._leave_now(other)
            cls._idle.pop(config, None)
            cls._leases[config] += 1
            return cls._instance(config)

    @classmethod
    def _may_leave(cls, config: EngineConfig) -> bool:  # with _instances_lock held
        client = cls._instances.get(config)
        return not (cls._leases[config] or client is None or client._pinned or client._has_resident())

    @classmethod
    def _leave_now(cls, config: EngineConfig) -> None:  # with _instances_lock held
        cls._leases.pop(config, None)
        cls._instances.pop(config)._leave()

    def __init__(self, config: EngineConfig):
        self.config = config
        self.client_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        # Submitted (a Request) or resumed (a migrated-out state), result not yet taken.
        self._resident: dict[str, Request | dict] = {}
        self._done: dict[str, Completion] = {}
        self._taken: list[str] = []  # taken here since the last poll: acknowledged with the next
        # Acknowledged by polls on their way (another thread's): an id among them is not free
        # to submit again until they are back (see _acknowledge_before_reuse).
        self._acknowledging: Counter[str] = Counter()
        self._polls_back = threading.Condition(self._lock)
        # Cancelled or abandoned, their completions on the way: acknowledged on arrival.
        self._unwanted: set[str] = set()
        self.restarts = 0
        self._deaths: Counter[str] = Counter()  # engine deaths each resident request was in flight for
        self._deaths_alone: Counter[str] = Counter()  # those of them it ran apart from the others
        self._held: list[list[str]] = []  # suspects' groups (SUSPECT_DEATHS), waiting for their turn
        self._held_ids: set[str] = set()  # their ids: resident, not in the engine
        self._trial: list[str] = []  # the suspects' group in the engine now, if any
        self._suspects_turn = _SuspectsTurn(config.tag)  # taken while its groups run
        self.last_info: dict | None = None  # the engine's counters as of the last poll
        # Connected on first use, not here: Beam's multi-model RunInference constructs the
        # handler's model under the lock that connecting needs too (a deadlock).
        self._service = None
        self._handle: MultiProcessShared | None = None  # the engine process's, to stop it
        self._pinned = False  # got through shared(): stays for the life of this process
        # Runs the methods the main thread calls (_finishes_when_interrupted), one at a time.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-client")

    def _has_resident(self) -> bool:
        with self._lock:
            return bool(self._resident)

    @_finishes_when_interrupted
    def _leave(self) -> None:
        """Tell the engine this process no longer uses it; the last client to leave stops its
        process (a client joining meanwhile finds it gone and starts another)."""
        with self._lock:
            service, handle, self._service = self._service, self._handle, None
            self._suspects_turn.give_back()
        if service is None:
            return
        try:
            if service.leave(self.client_id) == 0:
                log.info("batchgen: no client uses the engine of %s any more; stopping it", self.config.model)
                handle.unsafe_hard_delete()
        except _ENGINE_GONE:  # stopped, or it died: nothing left to stop
            pass

    @_finishes_when_interrupted
    def connect(self) -> "EngineClient":
        """Start (or find) the machine's engine process now rather than on first use."""
        self._connected()
        return self

    def _connected(self):
        with self._lock:
            if self._service is None:
                self._service = self._connect()
            return self._service

    def _connect(self):
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # The engine process, started by spawn, is running the user's script again as it
            # imports the main module: it would wait forever for the lock its parent holds
            # while it waits for this process (multiprocessing's own check, a step later).
            raise RuntimeError("batchgen-beam: the pipeline ran again inside the engine process as it "
                               "started: the script that runs it needs `if __name__ == \"__main__\":` "
                               "around it (the engine process starts with multiprocessing's spawn, "
                               "which imports the main module again)")
        cause = None
        for _ in range(MAX_ENGINE_DEATHS):
            # The constructor travels to a spawned process: it must pickle (no lambdas).
            handle = MultiProcessShared(functools.partial(EngineService, self.config), tag=self.config.tag,
                                        always_proxy=True, spawn_process=True)
            try:
                service = handle.acquire()
                service.join(self.client_id)
            except _ENGINE_GONE as gone:  # its last client stopped it meanwhile: start another
                cause = gone
                continue
            except RuntimeError as failed:
                if str(failed).startswith("Shared Server Process died"):
                    cause = failed  # killed as it started (no error of its own): start another
                    continue
                if str(failed).startswith("Shared Server Process crashed"):  # its own error
                    raise EngineStartError.from_report(self.config, str(failed)) from None
                raise
            self._handle = handle
            return service
        hint = ""
        if getattr(sys.modules["__main__"], "__file__", None):  # what a script's spawned child says
            hint = (" (so ends a script that needs `if __name__ == \"__main__\":` around its pipeline: "
                    "the engine process starts with spawn, which runs the main module again)")
        raise EngineStartError(self.config, f"its process was gone {MAX_ENGINE_DEATHS} times as it was "
                                            f"started or joined (last: {cause}){hint}") from cause

    def _call(self, method: str, *args, restart: bool = True):
        """The engine's `method`; where its process is gone, a new one's (unless not `restart`:
        then the error is raised)."""
        service = self._connected()
        try:
            return getattr(service, method)(*args)
        except _ENGINE_GONE as gone:
            if not restart:
                raise
            cause = gone
        # The engine process died; a new one may die again (a request that crashes it becomes a
        # suspect, and runs apart from the others: _restart).
        deaths = 1
        while True:
            try:
                service = self._restart(service, cause)
                if method in ("submit", "resume"):  # the restart resubmitted every resident one, these too
                    return None
                return getattr(service, method)(*args)
            except _ENGINE_GONE as gone:
                cause = gone
            deaths += 1
            if deaths > self._deaths_in_a_row_allowed():
                with self._lock:  # its suspects wait for the next call; other processes' need not
                    self._suspects_turn.give_back()
                raise RuntimeError(f"the engine process died {deaths} times in a row "
                                   f"(calling {method}): {cause!r}") from cause

    def _deaths_in_a_row_allowed(self) -> int:
        """Deaths one call rides out: a few, and one more for each halving that setting a poison
        apart from the requests in flight may take (this client's, or the engine's as last
        seen: another process's suspects may be the ones halved). An engine that dies whatever
        it holds fails the call after as many, not after every request ran alone."""
        info = self.last_info or {}
        in_flight = max(len(self._resident), sum(info.get(key, 0) for key in ("waiting", "running", "suspended")))
        search = SUSPECT_DEATHS + in_flight.bit_length() if in_flight else 0  # and a lone suspect's retries
        return MAX_ENGINE_DEATHS + 1 + search

    def _restart(self, failed_service, cause: BaseException):
        """A new engine process, every resident request resubmitted to it but the suspects
        (SUSPECT_DEATHS): those wait to run apart, a group at a time; a suspect that kills the
        engine alone ends as an error completion. Returns the new service."""
        with self._lock:
            if self._service is not failed_service:  # another thread already restarted it
                return self._service
            pending = [rid for rid in self._resident if rid not in self._done and rid not in self._held_ids]
            log.warning("batchgen engine process is gone (%r); starting a new one and resubmitting "
                        "%d resident request(s) (suspects apart: %d)", cause, len(pending),
                        sum(self._deaths[rid] + 1 >= SUSPECT_DEATHS for rid in pending))
            self._service = self._connect()
            self.restarts += 1
            for request_id in pending:
                self._deaths[request_id] += 1
            tried = [rid for rid in self._trial if rid in pending]
            others = [rid for rid in pending if rid not in self._trial]
            self._trial = []
            lone = tried[0] if len(tried) == 1 else None
            if lone is not None:
                self._deaths_alone[lone] += 1
            # Alone but for requests not suspects yet (submitted since, here or by another
            # process): a poison among them is set apart after SUSPECT_DEATHS deaths, so one
            # more death alone convicts it.
            if lone is not None and self._deaths_alone[lone] > SUSPECT_DEATHS:
                self._done[lone] = Completion.failed(
                    lone, f"the engine process died while this request ran apart from others "
                          f"({self._deaths[lone]} deaths with it in flight, {self._deaths_alone[lone]} of "
                          f"them apart, last: {cause!r}); not resubmitted again")
            else:  # the suspects of the group that died again go first, in halves
                self._hold(tried, first=True)
            self._hold([rid for rid in others if self._deaths[rid] >= SUSPECT_DEATHS])
            self._send(self._service, [self._resident[rid] for rid in others if rid not in self._held_ids])
            self._start_trial(self._service)
            return self._service

    def _hold(self, suspects: list[str], first: bool = False) -> None:
        """Keep these suspects out of the engine until their turn, in two groups (call with the
        lock held)."""
        halves = [half for half in (suspects[:len(suspects) // 2], suspects[len(suspects) // 2:]) if half]
        if first:
            self._held[:0] = halves
        else:
            self._held += halves
        self._held_ids.update(suspects)

    def _start_trial(self, service) -> None:
        """Once no suspects run, send the next held group in the machine's suspects' turn, or
        give the turn back where none is left (call with the lock held). Where the engine is
        gone, the group stays first in line and _ENGINE_GONE is raised."""
        if any(rid in self._resident and rid not in self._done for rid in self._trial):
            return
        self._trial = []
        while self._held and not self._trial:
            if not self._suspects_turn.take():
                return  # another process's suspects run: a later pull tries again
            group = self._held.pop(0)
            self._held_ids.difference_update(group)
            self._trial = [rid for rid in group if rid in self._resident]  # not let go meanwhile
        if not self._trial:
            self._suspects_turn.give_back()
            return
        try:
            self._send(service, [self._resident[rid] for rid in self._trial])
        except _ENGINE_GONE:
            self._held.insert(0, self._trial)
            self._held_ids.update(self._trial)
            self._trial = []
            raise

    def _send(self, service, items: list) -> None:
        """Submit the requests and resume the migrated states among `items`."""
        requests = [item for item in items if isinstance(item, Request)]
        states = [item for item in items if not isinstance(item, Request)]
        if requests:
            service.submit(self.client_id, requests)
        if states:
            service.resume(self.client_id, states)

    # ---- the coarse API ------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Submit requests not already resident (a retried bundle resubmits nothing twice)."""
        self._start("submit", requests, lambda request: request.id)

    def resume(self, states: Iterable[dict]) -> None:
        """Continue migrated-out requests (`migrate_out` states) not already resident."""
        self._start("resume", states, lambda state: state["request_id"])

    @_finishes_when_interrupted
    def _start(self, method: str, items: Iterable, id_of) -> None:
        with self._lock:
            fresh = []
            for item in items:
                if id_of(item) not in self._resident:  # nor given earlier in this call
                    self._resident[id_of(item)] = item
                    self._unwanted.discard(id_of(item))  # abandoned, now wanted again
                    fresh.append(item)
        if fresh:
            self._acknowledge_before_reuse([id_of(item) for item in fresh])
            self._call(method, self.client_id, fresh)

    def _acknowledge_before_reuse(self, request_ids: list[str]) -> None:
        """The engine holds an id this client took until a poll acknowledges it; an id
        submitted again before that (an identical record after the first's row went out) would
        be taken for the one in flight and never run, and an acknowledgement arriving after
        the submit would disown the new one. So acknowledge first, and wait for another
        thread's poll that carries one."""
        while True:
            with self._polls_back:
                self._polls_back.wait_for(lambda: self._acknowledging.keys().isdisjoint(request_ids))
                if set(self._taken).isdisjoint(request_ids):
                    return
            self._pull(0.0)  # another thread's poll may take them first: then wait for it

    @_finishes_when_interrupted
    def migrate_out(self, request_ids: Iterable[str]) -> dict[str, dict]:
        """Take these requests, if still running, out of the engine: their states by id. They
        are no longer this client's; the others' completions arrive as usual."""
        states = self._call("migrate_out", self.client_id, list(request_ids))
        with self._lock:
            for request_id in states:
                self._forget(request_id)
        return states

    def _forget(self, request_id: str) -> None:
        """No longer this client's to resubmit (call with the lock held)."""
        self._resident.pop(request_id, None)
        self._deaths.pop(request_id, None)
        self._deaths_alone.pop(request_id, None)
        self._held_ids.discard(request_id)

    @_finishes_when_interrupted
    def abandon(self, request_ids: Iterable[str]) -> None:
        """No longer wait for these requests, nor resubmit them after a restart; they run on, so
        that the same ids submitted again (a retried batch) pick them up. Their completions are
        acknowledged, here or on arrival, or the engine would hold them for good."""
        with self._lock:
            for request_id in request_ids:
                if request_id in self._resident:  # a held suspect is in no engine
                    self._let_go(request_id, completion_coming=request_id not in self._held_ids)
            self._next_trial()  # a trial let go is over: its turn must not wait for a pull

    @_finishes_when_interrupted
    def cancel(self, prefix: str) -> None:
        """Drop this process's requests whose ids start with `prefix` (a job that is over): the
        running ones leave the engine, and finished ones' completions are acknowledged unread.
        An engine that is gone is not restarted for it: nothing runs them any more."""
        with self._lock:
            ids = [rid for rid in self._resident if rid.startswith(prefix)]
            engine_up = self._service is not None
        if not ids:
            return
        taken_out = {}
        if engine_up:
            try:
                taken_out = self._call("migrate_out", self.client_id, ids, restart=False)
            except _ENGINE_GONE:
                engine_up = False
        with self._lock:
            for request_id in ids:  # those not taken out had finished (or are held suspects)
                self._let_go(request_id, completion_coming=engine_up and request_id not in taken_out
                             and request_id not in self._held_ids)
            self._next_trial()

    def _let_go(self, request_id: str, completion_coming: bool) -> None:
        """No longer this client's; its completion is acknowledged unread: now if it is here,
        on arrival if one is coming (call with the lock held)."""
        self._forget(request_id)
        if self._done.pop(request_id, None) is not None:
            self._taken.append(request_id)
        elif completion_coming:
            self._unwanted.add(request_id)

    def knows(self, request_id: str) -> bool:
        """Submitted by this process and its result not yet taken."""
        return request_id in self._resident

    def done_ids(self) -> set[str]:
        """Ids whose completions are here, waiting to be taken (pulls what the engine has)."""
        self._pull(0.0)
        with self._lock:
            return set(self._done)

    def wait_for_capacity(self, max_in_flight: int) -> None:
        """Backpressure: block while this process has max_in_flight requests still running."""
        while len(self._resident) - len(self._done) >= max_in_flight:
            self._pull(0.5)

    def take(self, request_ids: Iterable[str], timeout: float = 0.0) -> dict[str, Completion]:
        """Completions of these ids that are done, waiting up to `timeout` for the first.

        Asks the engine before looking: a completion pulled earlier may since have been taken
        over by another process (Beam handles a key in one place at a time, so once this pull
        has not reported it taken, no other process takes it before we do)."""
        wanted = set(request_ids)
        deadline = time.monotonic() + timeout
        wait = 0.0
        while True:
            self._pull(wait)  # an interrupt during it leaves what it pulled here, to be taken
            with self._lock:  # on the caller's thread, so what it takes is the caller's; in an
                # order an interrupt may cut short: acknowledged (one step) before any is dropped
                found = {rid: self._done[rid] for rid in wanted & self._done.keys()}
                self._taken.extend(found)
                for rid in found:
                    self._forget(rid)
                    del self._done[rid]
            remaining = deadline - time.monotonic()
            if found or remaining <= 0 or not wanted:
                return found
            wait = min(remaining, 0.5)

    def wait_all(self, request_ids: Iterable[str]) -> dict[str, Completion]:
        """Block until every id is done."""
        pending, results = set(request_ids), {}
        while pending:
            got = self.take(pending, timeout=1.0)
            results.update(got)
            pending -= got.keys()
        return results

    @_finishes_when_interrupted
    def _pull(self, timeout: float) -> None:
        with self._lock:
            acknowledged, self._taken = self._taken, []
            self._acknowledging.update(acknowledged)
        try:
            completions, taken, self.last_info = self._call("poll", self.client_id, timeout, acknowledged)
        except BaseException:  # maybe not sent: acknowledged again with the next (the engine minds not)
            with self._lock:
                self._taken[:0] = acknowledged
            raise
        finally:
            with self._polls_back:
                self._acknowledging -= Counter(acknowledged)
                self._polls_back.notify_all()
        with self._lock:
            for request_id in taken:  # another process collects these now
                self._forget(request_id)
                self._done.pop(request_id, None)
                self._unwanted.discard(request_id)
        for completion in completions:
            with self._lock:
                if completion.id in self._resident:  # else: a result already taken
                    self._done[completion.id] = completion
                elif completion.id in self._unwanted:
                    self._unwanted.remove(completion.id)
                    self._taken.append(completion.id)
        if self._held or self._trial:  # read unlocked: a group held meanwhile waits for the next pull
            with self._lock:
                self._next_trial()

    def _next_trial(self) -> None:
        """Where suspects wait or ran: the next group sent, or the machine's turn given back
        (call with the lock held). An engine found gone is left to the next call, which
        restarts it and sends them then."""
        if self._service is not None and (self._held or self._trial):
            try:
                self._start_trial(self._service)
            except _ENGINE_GONE:
                pass

    @_finishes_when_interrupted
    def info(self) -> dict:
        return self._call("info")

    @_finishes_when_interrupted
    def reset_prefix_cache(self) -> int:
        """The engine's Engine.reset_prefix_cache (shared by every client of this machine)."""
        return self._call("reset_prefix_cache")

    @_finishes_when_interrupted
    def check_params(self, params) -> None:
        """The engine's Engine.check_params: ValueError for values it cannot honour."""
        self._call("check_params", params)


class EngineLease:
    """One use of the machine's engine (a RunInference model): its client stays while any lease
    of its config lives in this process; when the last is released (or collected), the client
    leaves the engine (see IDLE_LEASE_GRACE_S), which stops once no client of any process uses
    it."""

    def __init__(self, config: EngineConfig):
        self.client = EngineClient._take_lease(config)
        self._release = weakref.finalize(self, _release_on_a_thread, config)
        self._release.atexit = False  # at exit, Beam stops the engine process itself

    # What a RunInference batch needs, as methods: under a KeyedModelHandler of several models,
    # Beam hands run_inference a proxy of the lease held by another process, which forwards
    # method calls only.
    def run(self, requests: list[Request]) -> dict[str, Completion]:
        """Submit the requests, and wait for all of them. If that fails (Beam then retries the
        batch), they are no longer this client's, nor do they keep it from leaving."""
        try:
            self.client.submit(requests)
            return self.client.wait_all([request.id for request in requests])
        except BaseException:
            self.client.abandon(request.id for request in requests)
            raise

    def engine_config(self) -> EngineConfig:
        return self.client.config

    def engine_info(self) -> dict | None:
        """The engine's counters as of this client's last poll (EngineMetrics.engine)."""
        return self.client.last_info

    def release(self) -> None:
        self._release()


def _release_on_a_thread(config: EngineConfig) -> None:
    """A lease's release, off the thread that dropped it: the garbage collector may run it
    anywhere, even where that thread holds the instances' lock, and leaving makes a call."""
    threading.Thread(target=EngineClient._release_lease, args=(config,), name="batchgen-lease",
                     daemon=True).start()
