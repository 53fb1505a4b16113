"""The Triton kernels (kernels/triton/) against the torch ops, on CPU tensors in Triton's
interpreter; the backend choice by device; and the engine with the Triton kernels forced.

Half-precision inputs are compared with the torch op run in fp32 on the same (upcast) values.
The interpreter rounds fp32 to bf16 by truncation (a GPU rounds to nearest), so bf16 outputs
may be one unit in the last place off: bf16 tolerances allow that.
"""

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

import kernels
from helpers import greedy_requests, make_engine, random_prompts
from kernels import activation, attention, moe, norm, rope
from kernels.backend import backend_for, forced_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.float16: dict(atol=3e-3, rtol=3e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
OPS = ["add_rms_norm", "apply_rope", "grouped_experts", "paged_decode_attention",
       "paged_prefill_attention", "rms_norm", "silu_and_mul", "write_kv"]


@pytest.fixture(scope="module")
def kt():
    """kernels.triton, its kernels interpreted (conftest.py sets TRITON_INTERPRET=1 in time)."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")
    package = importlib.import_module("kernels.triton")
    if not package.common.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is not 1: triton cannot run kernels on CPU tensors")
    return package


def gen(seed):
    return torch.Generator().manual_seed(seed)


def cast(dtype, *tensors):
    """The tensors in dtype, and the same values in fp32 for the reference."""
    low = [t.to(dtype) for t in tensors]
    return low, [t.float() for t in low]


def check(out, expected, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


# ---- backend choice ------------------------------------------------------------------------

def test_backend_follows_the_device():
    assert backend_for(torch.device("cpu")) == "torch"
    assert backend_for(torch.device("meta")) == "torch"
    assert backend_for(torch.device("cuda")) == "triton"
    assert backend_for(torch.device("cuda", 1)) == "triton"
    with forced_triton():
        assert backend_for(torch.device("cpu")) == "triton"
        with forced_triton():
            pass
        assert backend_for(torch.device("cpu")) == "triton"  # the inner block restored it
    assert backend_for(torch.device("cpu")) == "torch"


def test_public_ops_route_cuda_tensors_to_triton(monkeypatch):
    fake_triton = SimpleNamespace(**{name: (lambda *args, name=name: name) for name in OPS})
    monkeypatch.setattr("kernels.backend.triton_ops", lambda: fake_triton)
    on_cuda = SimpleNamespace(device=torch.device("cuda"))  # stands in for a CUDA tensor
    for name in OPS:
        assert getattr(kernels, name)(on_cuda) == name
    x, weight = torch.randn(3, 8, generator=gen(0)), torch.randn(8, generator=gen(1))
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


def test_cpu_needs_no_triton_and_cuda_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    x, weight = torch.randn(3, 8, generator=gen(0)), torch.ones(8)
    kernels.rms_norm(x, weight, 1e-6)
    with pytest.raises(ImportError, match=r"install the `cuda` extra"):
        kernels.rms_norm(SimpleNamespace(device=torch.device("cuda")), weight, 1e-6)


def test_cpu_tensors_outside_the_interpreter_are_refused(kt, monkeypatch):
    monkeypatch.setattr(kt.common, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kt.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)


# ---- elementwise ops -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(kt, dtype):
    g = gen(2)
    wide = torch.randn(7, 128, generator=g) * 3
    wide[0] *= 1e-3  # a row where eps matters
    (wide, weight), (wide32, weight32) = cast(dtype, wide, torch.randn(96, generator=g))
    x, x32 = wide[:, :96], wide32[:, :96]  # rows of a wider tensor
    out = kt.rms_norm(x, weight, 1e-5)
    check(out, norm.rms_norm(x32, weight32, 1e-5), dtype)
    if dtype == torch.float16:  # rounds where the torch op rounds: bit-equal but for a rare ulp
        assert (out == norm.rms_norm(x, weight, 1e-5)).float().mean() > 0.99
    # An fp32 weight on a half input promotes the output, as the torch op does.
    assert kt.rms_norm(x, weight32, 1e-5).dtype == norm.rms_norm(x, weight32, 1e-5).dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(kt, dtype):
    g = gen(3)
    (x, residual, weight), (x32, residual32, weight32) = cast(
        dtype, torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g) * 4,
        torch.randn(96, generator=g))
    out, new_residual = kt.add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_residual = norm.add_rms_norm(x32, residual32, weight32, 1e-6)
    check(new_residual, expected_residual, dtype)
    check(out, expected_out, dtype)
    torch.testing.assert_close(residual.float(), residual32)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [16, 12, 6, 0], ids=["full", "three-quarters", "partial-odd-tiles", "none"])
def test_apply_rope(kt, dtype, rotary):
    tokens, heads, kv_heads, dim = 6, 6, 2, 16
    g = gen(4)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    inv_freq = 10000 ** -(torch.arange(0, rotary, 2) / rotary)
    angles = torch.randint(0, 500, (tokens, 1), generator=g) * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1) * 0.9, torch.cat([angles.sin()] * 2, -1) * 0.9
    (qkv, cos, sin), (qkv32, cos32, sin32) = cast(dtype, qkv, cos, sin)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)  # strided, as the model's q is
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    check(kt.apply_rope(q, cos, sin), rope.apply_rope(q.float(), cos32, sin32), dtype)
    check(kt.apply_rope(k, cos, sin), rope.apply_rope(k.float(), cos32, sin32), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kt, dtype):
    (gate_up,), (gate_up32,) = cast(dtype, torch.randn(2, 5, 2 * 40, generator=gen(5)) * 3)
    check(kt.silu_and_mul(gate_up), activation.silu_and_mul(gate_up32), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 12])
def test_write_kv(kt, dtype, block_size):
    g = gen(6)
    kv = torch.randn(5, 2, 2, 16, generator=g).to(dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    slots = torch.tensor([5 * block_size + 3, 0, 7 * block_size + block_size - 1, 2 * block_size + 9, 13])
    caches = [torch.randn(8, block_size, 2, 16, generator=g).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    kt.write_kv(*caches, slots, k, v)
    attention.write_kv(*expected, slots, k, v)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_index_tensors_and_weights_may_be_strided_views(kt):
    """Block tables, context lengths, slots and the norm weight as views with gaps (the torch
    and C++ ops take them): read by their strides, not as dense rows."""
    g = gen(11)
    k, v = torch.randn(12, 4, 2, 16, generator=g), torch.randn(12, 4, 2, 16, generator=g)
    tables = torch.tensor([[3, -1, 7, -1, 1, -1], [5, -1, 2, -1, 0, -1]])[:, ::2]
    lens = torch.tensor([[10, 99], [9, 99]])[:, 0]
    q = torch.randn(2, 4, 16, generator=g)
    torch.testing.assert_close(kt.paged_decode_attention(q, k, v, tables, lens, 0.25),
                               attention.paged_decode_attention(q, k, v, tables.contiguous(), lens.contiguous(), 0.25))
    chunk = torch.randn(5, 4, 16, generator=g)
    torch.testing.assert_close(kt.paged_prefill_attention(chunk, k, v, tables[0], 5, 0.25),
                               attention.paged_prefill_attention(chunk, k, v, tables[0].contiguous(), 5, 0.25))
    slots = torch.tensor([5, -1, 17, -1, 30, -1])[::2]
    new_k, new_v = torch.randn(2, 3, 2, 16, generator=g)
    caches, expected = [k.clone(), v.clone()], [k.clone(), v.clone()]
    kt.write_kv(*caches, slots, new_k, new_v)
    attention.write_kv(*expected, slots.contiguous(), new_k, new_v)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    x, weight = torch.randn(3, 8, generator=g), torch.randn(16, generator=g)[::2]
    torch.testing.assert_close(kt.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


# ---- attention over the paged cache ----------------------------------------------------------

class PagedCache:
    """A cache of random K/V, one sequence per block table, block ids shuffled; `tables` pads
    with -1, which the torch op cannot take (it gathers every entry) but the kernel never reads."""

    def __init__(self, lengths, kv_heads, block_size=16, head_dim=16, num_blocks=40, seed=0):
        g = gen(seed)
        self.k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        self.v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        free = torch.randperm(num_blocks, generator=g).tolist()
        rows = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
        width = max(map(len, rows))
        self.tables = torch.tensor([r + [-1] * (width - len(r)) for r in rows])
        self.used = sorted(b for r in rows for b in r)


def test_a_dtype_without_tiles_is_not_implemented(kt):
    cache = PagedCache([5], kv_heads=1)
    q, k, v = (t.double() for t in (torch.randn(1, 2, 16, generator=gen(3)), cache.k, cache.v))
    with pytest.raises(NotImplementedError, match="the Triton kernels run .* not torch.float64"):
        kt.paged_decode_attention(q, k, v, cache.tables, torch.tensor([5]), 0.3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
@pytest.mark.parametrize("window", [None, 5, 20])
def test_paged_decode_attention(kt, dtype, heads, kv_heads, window):
    lengths = [1, 15, 16, 17, 40, 3]  # ragged, mostly not a multiple of the block size
    cache = PagedCache(lengths, kv_heads, seed=heads + kv_heads)
    (q, k, v), (q32, k32, v32) = cast(dtype, torch.randn(len(lengths), heads, 16, generator=gen(7)),
                                      cache.k, cache.v)
    context_lens = torch.tensor(lengths)
    out = kt.paged_decode_attention(q, k, v, cache.tables, context_lens, 0.3, window)
    expected = attention.paged_decode_attention(q32, k32, v32, cache.tables.clamp(min=0),
                                                context_lens, 0.3, window)
    check(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_capped_attention(kt, dtype):
    """Gemma 2's cap on the scores, decode and prefill."""
    lengths = [1, 17, 40]
    cache = PagedCache(lengths, 2, seed=31)
    (q, k, v), (q32, k32, v32) = cast(dtype, torch.randn(len(lengths), 4, 16, generator=gen(31)),
                                      cache.k, cache.v)
    context_lens = torch.tensor(lengths)
    check(kt.paged_decode_attention(q, k, v, cache.tables, context_lens, 1.0, 5, 2.0),
          attention.paged_decode_attention(q32, k32, v32, cache.tables.clamp(min=0), context_lens,
                                           1.0, 5, 2.0), dtype)
    table = cache.tables[2][cache.tables[2] >= 0]
    (chunk,), (chunk32,) = cast(dtype, torch.randn(30, 4, 16, generator=gen(32)))
    check(kt.paged_prefill_attention(chunk, k, v, table, 10, 1.0, None, 2.0),
          attention.paged_prefill_attention(chunk32, k32, v32, table, 10, 1.0, None, 2.0), dtype)


def test_kernels_take_a_head_major_cache(kt):
    """runtime.kv_cache.KVCache stores each block head by head: the strides say so."""
    cache = PagedCache([1, 15, 16, 40], kv_heads=2, seed=12)
    stored = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in (cache.k, cache.v)]
    q = torch.randn(4, 4, 16, generator=gen(12))
    tables, lens = cache.tables.clamp(min=0), torch.tensor([1, 15, 16, 40])
    check(kt.paged_decode_attention(q, *stored, tables, lens, 0.25),
          attention.paged_decode_attention(q, cache.k, cache.v, tables, lens, 0.25), torch.float32)
    chunk = torch.randn(20, 4, 16, generator=gen(13))
    check(kt.paged_prefill_attention(chunk, *stored, tables[3], 20, 0.25),
          attention.paged_prefill_attention(chunk, cache.k, cache.v, tables[3], 20, 0.25), torch.float32)
    slots = torch.tensor([3, 40, 17])
    k, v = torch.randn(2, 3, 2, 16, generator=gen(14))
    kt.write_kv(*stored, slots, k, v)
    attention.write_kv(cache.k, cache.v, slots, k, v)
    assert torch.equal(stored[0], cache.k) and torch.equal(stored[1], cache.v)


