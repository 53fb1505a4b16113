"""Sampling: per-sequence seeds independent of the batch, top-k / top-p / temperature as
transformers applies them, stop conditions, ignore_eos, and validation of every parameter."""

import math
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from helpers import (EOS, CallCounter, assert_idle_and_clean, assert_matches, make_engine, random_prompt,
                     random_prompts, teacher_forced_logprobs)
from runtime import Request, SamplingParams
from runtime import sampling
from runtime.sampling import SampleRow, sample

FAMILY = "llama"
RECORD = random_prompts([37], seed=100)[0]
RECORD_PARAMS = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=123)


def other_requests(count: int = 31) -> list[Request]:
    """Requests of all kinds: greedy, sampled with other seeds and settings, n = 2, stops."""
    rng = random.Random(7)
    requests = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(3, 30))
        elif kind == 1:
            params = SamplingParams(max_tokens=rng.randint(3, 30), temperature=rng.choice([0.5, 1.0, 1.3]),
                                    seed=rng.randrange(10_000), top_k=rng.choice([0, 5, 40]))
        elif kind == 2:
            params = SamplingParams(max_tokens=rng.randint(3, 30), temperature=1.0, top_p=0.7,
                                    seed=rng.randrange(10_000), n=2)
        else:
            params = SamplingParams(max_tokens=rng.randint(3, 30), temperature=0.9, seed=123,
                                    stop_token_ids=(rng.randrange(3, 256),))
        requests.append(Request(f"o{i}", prompt_token_ids=random_prompt(rng.randint(1, 100), rng),
                                params=params))
    return requests


def test_seeded_record_is_the_same_alone_or_in_a_busy_batch(tiny):
    directory = tiny.dir(FAMILY)
    [alone] = make_engine(directory).generate([Request("x", prompt_token_ids=RECORD, params=RECORD_PARAMS)])
    assert len(alone.token_ids) == 20 or alone.finish_reason == "stop"
    greedy = tiny.greedy(FAMILY, RECORD, 20)[0]
    assert alone.token_ids != greedy  # it really sampled

    others = other_requests()
    busy = make_engine(directory, max_num_batched_tokens=96)
    results = busy.generate(others[:16] + [Request("x", prompt_token_ids=RECORD, params=RECORD_PARAMS)]
                            + others[16:])
    assert results[16].id == "x"
    assert results[16].token_ids == alone.token_ids
    assert_idle_and_clean(busy)

    # Every other seeded request too: the same as when it runs alone.
    solo = make_engine(directory)
    for request, in_batch in zip(others, results[:16] + results[17:]):
        if request.params.seed is None:
            continue
        [by_itself] = solo.generate([request])
        assert [o.token_ids for o in by_itself.outputs] == [o.token_ids for o in in_batch.outputs], request.id


@pytest.mark.parametrize("mode", ["suspend", "evict"])
def test_seeded_samples_are_unchanged_by_preemption(tiny, mode):
    directory = tiny.dir(FAMILY)
    rng = random.Random(8)
    requests = [Request(f"p{i}", prompt_token_ids=random_prompt(rng.randint(5, 40), rng),
                        params=SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=i,
                                              n=1 + i % 2, ignore_eos=True, logprobs=0)) for i in range(8)]
    roomy = make_engine(directory).generate(requests)
    tight = make_engine(directory, num_blocks=10, preemption=mode)
    preempt = CallCounter(tight.scheduler, "preempt")
    squeezed = tight.generate(requests)
    assert len(preempt) >= 3
    # Every sample is consistent with the model (its KV was right) ...
    for request, completion in zip(requests, squeezed):
        for output in completion.outputs:
            expected = teacher_forced_logprobs(tiny.hf(FAMILY), request.prompt_token_ids, output.token_ids)
            assert output.logprobs == pytest.approx(expected, abs=1e-4), (completion.id, output.index)
    # ... and the same as without preemption (its RNG stream was kept).
    for a, b in zip(roomy, squeezed):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs], a.id
    assert_idle_and_clean(tight)


