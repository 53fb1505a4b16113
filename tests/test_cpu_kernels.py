"""The C++ CPU kernels (kernels/cpu_kernels.py) against the torch ops they replace on CPU tensors
— paged decode attention, the few-row linear, RMSNorm (with and without the residual add),
RoPE, SiLU-and-mul — their dispatch (BATCHGEN_CPU_KERNELS), their build error, and the engine's
greedy tokens with them against the torch path and transformers."""

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

import kernels
from helpers import greedy_requests, make_engine, random_prompts
from kernels import activation, attention, cpu_kernels, linear_rows, matmul, moe, norm, rope, sampling

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-12, rtol=1e-12),
             torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def paged_case(lengths, heads, kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """(q, k_cache, v_cache, block_tables, context_lens): random K/V in shuffled blocks, with
    spare blocks of other data; tables padded with ids of those spare blocks, which the
    attention must not read."""
    g = gen(seed)
    widths = [-(-length // block_size) for length in lengths]
    num_blocks = sum(widths) + 4
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    spare = ids[:4]
    tables = [ids[4 + sum(widths[:i]):4 + sum(widths[:i + 1])] for i in range(len(lengths))]
    width = max(widths)
    tables = [t + [spare[j % 4] for j in range(width - len(t))] for t in tables]
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    return q, k, v, torch.tensor(tables), torch.tensor(lengths)


def reference(q, k, v, tables, lens, scale, window=None, softcap=None):
    """The torch op, in fp32 for low-precision inputs (its own bf16/fp16 rounding differs)."""
    up = (lambda t: t.float()) if q.dtype in (torch.bfloat16, torch.float16) else (lambda t: t)
    return attention.paged_decode_attention(up(q), up(k), up(v), tables, lens, scale, window, softcap)


def check(q, k, v, tables, lens, scale=0.3, window=None, softcap=None):
    out = cpu_kernels.paged_decode_attention(q, k, v, tables, lens, scale, window, softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.to(torch.float64),
                               reference(q, k, v, tables, lens, scale, window, softcap).to(torch.float64),
                               **TOLERANCE[q.dtype])


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 32), (torch.float32, 8), (torch.bfloat16, 16)],
                         ids=["fp32-vector-path", "fp32-generic-path", "bf16"])
@pytest.mark.parametrize("window", [None, 5])
def test_soft_capped_scores_match_torch(dtype, head_dim, window):
    """Gemma 2's softcap * tanh(score / softcap), in both of the kernel's paths."""
    q, k, v, tables, lens = paged_case([1, 17, 40], 4, 2, head_dim, 16, seed=head_dim, dtype=dtype)
    check(q, k, v, tables, lens, scale=1.0, window=window, softcap=2.0)
    capped = cpu_kernels.paged_decode_attention(q, k, v, tables, lens, 1.0, window, 2.0)
    assert not torch.allclose(capped, cpu_kernels.paged_decode_attention(q, k, v, tables, lens, 1.0, window))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (9, 3), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("window", [None, 1, 5, 20])
def test_matches_torch_on_ragged_contexts(heads, kv_heads, block_size, window):
    # Lengths 1, around block boundaries, and several blocks long.
    lengths = sorted({1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size + 2, 2, 45})
    check(*paged_case(lengths, heads, kv_heads, 16, block_size, seed=heads + block_size),
          window=window)


@pytest.mark.parametrize("head_dim", [8, 24, 64, 80])  # 24, 80: not a multiple of the 16 lanes
def test_head_dims(head_dim):
    check(*paged_case([1, 17, 40], 4, 2, head_dim, 16, seed=head_dim), scale=head_dim ** -0.5)


@pytest.mark.parametrize("scale", [4.0, 40.0])
@pytest.mark.parametrize("block_size", [16, 32])
def test_peaked_softmax(scale, block_size):
    """Scores spread over hundreds: the fp32 path's vector exp across its range, down to where it
    clamps, and rescaling as the running max jumps."""
    check(*paged_case([3, 17, 40, 90], 8, 2, 64, block_size, seed=int(scale)), scale=scale)


def runs_case(lengths, rows_of, heads, kv_heads, head_dim, block_size, dtype, seed):
    """paged_case, where sequence i also has rows_of[i] - 1 rows after its first, each one
    position shorter and reading the same blocks (a drafted sequence's guess rows)."""
    q, k, v, tables, lens = paged_case(lengths, heads, kv_heads, head_dim, block_size, dtype, seed)
    which = [i for i, count in enumerate(rows_of) for _ in range(count)]
    offsets = torch.tensor([j for count in rows_of for j in range(count)])
    q = torch.randn(len(which), heads, head_dim, generator=gen(seed + 1)).to(dtype)
    return q, k, v, tables[which], lens[which] - offsets


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.float32, 24), (torch.bfloat16, 16)],
                         ids=["fp32-vector-path", "fp32-generic-path", "bf16"])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 2.0), (20, 2.0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_rows_that_read_the_same_blocks_are_computed_as_each_alone(dtype, head_dim, window, softcap, block_size):
    """A sequence's rows at positions p + k, ..., p (its guesses) share one pass over its KV in
    the kernel: each row's output is bit-identical to the row computed alone, and matches
    torch. Runs longer than the kernel's 16 rows, runs of one, and runs across block edges."""
    lengths = [40, 3, 17, 70, 9]
    rows_of = [5, 1, 3, 20, 2]  # the 20 rows: more than one run; 3 - 1 = 2 keys left at the end
    case = runs_case(lengths, rows_of, 6, 2, head_dim, block_size, dtype, seed=head_dim + block_size)
    q, k, v, tables, lens = case
    out = cpu_kernels.paged_decode_attention(q, k, v, tables, lens, 0.3, window, softcap)
    alone = torch.cat([cpu_kernels.paged_decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1],
                                                          0.3, window, softcap) for i in range(len(q))])
    assert torch.equal(out, alone)
    check(*case, window=window, softcap=softcap)


