"""Turns a scheduled batch into one flattened forward pass and returns logits for the rows
that sample (decodes, and prefill chunks that finish their sequence's pending tokens)."""

import torch

from runtime.kv_cache import KVCache
from runtime.model import AttentionBatch, CausalLM, PrefillChunk
from runtime.scheduler import ScheduledBatch
from runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device):
        self.model, self.kv, self.device = model, kv, device
        self.block_size = kv.block_size

    def _slots(self, table: list[int], start: int, count: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        self.kv.copy_blocks(batch.block_copies)
        input_ids, positions, slots = [], [], []
        for seq in batch.decodes:
            pos = seq.num_tokens - 1
            input_ids.append(seq.token_ids[-1])
            positions.append(pos)
            slots.append(seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
        sampling_rows, samplers = list(range(len(batch.decodes))), list(batch.decodes)
        chunks = []
        for seq, num in batch.prefills:
            start = seq.num_computed
            chunks.append(PrefillChunk(len(input_ids), num, start,
                                       torch.tensor(seq.block_table, device=self.device)))
            input_ids.extend(seq.token_ids[start:start + num])
            positions.extend(range(start, start + num))
            slots.extend(self._slots(seq.block_table, start, num))
            if num == seq.num_uncomputed:
                sampling_rows.append(len(input_ids) - 1)
                samplers.append(seq)

        max_blocks = max((len(s.block_table) for s in batch.decodes), default=0)
        tensor = lambda data: torch.tensor(data, dtype=torch.long, device=self.device)  # noqa: E731
        attention = AttentionBatch(
            slot_mapping=tensor(slots),
            num_decode=len(batch.decodes),
            decode_block_tables=tensor([s.block_table + [0] * (max_blocks - len(s.block_table))
                                        for s in batch.decodes]),
            decode_context_lens=tensor([s.num_tokens for s in batch.decodes]),
            prefills=chunks,
        )
        hidden = self.model(tensor(input_ids), tensor(positions), attention, self.kv.layers)
        return self.model.compute_logits(hidden[tensor(sampling_rows)]), samplers
