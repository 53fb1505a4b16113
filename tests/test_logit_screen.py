"""runtime/logit_screen.py: greedy tokens from a bf16 screen of the vocabulary, verified in fp32,
are the fp32 argmax, on either backend of kernels.bf16_weight_linear; rows the bound cannot
clear (near-ties, NaN) take the full logits; and the engine routes only greedy rows without
logprobs through it."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from helpers import make_engine, random_prompts
from kernels import cpu_kernels, matmul
from runtime import Request, SamplingParams
from runtime.logit_screen import CANDIDATES, LogitScreen, screened_argmax

BACKENDS = ["cpp", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", request.param)
    return request.param


def screen_and_reference(hidden, weight, finish=lambda logits: logits):
    calls = []

    def full(rows):
        calls.append(len(rows))
        return finish(F.linear(rows, weight))

    tokens, chosen, misses = screened_argmax(hidden, weight, LogitScreen.of(weight), full, finish)
    assert misses == sum(calls)
    logits = finish(F.linear(hidden, weight))
    # each row's logit at its token, as its fp32 logits have it (NaN where they hold one)
    torch.testing.assert_close(chosen, logits.gather(1, tokens[:, None])[:, 0].float(), equal_nan=True)
    return tokens, misses, logits.argmax(dim=1)


@pytest.mark.parametrize("rows", [1, 5, cpu_kernels.BF16_PANEL_ROWS, cpu_kernels.BF16_PANEL_ROWS + 1, 40])
@pytest.mark.parametrize("vocab,size", [(3000, 64), (517, 96), (CANDIDATES, 32), (7, 16)])
def test_the_screened_token_is_the_fp32_argmax(backend, rows, vocab, size):
    g = torch.Generator().manual_seed(rows * vocab + size)
    weight = torch.randn(vocab, size, generator=g) * 0.05
    hidden = torch.randn(rows, size, generator=g) * 3
    tokens, misses, reference = screen_and_reference(hidden, weight)
    assert torch.equal(tokens, reference)
    if vocab > 3 * CANDIDATES:
        assert misses < rows  # the bound clears typical rows: the screen is not just the fallback


def test_tied_logits_give_the_lowest_id_as_argmax_does(backend):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(400, 32, generator=g)
    weight[[50, 120, 399]] = weight[7].clone()  # four tokens with identical logits on every row
    hidden = weight[7].expand(6, 32) * 2  # ... and those the largest
    tokens, misses, reference = screen_and_reference(hidden, weight)
    assert tokens.tolist() == reference.tolist() == [7] * 6


def test_rows_the_bound_cannot_clear_take_the_full_logits(backend):
    """A flat vocabulary (more than CANDIDATES tokens within bf16's error of the top): the screen
    cannot prove its pick, so the row's full fp32 logits decide."""
    g = torch.Generator().manual_seed(2)
    size = 64
    direction = torch.randn(size, generator=g)
    weight = direction.repeat(300, 1) + 1e-4 * torch.randn(300, size, generator=g)
    hidden = torch.stack([direction, -direction, torch.randn(size, generator=g)])
    tokens, misses, reference = screen_and_reference(hidden, weight)
    assert misses >= 1
    assert torch.equal(tokens, reference)


def test_a_row_with_nan_takes_the_full_logits(backend):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 16, generator=g)
    hidden = torch.randn(3, 16, generator=g)
    hidden[1, 4] = float("nan")
    tokens, misses, reference = screen_and_reference(hidden, weight)
    assert misses == 1
    assert torch.equal(tokens, reference)


def test_fp16_logits_past_its_range_take_the_full_logits(backend):
    """Forty tokens overflow to inf in fp16, the larger ids by more: the screen's bf16 finds
    them apart, but argmax over fp16 logits takes the lowest id of the infs."""
    size = 16
    weight = torch.zeros(64, size)
    for token in range(40):
        weight[token] = (66000 + 100 * token) / size
    weight[40:] = torch.randn(24, size, generator=torch.Generator().manual_seed(4)) * 0.01
    weight = weight.half()
    hidden = torch.ones(2, size, dtype=torch.float16)
    tokens, misses, reference = screen_and_reference(hidden, weight)
    assert tokens.tolist() == reference.tolist() == [0, 0] and misses == 2


