"""prompt_logprobs (scoring): each prompt token's logprob and the top k at its position equal
transformers' log-softmax over its logits on the same prompt, when the prompt is prefilled in
chunks, when its blocks are in the prefix cache, after its sequence is evicted mid-prefill, when
it migrates mid-prefill to another engine, and with n > 1."""

import pickle

import pytest
import torch

from helpers import assert_idle_and_clean, collect, make_engine, random_prompts
from runtime import Request, SamplingParams

PROMPTS = random_prompts((1, 2, 15, 16, 17, 45, 90), seed=21)
TOP = 3


def hf_prompt_logprobs(model, prompt, with_ranks=False) -> tuple[list, ...]:
    """transformers' logprob of each prompt token after the first, and the top TOP before it
    (and the range each one's rank may take: 1 + how many tokens are surely likelier, to how
    many are at least as likely within the tolerance)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])
    top = logprobs.topk(TOP, dim=1)
    found = chosen[:, 0].tolist(), [dict(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    if not with_ranks:
        return found
    ranks = zip(((logprobs > chosen + 1e-4).sum(1) + 1).tolist(), (logprobs >= chosen - 1e-4).sum(1).tolist())
    return (*found, list(ranks))


def assert_scored(tiny, family, prompt, completion, tol=1e-4):
    chosen, top, ranks = hf_prompt_logprobs(tiny.hf(family), prompt, with_ranks=True)
    assert completion.error is None, completion.error
    assert completion.prompt_logprobs[0] is None and completion.prompt_top_logprobs[0] is None
    assert len(completion.prompt_logprobs) == len(completion.prompt_top_logprobs) == len(prompt)
    assert completion.prompt_token_ids == prompt
    assert completion.prompt_logprobs[1:] == pytest.approx(chosen, abs=tol)
    assert completion.prompt_ranks[0] is None
    # a rank may differ by the ties that logits' last bits make or break
    assert all(low <= got <= high for got, (low, high) in zip(completion.prompt_ranks[1:], ranks, strict=True))
    for got, want in zip(completion.prompt_top_logprobs[1:], top):
        assert list(got) == list(want)
        assert list(got.values()) == pytest.approx(list(want.values()), abs=tol)


def scoring(i, prompt, **params):
    return Request(f"s{i}", prompt_token_ids=prompt,
                   params=SamplingParams(max_tokens=params.pop("max_tokens", 1), prompt_logprobs=TOP, **params))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_prompt_logprobs_match_transformers_in_chunks(tiny, family):
    """Prefill chunks of 16 tokens: prompts span up to six chunks, beside requests that do not
    score their prompts."""
    engine = make_engine(tiny.dir(family), max_num_batched_tokens=16)
    others = [Request(f"g{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=5)) for i, p in enumerate(PROMPTS)]
    done = {c.id: c for c in engine.generate([scoring(i, p) for i, p in enumerate(PROMPTS)] + others)}
    for i, prompt in enumerate(PROMPTS):
        assert_scored(tiny, family, prompt, done[f"s{i}"])
        assert done[f"s{i}"].completion_tokens == 1
        assert done[f"g{i}"].prompt_logprobs is None
    assert_idle_and_clean(engine)


def test_a_cached_prefix_is_still_scored(tiny):
    engine = make_engine(tiny.dir("qwen2"))
    prompt = PROMPTS[-1]
    engine.generate([Request("warm", prompt_token_ids=prompt, params=SamplingParams(max_tokens=2))])
    [done] = engine.generate([scoring(0, prompt)])
    assert_scored(tiny, "qwen2", prompt, done)
    assert engine.stats.prefill_tokens == 2 * len(prompt)  # computed again, not taken from the cache


def test_eviction_mid_prefill_scores_each_token_once(tiny):
    engine = make_engine(tiny.dir("llama"), max_num_batched_tokens=16)
    prompt = PROMPTS[-1]
    engine.submit(scoring(0, prompt, max_tokens=4))
    engine.step()
    engine.step()
    assert engine.evict("s0") == 1  # 32 of its 90 prompt tokens computed (and 31 scored)
    done = collect(engine)
    assert_scored(tiny, "llama", prompt, done["s0"])


def test_migration_mid_prefill_carries_the_scores(tiny):
    source, target = make_engine(tiny.dir("llama"), max_num_batched_tokens=16), make_engine(tiny.dir("llama"))
    prompt = PROMPTS[-1]
    source.submit(scoring(0, prompt, max_tokens=4))
    source.step()
    state = pickle.loads(pickle.dumps(source.migrate_out("s0", with_kv=True)))
    target.migrate_in(state)
    assert_scored(tiny, "llama", prompt, collect(target)["s0"])


def test_samples_share_one_scored_prompt(tiny):
    engine = make_engine(tiny.dir("qwen3"))
    [done] = engine.generate([scoring(0, PROMPTS[4], max_tokens=6, n=3, temperature=1.0, seed=2)])
    assert len(done.outputs) == 3
    assert_scored(tiny, "qwen3", PROMPTS[4], done)


def test_evicted_samples_recompute_no_more_than_unscored_ones(tiny):
    """Only sample 0 reports the prompt's logprobs: the other samples, evicted after the fork,
    take the prompt from the prefix cache as sample 0 does, instead of rescoring it."""
    prefill, texts = [], []
    for prompt_logprobs in (None, TOP):
        engine = make_engine(tiny.dir("llama"), block_size=4)
        engine.submit(Request("s", prompt_token_ids=PROMPTS[4], params=SamplingParams(
            max_tokens=12, n=3, temperature=1.0, seed=2, ignore_eos=True, prompt_logprobs=prompt_logprobs)))
        for _ in range(4):
            engine.step()
        assert engine.evict("s") == 3
        done = collect(engine)["s"]
        prefill.append(engine.stats.prefill_tokens)
        texts.append([sample.token_ids for sample in done.outputs])
        assert_idle_and_clean(engine)
    assert_scored(tiny, "llama", PROMPTS[4], done)
    assert texts[0] == texts[1] and prefill[0] == prefill[1]


def test_prompt_logprobs_zero_gives_no_top_and_too_many_are_refused(tiny):
    engine = make_engine(tiny.dir("llama"))
    [done] = engine.generate([Request("z", prompt_token_ids=PROMPTS[3],
                                      params=SamplingParams(max_tokens=1, prompt_logprobs=0))])
    assert done.prompt_top_logprobs is None
    assert done.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(tiny.hf("llama"), PROMPTS[3])[0], abs=1e-4)
    with pytest.raises(ValueError, match="prompt_logprobs: must be <= the vocabulary's 256 tokens"):
        engine.submit(Request("big", prompt_token_ids=[3], params=SamplingParams(prompt_logprobs=257)))