def test_rows_whose_blocks_differ_are_not_computed_together():
    """Two rows one position apart whose tables differ in a block the shorter reads (another
    sequence's): each reads its own blocks."""
    q, k, v, tables, lens = paged_case([30, 29], 4, 2, 32, 8, seed=3)
    tables[1, 1] = tables[0, 1]  # the same first, second and fourth blocks...
    tables[1, 0] = tables[0, 0]
    tables[1, 3] = tables[0, 3]  # ...but not the third: its keys differ
    assert tables[1, 2] != tables[0, 2]
    check(q, k, v, tables, lens)


def test_rows_whose_windows_leave_a_gap_are_not_computed_together():
    """Two rows sharing a block, the shorter's window ending before the longer's begins: one pass
    over both would walk the blocks between through the longer's table, entries neither reads and
    the contract lets hold anything. Here they hold an id far past the cache (a read would
    fault); run in a child process, so that a fault fails this test alone."""
    child = subprocess.run([sys.executable, "-c", """if True:
        import torch
        from kernels import attention, cpu_kernels
        k, v, q = torch.randn(8, 4, 1, 16), torch.randn(8, 4, 1, 16), torch.randn(2, 1, 16)
        # Window 4, blocks of 4: the first row reads keys 16-19 (its fifth block), the second
        # keys 4-7 (its second block, the first row's second too); entries 2 and 3 of the
        # first row lie before its window.
        tables = torch.tensor([[0, 1, 10**9, 10**9, 2, 0], [0, 1, 3, 3, 3, 3]])
        lens = torch.tensor([20, 8])
        out = cpu_kernels.paged_decode_attention(q, k, v, tables, lens, 0.3, 4, None)
        tables[0, 2:4] = 0
        expected = attention.paged_decode_attention(q, k, v, tables, lens, 0.3, 4)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        """], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]


@pytest.mark.parametrize("lengths", [[1], [37], [16]])
def test_batch_of_one(lengths):
    check(*paged_case(lengths, 9, 3, 64, 16, seed=lengths[0]))


def test_large_ragged_batch_at_the_default_models_shape():
    lengths = torch.randint(1, 300, (64,), generator=gen(5)).tolist()
    check(*paged_case(lengths, 9, 3, 64, 16, seed=5), scale=64 ** -0.5)


def test_empty_batch():
    q, k, v, _, _ = paged_case([5], 4, 2, 8, 4)
    out = cpu_kernels.paged_decode_attention(q[:0], k, v, torch.zeros(0, 2, dtype=torch.long),
                                               torch.zeros(0, dtype=torch.long), 0.3)
    assert out.shape == (0, 4, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("window", [None, 7])
def test_dtypes(dtype, window):
    check(*paged_case([1, 15, 16, 17, 50], 8, 2, 32, 16, dtype=dtype, seed=3), window=window)


def test_strided_inputs_and_int32_indices():
    """q as a view into a wider projection (as qkv splits make it), caches as views with padded
    rows, int32 block tables and lengths."""
    q, k, v, tables, lens = paged_case([3, 16, 33], 4, 2, 16, 16, seed=7)
    wide_q = torch.randn(3, 4, 40, generator=gen(8))
    wide_q[:, :, 4:20] = q
    strided_q = wide_q[:, :, 4:20]
    wide_k = torch.randn(*k.shape[:3], 24, generator=gen(9))
    wide_v = torch.randn(*v.shape[:3], 24, generator=gen(10))
    wide_k[..., :16], wide_v[..., :16] = k, v
    strided_k, strided_v = wide_k[..., :16], wide_v[..., :16]
    assert not (strided_q.is_contiguous() or strided_k.is_contiguous())
    out = cpu_kernels.paged_decode_attention(strided_q, strided_k, strided_v, tables.int(),
                                               lens.int(), 0.3)
    torch.testing.assert_close(out, attention.paged_decode_attention(q, k, v, tables, lens, 0.3),
                               **TOLERANCE[torch.float32])


def test_padding_past_the_context_is_never_read():
    q, k, v, tables, lens = paged_case([5, 40], 4, 2, 16, 16, seed=11)
    want = attention.paged_decode_attention(q, k, v, tables, lens, 0.3)
    tables[0, 1:] = -1  # not a block at all
    out = cpu_kernels.paged_decode_attention(q, k, v, tables, lens, 0.3)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(lens=torch.tensor([5, 49])), "outside 1..48"),
    (lambda c: c.update(lens=torch.tensor([0, 40])), "outside 1..48"),
    (lambda c: c["tables"].__setitem__((1, 2), 1000), "not a block of the cache"),
    (lambda c: c.update(k=c["k"].transpose(2, 3).contiguous().transpose(2, 3),
                        v=c["v"].transpose(2, 3).contiguous().transpose(2, 3)), "must be contiguous"),
    (lambda c: c.update(q=c["q"][:, :3]), "multiple of kv_heads"),
    (lambda c: c.update(k=c["k"][:, :, :0], v=c["v"][:, :, :0]), "multiple of kv_heads"),
    (lambda c: c.update(v=c["v"].double()), "same dtype"),
    (lambda c: c.update(tables=c["tables"].float()), "must be integer tensors"),
    (lambda c: c.update(lens=c["lens"] + 0.5), "must be integer tensors"),  # was 40.5 read as 40
])
def test_bad_inputs_raise(change, message):
    q, k, v, tables, lens = paged_case([5, 40], 4, 2, 16, 16, seed=12)
    case = dict(q=q, k=k, v=v, tables=tables, lens=lens)
    change(case)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_decode_attention(case["q"], case["k"], case["v"], case["tables"],
                                             case["lens"], 0.3)


# ---- the few-row linear -------------------------------------------------------------------------