# int64's range (OpenAI's and vLLM's seeds) and uint64's: ones that would alias modulo 2**63.
SEEDS = (0, 1, 2, 3, 4, -1, -(1 << 63), (1 << 63) + 1, (1 << 64) - 2)


def test_different_seeds_give_different_samples(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    params = dict(max_tokens=20, temperature=1.5, ignore_eos=True)
    results = engine.generate([Request(f"s{seed}", prompt_token_ids=RECORD,
                                       params=SamplingParams(seed=seed, **params)) for seed in SEEDS])
    assert len({tuple(c.token_ids) for c in results}) == len(SEEDS)
    # A request's n samples draw streams of their own too, apart from other seeds' samples.
    [pair] = engine.generate([Request("pair", prompt_token_ids=RECORD, params=SamplingParams(seed=5, n=2, **params))])
    [next_seed] = engine.generate([Request("next", prompt_token_ids=RECORD,
                                           params=SamplingParams(seed=5 + (1 << 32), **params))])
    assert len({tuple(o.token_ids) for o in (*pair.outputs, next_seed.outputs[0])}) == 3
    again = engine.generate([Request("s3", prompt_token_ids=RECORD, params=SamplingParams(seed=3, **params))])
    assert again[0].token_ids == results[3].token_ids
    # No seed: a fresh random stream each time.
    unseeded = engine.generate([Request(f"u{i}", prompt_token_ids=RECORD, params=SamplingParams(**params))
                                for i in range(2)])
    assert unseeded[0].token_ids != unseeded[1].token_ids


@pytest.mark.parametrize("params", [dict(temperature=1.0, top_k=1, seed=1),
                                    dict(temperature=2.0, top_p=1e-6, seed=2),
                                    # Below what fp32 holds: must not scale to inf or NaN.
                                    dict(temperature=1.0, top_p=5e-324, seed=3),
                                    dict(temperature=1e-300, seed=4),
                                    dict(temperature=5e-324, top_k=7, top_p=0.5, seed=5)],
                         ids=["top_k=1", "tiny-top_p", "smallest-top_p", "tiny-temperature",
                              "smallest-temperature"])
def test_sampling_restricted_to_one_token_equals_greedy(tiny, params):
    prompts = random_prompts([5, 33], seed=101)
    engine = make_engine(tiny.dir(FAMILY))
    results = engine.generate([Request(f"r{i}", prompt_token_ids=p,
                                       params=SamplingParams(max_tokens=24, logprobs=0, **params))
                               for i, p in enumerate(prompts)])
    for prompt, completion in zip(prompts, results):
        assert_matches(completion, *tiny.greedy(FAMILY, prompt, 24), max_tokens=24)


# ---- the sampler's distribution -------------------------------------------------------------

def sampled_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities the sampler draws from, over the whole vocabulary (captured where it
    draws)."""
    seen = []
    real = sampling.draw

    def capture(weights, ids, generator):
        full = torch.zeros(logits.shape[-1], dtype=torch.float64)
        full[slice(None) if ids is None else ids] = weights.double()
        seen.append(full / full.sum())
        return real(weights, ids, generator)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "draw", capture)
        sample(logits[None], [SampleRow(params, np.random.default_rng(0))])
    [probs] = seen
    return probs


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 20, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (0.8, 50, 0.9, 0.0),
    (1.5, 5, 0.3, 0.0), (1.0, 0, 1.0, 0.1), (1.4, 30, 0.95, 0.05)])
def test_filtered_distribution_is_transformers_warpers_in_vllms_order(temperature, top_k,
                                                                      top_p, min_p):
    """vLLM's sampler: temperature, then min-p (a logits processor), then top-k and top-p."""
    logits = torch.randn(256, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = sampled_distribution(logits, params)
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)[0].double()
    assert torch.equal(probs > 0, expected > 0)
    assert torch.allclose(probs, expected, atol=1e-6)
    if top_k:
        assert int((probs > 0).sum()) <= top_k


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_min_p_cuts_before_top_p_measures():
    """min_p drops 0.1 (< 0.3 x 0.4); top_p then measures the rest, renormalised: 0.4/0.9 and
    0.3/0.9 reach 0.75, so 0.2 goes too. Measured the other way round, 0.2 would stay."""
    probs = sampled_distribution(torch.tensor([0.4, 0.3, 0.2, 0.1]).log(),
                                 SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3))
    assert torch.allclose(probs, torch.tensor([4 / 7, 3 / 7, 0, 0], dtype=torch.float64))


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = torch.zeros(4)
    generator = np.random.default_rng(0)
    for top_p, allowed in ((0.5, {0}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        draws = [sample(logits[None], [SampleRow(params, generator)])[0].token_id for _ in range(400)]
        assert set(draws) == allowed, top_p
        if top_p == 1.0:
            counts += torch.bincount(torch.tensor(draws), minlength=4)
    frequencies = counts / counts.sum()
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.07)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, 0, 0.9, 0.0), (1.0, 0, 0.95, 0.0), (1.5, 0, 0.99, 0.0), (3.0, 0, 0.5, 0.0), (0.8, 40, 0.9, 0.02),
    (1.0, 0, 0.9, 0.0001), (3.0, 0, 5e-324, 0.0)])
