"""Expert-level batching as two grouped matmul kernels over the (token, expert) pairs sorted by
expert (kernels.moe.grouped_experts): gate_up with SiLU-and-mul, then down weighted by the
router. Each program takes a tile of one expert's pairs, so an expert's weights are read once
per tile, and experts nobody chose get no tiles at all."""

import torch
import triton
import triton.language as tl

from kernels.triton.common import Tiles, check_launchable, dot, dot_dtype, tiles_for

# Pairs per tile, output columns per program, reduction step. fp32 from benchmarks.triton_tiles
# on an H200 (results/triton_tiles.json): 4.87 ms where 64-column tiles took 5.37.
_HALF = Tiles(max_block_m=64, block_n=64, block_k=32)
TILES = {torch.float32: Tiles(max_block_m=64, block_n=128, block_k=32), torch.float16: _HALF,
         torch.bfloat16: _HALF}


@triton.jit
def _tile_rows(schedule, order, top_k, BLOCK_M: tl.constexpr):
    """The tile's expert, its rows in the sorted pairs, which of them exist, and their tokens."""
    tile_id = tl.program_id(0)
    expert = tl.load(schedule + 3 * tile_id).to(tl.int64)
    rows = tl.load(schedule + 3 * tile_id + 1).to(tl.int64) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(schedule + 3 * tile_id + 2)
    pair = tl.load(order + rows, mask=row_ok, other=0)
    return expert, rows, row_ok, pair, pair // top_k


@triton.jit
def _gate_up_kernel(hidden, gate_up_proj, act, schedule, order, top_k, hidden_size, inter_size,
                    hidden_stride, expert_stride, row_stride, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    expert, rows, row_ok, _, token = _tile_rows(schedule, order, top_k, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    weights = gate_up_proj + expert * expert_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        x = tl.load(hidden + token[:, None] * hidden_stride + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        # Weight rows are output features: load them transposed, [BLOCK_K, BLOCK_N].
        w_gate = tl.load(weights + cols[None, :] * row_stride + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(weights + (inter_size + cols[None, :]) * row_stride + ks[:, None],
                       mask=w_mask, other=0.0)
        gate += dot(x, w_gate, DOT)
        up += dot(x, w_up, DOT)
    tl.store(act + rows[:, None] * inter_size + cols[None, :],
             (gate * tl.sigmoid(gate) * up).to(act.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act, down_proj, pair_out, router_weights, schedule, order, top_k, hidden_size,
                 inter_size, expert_stride, row_stride, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    expert, rows, row_ok, pair, _ = _tile_rows(schedule, order, top_k, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    weights = down_proj + expert * expert_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter_size
        a = tl.load(act + rows[:, None] * inter_size + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(weights + cols[None, :] * row_stride + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += dot(a, w, DOT)
    # The router weight as the family applies it: rounded to the model's dtype, or fp32 (Mixtral).
    weight = tl.load(router_weights + pair, mask=row_ok, other=0.0).to(tl.float32)
    # Each pair has its own row (the token's k-th choice): no atomics, a deterministic sum.
    tl.store(pair_out + pair[:, None] * hidden_size + cols[None, :],
             acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


def _schedule(counts: torch.Tensor, block_m: int) -> torch.Tensor:
    """[tiles, 3] (expert, first row, end row) over the expert-sorted pairs: each expert's rows
    cut into tiles of block_m, none for an expert without pairs."""
    per_expert = (counts + block_m - 1) // block_m
    expert = torch.repeat_interleave(torch.arange(len(counts)), per_expert)
    ends = torch.cumsum(counts, 0)
    nth = torch.arange(len(expert)) - torch.repeat_interleave(torch.cumsum(per_expert, 0) - per_expert,
                                                             per_expert)
    first = ends[expert] - counts[expert] + nth * block_m
    return torch.stack([expert, first, ends[expert]], dim=1).to(torch.int32)


def grouped_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, tiles: Tiles | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU experts over routed tokens (kernels.moe.grouped_experts, same arguments and
    results: the combined output [T, H] and each expert's token count [E], on the CPU).
    `tiles` overrides TILES (benchmarks.triton_tiles)."""
    check_launchable(hidden)
    tokens, top_k = topk_ids.shape
    num_experts, double_inter, hidden_size = gate_up_proj.shape
    inter_size = double_inter // 2
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).cpu()
    if tokens == 0:
        return torch.zeros_like(hidden), counts

    tiles = tiles or tiles_for(TILES, hidden.dtype)
    block_m = tiles.block_m(int(counts.max()))
    schedule = _schedule(counts, block_m).to(hidden.device)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    gate_up_proj, down_proj = gate_up_proj.contiguous(), down_proj.contiguous()
    act = torch.empty(tokens * top_k, inter_size, dtype=hidden.dtype, device=hidden.device)
    pair_out = torch.empty(tokens * top_k, hidden_size, dtype=torch.float32, device=hidden.device)
    launch = dict(BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                  DOT=dot_dtype(hidden.dtype), num_warps=tiles.num_warps)
    _gate_up_kernel[(len(schedule), triton.cdiv(inter_size, tiles.block_n))](
        hidden, gate_up_proj, act, schedule, order, top_k, hidden_size, inter_size,
        hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), **launch)
    _down_kernel[(len(schedule), triton.cdiv(hidden_size, tiles.block_n))](
        act, down_proj, pair_out, topk_weights.reshape(-1).contiguous(), schedule, order, top_k,
        hidden_size, inter_size, down_proj.stride(0), down_proj.stride(1), **launch)
    return pair_out.view(tokens, top_k, hidden_size).sum(1).to(hidden.dtype), counts