# fp32 sums of up to 576 products of N(0, 1) values, in another order than MKL's.
LINEAR_TOLERANCE = dict(atol=1e-4, rtol=1e-5)


def small_rows_linear(x, weight, bias=None):
    return cpu_kernels.build().small_rows_linear(x, weight, bias)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 24, 40])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (576, 960), (70, 33), (5, 3), (17, 1)])
def test_linear_matches_torch(rows, in_features, out_features):
    """The kernel at any row count (dispatch sends it the span kernels/linear_rows.py measures):
    both weight-tile shapes and their remainders; feature sizes that are and are not multiples
    of the 16 lanes and of the tiles."""
    g = gen(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    torch.testing.assert_close(small_rows_linear(x, weight, bias), F.linear(x, weight, bias),
                               **LINEAR_TOLERANCE)
    torch.testing.assert_close(small_rows_linear(x, weight), F.linear(x, weight), **LINEAR_TOLERANCE)


def test_linear_takes_strided_inputs():
    """x as a slice of a wider activation, the weight as a view of a packed projection."""
    g = gen(3)
    wide = torch.randn(4, 100, generator=g)
    packed = torch.randn(50, 64, generator=g)
    x, weight = wide[:, 10:74], packed[10:40]
    assert not x.is_contiguous()
    torch.testing.assert_close(small_rows_linear(x, weight), F.linear(x, weight), **LINEAR_TOLERANCE)


def test_linear_takes_the_kernel_only_for_the_row_counts_of_its_span(monkeypatch):
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(0), range(4, 25)))
    g = gen(4)
    weight = torch.randn(8, 16, generator=g)
    for rows in (4, 24):
        x = torch.randn(rows, 16, generator=g)
        torch.testing.assert_close(cpu_kernels.linear(x, weight), F.linear(x, weight), **LINEAR_TOLERANCE)
    # Fewer or more rows, other dtypes and batched 3-d inputs: torch's matmul, never the kernel.
    monkeypatch.setattr(cpu_kernels, "build", lambda: pytest.fail("the C++ linear was called"))
    for x in (torch.randn(3, 16, generator=g), torch.randn(25, 16, generator=g), torch.randn(0, 16),
              torch.randn(2, 5, 16, generator=g)):
        torch.testing.assert_close(cpu_kernels.linear(x, weight), F.linear(x, weight))
    x = torch.randn(3, 16, generator=g).bfloat16()
    assert torch.equal(cpu_kernels.linear(x, weight.bfloat16()), F.linear(x, weight.bfloat16()))


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 25, 64, 193, 300])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (70, 33), (1, 32), (40, 65)])
def test_the_panel_kernel_matches_torch(rows, in_features, out_features):
    """Row counts around the 12-row register tile and the 192-row passes, outputs that fill
    their last panel and ones that do not, with and without bias."""
    g = gen(rows + in_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    packed = cpu_kernels.pack_panels(weight)
    assert packed.shape == (-(-out_features // cpu_kernels.PANEL), in_features, cpu_kernels.PANEL)
    panel_linear = cpu_kernels.build().panel_linear
    torch.testing.assert_close(panel_linear(x, packed, out_features, bias), F.linear(x, weight, bias),
                               **LINEAR_TOLERANCE)
    torch.testing.assert_close(panel_linear(x, packed, out_features, None), F.linear(x, weight),
                               **LINEAR_TOLERANCE)


def test_the_panel_kernel_takes_no_rows():
    """A step whose rows are all a chunked prompt's asks the screen's linear for none (it
    divided by zero, killing the engine process, when passes were first sized evenly)."""
    weight = torch.randn(40, 16, generator=gen(3))
    for packed in (cpu_kernels.pack_panels(weight), cpu_kernels.pack_panels(weight.bfloat16())):
        out = cpu_kernels.build().panel_linear(torch.randn(0, 16), packed, 40, None)
        assert out.shape == (0, 40)
    assert cpu_kernels.bf16_weight_linear(torch.randn(0, 16), weight.bfloat16(),
                                          cpu_kernels.pack_bf16_weight(weight.bfloat16())).shape == (0, 40)


def test_a_panel_kernel_row_does_not_depend_on_the_rows_beside_it():
    """However the rows split into passes and register tiles, each row sums its products in the
    same order: a row of a 1-, 193- or 385-row call is bit-identical to the row alone."""
    g = gen(7)
    weight = torch.randn(100, 300, generator=g)
    x = torch.randn(385, 300, generator=g)
    panel_linear, packed = cpu_kernels.build().panel_linear, cpu_kernels.pack_panels(weight)
    alone = torch.cat([panel_linear(row[None], packed, 100, None) for row in x])
    for rows in (1, 193, 385):
        assert torch.equal(panel_linear(x[:rows], packed, 100, None), alone[:rows])


@pytest.mark.parametrize("in_features", [1536, 4096])
def test_the_panel_kernel_sums_in_blocks_where_an_input_is_massive(in_features):
    """A massive input early in k (an LLM's outlier channels reach ~1e4) cancelled by one at the
    end: one running sum rounds every later product at the massive value's ulp, an error that
    grows with sqrt(k) (a prompt logprob 1e-3 off transformers'); summed in blocks it does not."""
    g = gen(in_features)
    x = torch.randn(13, in_features, generator=g)
    x[:, 0], x[:, -1] = 1e4, -1e4
    weight = torch.randn(64, in_features, generator=g)
    weight[:, 0] = weight[:, -1] = 1
    y = cpu_kernels.build().panel_linear(x, cpu_kernels.pack_panels(weight), 64, None)
    error = y.double() - x.double() @ weight.double().T
    ulp = torch.finfo(torch.float32).eps * 2 ** 13  # of values in [8192, 16384)
    running_sum_rms = ulp / 12 ** 0.5 * in_features ** 0.5  # k roundings of uniform error
    assert error.pow(2).mean().sqrt() < running_sum_rms / 2


def test_the_panel_kernel_refuses_what_does_not_fit_its_panels():
    panel_linear = cpu_kernels.build().panel_linear
    packed = cpu_kernels.pack_panels(torch.randn(40, 16))  # two panels
    with pytest.raises(RuntimeError, match="does not fill"):
        panel_linear(torch.randn(2, 16), packed, 70, None)
    with pytest.raises(RuntimeError, match="x must be"):
        panel_linear(torch.randn(2, 15), packed, 40, None)
    with pytest.raises(RuntimeError, match="packed must be"):
        panel_linear(torch.randn(2, 16), torch.randn(40, 16), 40, None)


def test_weights_are_packed_only_where_the_panel_kernel_takes_rows_and_only_fp32(monkeypatch):
    weight = torch.randn(8, 16)
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(0), range(1, 5)))
    assert cpu_kernels.pack_linear_weight(weight) is None
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(1, 5), range(1, 5)))
    assert cpu_kernels.pack_linear_weight(weight.bfloat16()) is None
    assert cpu_kernels.pack_linear_weight(weight) is not None
    assert kernels.pack_linear_weight(weight) is not None  # the public op dispatches here
    assert matmul.pack_linear_weight(weight) is None  # torch multiplies the plain weight


