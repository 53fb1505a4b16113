"""Turns a scheduled batch into one flattened forward pass and returns the final hidden states
of the rows that sample (decodes, and prefill chunks that finish their sequence's pending
tokens), and of the prompt positions of sequences whose prompts are scored (prompt_logprobs)."""

from dataclasses import dataclass

import torch

from kernels.backend import decode_attention_pads
from runtime.kv_cache import KVCache
from runtime.model import AttentionBatch, CausalLM, DecodeGroup, PrefillChunk
from runtime.scheduler import ScheduledBatch
from runtime.sequence import Sequence

# The torch decode attention pads each group to its longest context; start a new group rather
# than waste more than this fraction of a group's gathered KV on padding. The C++ and Triton
# kernels take all decode rows as one ragged group.
MAX_DECODE_PADDING = 0.25


def group_by_length(lengths: list[int]) -> list[int]:
    """Split lengths (longest first) into runs whose padding to the run's first (its longest)
    stays under MAX_DECODE_PADDING; returns each run's size."""
    sizes, width, total, count = [], 0, 0, 0
    for length in lengths:
        if count and (width * (count + 1) - total - length) > MAX_DECODE_PADDING * width * (count + 1):
            sizes.append(count)
            count = 0
        if count == 0:
            width, total = length, 0
        total += length
        count += 1
    if count:
        sizes.append(count)
    return sizes


@dataclass
class ScoredPrompts:
    """Hidden states of prompt positions to score: per (sequence, count) in `seqs`, in order,
    `count` rows from the first position whose next prompt token it has no logprob for."""
    hidden: torch.Tensor
    seqs: list[tuple[Sequence, int]]


def _decode_token(seq: Sequence, position: int, drafts: dict[Sequence, list[int]]) -> int:
    """The input token of a decode row: the sequence's own, or past its end its draft's."""
    offset = position - seq.num_tokens
    return seq.token_ids[position] if offset < 0 else drafts[seq][offset]


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model, self.kv, self.device = model, kv, device
        self.block_size = kv.block_size

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence], ScoredPrompts | None]:
        """Returns hidden states [sampling rows, hidden] (normed), the sequence of each row (a
        drafted one's rows follow each other, its own first), and the hidden states of prompt
        positions to score, if any."""
        bs = self.block_size
        # A decode row per sequence, and one per draft token after it (its position and
        # context one further each), sampled in that order. They run sequence by sequence,
        # longest context first, each sequence's rows longest first: rows that read the same
        # blocks side by side, as the C++ kernel shares one pass over them.
        def last_position(seq: Sequence) -> int:
            return seq.num_tokens - 1 + len(batch.drafts.get(seq, ()))

        rows, order = [], []
        for seq in sorted(batch.decodes, key=last_position, reverse=True):
            first = len(rows)
            rows += [(seq, position) for position in range(seq.num_tokens - 1, last_position(seq) + 1)]
            order += reversed(range(first, len(rows)))
        decodes = [rows[row] for row in order]
        input_ids = [_decode_token(seq, position, batch.drafts) for seq, position in decodes]
        positions = [position for _, position in decodes]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in decodes]
        context_blocks = [p // bs + 1 for p in positions]
        if decode_attention_pads(self.device):
            sizes = group_by_length(context_blocks)
        else:
            sizes = [len(decodes)] if decodes else []
        groups, start = [], 0
        for size in sizes:
            members = decodes[start:start + size]
            # Its longest: a sequence after a drafted one may be longer than its last guess row.
            width = max(context_blocks[start:start + size])
            groups.append(DecodeGroup(
                start, self._tensor([(s.block_table + [0] * width)[:width] for s, _ in members]),
                self._tensor([p + 1 for _, p in members])))
            start += size

        sampling_rows = [0] * len(rows)  # each of `rows`' place in the forward pass
        for place, row in enumerate(order):
            sampling_rows[row] = place
        samplers = [seq for seq, _ in rows]
        scored_rows, scored = [], []
        chunks = []
        for seq, num in batch.prefills:
            first = seq.num_computed
            if seq.scores_prompt:
                # Position p predicts prompt token p + 1; the last prompt position samples instead.
                if first > len(seq.prompt_logprobs):
                    raise RuntimeError(f"sequence {seq.seq_id}: prompt positions skipped before {first}")
                wanted = range(len(seq.prompt_logprobs), min(first + num, seq.num_prompt_tokens - 1))
                scored_rows.extend(len(input_ids) + p - first for p in wanted)
                scored.append((seq, len(wanted)))
            chunks.append(PrefillChunk(len(input_ids), num, first, self._tensor(seq.block_table)))
            input_ids.extend(seq.token_ids[first:first + num])
            positions.extend(range(first, first + num))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(first, first + num))
            if num == seq.num_uncomputed:
                sampling_rows.append(len(input_ids) - 1)
                samplers.append(seq)

        attention = AttentionBatch(self._tensor(slots), groups, chunks)
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), attention, self.kv.layers)
        prompts = ScoredPrompts(hidden[self._tensor(scored_rows)], scored) if scored_rows else None
        return hidden[self._tensor(sampling_rows)], samplers, prompts