@pytest.mark.parametrize("shape", ["flat", "peaked", "long tail"])
def test_top_p_over_a_large_vocabulary_keeps_the_set_a_full_sort_keeps(temperature, top_k, top_p, min_p, shape):
    """Top-p looks among the tokens above a probability floor before it sorts the whole
    vocabulary: peaked rows stop at a high floor, flat ones at a low one, and a long tail of
    tokens below every floor that holds more than 1 - top_p falls through to the sort."""
    generator = torch.Generator().manual_seed(len(shape))
    if shape == "long tail":  # 2% of the mass in 31980 tokens of probability below 1e-6
        head, tail = torch.rand(20, generator=generator) + 1, torch.rand(31980, generator=generator) + 1
        logits = torch.cat([(head / head.sum() * 0.98).log(), (tail / tail.sum() * 0.02).log()])
    else:
        logits = torch.randn(32000, generator=generator) * (4.0 if shape == "peaked" else 1.0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].double())
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    expected = TopPLogitsWarper(top_p)(None, scores).softmax(-1)[0]
    probs = sampled_distribution(logits, params)
    assert torch.equal(probs > 0, expected > 0)
    assert torch.allclose(probs, expected, atol=1e-9)


def test_draws_follow_the_weights_and_never_take_a_token_of_weight_zero():
    weights = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.25, 0.0, 0.25, 0.0], dtype=torch.float64)
    generator = np.random.default_rng(7)
    draws = torch.tensor([sampling.draw(weights, None, generator) for _ in range(4000)])
    frequencies = torch.bincount(draws, minlength=8).double() / 4000
    assert torch.allclose(frequencies, weights / weights.sum(), atol=0.03)
    assert not frequencies[weights == 0].any()
    ids = torch.tensor([11, 3, 5])
    assert {sampling.draw(torch.tensor([1.0, 0.0, 1e-300], dtype=torch.float64), ids, generator)
            for _ in range(200)} == {11}


@pytest.mark.parametrize("temperature", [1e39, 1e300])
def test_a_temperature_past_fp32s_range_draws_evenly_among_the_tokens_allowed(temperature):
    logits = torch.randn(8, generator=torch.Generator().manual_seed(0))
    logits[[2, 5]] = float("-inf")  # banned, or masked by a grammar
    row = SampleRow(SamplingParams(temperature=temperature), np.random.default_rng(1))
    draws = [sample(logits[None], [row])[0] for _ in range(600)]
    assert all(token.error is None for token in draws)
    counts = torch.bincount(torch.tensor([token.token_id for token in draws]), minlength=8)
    assert counts[[2, 5]].sum() == 0 and counts.min() == 0 and (counts[[0, 1, 3, 4, 6, 7]] > 60).all()