def test_linear_bad_inputs_raise():
    with pytest.raises(RuntimeError, match=r"x must be \[rows, in\]"):
        small_rows_linear(torch.randn(2, 16), torch.randn(8, 15))
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        small_rows_linear(torch.randn(2, 16), torch.randn(8, 16), torch.randn(7))


@pytest.mark.parametrize("counts", [[1, 0, 2, 3], [0, 0, 5, 0], [4, 24, 1, 30], [0, 0, 0, 0]])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (70, 33)])
def test_grouped_linear_matches_each_experts_matmul(counts, in_features, out_features):
    """Experts with no rows, one, a tile's worth and more than the dispatch gives it (30)."""
    g = gen(sum(counts) + in_features)
    weight = torch.randn(len(counts), out_features, in_features, generator=g)
    x = torch.randn(sum(counts), in_features, generator=g)
    out = cpu_kernels.build().grouped_small_rows_linear(x, weight, torch.tensor(counts))
    want = torch.cat([F.linear(part, weight[e]) for e, part in enumerate(x.split(counts))])
    torch.testing.assert_close(out, want, **LINEAR_TOLERANCE)


def test_grouped_linear_bad_counts_raise():
    kernel = cpu_kernels.build().grouped_small_rows_linear
    x, weight = torch.randn(5, 16), torch.randn(3, 8, 16)
    with pytest.raises(RuntimeError, match="counts sum to 4, x has 5 rows"):
        kernel(x, weight, torch.tensor([1, 1, 2]))
    with pytest.raises(RuntimeError, match="one row count per expert"):
        kernel(x, weight, torch.tensor([5]))
    with pytest.raises(RuntimeError, match="is negative"):
        kernel(x, weight, torch.tensor([6, -1, 0]))


@pytest.mark.parametrize("largest", [1, 24, 25])
def test_expert_ffn_takes_the_kernel_while_every_expert_has_few_rows(largest, monkeypatch):
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(0), range(4, 25)))
    g = gen(largest)
    counts = torch.tensor([largest, 0, 3, 1])
    gate_up, down = torch.randn(4, 2 * 24, 32, generator=g), torch.randn(4, 32, 24, generator=g)
    rows = torch.randn(int(counts.sum()), 32, generator=g)
    want = moe.expert_ffn(rows, gate_up, down, counts)
    if largest >= 25:  # torch's grouped matmul: the kernel is never called
        monkeypatch.setattr(cpu_kernels, "build", lambda: pytest.fail("the C++ kernel was called"))
    torch.testing.assert_close(cpu_kernels.expert_ffn(rows, gate_up, down, counts), want,
                               **LINEAR_TOLERANCE)


# ---- the per-token ops -----------------------------------------------------------------------------

POINTWISE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# The torch ops round where these do; only the order of the norm's sum of squares differs.
POINTWISE_TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float64: dict(atol=1e-12, rtol=1e-12),
                       torch.bfloat16: dict(atol=1e-2, rtol=1e-2), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", POINTWISE_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 24), (0, 16)])
def test_norms_match_torch(dtype, shape):
    g = gen(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    residual = torch.randn(*shape, generator=g).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    # The norm computes in fp32 for every dtype (fp64 too): fp32's tolerance there.
    tolerance = POINTWISE_TOLERANCE[torch.float32 if dtype == torch.float64 else dtype]
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, norm.rms_norm(x, weight, 1e-5), **tolerance)
    normed, summed = cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = norm.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, **tolerance)


