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
    """Split lengths (sorted descending) into runs whose padding to the run's first (longest)
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


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model, self.kv, self.device = model, kv, device
        self.block_size = kv.block_size

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence], ScoredPrompts | None]:
        """Returns hidden states [sampling rows, hidden] (normed), the sequence of each row, and
        the hidden states of prompt positions to score, if any."""
        bs = self.block_size
        decodes = sorted(batch.decodes, key=lambda s: s.num_tokens, reverse=True)
        input_ids = [s.token_ids[-1] for s in decodes]
        positions = [s.num_tokens - 1 for s in decodes]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, positions)]
        if decode_attention_pads(self.device):
            sizes = group_by_length([len(s.block_table) for s in decodes])
        else:
            sizes = [len(decodes)] if decodes else []
        groups, start = [], 0
        for size in sizes:
            members = decodes[start:start + size]
            width = len(members[0].block_table)
            groups.append(DecodeGroup(
                start, self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in members]),
                self._tensor([s.num_tokens for s in members])))
            start += size

        sampling_rows, samplers = list(range(len(decodes))), list(decodes)
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
