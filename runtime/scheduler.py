"""Continuous batching under a per-step token budget.

Each step: running sequences first (decodes, then continuing prefill chunks), then suspended
ones resume, then waiting ones are admitted in the configured order (one passed over for
OVERDUE_AFTER_BATCHES batches of admissions first), each taking a prefill chunk of what budget
is left (each once blocks for all its tokens are free). When KV blocks run out, the most
recently admitted running sequence is preempted: suspended to the host tier if it has room (or
if asked to), else evicted.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from runtime.estimate import EstimateOrder, LengthEstimator
from runtime.kv_cache import BlockManager, HostKVPool, KVCache
from runtime.sequence import Event, Sequence, Status

# Admission orders: a sort key over waiting sequences (lowest first), given the engine's
# estimate of remaining output (runtime/estimate.py).
ADMISSION_ORDERS: dict[str, Callable[[Sequence, LengthEstimator], object]] = {
    "fifo": lambda seq, est: 0,
    # Longest work first by what max_tokens guarantees: the batch's long tail starts early and
    # finishes with it.
    "longest_first": lambda seq, est: -(seq.num_tokens + seq.params.max_tokens - seq.num_generated),
    "shortest_first": lambda seq, est: seq.num_tokens + seq.params.max_tokens - seq.num_generated,
    # Longest expected work first, learned from finished sequences: where max_tokens is a loose
    # bound it ranks by how long outputs actually run (the bound until enough have finished).
    "adaptive": lambda seq, est: -(seq.num_tokens + est.remaining(seq.params, seq.num_generated)),
}
PREEMPTION_MODES = ("suspend", "evict")
# Under an order other than fifo, a sequence passed over while this many batches (of
# max_num_seqs) were admitted goes first: arrivals that outrank it cannot hold it back for ever.
OVERDUE_AFTER_BATCHES = 2


@dataclass
class ScheduledBatch:
    """Sequences to run this step and how many of each one's pending tokens to compute.
    Decodes (one token each) come first, then prefill chunks."""
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    # Decodes that verify guessed tokens after their next one (runtime/speculate.py): a row each.
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_rows + sum(n for _, n in self.prefills)

    @property
    def num_decode_rows(self) -> int:
        return len(self.decodes) + sum(len(d) for d in self.drafts.values())

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    @staticmethod
    def check_modes(admission: str, preemption: str) -> None:
        if not isinstance(admission, str) or admission not in ADMISSION_ORDERS:
            raise ValueError(f"admission must be one of {sorted(ADMISSION_ORDERS)}, got {admission!r}")
        if not isinstance(preemption, str) or preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")

    def __init__(self, blocks: BlockManager, kv: KVCache, host: HostKVPool, max_num_seqs: int,
                 max_num_batched_tokens: int, admission: str = "fifo",
                 preemption: str = "suspend"):
        self.check_modes(admission, preemption)
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks, self.kv, self.host = blocks, kv, host
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission_key = ADMISSION_ORDERS[admission]
        self.estimator = LengthEstimator()  # fed by the engine as sequences finish
        self.preemption = preemption
        self.waiting: list[Sequence] = []
        self._waiting_order = EstimateOrder(
            self.estimator, reads_estimate=admission == "adaptive", joined_at=lambda seq: seq.queued_at,
            overdue_after=None if admission == "fifo" else OVERDUE_AFTER_BATCHES * max_num_seqs)
        self.suspended: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.held: dict[str, Sequence] = {}  # suspended by a caller: resume only when asked

    # ---- queues --------------------------------------------------------------------------
    def add(self, seq: Sequence, kv: torch.Tensor | None = None) -> None:
        """Queue a sequence. One that arrives with its KV (migrated in, SUSPENDED) parks it in
        the host tier and swaps in like any suspended sequence; if the host tier cannot hold
        it, it is evicted on arrival and recomputes."""
        if kv is None:
            self._wait(seq)
        elif self.host.can_hold(kv.shape[2]):
            self.host.park(seq.seq_id, kv)
            self.suspended.append(seq)
        else:
            seq.send(Event.EVICTED)
            self._wait(seq)

    def _wait(self, seq: Sequence, first: bool = False) -> None:
        """Queue seq for admission, last (first: at the front, fifo's next)."""
        if first:
            self.waiting.insert(0, seq)
        else:
            self.waiting.append(seq)
        seq.queued_at = self._waiting_order.taken
        self._waiting_order.joined()

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler, releasing its device and host KV."""
        for queue in (self.waiting, self.running, self.suspended):
            if seq in queue:
                queue.remove(seq)
                if queue is self.waiting:
                    self._waiting_order.joined()  # its order is to be taken again
        self.held.pop(seq.seq_id, None)
        self.blocks.release(seq.block_table)
        seq.block_table = []
        if seq.seq_id in self.host:
            self.host.take(seq.seq_id)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        decodes = [s for s in self.running if s.status is Status.DECODING]
        prefilling = [s for s in self.running if s.status is Status.PREFILLING]
        for seq in decodes + prefilling:
            if budget == 0:
                break
            if id(seq) not in scheduled and seq in self.running:
                num = min(seq.num_uncomputed, budget)
                if self._run(seq, num, scheduled, batch):
                    budget -= num
        # Sample 0 of n forks the others once prefilled: it takes room for all n (vLLM counts
        # each sample), unless nothing runs (n above the limit would never start).
        occupied = sum(_seats(s) for s in self.running)
        while self.suspended and budget:
            seq = self.suspended[0]
            if not self._has_seat(seq, occupied) or not self._fits(self._blocks_for_all_tokens(seq)):
                break
            self.suspended.popleft()
            self.swap_in(seq)
            occupied += _seats(seq)
            num = min(seq.num_uncomputed, budget)
            if not self._run(seq, num, scheduled, batch):
                break
            budget -= num
        if self.waiting and budget and not self.suspended:
            self._waiting_order.sort(self.waiting, self.admission_key)
        while self.waiting and budget and not self.suspended:
            seq = self.waiting[0]
            if not self._has_seat(seq, occupied):
                break
            # A prompt being scored needs every token's hidden state: no cached prefix for it.
            cached, hashes = ([], []) if seq.scores_prompt else self.blocks.match_prefix(seq.token_ids)
            num = min(seq.num_tokens - len(cached) * self.blocks.block_size, budget)
            if not self._fits(self._blocks_for_all_tokens(seq) - len(cached)):
                self.blocks.release(cached)
                break
            self.waiting.pop(0)
            self._waiting_order.took()
            seq.block_table, seq.block_hashes = cached, hashes
            seq.send(Event.ADMITTED)
            if cached:
                seq.send(Event.PREFILLED, len(cached) * self.blocks.block_size)
            self.running.append(seq)
            occupied += _seats(seq)
            if not self._run(seq, num, scheduled, batch):  # (its blocks were free: never)
                break
            budget -= num
        return batch

    def _has_seat(self, seq: Sequence, occupied: int) -> bool:
        """Whether max_num_seqs leaves room for it (a request alone always has)."""
        return not self.running or occupied + _seats(seq) <= self.max_num_seqs

    def _run(self, seq: Sequence, num: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        """Put `num` of its tokens in this step's batch, their blocks reserved; False where it
        was itself preempted for them."""
        if not self._reserve(seq, num, scheduled):
            return False
        scheduled.add(id(seq))
        self._place(seq, num, batch)
        return True

    def _blocks_for_all_tokens(self, seq: Sequence) -> int:
        """Blocks for all its tokens and the next it generates: what a sequence waits for before
        it is admitted or swapped in, not just its next chunk's. Else its later chunks would
        preempt it, the most recent of the running, and it would recompute (or swap out and in)
        over and over."""
        return self.blocks.blocks_needed(seq.num_tokens + 1)

    def _fits(self, num_blocks: int) -> bool:
        return num_blocks <= self.blocks.num_free

    def _place(self, seq: Sequence, num: int, batch: ScheduledBatch) -> None:
        if seq.status is Status.DECODING:
            batch.decodes.append(seq)
        else:
            batch.prefills.append((seq, num))

    def _reserve(self, seq: Sequence, num: int, scheduled: set[int]) -> bool:
        """Make seq's block table cover `num` more tokens, preempting others (never ones already
        scheduled this step) if blocks run short. False if seq itself had to be preempted."""
        first_block = seq.num_computed // self.blocks.block_size
        while True:  # preempting a victim may also unshare seq's blocks: re-evaluate each time
            need = self.blocks.blocks_needed(seq.num_computed + num) - len(seq.block_table)
            cow = first_block < len(seq.block_table) and self.blocks.is_shared(seq.block_table[first_block])
            if need + cow <= self.blocks.num_free:
                break
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                raise RuntimeError("KV cache too small for the sequences already scheduled")
            self.preempt(victim)
            if victim is seq:
                return False
        if cow:  # never write into a block another sequence still reads: copy it now
            shared = seq.block_table[first_block]
            (copy,) = self.blocks.allocate(1)
            self.kv.copy_blocks([(shared, copy)])
            self.blocks.release([shared])
            seq.block_table[first_block] = copy
        self._grow(seq, need)
        return True

    def reserve_draft(self, seq: Sequence, num: int) -> int:
        """Blocks for `num` draft tokens after a scheduled decode's next one, from free blocks
        only (a guess never preempts anyone): how many of them fit."""
        slots = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
        num = max(0, min(num, slots - seq.num_computed - 1))
        need = self.blocks.blocks_needed(seq.num_computed + 1 + num) - len(seq.block_table)
        self._grow(seq, need)
        return num

    def _grow(self, seq: Sequence, need: int) -> None:
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))
            seq.send(Event.PAGE_BOUNDARY, len(seq.block_table))

    def release_unused(self, seq: Sequence) -> None:
        """Give back blocks past those its tokens need (the rejected guesses' after a drafted
        step): suspended or migrated, a sequence carries exactly its tokens' KV."""
        keep = self.blocks.blocks_needed(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.blocks.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    # ---- primitives ----------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        seq.counters["preemptions"] += 1
        if self.preemption == "suspend" and self.host.can_hold(len(seq.block_table)):
            self.suspend(seq)
        else:
            self.evict(seq)

    def suspend(self, seq: Sequence, hold: bool = False) -> None:
        """Move seq's KV to the host tier; it resumes exactly where it was, as soon as blocks
        allow, or (hold=True) once `resume` asks for it."""
        if not self.host.can_hold(len(seq.block_table)):
            raise RuntimeError(f"host KV tier is full: cannot suspend {seq.seq_id}")
        self.host.park(seq.seq_id, self.kv.read_blocks(seq.block_table, self.host.pin_memory))
        self.blocks.release(seq.block_table)
        seq.block_table = []
        self.running.remove(seq)
        if hold:
            self.held[seq.seq_id] = seq
        else:
            self.suspended.append(seq)
        seq.send(Event.SUSPENDED)

    def resume(self, seq: Sequence) -> None:
        """Release a held sequence: it swaps in first, as soon as blocks allow."""
        self.suspended.appendleft(self.held.pop(seq.seq_id))

    def swap_in(self, seq: Sequence) -> None:
        data = self.host.take(seq.seq_id)
        seq.block_table = self.blocks.allocate(data.shape[2])
        self.kv.write_blocks(seq.block_table, data)
        self.running.append(seq)
        seq.send(Event.RESUMED)

    def evict(self, seq: Sequence) -> None:
        """Drop seq's KV and keep its tokens; it recomputes them when admitted again."""
        self.remove(seq)
        seq.block_hashes = []
        seq.send(Event.EVICTED)
        self._wait(seq, first=True)  # first in line when space returns (fifo)


def _seats(seq: Sequence) -> int:
    """The sequences it stands for in the running set: sample 0 of n, not yet forked, all n."""
    return 1 if seq.forked else seq.params.n