def test_norms_with_a_weight_of_another_dtype_promote_as_torch_does():
    x, weight = torch.randn(3, 32).bfloat16(), torch.randn(32)
    assert torch.equal(cpu_kernels.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
    for ours, want in zip(cpu_kernels.add_rms_norm(x, x, weight, 1e-6), norm.add_rms_norm(x, x, weight, 1e-6)):
        assert torch.equal(ours, want)


@pytest.mark.parametrize("dtype", POINTWISE_DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 9, 64), (5, 3, 64), (4, 2, 6), (0, 2, 8)])
def test_rope_matches_torch(dtype, tokens, heads, head_dim):
    g = gen(tokens * heads + head_dim)
    x = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    cos, sin = (torch.randn(tokens, head_dim, generator=g).to(dtype) for _ in range(2))
    torch.testing.assert_close(cpu_kernels.apply_rope(x, cos, sin), rope.apply_rope(x, cos, sin),
                               **POINTWISE_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", POINTWISE_DTYPES)
@pytest.mark.parametrize("head_dim,rotary", [(64, 48), (16, 4), (8, 0)])
def test_partial_rope_matches_torch(dtype, head_dim, rotary):
    """Only the first `rotary` dims of each head turn (Phi-4-mini's partial rotary)."""
    g = gen(head_dim + rotary)
    x = torch.randn(5, 3, head_dim, generator=g).to(dtype)
    cos, sin = (torch.randn(5, rotary, generator=g).to(dtype) for _ in range(2))
    out = cpu_kernels.apply_rope(x, cos, sin)
    torch.testing.assert_close(out, rope.apply_rope(x, cos, sin), **POINTWISE_TOLERANCE[dtype])
    assert torch.equal(out[..., rotary:], x[..., rotary:])


def test_rope_takes_the_heads_of_a_packed_projection():
    """q and k are views into the packed q|k|v projection, as the model splits them."""
    g = gen(9)
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16, generator=g)
    k = qkv[:, 64:96].view(3, 2, 16)
    cos, sin = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    assert not k.is_contiguous()
    torch.testing.assert_close(cpu_kernels.apply_rope(k, cos, sin), rope.apply_rope(k, cos, sin),
                               **POINTWISE_TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", POINTWISE_DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 7])
def test_write_kv_matches_torch_from_views_of_a_packed_projection(dtype, tokens):
    """k as rope returns it, v a view into the packed q|k|v rows; slots anywhere in the cache."""
    g = gen(tokens + 3)
    blocks, block_size, kv_heads, head_dim = 5, 4, 2, 8
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = qkv[:, 2 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    caches = [torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    ours, want = [c.clone() for c in caches], [c.clone() for c in caches]
    cpu_kernels.write_kv(*ours, slots, k, v)
    attention.write_kv(*want, slots, k, v)
    assert all(torch.equal(a, b) for a, b in zip(ours, want))


@pytest.mark.parametrize("dtype", POINTWISE_DTYPES)
def test_write_kv_into_a_head_major_cache(dtype):
    """KVCache stores each block head by head: a token's heads land apart, at the strides."""
    g = gen(9)
    caches = [torch.randn(5, 4, 3, 8, generator=g).to(dtype) for _ in range(2)]
    stored = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in caches]
    k, v = torch.randn(2, 6, 3, 8, generator=g).to(dtype)
    slots = torch.randperm(20, generator=g)[:6]
    cpu_kernels.write_kv(*stored, slots, k, v)
    attention.write_kv(*caches, slots, k, v)
    assert all(torch.equal(a, b) for a, b in zip(stored, caches))


def test_the_public_write_kv_takes_the_cpp_kernel_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernels, "build", lambda: SimpleNamespace(write_kv=lambda *args: calls.append(args)))
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    k = torch.randn(1, 1, 8)
    kernels.write_kv(*caches, torch.tensor([5]), k, k)
    assert len(calls) == 1 and not caches[0].any()
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "torch")
    kernels.write_kv(*caches, torch.tensor([5]), k, k)
    assert len(calls) == 1 and torch.equal(caches[0][1, 1], k[0])


def test_write_kv_refuses_slots_outside_the_cache():
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    k = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="is not a slot of the cache"):
        cpu_kernels.write_kv(*caches, torch.tensor([3, 8]), k, k)
    with pytest.raises(RuntimeError, match="one slot per token"):
        cpu_kernels.write_kv(*caches, torch.tensor([3]), k, k)


@pytest.mark.parametrize("dtype", POINTWISE_DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (6, 40), (2, 3, 10), (0, 8)])
def test_silu_and_mul_matches_torch(dtype, shape):
    gate_up = (torch.randn(*shape, generator=gen(sum(shape))) * 4).to(dtype)
    out = cpu_kernels.silu_and_mul(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, activation.silu_and_mul(gate_up), **POINTWISE_TOLERANCE[dtype])


def test_silu_and_mul_at_gates_where_exp_leaves_fp32s_range():
    """The vectorised exp clamps its input: silu must still be ~0 far below zero and the gate
    itself far above (exp(-g) over- and underflows there), -0 where exp(-g) is infinite as
    torch has it (a clamped exp left g / 1.7e38: -0.06 at g = -1e37), and NaN at -inf."""
    gate = torch.tensor([-120.0, -100.0, -89.0, -88.5, -87.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.5,
                         88.5, 89.0, 100.0, 120.0, 3.0, -1e37, -3e38, -float("inf"), float("inf"),
                         1e37, -1e32, -1e6, 5.0] * 2)
    gate_up = torch.cat([gate, torch.linspace(-2, 2, len(gate))])[None]
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), activation.silu_and_mul(gate_up),
                               equal_nan=True, **POINTWISE_TOLERANCE[torch.float32])


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 5), (2, 16), (5, 17), (7, 49152), (2, 100003)])
def test_argmax_matches_torch(rows, vocab):
    x = torch.randn(rows, vocab, generator=gen(rows + vocab))
    assert torch.equal(cpu_kernels.argmax(x), sampling.argmax(x))
    assert torch.equal(cpu_kernels.argmax(x.t().contiguous().t()), sampling.argmax(x))  # strided


def test_argmax_breaks_ties_and_meets_nan_and_inf_as_torch_does():
    """Ties go to the first index (within a lane, across lanes, in the tail), a NaN is the
    maximum, a row of -inf answers its first index."""
    x = torch.zeros(6, 40)
    x[0, [7, 23, 33]] = 1.0  # two lanes and the tail tie
    x[1] = float("-inf")
    x[2, [30, 20]] = float("nan")
    x[3, 39] = float("nan")  # only in the tail
    x[4, [5, 37]] = float("inf")
    x[5, [3, 19]] = 2.0  # one lane, twice
    assert cpu_kernels.argmax(x).tolist() == sampling.argmax(x).tolist() == [7, 0, 20, 39, 5, 3]
    few = torch.randint(0, 3, (50, 333), generator=gen(5)).float()  # ties everywhere
    assert torch.equal(cpu_kernels.argmax(few), sampling.argmax(few))


