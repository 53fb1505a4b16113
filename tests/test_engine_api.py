"""The engine's caller-facing API: bad prompts become error completions, submit from many
threads with the background loop, poll / completions() / generate, timings, admission orders,
engine-level argument checks, and a failing loop surfacing to callers."""

import json
import random
import re
import shutil
import signal
import threading
import time

import pytest
import torch

from helpers import (CallCounter, assert_idle_and_clean, assert_matches, greedy_requests, make_engine,
                     random_prompt, random_prompts)
from runtime import Engine, Request, SamplingParams
from runtime.step_lock import StepLock

FAMILY = "qwen2"
MAX_TOKENS = 12


def reference(tiny, prompt, max_tokens=MAX_TOKENS, **overrides):
    return tiny.greedy(FAMILY, prompt, max_tokens, **overrides)


# ---- bad input -----------------------------------------------------------------------------

BAD = {
    "empty": dict(prompt_token_ids=[]),
    "context-length": dict(prompt_token_ids=list(range(3, 67))),  # 64 tokens, context 64
    "far-too-long": dict(prompt_token_ids=[5] * 500),
    "out-of-vocab": dict(prompt_token_ids=[5, 256, 7]),
    "way-out-of-vocab": dict(prompt_token_ids=[10**12]),
    "negative": dict(prompt_token_ids=[5, -1]),
    "float": dict(prompt_token_ids=[5, 6.0]),
    "string": dict(prompt_token_ids=[5, "6"]),
    "bool": dict(prompt_token_ids=[5, True]),
    "none-id": dict(prompt_token_ids=[None]),
    "nested": dict(prompt_token_ids=[[5, 6]]),
    "prompt-and-ids": dict(prompt="hello", prompt_token_ids=[5, 6]),
    "nothing": dict(),
    "text-without-tokenizer": dict(prompt="Once upon a time"),
    "chat-without-tokenizer": dict(messages=[{"role": "user", "content": "hi"}]),
}
MESSAGE_WORDS = {
    "empty": "empty", "context-length": "64", "far-too-long": "500", "out-of-vocab": "256",
    "way-out-of-vocab": "256", "negative": "integers", "float": "integers", "string": "integers",
    "bool": "integers", "none-id": "integers", "nested": "integers", "prompt-and-ids": "exactly one",
    "nothing": "exactly one", "text-without-tokenizer": "tokenizer", "chat-without-tokenizer": "tokenizer",
}


def test_bad_prompts_become_error_completions_and_the_rest_run(tiny):
    directory = tiny.dir(FAMILY, max_position_embeddings=64)
    engine = make_engine(directory)
    assert engine.max_model_len == 64
    good = random_prompts([10, 63, 30], seed=1)  # 63 tokens: the longest prompt that fits
    requests = []
    for i, (name, fields) in enumerate(BAD.items()):
        requests.append(Request(name, params=SamplingParams(max_tokens=MAX_TOKENS), **fields))
        if i % 5 == 0:
            requests.append(Request(f"g{i // 5}", prompt_token_ids=good[i // 5],
                                    params=SamplingParams(max_tokens=MAX_TOKENS, logprobs=0)))
    results = engine.generate(requests)
    assert [c.id for c in results] == [r.id for r in requests]
    for completion in results:
        if completion.id.startswith("g"):
            prompt = good[int(completion.id[1:])]
            # The context (64) ends generation: one token for the 63-token prompt.
            budget = min(MAX_TOKENS, 64 - len(prompt))
            tokens, logprobs = reference(tiny, prompt, budget, max_position_embeddings=64)
            assert_matches(completion, tokens, logprobs)
            if len(prompt) == 63:
                assert len(tokens) == 1 and completion.finish_reason == "length"
            continue
        assert completion.finish_reason == "error", completion.id
        assert completion.error and MESSAGE_WORDS[completion.id] in completion.error, \
            (completion.id, completion.error)
        assert completion.token_ids == [] and completion.completion_tokens == 0
        assert completion.text == ""
    assert_idle_and_clean(engine)
    # The engine is still healthy afterwards, and the ids can be used again.
    [again] = engine.generate([Request("empty", prompt_token_ids=good[0],
                                       params=SamplingParams(max_tokens=MAX_TOKENS))])
    assert again.token_ids == reference(tiny, good[0], max_position_embeddings=64)[0]


def test_text_utf8_cannot_hold_is_an_error_completion(tiny_chat):
    engine = make_engine(tiny_chat.dir(FAMILY))
    bad_prompt, bad_message, ok = engine.generate([
        Request("p", prompt="Hi \ud800"),  # a lone surrogate, as JSON's "\\ud800" makes
        Request("m", messages=[{"role": "user", "content": "\udcff"}]),
        Request("ok", prompt="Hi \U0001F600", params=SamplingParams(max_tokens=3))])
    assert bad_prompt.finish_reason == bad_message.finish_reason == "error"
    assert "prompt is not valid Unicode text (lone surrogate at index 3)" == bad_prompt.error
    assert "messages[0].content is not valid Unicode text" in bad_message.error
    assert ok.error is None and ok.completion_tokens >= 1
    assert_idle_and_clean(engine)


def test_messages_a_chat_template_refuses_are_an_error_completion(tiny_chat, tmp_path):
    # Like Llama-2's or Mistral's: templates raise on roles out of turn.
    model_dir = tmp_path / "strict-template"
    shutil.copytree(tiny_chat.dir(FAMILY), model_dir)
    (model_dir / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    engine = make_engine(model_dir)
    refused, ok = engine.generate([
        Request("refused", messages=[{"role": "assistant", "content": "Hi"}]),
        Request("ok", messages=[{"role": "user", "content": "Hi"}], params=SamplingParams(max_tokens=3))])
    assert refused.finish_reason == "error"
    assert refused.error == "messages: the model's chat template refused them (Conversation must start with user)"
    assert ok.error is None and ok.completion_tokens >= 1
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("template, joins", [
    # takes a string: the parts are joined by newlines (vLLM's rule)
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}", True),
    # loops over the parts itself, as Gemma 3's and Mistral Small 3.1's do
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
     "{% else %}{% for part in m['content'] %}{{ part['text'] | trim }}{% endfor %}{% endif %}<|im_end|>\n"
     "{% endfor %}", False),
    # the same with a training template's {% generation %} tag, which transformers' jinja knows
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
     "{{ m['content'] }}{% endgeneration %}{% elif m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}<|im_end|>\n{% endfor %}", False),
    # through a variable named content (vLLM follows no other variable: `text` below)
    ("{% for m in messages %}{% set content = m.content %}<|im_start|>{{ m['role'] }}\n"
     "{% if content is string %}{{ content }}{% else %}{% for part in content %}[{{ part.text }}]{% endfor %}"
     "{% endif %}<|im_end|>\n{% endfor %}", False),
    ("{% for m in messages %}{% set text = m.content %}<|im_start|>{{ m['role'] }}\n"
     "{% if text is string %}{{ text }}{% else %}{% for part in text %}[{{ part.text }}]{% endfor %}{% endif %}"
     "<|im_end|>\n{% endfor %}", True),
    # a loop over the first message's content, or a tool's: not a loop over each message's
    ("{% for part in messages[0]['content'] %}{{ part }}{% endfor %}{% for m in messages %}<|im_start|>"
     "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}", True),
    ("{% for tool in tools or [] %}{% for line in tool.content %}{{ line }}{% endfor %}{% endfor %}"
     "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}", True),
    # through a macro's parameter
    ("{% macro render(body) %}{% if body is string %}{{ body }}{% else %}{% for part in body %}"
     "[{{ part.text }}]{% endfor %}{% endif %}{% endmacro %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
     "{{ render(m['content']) }}<|im_end|>\n{% endfor %}", False),
    # a loop over something else the template set
    ("{% for m in messages %}{% set words = m['role'] ~ ' ' ~ m['content'] %}{% set lines = [words] %}"
     "{% for line in lines %}{{ line }}{% endfor %}\n{% endfor %}", True)],
    ids=["string", "loops-over-parts", "generation-tag", "variable-named-content", "other-variable",
         "first-message-only", "a-tools-content", "macro-parameter", "other-loop"])
