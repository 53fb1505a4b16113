"""Attention over a paged KV cache.

Cache layout, per layer: k_cache, v_cache of shape [num_blocks, block_size, kv_heads, head_dim],
with any strides that keep head_dim contiguous (runtime.kv_cache.KVCache stores each block head
by head). A sequence's block table lists its blocks in order; token position p lives in block
table[p // block_size] at offset p % block_size.
"""

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v ([tokens, kv_heads, head_dim]) at flat slots (block * block_size + offset)."""
    blocks, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[batch, blocks] block ids -> [batch, kv_heads, blocks * block_size, head_dim]."""
    batch, num_blocks = block_tables.shape
    # index_select over whole blocks: about twice as fast as advanced indexing on CPU.
    gathered = cache.index_select(0, block_tables.reshape(-1))
    return gathered.view(batch, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """SDPA over q [batch, heads, queries, head_dim] and k, v [batch, kv_heads, keys, head_dim];
    with softcap, the scores pass through softcap * tanh(score / softcap) before the mask
    (Gemma 2), which SDPA cannot do: computed as transformers' eager attention does."""
    gqa = k.shape[1] != q.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None
                           ) -> torch.Tensor:
    """One query token per sequence, attending to its first context_lens[i] cached positions.

    q: [batch, heads, head_dim]; block_tables: [batch, max_blocks] (padding entries may be any
    valid block id: they are masked); softcap: the attention scores' soft cap, if any;
    returns [batch, heads, head_dim].
    """
    k = _gather(k_cache, block_tables)
    v = _gather(v_cache, block_tables)
    key_pos = torch.arange(k.shape[2], device=q.device)
    mask = key_pos[None, :] < context_lens[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] >= (context_lens[:, None] - sliding_window)
    out = _attention(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap)
    return out.squeeze(2)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, start_pos: int, scale: float,
                            sliding_window: int | None = None, softcap: float | None = None
                            ) -> torch.Tensor:
    """A chunk of one sequence's queries at positions start_pos.. attending causally to the
    cache (which already holds the chunk's own keys).

    q: [chunk, heads, head_dim]; block_table: [blocks]; returns [chunk, heads, head_dim].
    """
    chunk = q.shape[0]
    context = start_pos + chunk
    k = _gather(k_cache, block_table[None])[:, :, :context]
    v = _gather(v_cache, block_table[None])[:, :, :context]
    q = q.transpose(0, 1)[None]
    if start_pos == 0 and sliding_window is None:  # plain causal: the fused kernel's fast path
        out = _attention(q, k, v, None, scale, softcap, is_causal=True)
    else:
        query_pos = torch.arange(start_pos, context, device=q.device)[:, None]
        key_pos = torch.arange(context, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        # A 4-d mask keeps SDPA on its fused CPU kernel (a 2-d one falls back to the slow path).
        out = _attention(q, k, v, mask[None, None], scale, softcap)
    return out[0].transpose(0, 1)
