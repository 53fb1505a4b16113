"""Repetition, frequency and presence penalties: the repetition penalty token-exact with
transformers' greedy `generate(repetition_penalty=...)`, frequency and presence penalties
(OpenAI's definition, which transformers lacks) against transformers' logits with the penalties
applied by hand, and penalised rows mixed into batches of screened greedy and sampled rows."""

from collections import Counter

import pytest
import torch

from helpers import assert_matches, make_engine, random_prompts
from runtime import Request, SamplingParams
from runtime.sampling import SampleRow, sample

PROMPTS = random_prompts((3, 12, 30, 57), seed=11)
MAX_TOKENS = 24


def hf_generate(model, prompt, **kwargs) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation under its logits processors, and each chosen token's
    log-probability under the raw model (output_logits are taken before the processors)."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_moe"])
def test_repetition_penalty_matches_transformers(tiny, family):
    """With and without logprobs, beside plain greedy rows (which the bf16 screen takes, but
    not penalised ones) and a sampled penalised row, in one batch."""
    engine = make_engine(tiny.dir(family), greedy_screen=True)
    def requests(prefix, **params):
        return [Request(f"{prefix}{i}", prompt_token_ids=p,
                        params=SamplingParams(max_tokens=MAX_TOKENS, **params)) for i, p in enumerate(PROMPTS)]

    penalised = requests("p", repetition_penalty=1.6, logprobs=0) + requests("q", repetition_penalty=1.6)
    plain = requests("g")
    sampled = Request("s", prompt_token_ids=PROMPTS[1], params=SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, seed=5, repetition_penalty=0.8))
    got = {c.id: c for c in engine.generate(penalised + plain + [sampled])}
    hf = tiny.hf(family)
    changed = 0
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = hf_generate(hf, prompt, repetition_penalty=1.6)
        assert_matches(got[f"p{i}"], tokens, logprobs, max_tokens=MAX_TOKENS)
        assert got[f"q{i}"].token_ids == tokens
        plain_tokens = hf_generate(hf, prompt)[0]
        assert got[f"g{i}"].token_ids == plain_tokens
        changed += plain_tokens != tokens
    assert changed, "the penalty changed no output: the test would pass without it"
    assert got["s"].error is None and got["s"].completion_tokens == MAX_TOKENS
    # The screen took the plain rows only.
    assert engine.stats.screened_rows == sum(got[f"g{i}"].completion_tokens for i in range(len(PROMPTS)))


def openai_penalised(logits: torch.Tensor, output: list[int], frequency: float,
                     presence: float) -> torch.Tensor:
    """OpenAI's definition, in float64: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    penalised = logits.double().clone()
    for token, count in Counter(output).items():
        penalised[token] -= count * frequency + presence
    return penalised


@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 2.0), (0.7, -0.4)])
def test_frequency_and_presence_penalties_follow_openai(tiny, frequency, presence):
    """Each greedy token is the argmax of transformers' logits (teacher-forced on the engine's
    output) penalised by hand for the output so far; prompt tokens are not penalised."""
    family = "qwen2"
    engine = make_engine(tiny.dir(family))
    params = SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=frequency, presence_penalty=presence,
                            ignore_eos=True)
    completions = engine.generate([Request(f"r{i}", prompt_token_ids=p, params=params)
                                   for i, p in enumerate(PROMPTS)])
    hf = tiny.hf(family)
    changed = 0
    for prompt, completion in zip(PROMPTS, completions):
        output = completion.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
        for step, token in enumerate(output):
            expected = openai_penalised(logits[step], output[:step], frequency, presence).argmax().item()
            assert token == expected, (completion.id, step)
        changed += output != tiny.greedy(family, prompt, MAX_TOKENS)[0]
    assert changed, "the penalties changed no output: the test would pass without them"


def test_penalties_come_before_temperature_and_top_k():
    """vLLM's order: with top_k=1 after them, a sampled row draws the penalised argmax."""
    logits = torch.tensor([[3.0, 2.9, 2.0, -1.0, -1.2]] * 4)
    rows = [SampleRow(SamplingParams(repetition_penalty=2.0), prompt_ids=[0]),  # 3.0 / 2
            SampleRow(SamplingParams(presence_penalty=0.2), output_ids=[0]),
            SampleRow(SamplingParams(frequency_penalty=1.2, temperature=1.0, top_k=1),
                      torch.Generator().manual_seed(0), prompt_ids=[1], output_ids=[0, 1, 1]),
            SampleRow(SamplingParams(repetition_penalty=3.0, logprobs=0), output_ids=[3])]
    tokens = sample(logits, rows)
    assert [t.token_id for t in tokens] == [1, 1, 2, 0]
    # A negative logit is multiplied by the repetition penalty: -1.0 * 3 stays below -1.2.
    assert sample(torch.tensor([[-5.0, -5.0, -5.0, -1.0, -1.2]]), rows[3:])[0].token_id == 4
    # Logprobs stay those of the model's own distribution.
    assert tokens[3].logprob == pytest.approx(torch.log_softmax(logits[3], -1)[0].item())