def test_argmax_of_other_dtypes_and_shapes_is_torchs():
    x = torch.randn(3, 40, generator=gen(2))
    for logits in (x.double(), x.bfloat16(), x[0], torch.empty(0, 40)):
        assert torch.equal(cpu_kernels.argmax(logits), sampling.argmax(logits))


def test_pointwise_bad_inputs_raise():
    with pytest.raises(RuntimeError, match="weight must be \\[hidden\\]"):
        cpu_kernels.rms_norm(torch.randn(2, 16), torch.randn(15), 1e-6)
    with pytest.raises(RuntimeError, match="same shape and dtype"):
        cpu_kernels.add_rms_norm(torch.randn(2, 16), torch.randn(3, 16), torch.randn(16), 1e-6)
    for rotary in (7, 10):  # odd; wider than the head
        with pytest.raises(RuntimeError, match="rotary dims\\] \\(even, at most head_dim\\)"):
            cpu_kernels.apply_rope(torch.randn(2, 3, 8), torch.randn(2, rotary), torch.randn(2, rotary))
    with pytest.raises(RuntimeError, match="must be even"):
        cpu_kernels.silu_and_mul(torch.randn(2, 7))


# ---- dispatch and build ----------------------------------------------------------------------

def test_cpu_tensors_take_the_cpp_kernels_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(0), range(1, 9)))
    ops = ["paged_decode_attention", "small_rows_linear", "rms_norm", "add_rms_norm", "apply_rope",
           "silu_and_mul", "grouped_small_rows_linear", "argmax"]
    monkeypatch.setattr(cpu_kernels, "build",
                        lambda: SimpleNamespace(**{op: (lambda *args, op=op: op) for op in ops}))
    g = gen(1)
    x, weight = torch.randn(4, 16, generator=g), torch.randn(16, generator=g)
    q, cos, sin = torch.randn(4, 2, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    case = paged_case([5, 20], 4, 2, 8, 16)
    calls = {
        "paged_decode_attention": (kernels.paged_decode_attention, (*case, 0.3), attention.paged_decode_attention),
        "small_rows_linear": (kernels.linear, (x, torch.randn(4, 16, generator=g)), F.linear),
        "rms_norm": (kernels.rms_norm, (x, weight, 1e-6), norm.rms_norm),
        "add_rms_norm": (kernels.add_rms_norm, (x, x, weight, 1e-6), norm.add_rms_norm),
        "apply_rope": (kernels.apply_rope, (q, cos, sin), rope.apply_rope),
        "silu_and_mul": (kernels.silu_and_mul, (x,), activation.silu_and_mul),
        "argmax": (kernels.argmax, (x,), sampling.argmax),
        # the experts' first matmul, which the stand-in answers
        "grouped_small_rows_linear": (kernels.expert_ffn, (x, torch.randn(2, 8, 16, generator=g),
                                                           torch.randn(2, 16, 4, generator=g),
                                                           torch.tensor([1, 3])), moe.expert_ffn),
    }
    for choice in (None, "cpp"):
        if choice is None:
            monkeypatch.delenv("BATCHGEN_CPU_KERNELS", raising=False)
        else:
            monkeypatch.setenv("BATCHGEN_CPU_KERNELS", choice)
        assert {name: op(*args) for name, (op, args, _) in calls.items()} == {op: op for op in ops}
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "torch")
    for op, args, torch_op in calls.values():
        torch.testing.assert_close(op(*args), torch_op(*args))
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="expected 'cpp' or 'torch'"):
        kernels.paged_decode_attention(*case, 0.3)


def test_a_failed_build_raises_and_names_the_opt_out(monkeypatch):
    def broken_load(**kwargs):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    monkeypatch.delenv("BATCHGEN_CPU_KERNELS", raising=False)
    with pytest.raises(kernels.KernelBuildError, match="g\\+\\+: command not found") as error:
        kernels.prepare("cpu")
    assert "BATCHGEN_CPU_KERNELS=torch" in str(error.value)
    with pytest.raises(kernels.KernelBuildError):
        kernels.paged_decode_attention(*paged_case([5], 4, 2, 8, 16), 0.3)
    # Opted out, or not on a CPU: nothing is built.
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "torch")
    kernels.prepare("cpu")
    monkeypatch.delenv("BATCHGEN_CPU_KERNELS")
    kernels.prepare("meta")


def test_the_build_is_cached_under_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_kernels.build_directory().parent == tmp_path


