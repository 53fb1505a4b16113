"""Attention over the paged KV cache (layout in kernels/attention.py).

One kernel serves decode and prefill: each program takes a tile of query rows of one sequence
that share a KV head and attends to the sequence's cached positions in tiles of BLOCK_N,
with an online softmax. A sequence's queries are the last `num_queries` positions of its
context (one for decode; a prefill chunk's tokens, whose keys are already cached). The GQA
heads of a KV head are packed into the rows, so each K/V tile is read once for all of them.
"""

import math

import torch
import triton
import triton.language as tl

from kernels.triton.common import Tiles, check_launchable, dot, dot_dtype, tile, tiles_for

# Query rows per program (a GQA group's heads x queries) and cached positions per softmax step,
# from benchmarks.triton_tiles on an H200 (results/triton_tiles.json). fp32 dots run on CUDA
# cores (not TF32) and fall off a cliff where a tile spills registers: fp32 prefill with 64-row
# tiles took 13.1 ms where these take 0.97; fp32 decode went from 1.10 to 0.61 ms. Half
# precision (bf16 swept; fp16 takes the same tensor-core path) gains from 64 positions a step:
# decode 0.125 -> 0.099 ms, prefill 0.090 -> 0.055 ms.
_HALF = Tiles(max_block_m=64, block_n=64)
DECODE_TILES = {torch.float32: Tiles(max_block_m=16, block_n=64), torch.float16: _HALF,
                torch.bfloat16: _HALF}
PREFILL_TILES = {torch.float32: Tiles(max_block_m=32, block_n=32), torch.float16: _HALF,
                 torch.bfloat16: _HALF}
LN2 = tl.constexpr(math.log(2.0))