def test_a_row_with_nothing_to_draw_fails_alone():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    rows = [SampleRow(SamplingParams(temperature=1.0), np.random.default_rng(i)) for i in range(3)]
    first, broken, last = sample(logits, rows)
    assert broken.token_id == -1 and "logits are NaN" in broken.error and not broken.invalid
    assert first.error is None and last.error is None


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(logprobs=2), SamplingParams(logit_bias={3: 1.0}),
                                    SamplingParams(temperature=0.7, top_k=5)],
                         ids=["greedy", "greedy-logprobs", "greedy-biased", "sampled"])
def test_logits_holding_nan_or_only_minus_inf_fail_their_row_as_the_models_fault(params):
    """A greedy row used to take the argmax of NaN logits (the NaN's token, or token 0 where every
    logit is -inf) as a confident answer; every row of them fails instead, and not as the
    request's own doing, and the rows beside them are untouched."""
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    rows = [SampleRow(params, np.random.default_rng(i)) for i in range(4)]
    first, one_nan, all_minus_inf, last = sample(logits, rows)
    assert one_nan.token_id == -1 and "logits are NaN" in one_nan.error and not one_nan.invalid
    assert all_minus_inf.token_id == -1 and "-inf" in all_minus_inf.error and not all_minus_inf.invalid
    assert first.error is None and last.error is None
    if params.greedy:
        assert (first.token_id, last.token_id) == tuple(logits[[0, 3]].argmax(dim=1).tolist())


def test_a_row_whose_allowed_tokens_the_model_left_at_minus_inf_blames_the_models_nan():
    """allowed_token_ids masks the NaN away: every token left is -inf, but by the model's doing."""
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    logits[:, 5] = float("-inf")
    logits[0, 3] = float("nan")
    params = SamplingParams(allowed_token_ids=[5])
    broken, emptied = sample(logits, [SampleRow(params, permitted=torch.tensor([5]))] * 2)
    assert "logits are NaN" in broken.error and not broken.invalid
    assert "no token is left to choose" in emptied.error and emptied.invalid


@pytest.mark.parametrize("penalty", [1e-50, 1e300])
def test_a_penalty_past_fp32s_range_makes_no_nan(penalty):
    """A penalty that rounds to 0 (or inf) in fp32 made a banned token's -inf * 0, a logit of
    0 / 0 and an overflowed inf / inf NaN, which failed the request as the model's fault."""
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(4))
    logits[0, 2], logits[0, 6] = 0.0, float("inf")
    params = SamplingParams(repetition_penalty=penalty, allowed_token_ids=[2, 6, 9])
    row = SampleRow(params, prompt_ids=range(8), permitted=torch.tensor([2, 6, 9]))
    adjusted = logits[0].clone()
    sampling.adjust_logits(adjusted, row)
    assert not adjusted.isnan().any()
    assert adjusted[2] == 0 and adjusted[6] == float("inf") and adjusted[0] == float("-inf")
    assert sample(logits, [row])[0].token_id == 6


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_whose_own_penalties_leave_every_token_at_minus_inf_fails_as_its_own_doing(temperature):
    """repetition_penalty 1e300 over negative logits overflows fp32 to -inf: with every token
    seen, none is left, as when allowed_token_ids and bad_words exclude them all."""
    logits = -torch.rand(2, 16, generator=torch.Generator().manual_seed(2)) - 1
    params = SamplingParams(temperature=temperature, seed=1, repetition_penalty=1e300)
    emptied, fine = sample(logits, [SampleRow(params, np.random.default_rng(0), prompt_ids=range(16)),
                                    SampleRow(params, np.random.default_rng(0), prompt_ids=range(8))])
    assert emptied.invalid and "no token is left to choose" in emptied.error
    assert fine.error is None and fine.token_id >= 8