def test_the_build_runs_the_ninja_pip_installed_whatever_is_on_the_path(tmp_path):
    """`venv/bin/python -m ...` without activating the environment (cron, an IDE) finds the
    system's ninja first, or none; two ninja versions rebuilt the cache over each other's
    builds (their logs hash commands differently). Here PATH's only ninja fails."""
    cpu_kernels.build()  # built and cached, so the child only loads
    foreign = tmp_path / "ninja"
    foreign.write_text("#!/bin/sh\necho 'not the ninja pip installed' >&2\nexit 1\n")
    foreign.chmod(0o755)
    child = subprocess.run([sys.executable, "-c", "from kernels import cpu_kernels; import os; "
                            "print(cpu_kernels.build().panel_linear.__name__, os.environ['PATH'])"],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PATH": str(tmp_path)}, cwd=Path(cpu_kernels.__file__).parent.parent)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["panel_linear", str(tmp_path)]  # PATH as it was, after


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load():
    """torch's build lock is a plain file: a process killed mid-build leaves it, and torch's
    loader alone would wait on it forever. A fresh process must load the kernels regardless."""
    cpu_kernels.build()  # built and cached, so the child only loads
    directory = cpu_kernels.build_directory()
    with open(directory / "build.flock", "w") as turn:  # no build of ours is in its turn now
        fcntl.flock(turn, fcntl.LOCK_EX)
        (directory / "lock").touch()
    child = subprocess.run([sys.executable, "-c", "from kernels import cpu_kernels; "
                            "print(cpu_kernels.build().panel_linear.__name__)"],
                           capture_output=True, text=True, timeout=300,
                           cwd=Path(cpu_kernels.__file__).parent.parent)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "panel_linear"


def _read_only_mount(folder: Path) -> list[str]:
    """A command prefix that runs its command with folder mounted read-only (in a user and mount
    namespace: no root needed), or skips the test where this kernel allows no such namespace."""
    prefix = ["unshare", "-r", "-m", "sh", "-c",
              f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && exec "$@"', "sh"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"unshare is not usable here: {error}")
    if probe.returncode != 0:
        pytest.skip(f"unshare cannot mount here: {probe.stderr.strip()}")
    return prefix


@pytest.mark.parametrize("unwritable", ["read-only mount", "no write access"])
def test_a_prebuilt_build_directory_that_cannot_be_written_is_loaded_not_rebuilt(tmp_path, unwritable):
    """A container image may carry the build (made at image build time) in a folder its workers
    cannot write: a read-only root file system, or another user. The kernels load from a copy
    under the temp folder; the copy's objects keep their times, so nothing is rebuilt."""
    cpu_kernels.build()
    prebuilt = tmp_path / "extensions" / cpu_kernels.build_directory().name
    shutil.copytree(cpu_kernels.build_directory(), prebuilt)
    files = sorted(path.name for path in prebuilt.iterdir())
    (tmp_path / "tmp").mkdir()
    load = "from kernels import cpu_kernels; print(cpu_kernels.build().__file__)"
    if unwritable == "read-only mount":
        command = [*_read_only_mount(prebuilt), sys.executable, "-c", load]
    else:  # as another user would see it: os.access is what the loader asks
        command = [sys.executable, "-c", "import os; real = os.access; os.access = lambda path, mode: "
                   f"(mode != os.W_OK and real(path, mode)) if str(path) == {str(prebuilt)!r} else real(path, mode); " + load]
    child = subprocess.run(command, capture_output=True, text=True, timeout=300,
                           cwd=Path(cpu_kernels.__file__).parent.parent,
                           env={**os.environ, "TORCH_EXTENSIONS_DIR": str(prebuilt.parent),
                                "TMPDIR": str(tmp_path / "tmp")})
    assert child.returncode == 0, child.stderr
    copy = tmp_path / "tmp" / f"batchgen_cpu_kernels-{os.getuid()}" / prebuilt.name
    assert Path(child.stdout.strip()) == copy / "batchgen_cpu_kernels.so"
    assert (copy / "batchgen_cpu_kernels.so").stat().st_mtime == (prebuilt / "batchgen_cpu_kernels.so").stat().st_mtime
    assert sorted(path.name for path in prebuilt.iterdir()) == files



def test_the_copy_of_a_prebuilt_build_is_whole_and_this_users_alone(tmp_path, monkeypatch):
    """A copy killed midway is a staging folder no load takes; a copies folder that others may
    write (or another user made) is refused: its module would run as this user."""
    cpu_kernels.build()
    prebuilt = cpu_kernels.build_directory()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tmp_path / f"batchgen_cpu_kernels-{os.getuid()}"
    mine.mkdir(mode=0o700)
    (mine / "tmp-killed-midway").mkdir()
    (mine / "tmp-killed-midway" / "build.ninja").write_text("")
    copy = cpu_kernels._private_copy(prebuilt)
    assert copy == mine / prebuilt.name
    assert sorted(path.name for path in copy.iterdir()) == sorted(
        path.name for path in prebuilt.iterdir() if path.name not in ("build.flock", "lock"))
    assert cpu_kernels._private_copy(prebuilt) == copy  # made once
    mine.chmod(0o777)
    with pytest.raises(PermissionError, match="is not this user's alone"):
        cpu_kernels._private_copy(prebuilt)


# ---- the engine --------------------------------------------------------------------------------

PROMPTS = random_prompts((1, 5, 16, 17, 33, 64), seed=4)


class DecodeGroupSpy:
    """Stands in for an engine's model in its runner: records the rows of each decode group of
    every forward pass."""

    def __init__(self, engine):
        self.model, self.steps = engine.runner.model, []
        engine.runner.model = self

    def __call__(self, input_ids, positions, attention, kv_layers):
        self.steps.append([len(group.context_lens) for group in attention.decodes])
        return self.model(input_ids, positions, attention, kv_layers)


@pytest.mark.parametrize("family", ["llama", "mistral", "smollm", "qwen3_moe"])  # GQA 2, sliding window, MQA, MoE
def test_engine_greedy_is_token_exact_with_the_torch_path(tiny, family, monkeypatch):
    """Every C++ kernel against the torch ops in a whole engine. The torch path batches decode
    rows of similar length (it pads to the longest); the C++ kernel takes them all in one
    ragged call."""
    completions, groups = {}, {}
    for choice in ("torch", "cpp"):
        monkeypatch.setenv("BATCHGEN_CPU_KERNELS", choice)
        engine = make_engine(tiny.dir(family))
        groups[choice] = DecodeGroupSpy(engine).steps
        completions[choice] = engine.generate(greedy_requests(PROMPTS, 20))
    assert max(len(step) for step in groups["torch"]) > 1
    assert all(len(step) <= 1 for step in groups["cpp"])
    assert max(sum(step) for step in groups["cpp"]) == len(PROMPTS)
    for prompt, ours, theirs in zip(PROMPTS, completions["cpp"], completions["torch"]):
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
        assert ours.token_ids == tiny.greedy(family, prompt, 20)[0]


@pytest.mark.parametrize("family", ["qwen2", "smollm", "qwen2_moe"])  # q|k|v bias, tied LM head, MoE
@pytest.mark.parametrize("panel_rows", [range(1, linear_rows.OPEN_END), range(2, 5)])
def test_engine_greedy_is_token_exact_with_the_panel_kernel(tiny, family, panel_rows, monkeypatch):
    """Every linear's rows in the panel kernel's span on its packed weight (all of them, or some
    with MKL and the few-row kernel taking the rest): the loader packs each one, and greedy
    output stays transformers'."""
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(panel_rows, range(1, 2)))
    engine = make_engine(tiny.dir(family))
    linears = [m for m in engine.model.modules() if hasattr(m, "packed")]
    assert linears and all(m.packed is not None for m in linears)
    for prompt, ours in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, 20))):
        tokens, logprobs = tiny.greedy(family, prompt, 20)
        assert ours.token_ids == tokens
        assert ours.logprobs == pytest.approx(logprobs, abs=1e-4)