def test_an_fp64_head_screens_in_fp64(backend):
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(300, 32, generator=g, dtype=torch.float64)
    hidden = torch.randn(4, 32, generator=g, dtype=torch.float64)
    tokens, _, reference = screen_and_reference(hidden, weight)
    assert torch.equal(tokens, reference)


def test_the_row_norm_bound_is_summed_in_fp32_for_a_half_head():
    """A bf16 norm rounds by up to 2^-9: the bound needs the norm rounded up, never down."""
    weight = (torch.randn(1000, 64, generator=torch.Generator().manual_seed(0)) * 0.1).bfloat16()
    assert LogitScreen.of(weight).max_row_norm >= weight.double().norm(dim=1).max().item()


@pytest.mark.parametrize("rows", [1, 7, cpu_kernels.BF16_PANEL_ROWS, 30])
def test_bf16_weight_linear_is_within_the_bound_the_screen_assumes(backend, rows):
    """Each entry within 2^-8 |w_j|.|x| + 2^-9 |y_j| (+ fp32 accumulation) of the exact product,
    the C++ panel kernel (up to BF16_PANEL_ROWS) and oneDNN alike."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=g) * 4
    fp32_weight = torch.randn(1000, 200, generator=g) * 0.1  # the weight the bf16 one stands for
    weight = fp32_weight.bfloat16()
    got = kernels.bf16_weight_linear(x, weight, kernels.pack_bf16_weight(weight)).double()
    exact = x.double() @ fp32_weight.double().T
    dots = x.double().abs() @ fp32_weight.double().abs().T
    bound = (2.0 ** -8 + 2 * 200 * 2.0 ** -24) * dots + 2.0 ** -9 * got.abs()
    assert ((got - exact).abs() <= bound).all()


def test_the_cpp_backend_takes_few_rows_on_its_panels():
    weight = torch.randn(100, 32).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(weight)
    assert packed is not None and matmul.pack_bf16_weight(weight) is None
    few, many = torch.randn(3, 32), torch.randn(cpu_kernels.BF16_PANEL_ROWS + 1, 32)
    assert cpu_kernels.bf16_weight_linear(few, weight, packed).dtype == torch.float32  # the panels
    assert cpu_kernels.bf16_weight_linear(many, weight, packed).dtype == torch.bfloat16  # oneDNN
    torch.testing.assert_close(cpu_kernels.bf16_weight_linear(few, weight, packed),
                               few @ weight.float().T, rtol=1e-5, atol=1e-5)


def test_the_engine_screens_only_greedy_rows_without_logprobs(tiny):
    """A step mixing greedy, greedy-with-logprobs and sampled rows: every request's output is the
    one the unscreened engine gives, and only the plain greedy rows were screened."""
    prompts = random_prompts((5, 9, 14, 3), seed=4)
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5), SamplingParams(max_tokens=12, n=2)]

    def run(screen):
        engine = make_engine(tiny.dir("llama"), greedy_screen=screen)
        completions = engine.generate([Request(f"r{i}", prompt_token_ids=p, params=q)
                                       for i, (p, q) in enumerate(zip(prompts, params))])
        return [[o.token_ids for o in c.outputs] for c in completions], [c.logprobs for c in completions], engine

    plain, plain_logprobs, unscreened = run(False)
    screened, screened_logprobs, engine = run(True)
    assert screened == plain and screened_logprobs == plain_logprobs
    assert unscreened.stats.screened_rows == 0
    # r0 (and its drafts' rows that took no token), and both samples of r3
    rejected = engine.stats.draft_tokens - engine.stats.accepted_draft_tokens
    assert engine.stats.screened_rows == 12 + 2 * 12 + rejected


def test_a_step_that_samples_no_row_screens_nothing(tiny):
    """A chunk of a prompt alone samples no row: the screen's linear gets none (its C++ kernel
    divided by zero there, killing the process)."""
    prompt = random_prompts((40,), seed=6)[0]

    def tokens(screen):
        engine = make_engine(tiny.dir("llama"), greedy_screen=screen, max_num_batched_tokens=16)
        [completion] = engine.generate([Request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=4))])
        return completion.token_ids

    assert tokens(True) == tokens(False)


def test_a_half_precision_engine_screens_to_the_tokens_it_gives_unscreened(tiny):
    """The candidates' logits are soft-capped in bf16, as the full path's are (transformers'
    rounding): tanh rounds them to a few values near the cap, and the lowest id of the ties
    must win, as argmax has it, whether or not it was a candidate."""
    model_dir = tiny.dir("gemma2", final_logit_softcapping=0.5)
    prompts = random_prompts((20, 23, 26, 29), seed=6)

    def tokens(screen):
        engine = make_engine(model_dir, dtype=torch.bfloat16, greedy_screen=screen)
        return [c.token_ids for c in engine.generate([
            Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=12, ignore_eos=True))
            for i, p in enumerate(prompts)])], engine

    plain, _ = tokens(False)
    screened, engine = tokens(True)
    assert screened == plain and engine.stats.screened_rows > 0


def test_a_negative_logits_scaling_turns_the_screen_off(tiny, monkeypatch):
    """Granite divides the logits by logits_scaling: a negative one reverses their order, so the
    largest lm_head outputs the screen keeps hold the smallest logits. Asked for, the screen is
    refused; by default it stays off, and the tokens are transformers'."""
    overrides = dict(logits_scaling=-2.0)
    with pytest.raises(ValueError, match="greedy_screen: logits_scaling -2.0 reverses"):
        make_engine(tiny.dir("granite", **overrides), greedy_screen=True)
    monkeypatch.setattr(kernels, "bf16_matmul_is_fast", lambda device: True)  # its default: on
    engine = make_engine(tiny.dir("granite", **overrides))
    assert engine.model.logit_screen is None
    prompts = random_prompts((5, 12), seed=8)
    for prompt, ours in zip(prompts, engine.generate([Request(f"r{i}", prompt_token_ids=p,
                                                              params=SamplingParams(max_tokens=8))
                                                      for i, p in enumerate(prompts)])):
        assert ours.token_ids == tiny.greedy("granite", prompt, 8, **overrides)[0]