@pytest.mark.parametrize("screen", [True, False])
def test_a_nan_in_one_tokens_embedding_fails_the_requests_holding_it_and_no_other(tiny, tmp_path, screen):
    """NaN weights (here one embedding row) make NaN logits: the requests that meet them end as
    engine errors instead of text, greedy or sampled, and the others match their solo runs."""
    directory = tmp_path / "poisoned"
    shutil.copytree(tiny.dir("qwen2"), directory)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    poisoned_token = 9
    tensors["model.embed_tokens.weight"][poisoned_token, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    rng = random.Random(3)
    prompts = [[t for t in random_prompt(12, rng) if t != poisoned_token] for _ in range(4)]
    requests = [Request(f"clean{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=8, **kind))
                for i, (p, kind) in enumerate(zip(prompts, [{}, {"logprobs": 1}, {"temperature": 1.0, "seed": 4},
                                                             {"logit_bias": {3: 1.0}}]))]
    requests += [Request(f"poisoned{i}", prompt_token_ids=[*p, poisoned_token], params=r.params)
                 for i, (p, r) in enumerate(zip(prompts, requests))]
    engine = make_engine(directory, greedy_screen=screen)
    done = {c.id: c for c in engine.generate(requests)}
    for request in requests[len(prompts):]:
        got = done[request.id]
        assert got.finish_reason == "error" and "logits are NaN" in got.error and not got.invalid, got
    for request in requests[:len(prompts)]:
        alone = make_engine(directory, greedy_screen=screen).generate([request])[0]
        assert done[request.id].error is None and done[request.id].token_ids == alone.token_ids


class _Topmost:
    """A generator whose uniform draw rounds up to 1 (float64 rounding can take a draw there)."""

    def random(self) -> float:
        return 1.0


def test_a_draw_that_rounds_up_to_the_total_takes_the_last_token_of_weight_above_zero():
    weights = torch.tensor([1.0, 0.3, 0.25, 0.0, 0.0])
    assert sampling.draw(weights, None, _Topmost()) == 2


def test_sampled_logprobs_are_of_the_unprocessed_distribution():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.5, top_k=3, seed=0, logprobs=2)
    rows = [SampleRow(params, np.random.default_rng(i)) for i in range(2)]
    for row, token in enumerate(sample(logits, rows)):
        expected = torch.log_softmax(logits[row], -1)
        assert token.token_id in logits[row].topk(3).indices.tolist()
        assert token.logprob == pytest.approx(expected[token.token_id].item(), abs=1e-6)
        top = expected.topk(2)
        assert token.top_logprobs == pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist())))


# ---- stop conditions ------------------------------------------------------------------------

def no_eos_prompt(tiny, max_tokens, seed=200):
    """A prompt whose greedy continuation does not emit eos within max_tokens."""
    rng = random.Random(seed)
    for _ in range(20):
        prompt = random_prompt(rng.randint(5, 40), rng)
        tokens, _ = tiny.greedy(FAMILY, prompt, max_tokens)
        if len(tokens) == max_tokens and EOS not in tokens:
            return prompt, tokens
    pytest.fail("no prompt without eos found")


def test_stop_token_ids_end_generation_on_that_token(tiny):
    prompt, tokens = no_eos_prompt(tiny, 24)
    index = next(i for i in range(4, 24) if tokens[i] not in tokens[:i])
    later = next(i for i in range(index + 1, 24) if tokens[i] not in tokens[:i])
    engine = make_engine(tiny.dir(FAMILY))
    first, both, sampled = engine.generate([
        Request("a", prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=24, stop_token_ids=[tokens[index]])),
        Request("b", prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=24, stop_token_ids=(tokens[later], tokens[index]))),
        Request("c", prompt_token_ids=prompt, params=SamplingParams(max_tokens=24, temperature=1.0, top_k=1,
                                                                   seed=4, stop_token_ids=[tokens[index]]))])
    for completion in (first, both, sampled):
        assert completion.finish_reason == "stop"
        assert completion.token_ids == tokens[:index + 1]
        assert completion.token_ids[-1] == tokens[index]
        assert completion.outputs[0].stop_reason == tokens[index]


