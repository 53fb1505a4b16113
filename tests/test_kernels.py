"""Each compute op against a plain, dense reference written from its definition."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kernels import (apply_rope, paged_decode_attention, paged_prefill_attention, rms_norm,
                     silu_and_mul, write_kv)

BLOCK = 16
HEAD_DIM = 8


def gen(seed):
    return torch.Generator().manual_seed(seed)


def dense_attention(q, k, v, query_pos, scale, window=None, softcap=None):
    """q [queries, heads, d] at positions query_pos; k, v [keys, kv_heads, d] at positions
    0..keys-1. Causal (and windowed, and soft-capped), GQA by repeating each kv head over its
    query heads, in float64 with explicit loops over heads."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        kh = h // group
        scores = (q[:, h].double() @ k[:, kh].double().T) * scale  # [queries, keys]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        key_pos = torch.arange(k.shape[0])
        allowed = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        scores = scores.masked_fill(~allowed, -math.inf)
        out[:, h] = scores.softmax(-1) @ v[:, kh].double()
    return out.float()


class PagedSequences:
    """Random K/V for sequences of ragged lengths, scattered into a paged cache through
    shuffled block tables (every block id used at most once)."""

    def __init__(self, lengths, kv_heads, num_blocks=64, seed=0):
        g = gen(seed)
        self.k_cache = torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM, generator=g)  # garbage
        self.v_cache = torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM, generator=g)
        free = torch.randperm(num_blocks, generator=g).tolist()
        self.keys, self.values, self.tables = [], [], []
        for length in lengths:
            k = torch.randn(length, kv_heads, HEAD_DIM, generator=g)
            v = torch.randn(length, kv_heads, HEAD_DIM, generator=g)
            table = [free.pop() for _ in range(-(-length // BLOCK))]
            for p in range(length):
                self.k_cache[table[p // BLOCK], p % BLOCK] = k[p]
                self.v_cache[table[p // BLOCK], p % BLOCK] = v[p]
            self.keys.append(k)
            self.values.append(v)
            self.tables.append(table)

    def padded_tables(self, pad_with: int) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [pad_with] * (width - len(t)) for t in self.tables])


@pytest.fixture(params=["cpp", "torch"])
def both_cpu_kernel_choices(request, monkeypatch):
    """Runs the test with the C++ kernels and with the torch ops (kernels/backend.py)."""
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", request.param)


@pytest.mark.usefixtures("both_cpu_kernel_choices")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 5, 20])
def test_paged_decode_attention_matches_dense(heads, kv_heads, window):
    lengths = [1, 15, 16, 17, 40, 3]
    paged = PagedSequences(lengths, kv_heads, seed=heads * 10 + kv_heads)
    q = torch.randn(len(lengths), heads, HEAD_DIM, generator=gen(1))
    scale = HEAD_DIM ** -0.5
    # Padding entries point at a block full of other data: they must be masked out.
    tables = paged.padded_tables(pad_with=paged.tables[4][0])
    out = paged_decode_attention(q, paged.k_cache, paged.v_cache, tables, torch.tensor(lengths),
                                 scale, window)
    assert out.shape == q.shape
    for i, length in enumerate(lengths):
        want = dense_attention(q[i:i + 1], paged.keys[i], paged.values[i], torch.tensor([length - 1]),
                               scale, window)
        torch.testing.assert_close(out[i:i + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("both_cpu_kernel_choices")
def test_paged_decode_attention_ignores_cache_beyond_context_len():
    paged = PagedSequences([20], kv_heads=2, seed=3)
    q = torch.randn(1, 4, HEAD_DIM, generator=gen(2))
    tables = torch.tensor([paged.tables[0]])
    short = paged_decode_attention(q, paged.k_cache, paged.v_cache, tables, torch.tensor([18]), 0.3)
    paged.k_cache[paged.tables[0][1], 2:] = 1e4  # positions 18.. : beyond the context
    paged.v_cache[paged.tables[0][1], 2:] = 1e4
    again = paged_decode_attention(q, paged.k_cache, paged.v_cache, tables, torch.tensor([18]), 0.3)
    torch.testing.assert_close(short, again)
    want = dense_attention(q, paged.keys[0][:18], paged.values[0][:18], torch.tensor([17]), 0.3)
    torch.testing.assert_close(short, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("length,start", [(1, 0), (16, 0), (37, 0), (37, 5), (37, 16), (50, 49), (50, 33)])
def test_paged_prefill_attention_matches_dense(heads, kv_heads, window, length, start):
    paged = PagedSequences([length, 30], kv_heads, seed=length + start)
    chunk = length - start  # the chunk's keys are already in the cache, as the model writes them first
    q = torch.randn(chunk, heads, HEAD_DIM, generator=gen(start))
    scale = 0.25
    table = torch.tensor(paged.tables[0])
    out = paged_prefill_attention(q, paged.k_cache, paged.v_cache, table, start, scale, window)
    assert out.shape == q.shape
    want = dense_attention(q, paged.keys[0], paged.values[0], torch.arange(start, length), scale, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


SOFTCAP_SCALE, SOFTCAP = 1.0, 2.0  # scores of spread ~3 against a cap of 2: most are bent


@pytest.mark.usefixtures("both_cpu_kernel_choices")
@pytest.mark.parametrize("window", [None, 5])
def test_soft_capped_decode_attention_matches_dense(window):
    """Gemma 2: softcap * tanh(score / softcap) before the softmax."""
    lengths = [1, 17, 40]
    paged = PagedSequences(lengths, kv_heads=2, seed=21)
    q = torch.randn(len(lengths), 4, HEAD_DIM, generator=gen(21))
    out = paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.padded_tables(0),
                                 torch.tensor(lengths), SOFTCAP_SCALE, window, SOFTCAP)
    for i, length in enumerate(lengths):
        want = dense_attention(q[i:i + 1], paged.keys[i], paged.values[i], torch.tensor([length - 1]),
                               SOFTCAP_SCALE, window, SOFTCAP)
        torch.testing.assert_close(out[i:i + 1], want, atol=1e-5, rtol=1e-5)
        uncapped = dense_attention(q[i:i + 1], paged.keys[i], paged.values[i],
                                   torch.tensor([length - 1]), SOFTCAP_SCALE, window)
        assert length == 1 or not torch.allclose(want, uncapped, atol=1e-3)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("length,start", [(16, 0), (37, 5)])
def test_soft_capped_prefill_attention_matches_dense(window, length, start):
    paged = PagedSequences([length], kv_heads=2, seed=22)
    q = torch.randn(length - start, 4, HEAD_DIM, generator=gen(22))
    out = paged_prefill_attention(q, paged.k_cache, paged.v_cache, torch.tensor(paged.tables[0]), start,
                                  SOFTCAP_SCALE, window, SOFTCAP)
    want = dense_attention(q, paged.keys[0], paged.values[0], torch.arange(start, length),
                           SOFTCAP_SCALE, window, SOFTCAP)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_prefill_in_chunks_equals_prefill_at_once():
    paged = PagedSequences([45], kv_heads=2, seed=9)
    q = torch.randn(45, 4, HEAD_DIM, generator=gen(9))
    table = torch.tensor(paged.tables[0])
    whole = paged_prefill_attention(q, paged.k_cache, paged.v_cache, table, 0, 0.3, 24)
    parts = torch.cat([paged_prefill_attention(q[s:e], paged.k_cache, paged.v_cache, table, s, 0.3, 24)
                       for s, e in ((0, 8), (8, 30), (30, 45))])
    torch.testing.assert_close(whole, parts, atol=1e-6, rtol=1e-6)


def test_write_kv_stores_each_token_at_its_slot():
    g = gen(4)
    k_cache = torch.zeros(8, BLOCK, 2, HEAD_DIM)
    v_cache = torch.zeros(8, BLOCK, 2, HEAD_DIM)
    slots = torch.tensor([5 * BLOCK + 3, 0, 7 * BLOCK + 15, 2 * BLOCK + 9, 2 * BLOCK + 10])
    k = torch.randn(5, 2, HEAD_DIM, generator=g)
    v = torch.randn(5, 2, HEAD_DIM, generator=g)
    write_kv(k_cache, v_cache, slots, k, v)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for i, slot in enumerate(slots.tolist()):
        expected_k[slot // BLOCK, slot % BLOCK] = k[i]
        expected_v[slot // BLOCK, slot % BLOCK] = v[i]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache, stored as runtime.kv_cache.KVCache stores it: each block head by head."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.usefixtures("both_cpu_kernel_choices")
@pytest.mark.parametrize("window", [None, 5])
def test_ops_take_a_head_major_cache_as_they_take_a_slot_major_one(window):
    paged = PagedSequences([1, 15, 17, 40], kv_heads=2, seed=6)
    stored = [head_major(c) for c in (paged.k_cache, paged.v_cache)]
    assert stored[0].stride(1) == HEAD_DIM and torch.equal(stored[0], paged.k_cache)
    q = torch.randn(4, 4, HEAD_DIM, generator=gen(6))
    tables, lens = paged.padded_tables(pad_with=0), torch.tensor([1, 15, 17, 40])
    assert torch.equal(paged_decode_attention(q, *stored, tables, lens, 0.3, window),
                       paged_decode_attention(q, paged.k_cache, paged.v_cache, tables, lens, 0.3, window))
    chunk = torch.randn(9, 4, HEAD_DIM, generator=gen(7))
    table = torch.tensor(paged.tables[3])
    assert torch.equal(paged_prefill_attention(chunk, *stored, table, 31, 0.3, window),
                       paged_prefill_attention(chunk, paged.k_cache, paged.v_cache, table, 31, 0.3, window))
    slots = torch.tensor([5 * BLOCK + 3, 0, 7 * BLOCK + 15])
    k, v = torch.randn(2, 3, 2, HEAD_DIM, generator=gen(8))
    write_kv(*stored, slots, k, v)
    write_kv(paged.k_cache, paged.v_cache, slots, k, v)
    assert torch.equal(stored[0], paged.k_cache) and torch.equal(stored[1], paged.v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_formula_and_transformers(dtype):
    g = gen(5)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    weight = torch.randn(64, generator=g)
    eps = 1e-5
    out = rms_norm(x, weight, eps)
    x64 = x.double()
    formula = weight.double() * (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).double()
    torch.testing.assert_close(out.double(), formula, atol=1e-5 if dtype == torch.float32 else 2e-2,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2)
    reference = LlamaRMSNorm(64, eps=eps)
    reference.weight.data.copy_(weight)
    with torch.no_grad():
        expected = reference(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_apply_rope_rotates_each_pair_by_its_angle():
    tokens, heads, dim = 5, 3, 8
    g = gen(6)
    x = torch.randn(tokens, heads, dim, generator=g)
    positions = torch.tensor([0, 1, 7, 100, 3])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[:, None].float() * inv_freq[None, :]  # [tokens, dim/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    out = apply_rope(x, cos, sin)
    half = dim // 2
    expected = torch.empty_like(x)
    for t in range(tokens):
        for i in range(half):
            c, s = math.cos(angles[t, i].item()), math.sin(angles[t, i].item())
            a, b = x[t, :, i], x[t, :, i + half]
            expected[t, :, i] = a * c - b * s
            expected[t, :, i + half] = b * c + a * s
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation
    torch.testing.assert_close(out[0], x[0])  # position 0: identity
    # Same as transformers' (heads-first layout there).
    q_ref, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(out, q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_partial_rope_turns_the_first_dims_as_transformers_does():
    """Phi-3's apply_rotary_pos_emb: cos and sin narrower than the head turn its first dims."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    g = gen(8)
    x = torch.randn(4, 2, 16, generator=g)
    angles = torch.arange(4.0)[:, None] * torch.rand(1, 6, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # 12 of 16 dims
    out = apply_rope(x, cos, sin)
    q_ref, _ = phi3_rope(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(out, q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert torch.equal(out[..., 12:], x[..., 12:])


def test_apply_rope_scaled_tables_scale_the_output():
    x = torch.randn(2, 1, 4, generator=gen(7))
    cos, sin = torch.ones(2, 4) * 0.5, torch.zeros(2, 4)  # angle 0 with attention scaling 0.5
    torch.testing.assert_close(apply_rope(x, cos, sin), x * 0.5)


def test_silu_and_mul_is_swiglu_on_packed_halves():
    g = gen(8)
    gate_up = torch.randn(6, 2 * 10, generator=g) * 4
    gate, up = gate_up[:, :10], gate_up[:, 10:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul(gate_up), expected, atol=1e-6, rtol=1e-6)
    batched = torch.randn(2, 3, 8, generator=g)
    torch.testing.assert_close(silu_and_mul(batched)[1, 2], silu_and_mul(batched[1, 2][None])[0])