def test_the_screen_is_refused_under_a_weight_budget(tiny):
    with pytest.raises(ValueError, match="greedy_screen"):
        make_engine(tiny.dir("llama"), greedy_screen=True, weight_budget_bytes=1 << 30)


def test_the_screen_is_made_off_the_calling_thread(tiny):
    """Building the screen's bf16 copies runs parallel ops; on the thread that constructs the
    engine they would leave it an OpenMP pool beside the stepping thread's when `start()` steps
    on another thread, and every step would wait on it (W1-quick through Generate: 37 -> 51 s).
    In a fresh process (whose main thread has no pool yet), constructing the engine leaves no
    threads behind."""
    model = tiny.dir("llama", vocab_size=60000)  # an lm_head large enough for parallel copies
    probe = textwrap.dedent(f"""
        import os, time, torch
        torch.set_num_threads(2)
        from runtime import Engine

        def threads():
            return len(os.listdir("/proc/self/task"))

        before = threads()
        engine = Engine({str(model)!r}, greedy_screen=True, kv_cache_bytes=1 << 22)
        deadline = time.monotonic() + 10  # the setup threads' pools wind down after them
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        print(threads() - before)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, check=True)
    assert done.stdout.split()[-1] == "0", done.stdout + done.stderr


def test_a_soft_cap_that_makes_logits_equal_gives_the_lowest_id_as_argmax_does(backend):
    """Gemma 2's final soft cap: tanh rounds every logit far past the cap to the cap itself,
    so the greedy token is the lowest id of them all, which may be none of the candidates."""
    def soft_cap(logits, cap=1.0):
        return torch.tanh(logits / cap) * cap

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(3000, 64, generator=g) * 0.05
    hidden = torch.randn(6, 64, generator=g) * 400
    tokens, misses, reference = screen_and_reference(hidden, weight, soft_cap)
    assert (soft_cap(F.linear(hidden, weight)) == 1.0).sum(dim=1).min() > CANDIDATES  # saturated
    assert torch.equal(tokens, reference)
    mild = hidden / 400  # no saturation: the screen still answers
    tokens, misses, reference = screen_and_reference(mild, weight, soft_cap)
    assert torch.equal(tokens, reference) and misses < len(mild)