@pytest.mark.parametrize("max_tokens", [1, 7, 30])
def test_max_tokens_gives_exactly_that_many_and_length(tiny, max_tokens):
    prompt, tokens = no_eos_prompt(tiny, 30)
    engine = make_engine(tiny.dir(FAMILY))
    greedy, sampled = engine.generate([
        Request("g", prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens)),
        Request("s", prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                   seed=1, ignore_eos=True))])
    assert greedy.token_ids == tokens[:max_tokens] and greedy.finish_reason == "length"
    assert len(sampled.token_ids) == max_tokens and sampled.finish_reason == "length"
    assert greedy.completion_tokens == max_tokens


def test_context_length_ends_generation(tiny):
    directory = tiny.dir("qwen2", max_position_embeddings=64)
    engine = make_engine(directory)
    assert engine.max_model_len == 64
    prompts = random_prompts([50, 63], seed=300)
    a, b = engine.generate([Request(f"r{i}", prompt_token_ids=p,
                                    params=SamplingParams(max_tokens=100, ignore_eos=True))
                            for i, p in enumerate(prompts)])
    assert len(a.token_ids) == 14 and a.finish_reason == "length"
    assert len(b.token_ids) == 1 and b.finish_reason == "length"


def eos_prompt(tiny, family="qwen3", max_tokens=24):
    """A prompt whose greedy continuation emits eos well before max_tokens."""
    rng = random.Random(400)
    for _ in range(40):
        prompt = random_prompt(rng.randint(1, 40), rng)
        tokens, _ = tiny.greedy(family, prompt, max_tokens)
        if len(tokens) <= max_tokens - 4:
            return prompt, tokens
    pytest.fail("no prompt whose greedy continuation stops early found")


@torch.inference_mode()
def hf_greedy_ignoring_eos(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=[], pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def test_ignore_eos_keeps_generating_past_eos(tiny):
    family = "qwen3"
    prompt, tokens = eos_prompt(tiny, family)
    assert tokens[-1] == EOS
    engine = make_engine(tiny.dir(family))
    stops, ignores = engine.generate([
        Request("stop", prompt_token_ids=prompt, params=SamplingParams(max_tokens=24, logprobs=0)),
        Request("go", prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0))])
    assert stops.token_ids == tokens and stops.finish_reason == "stop"
    assert ignores.finish_reason == "length" and len(ignores.token_ids) == 24
    assert ignores.token_ids[:len(tokens)] == tokens
    assert_matches(ignores, *hf_greedy_ignoring_eos(tiny.hf(family), prompt, 24))


# ---- validation -----------------------------------------------------------------------------