def test_text_parts_render_as_vllm_renders_them(tiny_chat, tmp_path, template, joins):
    """A template that takes parts gets every content as parts, a string one wrapped in a text
    part; any other gets the parts joined by newlines. vLLM's rule (its renderers/hf.py
    _detect_content_format): our rule followed any variable set from any `.content`."""
    from transformers import AutoTokenizer
    model_dir = tmp_path / "template"
    shutil.copytree(tiny_chat.dir(FAMILY), model_dir)
    (model_dir / "chat_template.jinja").write_text(template)
    parts = [{"type": "text", "text": "Summarise this: "}, {"type": "text", "text": ""},
             {"type": "text", "text": "The cat sat."}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    if joins:  # an empty part adds no line
        given = [messages[0], {"role": "user", "content": "Summarise this: \nThe cat sat."}]
    else:
        given = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, messages[1]]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = tokenizer.apply_chat_template(given, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    engine = make_engine(model_dir)
    scored = SamplingParams(max_tokens=3, prompt_logprobs=0)
    parts_given, ids_given = engine.generate([Request("parts", messages=messages, params=scored),
                                              Request("ids", prompt_token_ids=list(expected), params=scored)])
    assert parts_given.error is None and parts_given.prompt_tokens == len(expected)
    assert parts_given.prompt_logprobs == ids_given.prompt_logprobs  # the same tokens
    assert parts_given.token_ids == ids_given.token_ids
    [refused] = engine.generate([Request("image", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}])])
    assert refused.finish_reason == "error" and "list of text parts" in refused.error
    assert_idle_and_clean(engine)


NO_DEVELOPER = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
KNOWS_DEVELOPER = ("{% for m in messages %}{% if m['role'] == 'developer' %}<dev>{{ m['content'] }}</dev>{% else %}"
                   "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")


def _message(role, content):
    return {"role": role, "content": content}


@pytest.mark.parametrize("template, messages, given", [
    (NO_DEVELOPER, [_message("developer", "B"), _message("user", "U")], [_message("system", "B"), _message("user", "U")]),
    (NO_DEVELOPER, [_message("system", "A"), _message("developer", "B"), _message("user", "U")],
     [_message("system", "A\n\nB"), _message("user", "U")]),
    (NO_DEVELOPER, [_message("user", "U"),
                    _message("developer", [{"type": "text", "text": "B"}, {"type": "text", "text": "C"}])],
     [_message("system", "B\nC"), _message("user", "U")]),
    (NO_DEVELOPER, [_message("developer", ""), _message("user", "U"), _message("system", "A")],
     [_message("system", "A"), _message("user", "U")]),
    (NO_DEVELOPER, [_message("user", "U"), _message("system", "A")], None),  # no developer: as they are
    (KNOWS_DEVELOPER, [_message("system", "A"), _message("developer", "B"), _message("user", "U")], None),
], ids=["first", "after-a-system-message", "after-the-user-in-parts", "empty", "none", "template-knows-it"])
def test_a_developer_message_reaches_the_template_as_vllm_gives_it(tiny_chat, tmp_path, template, messages, given):
    """vLLM gives "developer" to a template whose text names it; else it makes it a system
    message and merges every system message into one at the front (blank lines between, empty
    ones left out). We made it a system message where it stood."""
    from transformers import AutoTokenizer
    model_dir = tmp_path / "template"
    shutil.copytree(tiny_chat.dir(FAMILY), model_dir)
    (model_dir / "chat_template.jinja").write_text(template)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = tokenizer.apply_chat_template(given or messages, add_generation_prompt=True, tokenize=False)
    [completion] = make_engine(model_dir).generate([Request("d", messages=messages, params=SamplingParams(
        max_tokens=1, prompt_logprobs=0))])
    assert completion.error is None
    assert completion.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_a_chat_template_kept_only_in_the_processor_file_is_used(tiny_chat, tmp_path):
    """Image-text checkpoints may keep it in chat_template.json, which AutoTokenizer skips."""
    model_dir = tmp_path / "processor-template"
    shutil.copytree(tiny_chat.dir(FAMILY), model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.pop("chat_template", None) or (model_dir / "chat_template.jinja").read_text()
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    messages = [{"role": "user", "content": "Hi"}]
    engine = make_engine(model_dir)
    expected = engine.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
    scored = SamplingParams(max_tokens=2, prompt_logprobs=0)
    chat, ids = engine.generate([Request("chat", messages=messages, params=scored),
                                 Request("ids", prompt_token_ids=expected, params=scored)])
    assert chat.error is None and chat.prompt_tokens == len(expected)
    assert chat.prompt_logprobs == ids.prompt_logprobs


@pytest.mark.parametrize("failing_part", ["_sample_one", "adjust_logits"])
def test_a_request_whose_sampling_fails_ends_alone_as_an_error(tiny, monkeypatch, failing_part):
    import runtime.sampling
    real = getattr(runtime.sampling, failing_part)

    def failing(logits, *args):
        params = args[0] if failing_part == "_sample_one" else args[0].params
        if params.seed == 13:
            raise RuntimeError("boom")
        return real(logits, *args)

    monkeypatch.setattr(runtime.sampling, failing_part, failing)
    engine = make_engine(tiny.dir(FAMILY))
    prompts = random_prompts([7, 19, 11], seed=8)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=13, n=3, repetition_penalty=1.2)
    bad, *good = engine.generate([Request("bad", prompt_token_ids=prompts[0], params=sampled)]
                                 + greedy_requests(prompts[1:], MAX_TOKENS))
    assert bad.error == "sampling failed (RuntimeError: boom)" and bad.finish_reason == "error"
    assert bad.prompt_tokens == 7
    for prompt, completion in zip(prompts[1:], good):
        assert_matches(completion, *reference(tiny, prompt), max_tokens=MAX_TOKENS)
    assert engine.stats.failed_requests == 1
    assert_idle_and_clean(engine)


def test_a_request_whose_stop_handling_fails_ends_alone_as_an_error(tiny_chat, monkeypatch):
    from runtime.sequence import Sequence
    real = Sequence._hit_stop_string

    def failing(seq):
        if "boom" in seq.params.stop and seq.num_generated == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(seq)

    monkeypatch.setattr(Sequence, "_hit_stop_string", failing)
    engine = make_engine(tiny_chat.dir(FAMILY))
    params = dict(max_tokens=8, ignore_eos=True)
    bad, good = engine.generate([Request("bad", prompt="Hi", params=SamplingParams(stop=("boom",), **params)),
                                 Request("good", prompt="Hi", params=SamplingParams(stop=("zzz",), **params))])
    assert bad.finish_reason == "error" and bad.error.startswith("UnicodeDecodeError: 'utf-8' codec")
    assert good.error is None and good.completion_tokens == 8
    assert_idle_and_clean(engine)


def test_skip_special_tokens_off_keeps_them_in_the_text(tiny_chat):
    """vLLM's skip_special_tokens: a special token the model chose (made certain here by a logit
    bias) is in the text only when it is False; the token ids are the same either way."""
    engine = make_engine(tiny_chat.dir(FAMILY))
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = dict(max_tokens=3, logit_bias={special: 100})
    kept, skipped = engine.generate([
        Request("kept", prompt="Hi", params=SamplingParams(skip_special_tokens=False, **params)),
        Request("skipped", prompt="Hi", params=SamplingParams(**params))])
    assert kept.token_ids == skipped.token_ids == [special] * 3
    assert kept.text == "<|im_start|>" * 3 and skipped.text == ""
    assert_idle_and_clean(engine)


