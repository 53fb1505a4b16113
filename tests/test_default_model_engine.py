"""The engine on the real default model (SmolLM2-135M-Instruct) against transformers on the
same weights. Slow: run with `pytest -m slow`."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import assert_idle_and_clean
from runtime import Engine, Request, SamplingParams
from runtime.default_model import default_model_dir

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, kv_cache_bytes=256 << 20, host_kv_bytes=64 << 20)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def hf_greedy_chats(model_dir, tokenizer):
    """transformers' greedy continuation of each chat: (prompt ids, generated ids)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for messages in CHATS:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            results.append((ids, out[0, len(ids):].tolist()))
    return results


def test_chat_greedy_matches_transformers(engine, tokenizer, hf_greedy_chats):
    completions = engine.generate([Request(f"c{i}", messages=m, params=SamplingParams(max_tokens=MAX_TOKENS))
                                   for i, m in enumerate(CHATS)])
    for completion, (prompt_ids, tokens) in zip(completions, hf_greedy_chats):
        assert completion.error is None
        assert completion.prompt_tokens == len(prompt_ids)
        assert completion.token_ids == tokens
        assert completion.text == tokenizer.decode(tokens, skip_special_tokens=True)
        ends_with_eos = tokens[-1] == tokenizer.eos_token_id
        assert ends_with_eos or len(tokens) == MAX_TOKENS
        assert completion.finish_reason == ("stop" if ends_with_eos else "length")
    assert "Paris" in completions[0].text
    # The same prompts given as token ids give the same tokens.
    by_ids = engine.generate([Request(f"i{i}", prompt_token_ids=ids,
                                      params=SamplingParams(max_tokens=MAX_TOKENS))
                              for i, (ids, _) in enumerate(hf_greedy_chats)])
    assert [c.token_ids for c in by_ids] == [tokens for _, tokens in hf_greedy_chats]
    assert_idle_and_clean(engine)


def test_text_prompt_is_tokenized_like_transformers(engine, tokenizer):
    prompt = "The three largest cities in Europe are"
    [completion] = engine.generate([Request("t", prompt=prompt, params=SamplingParams(max_tokens=4))])
    assert completion.prompt_tokens == len(tokenizer.encode(prompt))


def test_stop_strings_cut_the_text(engine, tokenizer, hf_greedy_chats):
    full_tokens = hf_greedy_chats[2][1]
    full_text = tokenizer.decode(full_tokens, skip_special_tokens=True)
    words = full_text.split()
    assert len(words) >= 6, full_text
    stop = words[len(words) // 2]
    cut = full_text.find(stop)
    assert cut > 0
    never = "\u2603never-in-the-output\u2603"
    stopped, earliest, absent = engine.generate([
        Request("s", messages=CHATS[2], params=SamplingParams(max_tokens=MAX_TOKENS, stop=[stop])),
        Request("e", messages=CHATS[2],
                params=SamplingParams(max_tokens=MAX_TOKENS, stop=[never, stop, words[-1]])),
        Request("a", messages=CHATS[2], params=SamplingParams(max_tokens=MAX_TOKENS, stop=[never]))])
    for completion in (stopped, earliest):
        assert completion.finish_reason == "stop"
        assert completion.text == full_text[:cut]
        assert stop not in completion.text
        # Generation ended at the token that completed the stop string.
        assert completion.token_ids == full_tokens[:len(completion.token_ids)]
        assert stop in tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert stop not in tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=True)
    assert absent.token_ids == full_tokens and absent.text == full_text