class StackVersusLayers:
    """Stands in for an engine's model in its runner: runs each step of decode rows only twice
    more, on copies of the KV cache, through the C++ decode stack and through the Python layers,
    and records whether the hidden states and the written caches are bit-identical."""

    def __init__(self, engine):
        self.model, self.compared = engine.runner.model, []
        engine.runner.model = self

    def __call__(self, input_ids, positions, attention, kv_layers):
        if not attention.prefills:
            hidden, caches = {}, {}
            for path in ("stack", "layers"):
                caches[path] = [(k.clone(), v.clone()) for k, v in kv_layers]
                with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
                    if path == "layers":
                        patch.setattr(self.model, "_stack_for", lambda batch, x: None)
                    hidden[path] = self.model(input_ids, positions, attention, caches[path])
            self.compared.append(torch.equal(hidden["stack"], hidden["layers"]) and all(
                torch.equal(a, b) for pair in zip(caches["stack"], caches["layers"]) for a, b in zip(*pair)))
        return self.model(input_ids, positions, attention, kv_layers)


@pytest.fixture
def panel_at_every_row(monkeypatch):
    """The panel kernel at every row count, so the Python layers a stack is compared with take
    the stack's linears (the measured plan may start the panel span at 2-8 rows, and these
    tests' steps have 1-7 rows; the stack runs below the span too)."""
    measured = cpu_kernels.linear_plan()
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(1, linear_rows.OPEN_END),
                                                               measured.kernel_rows))


# GQA, window, biases, per-head q/k norm, MQA, NoPE, partial rotary, multipliers, GeGLU (gelu
# and tanh), norms around both sublayers, soft-capped scores, two RoPE tables, norms only at the
# sublayers' outputs with q/k norms over all heads at once (OLMo 2, and OLMo 3's sliding layers)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "smollm", "smollm3", "phi3",
                                    "granite", "gemma", "gemma2", "gemma3", "olmo2", "olmo3"])
def test_the_decode_stack_is_bit_identical_to_the_layers(tiny, family, panel_at_every_row):
    engine = make_engine(tiny.dir(family))
    spy = StackVersusLayers(engine)
    for prompt, ours in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, 20))):
        assert ours.token_ids == tiny.greedy(family, prompt, 20)[0]
    assert engine.model._decode_stack  # built, and so run on the steps compared
    assert len(spy.compared) > 10 and all(spy.compared)


# experts (with an all-heads q/k norm and clipping; with a shared expert)
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_layers_the_decode_stack_cannot_run_keep_the_python_path(tiny, family, panel_at_every_row):
    engine = make_engine(tiny.dir(family))
    for prompt, ours in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, 20))):
        assert ours.token_ids == tiny.greedy(family, prompt, 20)[0]
    assert engine.model._decode_stack is False


def test_the_decode_stack_runs_below_the_panel_span_too(tiny, monkeypatch):
    """A plan whose panel span starts at 8 rows (as calibration sometimes has it on a Xeon):
    steps of 1-7 decode rows still run as one C++ call, and greedy output stays transformers'."""
    measured = cpu_kernels.linear_plan()
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(8, linear_rows.OPEN_END),
                                                               measured.kernel_rows))
    engine = make_engine(tiny.dir("qwen3"))
    for prompt, ours in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, 20))):
        assert ours.token_ids == tiny.greedy("qwen3", prompt, 20)[0]
    assert len(PROMPTS) < 8 and engine.model._decode_stack  # built: a step of < 8 rows wanted it


@pytest.mark.parametrize("device,setting", [("cuda", "cpp"), ("cpu", "torch")])
def test_asking_whether_the_decode_stack_runs_builds_nothing_where_cpp_is_unused(device, setting,
                                                                                 monkeypatch):
    """On CUDA (or with BATCHGEN_CPU_KERNELS=torch) the answer is no without building or timing
    the C++ kernels: a GPU box without a compiler would fail its first decode step."""
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", setting)
    monkeypatch.setattr(linear_rows, "_plan", None)
    monkeypatch.setattr(linear_rows, "_resolve", lambda *args: pytest.fail("planned the C++ kernels"))
    hidden = SimpleNamespace(device=torch.device(device), shape=(1, 64))  # a CUDA tensor's face
    assert kernels.backend.decode_stack_runs(hidden) is False


def test_the_decode_stack_runs_only_with_the_cpp_kernels_and_the_panel_rows(tiny, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "torch")
    engine = make_engine(tiny.dir("llama"))
    engine.generate(greedy_requests(PROMPTS, 5))
    assert engine.model._decode_stack is None  # never wanted, so never built
    monkeypatch.delenv("BATCHGEN_CPU_KERNELS")
    monkeypatch.setattr(linear_rows, "_plan", linear_rows.Plan(range(0), range(1, 2)))
    engine = make_engine(tiny.dir("llama"))
    engine.generate(greedy_requests(PROMPTS, 5))
    assert engine.model._decode_stack is None