def test_a_prompt_the_tokenizer_fails_on_is_an_error_completion(tiny_chat, monkeypatch):
    engine = make_engine(tiny_chat.dir(FAMILY))
    real = engine.tokenizer.encode

    def failing(text, *args, **kwargs):
        if "poison" in text:
            raise OverflowError("out of range integral type conversion attempted")
        return real(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", failing)
    bad, good = engine.generate([Request("bad", prompt="poison"),
                                 Request("good", prompt="Hi", params=SamplingParams(max_tokens=3))])
    assert bad.finish_reason == "error"
    assert bad.error == "prompt: could not be tokenized (OverflowError: out of range integral type conversion attempted)"
    assert good.error is None and good.completion_tokens >= 1
    assert_idle_and_clean(engine)


def test_a_prompt_the_tokenizer_gives_ids_past_the_vocabulary_is_an_error_completion(tmp_path):
    """A tokenizer with an added token the model has no embedding for: that prompt's request
    fails alone (the embedding lookup would have failed the whole step)."""
    from tiny_models import make_tiny_model, make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(tmp_path)
    make_tiny_model("llama", tmp_path, vocab_size=len(tokenizer))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(tmp_path)
    engine = make_engine(tmp_path)
    bad, chat, good = engine.generate([
        Request("bad", prompt="call <|tool|> now"),
        Request("chat", messages=[{"role": "user", "content": "<|tool|>"}]),
        Request("good", prompt="Hi", params=SamplingParams(max_tokens=3))])
    for failed in (bad, chat):
        assert failed.finish_reason == "error"
        assert failed.error == (f"prompt: the tokenizer gave token ids [{len(tokenizer) - 1}] past the "
                                f"model's {len(tokenizer) - 1}-token vocabulary")
    assert good.error is None and good.completion_tokens >= 1
    assert_idle_and_clean(engine)


def test_a_tokenizer_whose_vocabulary_file_is_missing_is_refused_at_load(tmp_path):
    """From a tokenizer_config.json alone, transformers builds a GPT-2-style tokenizer (SmolLM2
    names that class) of only the special tokens: every text would encode to nothing."""
    from tiny_models import make_tiny_model, make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(tmp_path)
    make_tiny_model("llama", tmp_path, vocab_size=len(tokenizer))
    (tmp_path / "tokenizer.json").unlink()
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(ValueError, match=r"the tokenizer has no tokens but its \d+ special ones; its "
                                         r"vocabulary file .* is missing or empty \(found tokenizer_config.json\)"):
        make_engine(tmp_path)


def _refuse_loading_weights(monkeypatch):
    import runtime.engine

    def load(*args, **kwargs):
        raise AssertionError("the weights were read before the refusal")
    monkeypatch.setattr(runtime.engine, "load_model", load)


def test_a_corrupt_tokenizer_file_is_named_before_any_weight_is_read(tiny_chat, tmp_path, monkeypatch):
    import shutil

    model = tmp_path / "corrupt-tokenizer"
    shutil.copytree(tiny_chat.dir("llama"), model)
    (model / "tokenizer.json").write_text("{not json")
    _refuse_loading_weights(monkeypatch)
    with pytest.raises(ValueError, match=f"{model}: its tokenizer does not load from tokenizer.json.*JSONDecodeError"):
        make_engine(model)


def test_a_kv_cache_larger_than_the_machine_is_refused_before_any_weight_is_read(tiny, monkeypatch):
    """torch failed on it after the load, with "Storage size calculation overflowed"."""
    from runtime import Engine

    _refuse_loading_weights(monkeypatch)
    with pytest.raises(ValueError, match=r"kv_cache_bytes: a KV cache of [\d.]+ GiB does not fit in this cpu "
                                         r"device's [\d.]+ GiB of memory"):
        Engine(tiny.dir("llama"), kv_cache_bytes=10**20, num_threads=1)


def test_a_uri_is_refused_by_the_engine_whole():
    """Path() made gs://bucket/model "gs:/bucket/model", a folder the error then named."""
    from runtime import Engine

    with pytest.raises(ValueError, match="gs://bucket/model: a URI; runtime.Engine reads a local model directory"):
        Engine("gs://bucket/model", num_threads=1)


@pytest.mark.parametrize("size, value", [
    ("weight_budget_bytes", float("nan")), ("weight_budget_bytes", "300"), ("weight_budget_bytes", 1.5e8),
    ("kv_cache_bytes", 1e6), ("host_kv_bytes", -1), ("host_kv_bytes", float("nan")),
    ("max_num_seqs", 0), ("block_size", True), ("num_threads", 0), ("max_model_len", 1)])
def test_size_arguments_that_are_not_whole_numbers_at_least_their_floor_are_refused(tiny, size, value):
    """A NaN budget compared false everywhere: no budget at all; others failed deep in torch.
    The Beam glue checks them when the pipeline is built."""
    from batchgen_beam.engine_client import EngineConfig

    message = rf"{size} must be a whole number >= \d, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        make_engine(tiny.dir(FAMILY), **{size: value})
    with pytest.raises(ValueError, match=message):
        EngineConfig.of(None, **{size: value})


@pytest.mark.parametrize("name, value, message", [
    ("admission", "bogus", "admission must be one of"), ("preemption", "drop", "preemption must be one of"),
    ("admission", ["fifo"], "admission must be one of"), ("device", "tpu9", "device='tpu9': not a torch device"),
    ("dtype", "fp32", "dtype='fp32': give one of ['bfloat16', 'float16', 'float32']"),
    ("dtype", torch.float8_e4m3fn, "dtype=torch.float8_e4m3fn"),  # a float no kernel of ours takes
    ("dtype", "int8", "dtype='int8'"), ("dtype", torch.int32, "dtype=torch.int32"), ("dtype", None, "dtype=None"),
    ("device", None, "device=None")])
def test_arguments_out_of_their_domain_are_refused_by_the_engine_and_at_pipeline_construction(
        tiny, name, value, message):
    """Not a worker's engine start failing deep in torch or the scheduler: a ValueError at once."""
    from batchgen_beam.engine_client import EngineConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        make_engine(tiny.dir(FAMILY), **{name: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig.of(None, **{name: value})


def test_a_dtype_may_be_named_as_configs_and_flags_name_it(tiny):
    assert make_engine(tiny.dir(FAMILY), dtype="bfloat16").kv.block_layout()[1] == torch.bfloat16


def test_reset_prefix_cache_makes_a_rerun_compute_its_prompt_again(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    prompt = random_prompts([40], seed=9)[0]

    def prefill_tokens_of_a_run():
        before = engine.stats.prefill_tokens
        [done] = engine.generate([Request("r", prompt_token_ids=prompt, params=SamplingParams(max_tokens=2))])
        assert done.error is None
        return engine.stats.prefill_tokens - before

    assert prefill_tokens_of_a_run() == 40
    assert prefill_tokens_of_a_run() == 40 - 32  # two full 16-token blocks were cached
    assert engine.reset_prefix_cache() >= 2
    assert prefill_tokens_of_a_run() == 40
    assert_idle_and_clean(engine)


def test_more_samples_than_the_kv_cache_has_blocks_are_refused(tiny):
    engine = make_engine(tiny.dir(FAMILY), num_blocks=8, max_num_seqs=2)
    prompt = random_prompts([6], seed=2)[0]
    with pytest.raises(ValueError, match=r"n: must be <= the KV cache's 8 blocks, got 9"):
        engine.submit(Request("n", prompt_token_ids=prompt, params=SamplingParams(n=9)))
    # n above max_num_seqs is fine: the samples fork past it.
    [done] = engine.generate([Request("n", prompt_token_ids=prompt, params=SamplingParams(n=4, max_tokens=3))])
    assert len(done.outputs) == 4  # and the refused request did not keep the id
    assert_idle_and_clean(engine)


def test_more_logprobs_than_max_logprobs_are_refused(tiny):
    """A dict of logprobs a position: a whole vocabulary's at every position of a long prompt
    would run the engine out of memory (vLLM's default cap, 20)."""
    engine = make_engine(tiny.dir(FAMILY))
    prompt = random_prompts([6], seed=3)[0]
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name}: must be <= the engine's max_logprobs, 20 .*got 21"):
            engine.submit(Request("lp", prompt_token_ids=prompt, params=SamplingParams(**{name: 21})))
    [done] = engine.generate([Request("lp", prompt_token_ids=prompt,
                                      params=SamplingParams(max_tokens=1, logprobs=20, prompt_logprobs=20))])
    assert len(done.outputs[0].top_logprobs[0]) == 20 and len(done.prompt_top_logprobs[-1]) == 20
    with pytest.raises(ValueError, match="max_logprobs must be a whole number >= -1"):
        make_engine(tiny.dir(FAMILY), max_logprobs=-2)
    assert_idle_and_clean(engine)


def test_more_logprobs_than_the_vocabulary_has_tokens_are_refused(tiny):
    engine = make_engine(tiny.dir(FAMILY), max_logprobs=-1)
    vocab = engine.spec.vocab_size
    prompt = random_prompts([6], seed=3)[0]
    with pytest.raises(ValueError, match=rf"logprobs: must be <= the vocabulary's {vocab} tokens, got {vocab + 1}"):
        engine.submit(Request("lp", prompt_token_ids=prompt, params=SamplingParams(logprobs=vocab + 1)))
    # The whole vocabulary is fine: every token's logprob, best first.
    [done] = engine.generate([Request("lp", prompt_token_ids=prompt,
                                      params=SamplingParams(max_tokens=2, logprobs=vocab))])
    assert [len(top) for top in done.outputs[0].top_logprobs] == [vocab, vocab]
    assert_idle_and_clean(engine)


def test_non_list_prompt_token_ids_is_an_error_completion(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    good = random_prompts([10], seed=2)[0]
    bad, ok = engine.generate([Request("bad", prompt_token_ids=7),
                               Request("ok", prompt_token_ids=good, params=SamplingParams(max_tokens=4))])
    assert bad.finish_reason == "error" and bad.error
    assert ok.token_ids == reference(tiny, good, 4)[0]
    assert_idle_and_clean(engine)


def test_kv_cache_bounds_the_context(tiny):
    engine = make_engine(tiny.dir(FAMILY), num_blocks=4)
    assert engine.max_model_len == 64
    ok, too_long = engine.generate([
        Request("ok", prompt_token_ids=random_prompts([60], seed=3)[0],
                params=SamplingParams(max_tokens=50, ignore_eos=True)),
        Request("long", prompt_token_ids=random_prompts([64], seed=3)[0])])
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    assert too_long.finish_reason == "error" and "64" in too_long.error


def test_max_model_len_bounds_the_context(tiny):
    engine = make_engine(tiny.dir(FAMILY), max_model_len=32)
    assert engine.max_model_len == 32
    fits, too_long = engine.generate([
        Request("fits", prompt_token_ids=random_prompts([31], seed=13)[0],
                params=SamplingParams(max_tokens=10, ignore_eos=True)),
        Request("long", prompt_token_ids=random_prompts([32], seed=13)[0])])
    assert fits.finish_reason == "length" and len(fits.token_ids) == 1
    assert too_long.finish_reason == "error" and "32" in too_long.error
    assert too_long.prompt_tokens == 32 and too_long.completion_tokens == 0  # the row's usage


def test_truncate_prompt_tokens_keeps_a_long_prompts_end(tiny):
    """The last N tokens run as the prompt (a prompt over the context then fits); a prompt
    shorter than N runs whole."""
    engine = make_engine(tiny.dir(FAMILY), max_model_len=32)
    prompt = random_prompts([80], seed=5)[0]
    truncated = SamplingParams(max_tokens=6, truncate_prompt_tokens=20)
    cut, tail, short = engine.generate([
        Request("cut", prompt_token_ids=prompt, params=truncated),
        Request("tail", prompt_token_ids=prompt[-20:], params=SamplingParams(max_tokens=6)),
        Request("short", prompt_token_ids=prompt[:5], params=truncated)])
    assert cut.error is None and cut.prompt_tokens == 20 and cut.token_ids == tail.token_ids
    assert short.error is None and short.prompt_tokens == 5
    [still_long] = engine.generate([Request("long", prompt_token_ids=prompt, params=SamplingParams(
        truncate_prompt_tokens=40))])
    assert still_long.finish_reason == "error" and "truncate_prompt_tokens" in still_long.error
    # -1: as many as leave room for one token (vLLM's OpenAI server's rule).
    [whole] = engine.generate([Request("whole", prompt_token_ids=prompt, params=SamplingParams(
        max_tokens=6, truncate_prompt_tokens=-1))])
    assert whole.error is None and whole.prompt_tokens == 31 and whole.completion_tokens == 1
    assert whole.finish_reason == "length"
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= "):
            SamplingParams(truncate_prompt_tokens=bad)


def test_duplicate_in_flight_id_raises(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    prompt = random_prompts([8], seed=4)[0]
    request = Request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=MAX_TOKENS))
    engine.submit(request)
    with pytest.raises(ValueError, match="in flight"):
        engine.submit(request)
    with pytest.raises(ValueError, match="in flight"):
        engine.generate([request])
    with pytest.raises(ValueError, match="unique"):
        engine.generate([Request("b", prompt_token_ids=prompt), Request("b", prompt_token_ids=prompt)])
    done = []
    while engine.has_unfinished():
        done += engine.poll()
    assert [c.id for c in done] == ["a"]  # exactly once, and "b" was never submitted
    assert done[0].token_ids == reference(tiny, prompt)[0]
    [again] = engine.generate([request])  # finished: the id is free again
    assert again.token_ids == done[0].token_ids
    assert_idle_and_clean(engine)


def test_a_request_id_that_is_no_string_is_refused(tiny):
    """1 and "1" would name the same sequences (the host tier and held sequences are keyed by
    them), and None would run as "None"."""
    engine = make_engine(tiny.dir(FAMILY))
    for request_id in (1, None, ("a",)):
        with pytest.raises(TypeError, match="request ids are strings"):
            engine.submit(Request(request_id, prompt_token_ids=[5, 6]))
        with pytest.raises(TypeError, match="request ids are strings"):
            engine.generate([Request("fine", prompt_token_ids=[5, 6]), Request(request_id, prompt_token_ids=[5, 6])])
    assert_idle_and_clean(engine)


def test_engine_argument_checks(tiny):
    directory = tiny.dir(FAMILY)
    with pytest.raises(ValueError, match="admission"):
        make_engine(directory, admission="random")
    with pytest.raises(ValueError, match="preemption"):
        make_engine(directory, preemption="drop")
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(directory, kv_cache_bytes=1000)
    engine = make_engine(directory)
    with pytest.raises(ValueError, match="stop"):  # stop strings need a tokenizer
        engine.submit(Request("s", prompt_token_ids=[5, 6], params=SamplingParams(stop=["x"])))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.submit(Request("p", prompt_token_ids=[5, 6], params={"max_tokens": 3}))
    assert not engine.has_unfinished()
    # generate() checks every request before submitting any: a bad one leaves nothing in flight.
    good = Request("good", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=2))
    bad = Request("bad", prompt_token_ids=[5, 6], params=SamplingParams(logit_bias={10 ** 6: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate([good, bad])
    assert not engine.has_unfinished()
    assert engine.generate([good])[0].completion_tokens == 2


# ---- collecting ----------------------------------------------------------------------------

def test_concurrent_submit_with_background_loop_completes_each_request_once(tiny):
    rng = random.Random(5)

    def decisive_request(request_id):  # the batches here vary with thread timing: no near-ties
        while True:
            prompt, max_tokens = random_prompt(rng.randint(1, 40), rng), rng.randint(1, 10)
            if tiny.decisive(FAMILY, prompt, max_tokens):
                return Request(request_id, prompt_token_ids=prompt,
                               params=SamplingParams(max_tokens=max_tokens, logprobs=0))

    per_thread = [[decisive_request(f"t{t}-{i}") for i in range(25)] for t in range(4)]
    per_thread[2][7] = Request("t2-7", prompt_token_ids=[])  # an error completion among them
    everything = {r.id: r for requests in per_thread for r in requests}

    engine = make_engine(tiny.dir(FAMILY), max_num_seqs=16).start()
    try:
        barrier = threading.Barrier(4)
        errors = []

        def submitter(requests):
            try:
                barrier.wait()
                for request in requests:
                    engine.submit(request)
                    time.sleep(0.001)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=submitter, args=(r,)) for r in per_thread]
        for thread in threads:
            thread.start()
        collected = []
        deadline = time.monotonic() + 60
        while len(collected) < len(everything) and time.monotonic() < deadline:
            collected += engine.poll(timeout=0.2)
        for thread in threads:
            thread.join()
        assert not errors
        time.sleep(0.1)
        collected += engine.poll(timeout=0.1)  # nothing more may arrive
    finally:
        engine.stop()
    ids = [c.id for c in collected]
    assert len(ids) == len(set(ids)), "a request completed twice"
    assert set(ids) == set(everything)
    for completion in collected:
        request = everything[completion.id]
        if completion.id == "t2-7":
            assert completion.finish_reason == "error"
            continue
        tokens, logprobs = reference(tiny, request.prompt_token_ids, request.params.max_tokens)
        assert_matches(completion, tokens, logprobs, max_tokens=request.params.max_tokens)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("background", [False, True], ids=["caller-drives", "background-loop"])
def test_completions_iterator_yields_each_once(tiny, background):
    prompts = random_prompts([3, 17, 40, 5], seed=6)
    engine = make_engine(tiny.dir(FAMILY), max_num_batched_tokens=16)
    if background:
        engine.start()
    try:
        for request in greedy_requests(prompts, MAX_TOKENS):
            engine.submit(request)
        engine.submit(Request("bad", prompt_token_ids=[999]))
        done = {}
        for completion in engine.completions():
            assert completion.id not in done
            done[completion.id] = completion
    finally:
        engine.stop()
    assert sorted(done) == ["bad", "r0", "r1", "r2", "r3"]
    assert done["bad"].finish_reason == "error"
    for i, prompt in enumerate(prompts):
        assert_matches(done[f"r{i}"], *reference(tiny, prompt), max_tokens=MAX_TOKENS)
    assert list(engine.completions()) == []
    assert engine.poll() == []


@pytest.mark.parametrize("leave", ["break", "close", "raise"])
def test_completions_a_caller_leaves_unread_are_read_by_its_next_poll(tiny, leave):
    """Leaving completions() after its first item lost the others its poll had taken: they
    finished in the same step, and no later poll, completions() or finished() gave them."""
    engine = make_engine(tiny.dir(FAMILY))
    for request in greedy_requests(random_prompts([3, 5, 7], seed=8), 4):  # all finish at one step
        engine.submit(request)
    iterator = engine.completions()
    first = next(iterator)
    if leave == "close":
        iterator.close()
    elif leave == "raise":
        with pytest.raises(KeyError):
            iterator.throw(KeyError("the caller's own failure"))
    del iterator
    rest = list(engine.completions())
    assert sorted(c.id for c in [first, *rest]) == ["r0", "r1", "r2"]
    assert_idle_and_clean(engine)


def test_what_is_not_a_request_is_refused_as_such(tiny):
    """submit(None) or generate("abc") failed inside with "'NoneType' object has no attribute 'id'"."""
    engine = make_engine(tiny.dir(FAMILY))
    for call, value in [(engine.submit, None), (engine.submit, "Hello"), (engine.submit, {"id": "r"}),
                        (engine.generate, "abc"), (engine.generate, [None]),
                        (engine.generate, [Request("ok", prompt_token_ids=[5]), "Hello"])]:
        with pytest.raises(TypeError, match="requests are (an iterable of )?runtime.Request objects, got "):
            call(value)
    assert_idle_and_clean(engine)


def test_generate_takes_any_iterable_of_requests_and_refuses_what_is_none(tiny):
    """generate(None) returned [] as if asked for nothing, a generator failed on len(), and a
    lone Request on iteration."""
    engine = make_engine(tiny.dir(FAMILY))
    requests = [Request(f"g{i}", prompt_token_ids=[5, 6 + i], params=SamplingParams(max_tokens=3)) for i in range(3)]
    expected = [c.token_ids for c in engine.generate(requests)]
    assert [c.token_ids for c in engine.generate(r for r in requests)] == expected
    assert [c.token_ids for c in engine.generate(tuple(requests))] == expected
    assert engine.generate(iter([])) == []
    for value in (None, requests[0], 5, {"id": "r"}, b"abc"):
        with pytest.raises(TypeError, match="requests are an iterable of runtime.Request objects, got "):
            engine.generate(value)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "1"])
@pytest.mark.parametrize("background", [False, True], ids=["caller-drives", "background-loop"])
def test_a_poll_timeout_that_is_no_duration_is_refused(tiny, background, timeout):
    """poll(timeout=nan) with the background loop running waited forever: no deadline compares."""
    engine = make_engine(tiny.dir(FAMILY))
    if background:
        engine.start()
    try:
        with pytest.raises(ValueError, match="timeout must be a number >= 0"):
            engine.poll(timeout=timeout)
    finally:
        engine.stop()


def test_poll_without_background_loop_runs_steps_until_something_finishes(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    prompts = random_prompts([4, 4], seed=7)
    for name, prompt, max_tokens in (("short", prompts[0], 2), ("long", prompts[1], 20)):
        engine.submit(Request(name, prompt_token_ids=prompt,
                              params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    first = engine.poll()
    assert [c.id for c in first] == ["short"]
    assert engine.stats.steps == 2 and engine.has_unfinished()
    second = engine.poll()
    assert [c.id for c in second] == ["long"] and len(second[0].token_ids) == 20
    assert not engine.has_unfinished()


def test_poll_with_background_loop_waits_for_its_timeout_when_idle(tiny):
    """A collector polling an idle engine in a loop (the engine service's router does) must
    sleep in poll, not spin: poll waits out its timeout even with nothing in flight, and
    returns a request submitted meanwhile by another thread."""
    engine = make_engine(tiny.dir("llama")).start()
    try:
        start = time.monotonic()
        assert engine.poll(timeout=0.3) == []
        assert time.monotonic() - start >= 0.25
        threading.Timer(0.1, engine.submit, [Request("late", prompt_token_ids=[5, 6, 7],
                                                     params=SamplingParams(max_tokens=2))]).start()
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = engine.poll(timeout=1.0)
        assert [c.id for c in got] == ["late"]
    finally:
        engine.stop()


def test_generate_with_the_background_loop_running_and_from_two_threads(tiny):
    prompts = random_prompts([6, 25, 50, 12], seed=8)
    with make_engine(tiny.dir(FAMILY)) as engine:
        assert engine._thread is not None and engine._thread.is_alive()
        results = {}

        def call(name, subset):
            results[name] = engine.generate(greedy_requests(subset, MAX_TOKENS, prefix=name))

        threads = [threading.Thread(target=call, args=(name, prompts[k::2]))
                   for k, name in enumerate(("a", "b"))]
        for thread in threads:
            thread.start()
        own = engine.generate(greedy_requests(prompts, MAX_TOKENS, prefix="c"))
        for thread in threads:
            thread.join()
    assert engine._thread is None  # stopped on exit
    assert [c.id for c in own] == ["c0", "c1", "c2", "c3"]
    for i, completion in enumerate(own):
        assert_matches(completion, *reference(tiny, prompts[i]), max_tokens=MAX_TOKENS)
    for k, name in enumerate(("a", "b")):
        assert [c.id for c in results[name]] == [f"{name}0", f"{name}1"]
        for completion, prompt in zip(results[name], prompts[k::2]):
            assert completion.token_ids == reference(tiny, prompt)[0]
    assert_idle_and_clean(engine)


def test_timings_are_ordered(tiny):
    prompts = random_prompts([5, 60, 100, 20], seed=9)
    engine = make_engine(tiny.dir(FAMILY), max_num_batched_tokens=32, max_num_seqs=2)
    results = engine.generate(greedy_requests(prompts, MAX_TOKENS))
    for completion in results:
        t = completion.timings
        assert None not in (t.first_scheduled, t.first_token, t.finished)
        assert t.submitted <= t.first_scheduled <= t.first_token <= t.finished
    long = results[2].timings  # 100 tokens at 32 per step: its first token comes steps later
    assert long.first_scheduled < long.first_token
    last = results[3].timings  # admitted only once a slot frees up
    assert last.first_scheduled > results[0].timings.first_token


def test_a_failing_loop_is_raised_to_callers_not_hung_on(tiny):
    engine = make_engine(tiny.dir(FAMILY))

    def broken(batch):
        raise RuntimeError("kernel exploded")

    engine.runner.run = broken
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="engine loop failed") as info:
            engine.generate(greedy_requests(random_prompts([5], seed=10)))
        assert "kernel exploded" in str(info.value.__cause__)
    finally:
        engine.stop()


def test_poll_without_a_timeout_raises_a_loop_that_dies_while_it_waits(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    run, in_flight = engine.runner.run, threading.Event()

    def dies_on_the_second_step(batch):
        if in_flight.is_set():
            raise RuntimeError("kernel exploded")
        in_flight.set()
        return run(batch)

    engine.runner.run = dies_on_the_second_step
    engine.start()
    try:
        engine.submit(Request("r", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=8, ignore_eos=True)))
        with pytest.raises(RuntimeError, match="engine loop failed"):
            engine.poll()  # waited forever: the failure was looked at once, before the wait
    finally:
        engine.stop()


def test_poll_without_a_timeout_returns_once_its_work_migrated_away(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    engine.submit(Request("r", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    engine.start()
    try:
        polled = []
        poller = threading.Thread(target=lambda: polled.append(engine.poll()), daemon=True)
        poller.start()
        engine.migrate_out("r")
        poller.join(10)
        assert not poller.is_alive(), "poll() waited on with nothing in flight"
    finally:
        engine.stop()
    assert polled == [[]]


def test_an_id_a_generate_call_has_claimed_is_refused_to_submit(tiny, monkeypatch):
    """generate() claims its ids, then submits them: a submit() of one of them in between got
    its completion delivered to that call, and the call itself failed "already in flight"."""
    engine = make_engine(tiny.dir(FAMILY)).start()
    check, claimed, go_on = engine._check_request, threading.Event(), threading.Event()
    prompt = random_prompts([9], seed=12)[0]

    def held_in_submit(request):  # generate() checks each request twice: before and in submit
        check(request)
        if threading.current_thread().name == "generating":
            if claimed.is_set():
                go_on.wait(10)
            claimed.set()

    monkeypatch.setattr(engine, "_check_request", held_in_submit)
    results = []
    caller = threading.Thread(target=lambda: results.append(engine.generate(greedy_requests([prompt], MAX_TOKENS))),
                              name="generating", daemon=True)
    try:
        caller.start()
        assert claimed.wait(10)
        time.sleep(0.05)  # into its second check, the id claimed
        with pytest.raises(ValueError, match="already in flight"):
            engine.submit(Request("r0", prompt_token_ids=prompt))
        go_on.set()
        caller.join(30)
        assert not caller.is_alive()
    finally:
        go_on.set()
        engine.stop()
    [[completion]] = results
    assert_matches(completion, *reference(tiny, prompt))
    assert engine.poll(timeout=0.1) == []
    assert_idle_and_clean(engine)


def test_a_failed_step_from_one_caller_after_another_finished_the_work_is_no_stall(tiny):
    """Callers without a background loop each run steps; one that waited behind another's
    step, which finished the last request, found nothing to run: not a stall."""
    engine = make_engine(tiny.dir(FAMILY))
    engine._step_or_stall(lambda: False)  # nothing in flight: before, "engine stalled with requests in flight"
    engine.submit(Request("r", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2)))
    threads = [threading.Thread(target=lambda: collected.extend(engine.completions())) for _ in range(3)]
    collected = []
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [c.id for c in collected] == ["r"]
    assert_idle_and_clean(engine)


def test_a_step_that_found_nothing_is_no_stall_though_another_caller_submits_right_after(tiny, monkeypatch):
    """Caller A's request is finished by caller B's step, so A's next step finds nothing; B then
    submits and its step drains the new request before A looked: A saw a request in flight and
    none queued, and raised "engine stalled" for an engine that was busy (and its own done)."""
    engine = make_engine(tiny.dir(FAMILY))
    real_step = Engine._step
    b_finished_a, a_idle, b_drained = threading.Event(), threading.Event(), threading.Event()

    def step(self):
        if threading.current_thread().name == "A":
            assert b_finished_a.wait(30)
            outcome = real_step(self)
            if outcome != "ran":
                a_idle.set()
                assert b_drained.wait(30)  # B's request is in flight, none queued: A decides now
            return outcome
        outcome = real_step(self)
        if a_idle.is_set():
            b_drained.set()
            time.sleep(0.1)
        return outcome

    monkeypatch.setattr(Engine, "_step", step)
    prompts = random_prompts([5, 6, 7], seed=1)
    results = {}

    def a():
        try:
            results["a"] = engine.generate([Request("a", prompt_token_ids=prompts[0], params=SamplingParams(max_tokens=1))])
        except RuntimeError as exc:
            results["a"] = exc

    def b():
        while engine._inbox.empty():
            time.sleep(0.001)
        engine.generate([Request("b1", prompt_token_ids=prompts[1], params=SamplingParams(max_tokens=1))])
        b_finished_a.set()  # its step ran "a" too
        assert a_idle.wait(30)
        results["b2"] = engine.generate([Request("b2", prompt_token_ids=prompts[2], params=SamplingParams(max_tokens=4))])

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [c.id for c in results["a"]] == ["a"], results["a"]
    assert [c.id for c in results["b2"]] == ["b2"]
    assert_idle_and_clean(engine)


def test_a_caller_whose_request_another_step_finished_returns_though_the_engine_is_stuck(tiny, monkeypatch):
    """A suspended request leaves the engine nothing it can run; a caller whose own request was
    finished meanwhile (by another caller's step) has its answer and must not raise."""
    engine = make_engine(tiny.dir(FAMILY))
    prompts = random_prompts([9, 11], seed=3)
    engine.submit(Request("held", prompt_token_ids=prompts[0], params=SamplingParams(max_tokens=MAX_TOKENS)))
    engine.step()
    assert engine.suspend("held") == 1
    real_step = Engine._step

    def another_callers_step_first(self):
        real_step(self)  # finishes "mine" (one token), as a concurrent caller's step would
        return real_step(self)  # then this caller's: only the held request is left

    monkeypatch.setattr(Engine, "_step", another_callers_step_first)
    [completion] = engine.generate([Request("mine", prompt_token_ids=prompts[1], params=SamplingParams(max_tokens=1))])
    assert completion.id == "mine" and len(completion.token_ids) == 1
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="held by suspend"):
        engine.poll()
    assert engine.resume("held") == 1
    assert [c.id for c in engine.completions()] == ["held"]
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("how", ["stepped", "started", "streaming weights"])
def test_a_dropped_engine_is_freed_at_once_not_at_the_collectors_next_pass(tiny_chat, how):
    """Its bad-words cache and its stop rule's detokenizer held the engine itself: a dropped
    engine (and its KV cache, 2 GiB by default, and its weight readers' threads) lived on until
    a cyclic collection, so a notebook or worker making engines in turn held several at once."""
    import gc
    import weakref

    engine = make_engine(tiny_chat.dir(FAMILY), **({"weight_budget_bytes": 1 << 20} if how == "streaming weights" else {}))
    if how == "started":
        engine.start()
    engine.generate([Request("r", prompt="Hello there", params=SamplingParams(
        max_tokens=4, bad_words=("Hi",), stop=("zz",)))])
    engine.stop()
    threads_before = threading.active_count()
    dropped = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert dropped() is None
    finally:
        gc.enable()
    assert threading.active_count() <= threads_before


@pytest.mark.parametrize("loop", [False, True])
def test_an_interrupted_generate_leaves_none_of_its_requests_in_flight(tiny, monkeypatch, loop):
    """A notebook's stop button mid-generate(): its requests ran on in the engine, so running
    the same cell again failed ("request ids already in flight") until something drained them."""
    engine = make_engine(tiny.dir(FAMILY))
    prompts = random_prompts([9, 15, 23], seed=5)
    requests = greedy_requests(prompts, MAX_TOKENS)
    interrupt_at = 1 if loop else 3  # the loop's first wait slice, or the third step
    if loop:
        engine.start()
        target, real = "_raise_failure", engine._raise_failure
    else:
        target, real = "_step", engine._step

    def interrupted(*args):
        nonlocal interrupt_at
        interrupt_at -= 1
        if interrupt_at == 0:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(engine, target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(requests)
    monkeypatch.undo()
    assert not engine.has_unfinished()
    for completion, prompt in zip(engine.generate(requests), prompts):
        assert_matches(completion, *reference(tiny, prompt))
    engine.stop()
    assert engine.finished() == []
    assert_idle_and_clean(engine)


def test_an_interrupt_between_a_sequences_last_token_and_its_booking_leaks_nothing(tiny, monkeypatch):
    """Stopped after a sequence took its last token but before the engine booked its end, an
    interrupted generate() withdrew its requests' live sequences only: the finished one kept
    its KV blocks and its seat in the running queue for good."""
    engine = make_engine(tiny.dir(FAMILY))
    requests = greedy_requests(random_prompts([7, 19, 33], seed=3), MAX_TOKENS)
    real = engine._finish_sequence

    def interrupted(seq):
        monkeypatch.setattr(engine, "_finish_sequence", real)  # once
        raise KeyboardInterrupt
    monkeypatch.setattr(engine, "_finish_sequence", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(requests)
    assert_idle_and_clean(engine)
    for completion, request in zip(engine.generate(requests), requests):
        assert_matches(completion, *reference(tiny, request.prompt_token_ids))
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("where, when", [
    ("scheduler._reserve", None), ("scheduler.blocks.match_prefix", lambda taken: taken[0]),
    ("kv.copy_blocks", None), ("_finish_sequence", None), ("runner.run", None), ("scheduler.suspend", None)])
def test_a_real_stop_button_midway_through_a_step_or_primitive_leaves_it_whole(tiny, interruptible, where, when):
    """SIGINT on the main thread raised wherever it was: inside a copy-on-write (a block taken,
    never given back), a prefix match (references taken) or a booking. It is now held until the
    engine's lock is let go, so the interrupted generate() withdraws a consistent state."""
    engine = make_engine(tiny.dir(FAMILY))
    prompts = random_prompts([9, 21, 9 + 16], seed=8)
    prompts[2][:16] = prompts[1][:16]  # a cached prefix block to match
    requests = [Request(f"r{i}", prompt_token_ids=p,
                        params=SamplingParams(max_tokens=MAX_TOKENS, n=2, temperature=1.0, seed=i))
                for i, p in enumerate(prompts)]
    expected = [[o.token_ids for o in c.outputs] for c in make_engine(tiny.dir(FAMILY)).generate(requests)]
    engine.generate(requests[1:2])  # its prompt's blocks cached
    owner, name = engine, where
    while "." in name:
        head, name = name.split(".", 1)
        owner = getattr(owner, head)
    real, pressed = getattr(owner, name), []

    def pressing_stop(*args, **kwargs):  # right after it, before its caller goes on
        result = real(*args, **kwargs)
        if not pressed and (when is None or when(result)):
            pressed.append(True)
            signal.raise_signal(signal.SIGINT)
        return result
    setattr(owner, name, pressing_stop)
    if where == "scheduler.suspend":  # a primitive from the caller: after the first of two samples
        engine.submit(requests[0])
        engine.step()
        with pytest.raises(KeyboardInterrupt):
            engine.suspend("r0")
        assert engine.resume("r0") == 2
        assert [o.token_ids for o in next(engine.completions()).outputs] == expected[0]
    else:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(requests)
    assert pressed, f"{where} was not reached"
    setattr(owner, name, real)
    assert_idle_and_clean(engine)
    assert [[o.token_ids for o in c.outputs] for c in engine.generate(requests)] == expected
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("with_kv", [False, True])
def test_a_stop_button_during_migrate_out_leaves_the_request_running_here(tiny, interruptible, with_kv):
    """Held while the lock was, the interrupt came as migrate_out let go of it: the state it
    had made, the request's only copy, never reached the caller, and the request was lost."""
    request = Request("m", prompt_token_ids=random_prompts([11], seed=4)[0],
                      params=SamplingParams(max_tokens=MAX_TOKENS, n=2, temperature=1.0, seed=3))
    expected = [o.token_ids for o in make_engine(tiny.dir(FAMILY)).generate([request])[0].outputs]
    engine = make_engine(tiny.dir(FAMILY))
    engine.submit(request)
    for _ in range(3):
        engine.step()
    real = engine.scheduler.remove

    def pressing_stop(seq):
        real(seq)
        engine.scheduler.remove = real
        signal.raise_signal(signal.SIGINT)
    engine.scheduler.remove = pressing_stop
    with pytest.raises(KeyboardInterrupt):
        engine.migrate_out("m", with_kv=with_kv)
    [done] = list(engine.completions())
    assert done.error is None and [o.token_ids for o in done.outputs] == expected
    assert_idle_and_clean(engine)


def test_an_interrupt_right_after_generate_claims_its_ids_gives_them_back(tiny):
    """Claimed before the try whose finally gives them back: the same call run again failed
    with "request ids already in flight"."""
    engine = make_engine(tiny.dir(FAMILY))
    requests = greedy_requests(random_prompts([7, 9], seed=6), MAX_TOKENS)

    class InterruptedOnLeaving:
        def __init__(self, lock):
            self.lock, self.armed = lock, True

        def __enter__(self):
            return self.lock.__enter__()

        def __exit__(self, *exc):
            self.lock.__exit__(*exc)
            if self.armed and engine._waiters:  # right after the claim
                self.armed = False
                raise KeyboardInterrupt

    engine._ids_lock = InterruptedOnLeaving(engine._ids_lock)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(requests)
    assert not engine._waiters
    for completion, request in zip(engine.generate(requests), requests):
        assert_matches(completion, *reference(tiny, request.prompt_token_ids))
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("call", ["poll", "finished"])
def test_completions_a_poll_took_before_an_interrupt_go_back(tiny, call):
    """Taken off the outbox, then interrupted before the return: gone for good."""
    engine = make_engine(tiny.dir(FAMILY))
    requests = greedy_requests(random_prompts([5, 6, 7], seed=2), 3)
    for request in requests:
        engine.submit(request)
    while engine.has_unfinished():
        engine.step()
    real, taken = engine._outbox.get_nowait, []

    def interrupted_after_the_first():
        if taken:
            raise KeyboardInterrupt
        taken.append(real())
        return taken[-1]
    engine._outbox.get_nowait = interrupted_after_the_first
    with pytest.raises(KeyboardInterrupt):
        getattr(engine, call)()
    del engine._outbox.get_nowait
    assert sorted(c.id for c in engine.poll()) == sorted(r.id for r in requests)
    assert_idle_and_clean(engine)


def test_the_stop_button_held_by_the_engine_lock_only_once_and_only_its_own(interruptible):
    """A second press raises at once (a step that will not end can still be stopped); Python's
    handler is back after the block; an application's own SIGINT handler is left to run."""
    lock, reached = StepLock(), []
    with pytest.raises(KeyboardInterrupt):
        with lock.step():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the first")
            signal.raise_signal(signal.SIGINT)
            reached.append("after the second")
    assert reached == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with lock.held():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen = []
    signal.signal(signal.SIGINT, lambda *_: seen.append("own handler"))
    with lock.held():
        signal.raise_signal(signal.SIGINT)
        assert seen == ["own handler"]


def test_a_request_id_that_looks_like_another_requests_sample_keeps_its_own_kv(tiny):
    """Sample 1 of request "r" and request "r#1" were both keyed "r#1" in the host KV tier and
    among the held sequences: suspending both lost one."""
    engine = make_engine(tiny.dir(FAMILY))
    prompts = random_prompts([9, 23], seed=13)
    engine.submit(Request("r", prompt_token_ids=prompts[0], params=SamplingParams(max_tokens=MAX_TOKENS, n=2, logprobs=0)))
    engine.submit(Request("r#1", prompt_token_ids=prompts[1], params=SamplingParams(max_tokens=MAX_TOKENS, logprobs=0)))
    for _ in range(3):
        engine.step()
    assert engine.suspend("r#1") == 1 and engine.suspend("r") == 2
    assert engine.resume("r") == 2 and engine.resume("r#1") == 1
    done = {c.id: c for c in engine.completions()}
    assert sorted(done) == ["r", "r#1"]
    tokens, _ = reference(tiny, prompts[0])
    assert [o.token_ids for o in done["r"].outputs] == [tokens, tokens]
    assert_matches(done["r#1"], *reference(tiny, prompts[1]))
    assert_idle_and_clean(engine)


# ---- admission order ------------------------------------------------------------------------

@pytest.mark.parametrize("admission,order", [("fifo", ["a", "b", "c"]),
                                             ("longest_first", ["b", "c", "a"]),
                                             ("shortest_first", ["a", "c", "b"])])
def test_admission_order(tiny, admission, order):
    engine = make_engine(tiny.dir(FAMILY), max_num_seqs=1, admission=admission)
    prompts = random_prompts([10, 30, 20], seed=11)
    requests = [Request(name, prompt_token_ids=p, params=SamplingParams(max_tokens=5, ignore_eos=True))
                for name, p in zip("abc", prompts)]
    results = engine.generate(requests)
    by_start = sorted(results, key=lambda c: c.timings.first_scheduled)
    assert [c.id for c in by_start] == order
    for completion, prompt in zip(results, prompts):
        assert len(completion.token_ids) == 5


@pytest.mark.parametrize("admission", ["fifo", "longest_first", "shortest_first"])
def test_a_long_queue_is_sorted_when_it_changes_not_every_step(tiny, admission):
    """Each key once per request that joins (the steps between admit nothing new): sorting the
    whole queue every step made a job of N requests cost O(N^2 / max_num_seqs) keys."""
    engine = make_engine(tiny.dir(FAMILY), max_num_seqs=2, admission=admission)
    keys = CallCounter(engine.scheduler, "admission_key")
    requests = greedy_requests(random_prompts([3 + i % 7 for i in range(60)], seed=13), 3, ignore_eos=True)
    assert all(not c.error for c in engine.generate(requests))
    assert len(keys) <= 2 * len(requests), len(keys)
    assert_idle_and_clean(engine)


def test_completions_iterator_does_not_end_before_the_last_delivery(tiny):
    """The background loop may be descheduled between finishing a request and queueing its
    completion; completions() must still yield it (widened here by a slow delivery)."""
    engine = make_engine(tiny.dir(FAMILY))
    deliver = engine._deliver

    def slow_deliver(completion):
        time.sleep(0.05)
        deliver(completion)

    engine._deliver = slow_deliver
    engine.start()
    try:
        for request in greedy_requests(random_prompts([5, 10, 15], seed=12), 4, ignore_eos=True):
            engine.submit(request)
        ids = sorted(c.id for c in engine.completions())
    finally:
        engine.stop()
    assert ids == ["r0", "r1", "r2"]


@pytest.mark.parametrize("background", [False, True], ids=["caller-drives", "background-loop"])
def test_generate_of_no_requests_returns_an_empty_list(tiny, background):
    engine = make_engine(tiny.dir(FAMILY))
    if background:
        engine.start()
    outcome = []

    def call():
        try:
            outcome.append(engine.generate([]))
        except BaseException as error:  # noqa: BLE001 - asserted below
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=1.5)
    hung = caller.is_alive()
    engine.stop()  # also releases a hung caller (it then drives the loop itself and fails)
    caller.join(timeout=3)
    assert not hung, "generate([]) did not return"
    assert outcome == [[]]


def test_finished_takes_what_is_done_without_running_a_step(tiny):
    engine = make_engine(tiny.dir(FAMILY))
    engine.submit(greedy_requests(random_prompts([6], seed=14), 3, ignore_eos=True)[0])
    assert engine.finished() == [] and engine.stats.steps == 0
    while engine.step():
        pass
    assert [c.id for c in engine.finished()] == ["r0"]
    assert engine.finished() == []


def test_a_cuda_device_torch_cannot_see_is_refused_naming_it(tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda': this torch .* sees no CUDA device"):
        make_engine(tiny.dir("llama"), device="cuda")


def test_a_dtype_the_triton_kernels_have_no_tiles_for_is_refused_on_cuda(tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any CUDA call
    with pytest.raises(ValueError, match="dtype=torch.float64: CUDA runs the Triton kernels, which take"):
        make_engine(tiny.dir("llama"), device="cuda", dtype=torch.float64)


def test_finished_sequences_are_freed_without_waiting_for_the_garbage_collector(tiny_chat, monkeypatch):
    """A sequence's coroutine frame holds the sequence: unless the engine breaks that cycle when
    it ends, every finished one (and its grammar matcher's native memory) waits for a full
    collection, which a busy worker seldom runs."""
    import gc
    import weakref

    from runtime.sequence import Sequence

    made = []
    init = Sequence.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Sequence, "__init__", recording)
    engine = make_engine(tiny_chat.dir(FAMILY))
    requests = [Request(f"r{i}", prompt="Hi", params=SamplingParams(max_tokens=3, n=1 + i % 2, regex="[a-z]+"))
                for i in range(6)]
    gc.disable()
    try:
        engine.generate(requests)
        engine.submit(Request("moved", prompt="Hi there", params=SamplingParams(max_tokens=20, ignore_eos=True)))
        engine.step()
        engine.migrate_out("moved")
        assert len(made) == 10 and [ref() for ref in made] == [None] * 10
    finally:
        gc.enable()


def test_a_script_that_exits_while_the_loop_steps_exits_with_its_own_status(tiny_chat):
    """The loop thread is a daemon: left inside a torch op while the interpreter finalizes, it
    aborted the process (status 134, "terminate called without an active exception")."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    script = f"""
import sys, time
sys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]
import torch
torch.set_num_threads(1)
from helpers import make_engine
from runtime import Request, SamplingParams
engine = make_engine({str(tiny_chat.dir(FAMILY))!r}).start()
for i in range(2000):
    engine.submit(Request(f"r{{i}}", prompt="Hi there", params=SamplingParams(max_tokens=50, ignore_eos=True)))
time.sleep(0.5)
sys.exit(3)
"""
    statuses = [subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120).returncode
                for _ in range(2)]
    assert statuses == [3, 3]


def test_a_request_s_samples_count_against_max_num_seqs(tiny_chat):
    """Sample 0 of n forks the others once prefilled: it is admitted only with room for all n
    (vLLM counts each sample), unless nothing else runs."""
    engine = make_engine(tiny_chat.dir(FAMILY), max_num_seqs=4)
    for i in range(3):
        engine.submit(Request(f"r{i}", prompt="Hi", params=SamplingParams(max_tokens=6, n=3, temperature=1.0,
                                                                         seed=i, ignore_eos=True)))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3 and sorted(c.id for c in engine.finished()) == ["r0", "r1", "r2"]
    alone = make_engine(tiny_chat.dir(FAMILY), max_num_seqs=2)
    [done] = alone.generate([Request("n5", prompt="Hi", params=SamplingParams(max_tokens=3, n=5, temperature=1.0))])
    assert len(done.outputs) == 5  # above the limit: it runs alone


def test_a_resumed_request_waits_for_room_beside_an_unforked_one(tiny_chat):
    """A held request resumed while sample 0 of n is still prefilling (in chunks) takes a seat
    only where all n samples leave one: the fork would run past max_num_seqs."""
    engine = make_engine(tiny_chat.dir(FAMILY), max_num_seqs=2, max_num_batched_tokens=8)
    engine.submit(Request("held", prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(max_tokens=40, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.suspend("held")
    engine.submit(Request("two", prompt_token_ids=list(range(10, 70)),
                          params=SamplingParams(max_tokens=10, n=2, temperature=1.0, ignore_eos=True)))
    engine.step()  # admitted: two seats, prefilling 8 tokens a step
    engine.resume("held")
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 2 and sorted(c.id for c in engine.finished()) == ["held", "two"]