def test_paged_decode_attention_reads_nothing_past_the_context(kt):
    lengths = [20, 7, 33]
    cache = PagedCache(lengths, kv_heads=1, block_size=12, seed=8)  # block size not a power of 2
    q = torch.randn(3, 3, 16, generator=gen(8))
    context_lens = torch.tensor(lengths)
    expected = attention.paged_decode_attention(q, cache.k, cache.v, cache.tables.clamp(min=0),
                                                context_lens, 0.25)
    for i, n in enumerate(lengths):  # poison every slot a sequence must not see
        for p in range(n, cache.tables.shape[1] * 12):
            if cache.tables[i, p // 12] >= 0:
                cache.k[cache.tables[i, p // 12], p % 12] = float("nan")
                cache.v[cache.tables[i, p // 12], p % 12] = float("nan")
    unused = [b for b in range(len(cache.k)) if b not in cache.used]
    cache.k[unused], cache.v[unused] = float("nan"), float("nan")
    out = kt.paged_decode_attention(q, cache.k, cache.v, cache.tables, context_lens, 0.25)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


PREFILL_CASES = [(1, 0), (37, 0), (37, 5), (37, 16), (50, 49), (50, 33)]  # (context, start)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("context,start", PREFILL_CASES)
def test_paged_prefill_attention(kt, heads, kv_heads, window, context, start):
    cache = PagedCache([context, 30], kv_heads, seed=context + start)
    q = torch.randn(context - start, heads, 16, generator=gen(start))
    table = cache.tables[0][cache.tables[0] >= 0]
    out = kt.paged_prefill_attention(q, cache.k, cache.v, table, start, 0.25, window)
    expected = attention.paged_prefill_attention(q, cache.k, cache.v, table, start, 0.25, window)
    check(out, expected, torch.float32)


@pytest.mark.parametrize("max_block_m,block_n", [(16, 16), (32, 64), (64, 16)])
def test_paged_prefill_attention_any_tiles(kt, max_block_m, block_n):
    """Each launch shape benchmarks.triton_tiles may pick computes the same attention."""
    cache = PagedCache([70], kv_heads=2, seed=4)
    q = torch.randn(53, 6, 16, generator=gen(4))
    table = cache.tables[0]
    tiles = kt.common.Tiles(max_block_m=max_block_m, block_n=block_n)
    out = kt.paged_prefill_attention(q, cache.k, cache.v, table, 17, 0.25, 9, tiles=tiles)
    check(out, attention.paged_prefill_attention(q, cache.k, cache.v, table, 17, 0.25, 9), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_prefill_attention_half(kt, dtype, window):
    cache = PagedCache([45], kv_heads=2, block_size=8, seed=9)
    (q, k, v), (q32, k32, v32) = cast(dtype, torch.randn(29, 6, 16, generator=gen(9)), cache.k, cache.v)
    table = cache.tables[0]
    out = kt.paged_prefill_attention(q, k, v, table, 16, 0.25, window)
    check(out, attention.paged_prefill_attention(q32, k32, v32, table, 16, 0.25, window), dtype)


# ---- mixture of experts -------------------------------------------------------------------

def routed(topk_ids, seed):
    weights = torch.rand(topk_ids.shape, generator=gen(seed)) + 0.1
    return weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_experts(kt, dtype):
    # 6 experts: 0 is everyone's first choice, 3 and 5 get no token, 4 only one.
    topk_ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 4], [0, 2], [0, 1], [0, 2], [0, 1], [1, 0]])
    hidden_size, inter_size = 48, 40  # neither a multiple of the tiles
    g = gen(10)
    (hidden, gate_up, down), (hidden32, gate_up32, down32) = cast(
        dtype, torch.randn(len(topk_ids), hidden_size, generator=g),
        torch.randn(6, 2 * inter_size, hidden_size, generator=g) * 0.2,
        torch.randn(6, hidden_size, inter_size, generator=g) * 0.2)
    weights = routed(topk_ids, 10)
    out, counts = kt.grouped_experts(hidden, topk_ids, weights, gate_up, down)
    expected, expected_counts = moe.grouped_experts(hidden32, topk_ids, weights, gate_up32, down32)
    assert counts.tolist() == expected_counts.tolist() == [9, 5, 3, 0, 1, 0]
    assert counts.device.type == "cpu"
    check(out, expected, dtype)


@pytest.mark.parametrize("tiles", [None, (16, 32, 16), (32, 128, 64)])
def test_grouped_experts_many_tiles_per_expert_and_no_tokens(kt, tiles):
    """Also with launch shapes benchmarks.triton_tiles may pick (rows, columns, reduction step)."""
    g = gen(11)
    topk_ids = torch.stack([torch.full((150,), 2), torch.randint(0, 2, (150,), generator=g)], 1)
    hidden = torch.randn(150, 72, generator=g)
    gate_up, down = torch.randn(4, 80, 72, generator=g) * 0.2, torch.randn(4, 72, 40, generator=g) * 0.2
    weights = routed(topk_ids, 11)
    tiles = tiles and kt.common.Tiles(*tiles)
    out, counts = kt.grouped_experts(hidden, topk_ids, weights, gate_up, down, tiles=tiles)
    expected, expected_counts = moe.grouped_experts(hidden, topk_ids, weights, gate_up, down)
    assert torch.equal(counts, expected_counts) and counts[2] == 150 and counts[3] == 0
    check(out, expected, torch.float32)
    out, counts = kt.grouped_experts(hidden[:0], topk_ids[:0], weights[:0], gate_up, down)
    assert out.shape == (0, 72) and counts.tolist() == [0, 0, 0, 0]


# ---- end to end ----------------------------------------------------------------------------

def test_engine_with_triton_kernels_matches_torch(kt, tiny, monkeypatch):
    """Qwen2-MoE: a dense and a sparse layer, a shared expert, a sliding window, GQA; a budget
    of 16 tokens per step prefills the longer prompts in chunks."""
    model = tiny.dir("qwen2_moe")
    prompts = random_prompts((5, 17, 30), seed=1)
    expected = make_engine(model, max_num_batched_tokens=16).generate(greedy_requests(prompts, 8))
    calls = dict.fromkeys(OPS, 0)
    for name in OPS:
        def counted(*args, op=getattr(kt, name), name=name, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)
        monkeypatch.setattr(kt, name, counted)
    with forced_triton():
        got = make_engine(model, max_num_batched_tokens=16).generate(greedy_requests(prompts, 8))
    assert all(calls.values()), calls  # every op ran on the Triton path
    for want, have in zip(expected, got):
        assert have.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(have.logprobs, want.logprobs)) < 1e-4