@triton.jit
def _write_kv_kernel(k, v, k_cache, v_cache, slots, heads, k_token_stride, k_head_stride,
                     v_token_stride, v_head_stride, cache_block_stride, cache_slot_stride,
                     cache_head_stride, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_TILE: tl.constexpr, DIM_TILE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + token).to(tl.int64)
    head = tl.arange(0, HEADS_TILE)[:, None]
    dim = tl.arange(0, DIM_TILE)[None, :]
    mask = (head < heads) & (dim < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * cache_block_stride + (slot % BLOCK_SIZE) * cache_slot_stride \
        + head * cache_head_stride + dim
    tl.store(k_cache + dst, tl.load(k + token * k_token_stride + head * k_head_stride + dim, mask=mask),
             mask=mask)
    tl.store(v_cache + dst, tl.load(v + token * v_token_stride + head * v_head_stride + dim, mask=mask),
             mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v ([tokens, kv_heads, head_dim]) at flat slots (kernels.attention.write_kv);
    k, v and slot_mapping may be strided views."""
    check_launchable(k_cache)
    assert k_cache.stride() == v_cache.stride()
    tokens, heads, head_dim = k.shape
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.contiguous()  # read as a dense vector
    if tokens:
        _write_kv_kernel[(tokens,)](
            k, v, k_cache, v_cache, slot_mapping, heads, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), *k_cache.stride()[:3], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
            HEADS_TILE=tile(heads), DIM_TILE=tile(head_dim))


@triton.jit
def _paged_attention_kernel(
        q, k_cache, v_cache, out, block_tables, context_lens, qk_scale, window, softcap, num_queries,
        q_seq_stride, q_token_stride, q_head_stride, out_seq_stride, out_token_stride,
        out_head_stride, table_stride, cache_block_stride, cache_slot_stride, cache_head_stride,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DIM_TILE: tl.constexpr, DOT: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    first_row = tl.program_id(2) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = query < num_queries
    dims = tl.arange(0, DIM_TILE)
    dim_ok = dims < HEAD_DIM

    context = tl.load(context_lens + seq)
    first_query_pos = context - num_queries
    q_pos = first_query_pos + query
    q_tile = tl.load(q + seq * q_seq_stride + query[:, None] * q_token_stride
                     + head[:, None] * q_head_stride + dims[None, :],
                     mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # The positions some row of the tile may see: causal above, the window below.
    hi = tl.minimum(context, first_query_pos + (first_row + BLOCK_M - 1) // GROUP + 1)
    lo = 0
    if SLIDING:
        lo = tl.maximum(first_query_pos + first_row // GROUP - window + 1, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_TILE], tl.float32)
    table = block_tables + seq * table_stride
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        in_range = pos < hi  # table entries past the context (padding, even -1) are never read
        block = tl.load(table + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        offsets = (block * cache_block_stride + (pos % BLOCK_SIZE) * cache_slot_stride
                   + kv_head * cache_head_stride)[:, None] + dims[None, :]
        kv_mask = in_range[:, None] & dim_ok[None, :]
        k = tl.load(k_cache + offsets, mask=kv_mask, other=0.0)
        scores = dot(q_tile, tl.trans(k), DOT) * qk_scale
        if SOFTCAP:  # softcap * tanh(score / softcap) on the natural-log scores (log2 units here)
            capped = scores * (LN2 / softcap)
            scores = (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * (softcap / LN2)
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible &= pos[None, :] > q_pos[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        new_m = tl.maximum(m, tl.max(scores, axis=1))
        # A row that has seen no position yet keeps max -inf: shift by 0 there, not -inf - -inf.
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        p = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(m - shift)
        denominator = denominator * rescale + tl.sum(p, axis=1)
        v = tl.load(v_cache + offsets, mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + dot(p, v, DOT)
        m = new_m

    # Every query sees at least its own position; only padding rows may have seen none.
    denominator = tl.where(row_ok, denominator, 1.0)
    tl.store(out + seq * out_seq_stride + query[:, None] * out_token_stride
             + head[:, None] * out_head_stride + dims[None, :],
             (acc / denominator[:, None]).to(out.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
            sliding_window: int | None, softcap: float | None, tiles: Tiles) -> torch.Tensor:
    """q: [seqs, queries, heads, head_dim], the last `queries` positions of each sequence's
    context; block_tables: [seqs, max_blocks]; context_lens: [seqs]."""
    check_launchable(q)
    # The kernel indexes these as dense rows (a view's strides would be ignored).
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    seqs, num_queries, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    assert k_cache.stride() == v_cache.stride() and q.stride(3) == 1 and k_cache.stride(3) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m = tiles.block_m(num_queries * group)
    grid = (seqs, kv_heads, triton.cdiv(num_queries * group, block_m))
    if seqs and num_queries:
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, block_tables, context_lens, scale * math.log2(math.e),
            sliding_window or 0, softcap or 1.0, num_queries, *q.stride()[:3], *out.stride()[:3],
            block_tables.stride(0), *k_cache.stride()[:3], GROUP=group, HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[1], SLIDING=sliding_window is not None,
            SOFTCAP=softcap is not None, BLOCK_M=block_m,
            BLOCK_N=tiles.block_n, DIM_TILE=tile(head_dim, at_least=16), DOT=dot_dtype(q.dtype),
            num_warps=tiles.num_warps)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           tiles: Tiles | None = None) -> torch.Tensor:
    """One query per sequence over its first context_lens[i] cached positions
    (kernels.attention.paged_decode_attention); block table entries past the context are never
    read, so any padding value works. `tiles` overrides DECODE_TILES (benchmarks.triton_tiles)."""
    return _attend(q[:, None], k_cache, v_cache, block_tables, context_lens, scale,
                   sliding_window, softcap, tiles or tiles_for(DECODE_TILES, q.dtype))[:, 0]


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, start_pos: int, scale: float,
                            sliding_window: int | None = None, softcap: float | None = None,
                            tiles: Tiles | None = None) -> torch.Tensor:
    """A chunk of one sequence's queries at positions start_pos.. attending causally to the
    cache, which already holds the chunk's keys (kernels.attention.paged_prefill_attention).
    `tiles` overrides PREFILL_TILES (benchmarks.triton_tiles)."""
    context = torch.full((1,), start_pos + q.shape[0], dtype=torch.int32, device=q.device)
    return _attend(q[None], k_cache, v_cache, block_table[None], context, scale, sliding_window,
                   softcap, tiles or tiles_for(PREFILL_TILES, q.dtype))[0]
