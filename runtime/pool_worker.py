"""One engine of an `EnginePool`, in its own process (spawned): it drives the engine's steps
itself and, between two steps, takes commands — requests to run, sequences migrated in, a request
to donate work to an idle engine — and reports completions and its load to the pool.

Messages to the pool (its `outbox`), each with this engine's index and a load report:
  ("ready", i, report)                      the engine is loaded
  ("update", i, completions, report)        finished requests and/or a periodic report
  ("donated", i, taker, ids, report)        these requests left for engine `taker` (maybe none)
  ("received", i, ids, report)              these migrated-in requests are now resident here
  ("refused", i, message)                   the engine refused its arguments (a ValueError); the process ends
  ("failed", i, traceback text)             the engine or this loop raised; the process ends
Commands (its inbox): ("submit", requests), ("donate", taker, taker_load, min_tokens),
("migrate_in", states) from a donor engine directly, ("stop",).
"""

import queue
import time
import traceback
from collections import Counter

import torch

from runtime.engine import Engine
from runtime.rebalance import choose_donation
from runtime.request import Completion


class _Worker:
    def __init__(self, index: int, engine: Engine, inboxes: list, outbox, report_interval: float):
        self.index, self.engine = index, engine
        self.inbox, self.inboxes, self.outbox = inboxes[index], inboxes, outbox
        self.report_interval = report_interval
        self.busy = False
        self.transitions: list[tuple[float, bool]] = []  # (time, busy) since the last report
        # Commands handled, requests migrated in and out: in every report, from the first.
        self.counts = Counter(dict.fromkeys(("commands", "migrated_in", "migrated_out", "kv_migrated_in"), 0))
        self.last_report = 0.0

    def report(self) -> dict:
        loads = self.engine.workload()
        stats = self.engine.stats
        where = Counter(ld.where for ld in loads)
        transitions, self.transitions = self.transitions, []
        return {"t": time.monotonic(), "busy": self.busy, "transitions": transitions,
                "capacity": self.engine.scheduler.max_num_seqs,
                "waiting": where["waiting"], "running": where["running"],
                "suspended": where["suspended"] + where["held"],
                "remaining_tokens": sum(ld.remaining_tokens for ld in loads),
                "steps": stats.steps, "decode_tokens": stats.decode_tokens,
                "prefill_tokens": stats.prefill_tokens, "forward_seconds": stats.forward_seconds,
                **self.counts}

    def send(self, kind: str, *payload) -> None:
        self.last_report = time.monotonic()
        self.outbox.put((kind, self.index, *payload, self.report()))

    def run(self) -> None:
        while True:
            try:  # idle: wait for a command; busy: only take what is already there
                command = self.inbox.get(timeout=self.report_interval) if not self.busy \
                    else self.inbox.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return
                self.handle(command)
                try:
                    command = self.inbox.get_nowait()
                except queue.Empty:
                    command = None
            before = time.monotonic()
            stepped = self.engine.step()
            if stepped != self.busy:  # it was busy (or idle) from the start of this step
                self.busy = stepped
                self.transitions.append((before, stepped))
            completions = self.engine.finished()
            if completions or self.transitions or time.monotonic() - self.last_report >= self.report_interval:
                self.send("update", completions)

    def handle(self, command: tuple) -> None:
        kind = command[0]
        self.counts["commands"] += 1
        if kind == "submit":
            for request in command[1]:
                self.submit(request)
        elif kind == "migrate_in":
            states = command[1]
            for state in states:
                self.engine.migrate_in(state)
            self.counts["migrated_in"] += len(states)
            self.counts["kv_migrated_in"] += sum("kv" in s for state in states for s in state["sequences"])
            self.send("received", [state["request_id"] for state in states])
        elif kind == "donate":
            _, taker, taker_load, min_tokens = command
            ids = choose_donation(self.engine.workload(), taker_load, min_tokens)
            states = [self.engine.migrate_out(request_id, with_kv=True) for request_id in ids]
            if states:
                self.inboxes[taker].put(("migrate_in", states))
            self.counts["migrated_out"] += len(states)
            self.send("donated", taker, ids)
        else:
            raise ValueError(f"unknown command {kind!r}")

    def submit(self, request) -> None:
        try:
            self.engine.submit(request)
        except (ValueError, TypeError) as bad:  # the pool answers it, like a bad prompt
            self.send("update", [Completion.failed(request.id, str(bad), invalid=True)])


def run(index: int, model, engine_args: dict, threads: int, inboxes: list, outbox,
        report_interval: float) -> None:
    """The process's entry point."""
    try:
        torch.set_num_threads(threads)
        try:
            engine = Engine(model, num_threads=threads, **engine_args)
        except ValueError as refused:  # arguments only a loaded model can judge (too small a KV cache)
            outbox.put(("refused", index, str(refused)))
            return
        worker = _Worker(index, engine, inboxes, outbox, report_interval)
        worker.send("ready")
        worker.run()
    except BaseException:  # the pool raises it to its callers
        outbox.put(("failed", index, traceback.format_exc()))