INVALID = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", None),
    ("max_tokens", "8"),
    ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
    ("temperature", None), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", math.nan), ("top_p", "all"),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan),
    ("seed", -(1 << 63) - 1), ("seed", 1 << 64), ("seed", 1.5), ("seed", "7"),
    ("n", 0), ("n", -2), ("n", 2.0),
    ("logprobs", -1), ("logprobs", 1.5), ("logprobs", True),
    ("stop", [""]), ("stop", ""), ("stop", [3]), ("stop", ["ok", None]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1 << 63]), ("stop_token_ids", [1.5]), ("stop_token_ids", ["2"]),
    ("stop_token_ids", 1), ("stop_token_ids", "2"), ("stop", {"a": 1}), ("allowed_token_ids", 3), ("bad_words", 7),
    ("stop_token_ids", np.array(5)), ("allowed_token_ids", np.array(5)), ("stop", np.array("END")),
    ("ignore_eos", "yes"), ("ignore_eos", 1),
    ("repetition_penalty", 0), ("repetition_penalty", -1.2), ("repetition_penalty", math.nan),
    ("frequency_penalty", 2.5), ("frequency_penalty", "0.1"), ("presence_penalty", -2.01),
    ("presence_penalty", math.inf), ("truncate_prompt_tokens", 0), ("prompt_logprobs", -1),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_sampling_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_edge_values_are_accepted_and_normalised():
    params = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=0, seed=0, n=1, logprobs=0,
                            stop="END", stop_token_ids=[5, 6])
    assert params.stop == ("END",) and params.stop_token_ids == (5, 6)
    assert params.greedy
    assert not SamplingParams(temperature=1e-3).greedy
    hash(SamplingParams(stop=["a", "b"]))  # lists normalised: hashable
    none = SamplingParams(stop=None, stop_token_ids=None, allowed_token_ids=None, bad_words=None)
    assert none == SamplingParams()  # None is none, as in vLLM (and JSON's null)


def test_numpy_numbers_are_taken_as_the_python_numbers_they_hold():
    """A temperature read from a numpy column (np.float32) was refused as "must be a finite number",
    np.int64 max_tokens or token ids as "must be an integer", and np.float64 stayed numpy in the
    params (other reprs, hashes that may differ): the engine's other arguments take numpy numbers."""
    from_numpy = SamplingParams(
        max_tokens=np.int64(8), temperature=np.float32(0.5), top_p=np.float16(0.5), top_k=np.int32(3),
        min_p=np.float64(0.25), seed=np.uint64(7), n=np.int8(2), logprobs=np.int64(1),
        stop_token_ids=np.array([5, 6]), allowed_token_ids=[np.int64(1), 2], logit_bias={np.int64(4): np.float32(-2)},
        ignore_eos=np.True_, repetition_penalty=np.longdouble(1.5), presence_penalty=np.float32(0.5))
    plain = SamplingParams(max_tokens=8, temperature=0.5, top_p=0.5, top_k=3, min_p=0.25, seed=7, n=2,
                           logprobs=1, stop_token_ids=[5, 6], allowed_token_ids=[1, 2], logit_bias={4: -2.0},
                           ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5)
    assert from_numpy == plain and hash(from_numpy) == hash(plain) and repr(from_numpy) == repr(plain)
    for value in vars(from_numpy).values():
        for item in value if isinstance(value, tuple) else (value,):
            for number in item if isinstance(item, tuple) else (item,):
                assert type(number).__module__ == "builtins", (number, type(number))
    for field, value in [("max_tokens", np.float64(2.0)), ("temperature", np.float32("nan")), ("n", np.array(2)),
                         ("ignore_eos", np.int64(1)), ("top_k", np.bool_(True))]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


@pytest.mark.parametrize("temperature", [0.05, 0.1, 0.7])
def test_weights_far_below_the_top_are_zero_and_the_rest_exact(temperature):
    """A low temperature puts most of the vocabulary below exp's fp32 range (torch's exp is slow
    there: those weights are 0 without it); a token a grammar masks (-inf) weighs 0 too."""
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 4
    logits[::7] = float("-inf")
    weights, ids = sampling.filtered_weights(logits.clone(), SamplingParams(temperature=temperature))
    assert ids is None and torch.isfinite(weights).all()
    expected = ((logits - logits.max()).double() / temperature).exp()
    assert (weights[::7] == 0).all()
    assert torch.allclose(weights.double(), expected, rtol=1e-5, atol=1e-37)
    assert (weights[expected < 1e-38] == 0).all()


