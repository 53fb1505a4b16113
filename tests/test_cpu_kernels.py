"""The C++ paged decode attention (kernels/cpu_attention.py) against the torch op it replaces on
CPU tensors, its dispatch (BATCHGEN_CPU_ATTENTION), its build error, and the engine's greedy
tokens with it against the torch path and transformers."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension

import kernels
from helpers import greedy_requests, make_engine, random_prompts
from kernels import attention, cpu_attention

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


def reference(q, k, v, tables, lens, scale, window=None):
    """The torch op, in fp32 for low-precision inputs (its own bf16/fp16 rounding differs)."""
    up = (lambda t: t.float()) if q.dtype in (torch.bfloat16, torch.float16) else (lambda t: t)
    return attention.paged_decode_attention(up(q), up(k), up(v), tables, lens, scale, window)


def check(q, k, v, tables, lens, scale=0.3, window=None):
    out = cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.to(torch.float64),
                               reference(q, k, v, tables, lens, scale, window).to(torch.float64),
                               **TOLERANCE[q.dtype])


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


@pytest.mark.parametrize("lengths", [[1], [37], [16]])
def test_batch_of_one(lengths):
    check(*paged_case(lengths, 9, 3, 64, 16, seed=lengths[0]))


def test_large_ragged_batch_at_the_default_models_shape():
    lengths = torch.randint(1, 300, (64,), generator=gen(5)).tolist()
    check(*paged_case(lengths, 9, 3, 64, 16, seed=5), scale=64 ** -0.5)


def test_empty_batch():
    q, k, v, _, _ = paged_case([5], 4, 2, 8, 4)
    out = cpu_attention.paged_decode_attention(q[:0], k, v, torch.zeros(0, 2, dtype=torch.long),
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
    out = cpu_attention.paged_decode_attention(strided_q, strided_k, strided_v, tables.int(),
                                               lens.int(), 0.3)
    torch.testing.assert_close(out, attention.paged_decode_attention(q, k, v, tables, lens, 0.3),
                               **TOLERANCE[torch.float32])


def test_padding_past_the_context_is_never_read():
    q, k, v, tables, lens = paged_case([5, 40], 4, 2, 16, 16, seed=11)
    want = attention.paged_decode_attention(q, k, v, tables, lens, 0.3)
    tables[0, 1:] = -1  # not a block at all
    out = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.3)
    torch.testing.assert_close(out, want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(lens=torch.tensor([5, 49])), "outside 1..48"),
    (lambda c: c.update(lens=torch.tensor([0, 40])), "outside 1..48"),
    (lambda c: c["tables"].__setitem__((1, 2), 1000), "not a block of the cache"),
    (lambda c: c.update(k=c["k"].transpose(2, 3).contiguous().transpose(2, 3),
                        v=c["v"].transpose(2, 3).contiguous().transpose(2, 3)), "must be contiguous"),
    (lambda c: c.update(q=c["q"][:, :3]), "multiple of kv_heads"),
    (lambda c: c.update(v=c["v"].double()), "same dtype"),
])
def test_bad_inputs_raise(change, message):
    q, k, v, tables, lens = paged_case([5, 40], 4, 2, 16, 16, seed=12)
    case = dict(q=q, k=k, v=v, tables=tables, lens=lens)
    change(case)
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.paged_decode_attention(case["q"], case["k"], case["v"], case["tables"],
                                             case["lens"], 0.3)


# ---- dispatch and build ----------------------------------------------------------------------

def test_cpu_tensors_take_the_cpp_kernel_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(cpu_attention, "build",
                        lambda: SimpleNamespace(paged_decode_attention=lambda *args: "cpp"))
    case = paged_case([5, 20], 4, 2, 8, 16)
    monkeypatch.delenv("BATCHGEN_CPU_ATTENTION", raising=False)
    assert kernels.paged_decode_attention(*case, 0.3) == "cpp"
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION", "cpp")
    assert kernels.paged_decode_attention(*case, 0.3) == "cpp"
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION", "torch")
    torch.testing.assert_close(kernels.paged_decode_attention(*case, 0.3),
                               attention.paged_decode_attention(*case, 0.3))
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="expected 'cpp' or 'torch'"):
        kernels.paged_decode_attention(*case, 0.3)


def test_a_failed_build_raises_and_names_the_opt_out(monkeypatch):
    def broken_load(**kwargs):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(cpu_attention, "_module", None)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    monkeypatch.delenv("BATCHGEN_CPU_ATTENTION", raising=False)
    with pytest.raises(kernels.KernelBuildError, match="g\\+\\+: command not found") as error:
        kernels.prepare("cpu")
    assert "BATCHGEN_CPU_ATTENTION=torch" in str(error.value)
    with pytest.raises(kernels.KernelBuildError):
        kernels.paged_decode_attention(*paged_case([5], 4, 2, 8, 16), 0.3)
    # Opted out, or not on a CPU: nothing is built.
    monkeypatch.setenv("BATCHGEN_CPU_ATTENTION", "torch")
    kernels.prepare("cpu")
    monkeypatch.delenv("BATCHGEN_CPU_ATTENTION")
    kernels.prepare("meta")


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

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("family", ["llama", "mistral", "smollm"])  # GQA 2, sliding window, MQA
def test_engine_greedy_is_token_exact_with_the_torch_path(tiny, family, monkeypatch):
    """The torch path batches decode rows of similar length (it pads to the longest); the C++
    kernel takes them all in one ragged call."""
    completions, groups = {}, {}
    for choice in ("torch", "cpp"):
        monkeypatch.setenv("BATCHGEN_CPU_ATTENTION", choice)
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