def test_logits_a_penalty_pushed_to_inf_are_drawn_alone_and_alike():
    """repetition_penalty 1e-44 divides a positive logit past fp32's range: inf - inf would be
    NaN and fail the row; those tokens are the likeliest, so they alone are drawn."""
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0]])
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-44)
    rows = [SampleRow(params, np.random.default_rng(0), prompt_ids=[1, 2], output_ids=[])]
    draws = {sample(logits, rows)[0].token_id for _ in range(200)}
    assert draws == {1, 2}  # 2.0 and 0.5 divided by 1e-44: inf (0.5 / 1e-44 too)
    greedy = SampleRow(SamplingParams(repetition_penalty=1e-44), prompt_ids=[1, 2], output_ids=[])
    assert sample(logits, [greedy])[0].token_id == 1


def test_a_row_the_engine_cannot_build_fails_its_request_alone(tiny, monkeypatch):
    engine = make_engine(tiny.dir(FAMILY))
    build = engine._sample_row_for

    def breaking(seq):
        if seq.request_id == "broken":
            raise OverflowError("Overflow when unpacking long long")
        return build(seq)

    monkeypatch.setattr(engine, "_sample_row_for", breaking)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    done = {c.id: c for c in engine.generate([Request(name, prompt_token_ids=RECORD, params=params)
                                              for name in ("broken", "fine")])}
    assert "OverflowError" in done["broken"].error and not done["broken"].invalid
    assert done["fine"].error is None and len(done["fine"].token_ids) == 5
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_under_a_grammar_logprobs_are_over_the_tokens_it_allows(temperature):
    """vLLM masks a structured output's logits before it takes logprobs; a row without a
    grammar keeps the model's whole distribution."""
    logits = torch.randn(2, 70, generator=torch.Generator().manual_seed(3))
    allowed_ids = [3, 17, 40, 64]
    bitmask = torch.zeros(3, dtype=torch.int32)
    for token in allowed_ids:
        bitmask[token // 32] |= 1 << (token % 32)
    params = SamplingParams(temperature=temperature, seed=1, logprobs=2)
    generator = np.random.Generator(np.random.PCG64(1)) if temperature else None
    with_grammar = SamplingParams(temperature=temperature, seed=1, logprobs=2, choice=["x"])  # the mask is the row's
    structured, plain = sample(logits.clone(), [SampleRow(with_grammar, generator, allowed=bitmask),
                                                SampleRow(params, generator)])
    masked = torch.full((70,), float("-inf"))
    masked[allowed_ids] = logits[0, allowed_ids]
    want = torch.log_softmax(masked, -1)
    assert structured.token_id in allowed_ids
    assert structured.logprob == pytest.approx(want[structured.token_id].item(), abs=1e-6)
    assert set(structured.top_logprobs) <= set(allowed_ids)
    assert plain.logprob == pytest.approx(torch.log_softmax(logits[1], -1)[plain.token_id].item(), abs=1e-6)


def test_only_a_grammar_that_allows_nothing_but_its_end_may_end_before_min_tokens():
    """min_tokens bans the ending tokens; where the grammar allows nothing else, it may end (as
    vLLM lets it); where allowed_token_ids took the grammar's other tokens away, nothing is left."""
    def bitmask(tokens):
        mask = torch.zeros(2, dtype=torch.int32)
        for token in tokens:
            mask[token // 32] |= 1 << (token % 32)
        return mask

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    ending = torch.tensor([EOS])
    params = SamplingParams(choice=["x"], min_tokens=3)
    only_its_end, emptied, free = sample(logits, [
        SampleRow(params, allowed=bitmask([EOS]), banned=ending),
        SampleRow(params, allowed=bitmask([EOS, 5, 6]), banned=ending, permitted=torch.tensor([EOS, 9])),
        SampleRow(params, allowed=bitmask([EOS, 5, 6]), banned=ending)])
    assert only_its_end.token_id == EOS and only_its_end.error is None
    assert emptied.invalid and "no token is left to choose" in emptied.error
    assert free.token_id in (5, 6)
