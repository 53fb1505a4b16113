"""Greedy output of the engine is token-exact with transformers (and logprobs within 1e-4) on
tiny models of every supported family, also when prompts are prefilled in chunks, share cached
prefix blocks, or are preempted (suspended to the host tier or evicted and recomputed)."""

import json
import re

import pytest
import torch

from helpers import (EOS, BatchSpy, CallCounter, assert_idle_and_clean, assert_matches, collect,
                     greedy_requests, make_engine, random_prompts)
from runtime import Request, SamplingParams
from tiny_models import FAMILIES, hf_greedy, hf_model, image_text_config, make_tiny_model, make_tiny_tokenizer

MAX_TOKENS = 24
# Lengths straddle block boundaries (block_size 16) and Mistral's sliding window (24).
LENGTHS = (1, 5, 16, 17, 33, 64, 100)
PROMPTS = random_prompts(LENGTHS, seed=0)


def expected(tiny, family, prompt, max_tokens=MAX_TOKENS):
    return tiny.greedy(family, prompt, max_tokens)


def check_all(tiny, family, prompts, completions, max_tokens=MAX_TOKENS):
    assert [c.id for c in completions] == [f"r{i}" for i in range(len(prompts))]
    for prompt, completion in zip(prompts, completions):
        tokens, logprobs = expected(tiny, family, prompt, max_tokens)
        assert completion.prompt_tokens == len(prompt)
        assert completion.completion_tokens == len(tokens)
        assert_matches(completion, tokens, logprobs, max_tokens=max_tokens)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers(tiny, family):
    engine = make_engine(tiny.dir(family))
    completions = engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    check_all(tiny, family, PROMPTS, completions)
    assert engine.stats.prefill_tokens == sum(LENGTHS)  # nothing cached in a fresh engine
    assert engine.stats.decode_tokens == sum(c.completion_tokens - 1 for c in completions)
    assert_idle_and_clean(engine)


def test_longrope_runs_to_its_original_context_with_the_short_factors(tmp_path):
    """Phi-3's 128k variants: within original_max_position_embeddings transformers turns every
    position with the short factors (and LongRoPE's attention scaling); the engine stops there."""
    from tiny_models import hf_model

    rotary_half = 6  # of Phi-3's tiny head: 16 dims, 0.75 of them rotary
    directory = make_tiny_model("phi3", tmp_path / "phi3-longrope", original_max_position_embeddings=160,
                                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                     partial_rotary_factor=0.75,
                                                     short_factor=[1.0 + i for i in range(rotary_half)],
                                                     long_factor=[9.0] * rotary_half))
    engine = make_engine(directory)
    assert engine.max_model_len == 160
    oracle = hf_model(directory)
    for prompt, ours in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))):
        tokens, logprobs = hf_greedy(oracle, prompt, MAX_TOKENS)
        assert_matches(ours, tokens, logprobs, max_tokens=MAX_TOKENS)
    [too_long] = engine.generate(greedy_requests(random_prompts((161,), seed=1), 4))
    assert too_long.finish_reason == "error"


@pytest.mark.parametrize("kind", ["gemma3", "mistral3"])
def test_an_image_text_model_runs_its_language_model_on_text(tmp_path, kind):
    """Gemma 3 4B-27B and Mistral Small 3.1 are image-text checkpoints: the engine runs their
    language model (its text_config, its tensors under language_model.) on text prompts, as
    transformers does."""
    import torch
    import transformers

    from tiny_models import hf_greedy

    torch.manual_seed(0)
    config = image_text_config(kind)
    if kind == "gemma3":  # read by the text-only Gemma3ForCausalLM; the image-text model caps nothing
        config.text_config.final_logit_softcapping = 3.0
    oracle = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, param in oracle.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param), alpha=0.1)
    oracle.save_pretrained(tmp_path)
    engine = make_engine(tmp_path)
    for prompt, ours in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))):
        tokens, logprobs = hf_greedy(oracle, prompt, MAX_TOKENS)
        assert_matches(ours, tokens, logprobs, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("kind", ["gemma3", "mistral3"])
def test_an_image_text_model_stops_at_the_whole_model_s_eos_ids(tmp_path, kind):
    """gemma-3-*-it's config.json names its eos ids ([1, 106]) at the top level, not in its
    text_config: transformers' generate stops at those first, with no generation_config.json."""
    import json

    import transformers

    transformers.AutoModelForImageTextToText.from_config(image_text_config(kind)).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = [2, 7]
    config["text_config"].pop("eos_token_id", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert set(make_engine(tmp_path).stop_rule.eos_token_ids) == set(expected.eos_token_id) == {2, 7}


@pytest.mark.parametrize("generation_config", [True, False])
def test_the_tokenizers_eos_token_ends_a_completion_too(tmp_path, generation_config):
    """A chat fine-tune's tokenizer names <|im_end|> its eos_token while its configs still name
    the base model's <|endoftext|>: vLLM stops at both (and bans both under min_tokens); we ran
    on past <|im_end|> to max_tokens."""
    tokenizer = make_tiny_tokenizer(tmp_path)
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert tokenizer.eos_token_id == im_end != endoftext
    make_tiny_model("llama", tmp_path, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=endoftext)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    if generation_config:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    engine = make_engine(tmp_path)
    assert engine.stop_rule.eos_token_ids == {endoftext, im_end}
    favoured = {im_end: 100.0}
    [stopped, banned] = engine.generate([
        Request("stopped", prompt="Hi", params=SamplingParams(max_tokens=8, logit_bias=favoured)),
        Request("banned", prompt="Hi", params=SamplingParams(max_tokens=8, min_tokens=3, logit_bias=favoured))])
    assert stopped.token_ids == [im_end] and stopped.outputs[0].finish_reason == "stop"
    assert im_end not in banned.token_ids[:3] and banned.token_ids[3] == im_end


def test_only_the_tokenizers_eos_ends_a_completion_without_a_stop_reason(tmp_path):
    """vLLM folds the configs' EOS ids other than the tokenizer's into stop_token_ids and
    reports the one that ended a completion (Llama 3's <|eom_id|> beside <|eot_id|>); we gave
    None for all of them."""
    tokenizer = make_tiny_tokenizer(tmp_path)
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    make_tiny_model("llama", tmp_path, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=endoftext)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [endoftext, im_end]}))
    engine = make_engine(tmp_path)
    ended = {}
    for eos in (endoftext, im_end):
        params = SamplingParams(max_tokens=8, logit_bias={eos: 100.0})
        [completion] = engine.generate([Request("r", prompt="Hi", params=params)])
        assert completion.token_ids == [eos] and completion.outputs[0].finish_reason == "stop"
        ended[eos] = completion.outputs[0].stop_reason
    assert ended == {endoftext: endoftext, im_end: None}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_top_logprobs_are_the_models_distribution(tiny, family):
    prompt = PROMPTS[4]
    engine = make_engine(tiny.dir(family))
    [completion] = engine.generate([Request("r", prompt_token_ids=prompt,
                                            params=SamplingParams(max_tokens=MAX_TOKENS, logprobs=3))])
    tokens, logprobs = expected(tiny, family, prompt)
    assert_matches(completion, tokens, logprobs)
    top = completion.outputs[0].top_logprobs
    assert len(top) == len(tokens)
    for token, logprob, step_top in zip(tokens, completion.logprobs, top):
        assert len(step_top) == 3
        values = list(step_top.values())
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert next(iter(step_top)) == token
        assert step_top[token] == pytest.approx(logprob, abs=1e-6)


def test_logprobs_off_by_default(tiny):
    engine = make_engine(tiny.dir("qwen2"))
    [completion] = engine.generate([Request("r", prompt_token_ids=PROMPTS[2],
                                            params=SamplingParams(max_tokens=5))])
    assert completion.logprobs is None and completion.outputs[0].top_logprobs is None
    assert completion.token_ids == expected(tiny, "qwen2", PROMPTS[2], 5)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_screened_greedy_matches_transformers(tiny, family):
    """Greedy rows without logprobs take their token from the bf16 screen verified in fp32
    (runtime/logit_screen.py): still transformers' greedy output."""
    engine = make_engine(tiny.dir(family), greedy_screen=True)
    requests = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=MAX_TOKENS))
                for i, p in enumerate(PROMPTS)]
    completions = engine.generate(requests)
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.token_ids == expected(tiny, family, prompt)[0], completion.id
    # a row for each token, and one for each draft token that was not (runtime/speculate.py)
    stats = engine.stats
    rejected = stats.draft_tokens - stats.accepted_draft_tokens
    assert stats.screened_rows == sum(c.completion_tokens for c in completions) + rejected


# ---- chunked prefill -----------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_matches_transformers(tiny, family):
    budget = 8
    engine = make_engine(tiny.dir(family), max_num_batched_tokens=budget)
    spy = BatchSpy(engine)
    completions = engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    check_all(tiny, family, PROMPTS, completions)
    assert max(step["num_tokens"] for step in spy.steps) <= budget
    for i, length in enumerate(LENGTHS):
        chunks = spy.prefill_chunks(f"r{i}")
        # The chunks tile the prompt in order, each within the budget.
        assert [start for start, _ in chunks] == [sum(n for _, n in chunks[:j]) for j in range(len(chunks))]
        assert sum(n for _, n in chunks) == length
        assert len(chunks) >= -(-length // budget)
    assert_idle_and_clean(engine)


def test_long_prompt_needs_several_steps_before_its_first_token(tiny):
    prompt = random_prompts([40], seed=5)[0]
    engine = make_engine(tiny.dir("mistral"), max_num_batched_tokens=8)
    engine.submit(Request("r0", prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=MAX_TOKENS, logprobs=0)))
    spy = BatchSpy(engine)
    steps = 0
    while not spy.steps or not spy.steps[-1]["prefills"] or spy.prefill_chunks("r0")[-1][0] + 8 < 40:
        assert engine.step()
        steps += 1
    assert steps == 5
    assert engine.stats.prefill_tokens == 40 and engine.stats.decode_tokens == 0
    assert engine.stats.steps == 5
    done = {c.id: c for c in engine.completions()}
    assert_matches(done["r0"], *expected(tiny, "mistral", prompt), max_tokens=MAX_TOKENS)
    assert spy.prefill_chunks("r0") == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]


# ---- prefix caching ------------------------------------------------------------------------

SHARED = random_prompts([48], seed=11)[0]  # three full blocks
SUFFIXES = random_prompts([7, 0, 16, 30], seed=12)
PREFIXED = [SHARED + s for s in SUFFIXES]


def cached_tokens(prompt, shared_len=48, block_size=16):
    """Tokens of `prompt` a prefix cache holding `shared_len` tokens can serve (whole blocks,
    always leaving one token to compute)."""
    return min(shared_len, (len(prompt) - 1) // block_size * block_size)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "smollm"])
def test_prefix_cache_reuses_blocks_of_a_finished_request(tiny, family):
    engine = make_engine(tiny.dir(family))
    match = CallCounter(engine.scheduler.blocks, "match_prefix")
    [first] = engine.generate(greedy_requests(PREFIXED[:1], MAX_TOKENS))
    check_all(tiny, family, PREFIXED[:1], [first])
    before = engine.stats.prefill_tokens
    assert before == len(PREFIXED[0])

    rest = PREFIXED[1:]
    completions = engine.generate(greedy_requests(rest, MAX_TOKENS))
    check_all(tiny, family, rest, completions)
    # Only the uncached tokens were computed.
    assert engine.stats.prefill_tokens - before == sum(len(p) - cached_tokens(p) for p in rest)
    assert len(match) == len(PREFIXED)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_prefix_blocks_shared_with_a_running_request(tiny, family):
    engine = make_engine(tiny.dir(family))
    requests = greedy_requests(PREFIXED, MAX_TOKENS)
    engine.submit(requests[0])
    assert engine.step()  # r0 prefilled: its three prefix blocks are now registered
    [r0] = engine.scheduler.running
    prefix_blocks = r0.block_table[:3]
    for request in requests[1:]:
        engine.submit(request)
    assert engine.step()
    blocks = engine.scheduler.blocks
    others = [s for s in engine.scheduler.running if s.request_id != "r0"]
    assert len(others) == 3
    for seq in others:
        n = cached_tokens(seq.token_ids[:seq.num_prompt_tokens]) // 16
        assert seq.block_table[:n] == prefix_blocks[:n]
    assert [blocks.ref_counts[b] for b in prefix_blocks] == [4, 4, 3]  # r1 (48 tokens) reuses 2
    assert engine.stats.prefill_tokens == len(PREFIXED[0]) + sum(
        len(p) - cached_tokens(p) for p in PREFIXED[1:])
    done = {c.id: c for c in engine.completions()}
    check_all(tiny, family, PREFIXED, [done[f"r{i}"] for i in range(len(PREFIXED))])
    assert_idle_and_clean(engine)


def test_prefix_caching_disabled_recomputes_everything(tiny):
    engine = make_engine(tiny.dir("qwen2"), enable_prefix_caching=False)
    engine.generate(greedy_requests(PREFIXED[:1], MAX_TOKENS))
    completions = engine.generate(greedy_requests(PREFIXED[1:], MAX_TOKENS))
    check_all(tiny, "qwen2", PREFIXED[1:], completions)
    assert engine.stats.prefill_tokens == sum(len(p) for p in PREFIXED)
    assert not engine.scheduler.blocks.by_hash


# ---- preemption ----------------------------------------------------------------------------

PRESSURE = random_prompts((10, 15, 20, 15, 30, 12, 14, 40, 100), seed=21)
PRESSURE_TOKENS = 40


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("mode", ["suspend", "evict"])
def test_preemption_under_a_tiny_kv_budget_matches_transformers(tiny, family, mode):
    directory = tiny.dir(family)
    # 10 blocks (160 tokens): the nine sequences need 30 blocks together.
    engine = make_engine(directory, num_blocks=10, preemption=mode)
    assert engine.kv.num_blocks == 10
    preempt = CallCounter(engine.scheduler, "preempt")
    suspend = CallCounter(engine.scheduler, "suspend")
    evict = CallCounter(engine.scheduler, "evict")
    completions = engine.generate(greedy_requests(PRESSURE, PRESSURE_TOKENS))
    check_all(tiny, family, PRESSURE, completions, PRESSURE_TOKENS)
    assert len(preempt) >= 4
    if mode == "suspend":
        assert len(suspend) == len(preempt) and len(evict) == 0
    else:
        assert len(evict) == len(preempt) and len(suspend) == 0
    assert_idle_and_clean(engine)


def test_suspend_preemption_falls_back_to_evict_when_the_host_tier_is_full(tiny):
    directory = tiny.dir("qwen2")
    engine = make_engine(directory, num_blocks=10, host_kv_bytes=0,
                    preemption="suspend")
    preempt = CallCounter(engine.scheduler, "preempt")
    suspend = CallCounter(engine.scheduler, "suspend")
    completions = engine.generate(greedy_requests(PRESSURE, PRESSURE_TOKENS))
    check_all(tiny, "qwen2", PRESSURE, completions, PRESSURE_TOKENS)
    assert len(preempt) >= 4 and len(suspend) == 0
    assert_idle_and_clean(engine)


def test_preemption_combined_with_chunked_prefill_and_prefix_sharing(tiny):
    directory = tiny.dir("mistral")
    prompts = PREFIXED + PRESSURE[:3]
    engine = make_engine(directory, num_blocks=10,
                    max_num_batched_tokens=20, preemption="suspend")
    preempt = CallCounter(engine.scheduler, "preempt")
    completions = engine.generate(greedy_requests(prompts, MAX_TOKENS))
    check_all(tiny, "mistral", prompts, completions)
    assert len(preempt) >= 1
    assert_idle_and_clean(engine)


def test_a_prompt_is_admitted_when_all_of_it_fits_not_its_first_chunk(tiny):
    """Prompts that fit the cache only one or two at a time, prefilled in chunks: admitted on
    its first chunk, a prompt was preempted by its own later chunks (it is the most recent)
    and recomputed again and again (3.4x the prompt tokens here)."""
    family = "llama"
    prompts = random_prompts((100, 120, 90, 130), seed=3)
    engine = make_engine(tiny.dir(family), num_blocks=10, max_num_batched_tokens=24,
                         preemption="evict", enable_prefix_caching=False)
    completions = engine.generate(greedy_requests(prompts, 20))
    check_all(tiny, family, prompts, completions, 20)
    assert engine.stats.prefill_tokens <= 1.25 * sum(len(p) for p in prompts)
    assert_idle_and_clean(engine)


def test_a_resumed_sequence_swaps_in_once_all_of_it_fits(tiny):
    """r0, held on the host mid-prefill, is resumed with room for what it computed but not for
    its next chunk: swapped in on that room, its chunk preempted it (the most recent) back out,
    step after step, its KV copied in and out each time."""
    prompts = random_prompts((40, 17), seed=1)
    engine = make_engine(tiny.dir("qwen2"), num_blocks=3, max_num_batched_tokens=15, preemption="suspend")
    swaps = CallCounter(engine.scheduler, "swap_in")
    held, other = greedy_requests(prompts, 6)  # 46 tokens of the 48 the cache holds
    engine.submit(held)
    engine.step()  # its first chunk
    assert engine.suspend(held.id) == 1
    engine.submit(other)
    engine.step()
    engine.resume(held.id)
    done = collect(engine)
    check_all(tiny, "qwen2", prompts, [done[held.id], done[other.id]], 6)
    assert len(swaps) == 1
    assert_idle_and_clean(engine)


def test_max_num_seqs_bounds_the_running_set(tiny):
    engine = make_engine(tiny.dir("qwen2"), max_num_seqs=2)
    spy = BatchSpy(engine)
    completions = engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    check_all(tiny, "qwen2", PROMPTS, completions)
    assert max(len(s["decodes"]) + len(s["prefills"]) for s in spy.steps) == 2
    assert EOS not in PROMPTS[0]


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes_with_chunks_prefix_sharing_and_preemption(tiny, block_size):
    family = "llama"
    prompts = PREFIXED + PROMPTS[4:]
    engine = make_engine(tiny.dir(family), num_blocks=160 // block_size, block_size=block_size,
                         max_num_batched_tokens=24)
    assert engine.kv.block_size == block_size and engine.max_model_len == 160
    preempt = CallCounter(engine.scheduler, "preempt")
    completions = engine.generate(greedy_requests(prompts, MAX_TOKENS))
    check_all(tiny, family, prompts, completions)
    assert len(preempt) >= 1
    # Preempted sequences were suspended (nothing recomputed) and cached prefix blocks reused.
    assert engine.stats.prefill_tokens < sum(len(p) for p in prompts)
    assert_idle_and_clean(engine)


def test_a_config_transformers_cannot_read_names_its_file(tmp_path):
    """Phi-3-mini-128k's first revision ("su" rope scaling without the original context among
    its parameters): transformers' bare KeyError named no file."""
    from runtime.config import load_hf_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 131072,
        "rope_scaling": {"type": "su", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}}))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: transformers cannot read this config \(KeyError: "):
        load_hf_config(tmp_path)
    # huggingface_hub's strict dataclass checks raise none of KeyError, TypeError, ValueError.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": "four"}))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: transformers cannot read this config"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("overrides,problem", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported yet"),
    (dict(hidden_act="relu2"), "hidden_act 'relu2' is not supported yet"),
    (dict(model_type="mixtral", hidden_act="gelu"), "hidden_act 'gelu' is not supported yet"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(sliding_window=8, max_position_embeddings=64), "sliding_window 8 on model_type 'llama'"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), r"quantization_config \(gptq\)"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor with rope_type 'linear'"),
], ids=["model_type", "hidden_act", "moe-gelu", "bidirectional", "foreign-window",
        "quantised", "partial-rotary-off-phi3"])
def test_a_config_we_would_compute_wrong_is_refused(overrides, problem):
    """Load-time refusal, never a model that runs and differs from transformers."""
    from transformers import AutoConfig

    from runtime.config import model_spec, rope_cos_sin

    model_type = overrides.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4,
                                  num_hidden_layers=1, **overrides)
    with pytest.raises(NotImplementedError, match=problem):
        rope_cos_sin(config, model_spec(config).head_dim, 16)


def test_a_rope_type_transformers_does_not_know_is_refused_by_name(tmp_path):
    directory = make_tiny_model("qwen2", tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="rope_type 'mrope' is not supported"):
        make_engine(directory)


PER_LAYER_TYPE_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                      "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}


@pytest.mark.parametrize("family", ["qwen2", "ministral", "gemma2", "smollm3"])
def test_rope_parameters_per_layer_type_are_refused_where_transformers_reads_one_set(tmp_path, family):
    """transformers' model of these families fails on such a config (KeyError 'rope_type'):
    whatever we ran, nothing could check it. Gemma 3 and OLMo 3 read them per layer type."""
    directory = make_tiny_model(family, tmp_path / "m", layer_types=["sliding_attention", "full_attention"],
                                sliding_window=8)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = PER_LAYER_TYPE_ROPE
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=f"model_type '{family}' with rope_parameters per layer type"):
        make_engine(directory)


@pytest.mark.parametrize("family", ["gemma3", "olmo3"])
def test_rope_parameters_per_layer_type_match_transformers_where_it_reads_them(tmp_path, family):
    directory = make_tiny_model(family, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = PER_LAYER_TYPE_ROPE
    (directory / "config.json").write_text(json.dumps(config))
    prompt = random_prompts([9], seed=4)[0]
    expected = hf_greedy(hf_model(directory), prompt, 8)
    assert_matches(make_engine(directory).generate(greedy_requests([prompt], max_tokens=8))[0], *expected)


@pytest.mark.parametrize("bound", ["max_model_len", "kv_cache"])
def test_rope_tables_cover_the_context_the_engine_runs_not_the_models_whole_range(tmp_path, bound):
    """A 1M-position model (Qwen2.5-1M) would build gigabytes of tables no step reads."""
    directory = make_tiny_model("llama", tmp_path / "m", max_position_embeddings=1 << 20)
    engine = (make_engine(directory, max_model_len=40) if bound == "max_model_len"
              else make_engine(directory, num_blocks=5, block_size=16))
    assert engine.max_model_len == (40 if bound == "max_model_len" else 80)
    tables = [buffer for name, buffer in engine.model.named_buffers() if name.startswith("rope_")]
    assert tables and all(len(table) == engine.max_model_len for table in tables)
    prompt = random_prompts([30], seed=5)[0]
    expected = hf_greedy(hf_model(directory), prompt, engine.max_model_len - 30)
    assert_matches(engine.generate(greedy_requests([prompt], max_tokens=100))[0], *expected)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dynamic_rope_matches_transformers_up_to_the_context_end(tiny, family):
    """transformers rescales dynamic RoPE only past max_position_embeddings, where our context
    ends: up to there its initial table holds, the longest prompt here running to the end."""
    overrides = dict(max_position_embeddings=124,
                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    engine = make_engine(tiny.dir(family, **overrides))
    assert engine.max_model_len == 124
    for prompt, ours in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))):
        tokens, logprobs = tiny.greedy(family, prompt, MAX_TOKENS, **overrides)
        assert_matches(ours, tokens, logprobs, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo3", "qwen2"])
def test_sliding_layers_without_a_window_are_refused(model_type):
    """transformers' model raises on them; we must not run them as full attention."""
    from transformers import AutoConfig

    from runtime.config import model_spec

    config = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                  layer_types=["sliding_attention", "full_attention"])
    config.sliding_window = None
    with pytest.raises(ValueError, match="sliding_window is not set"):
        model_spec(config)


def test_sliding_layers_with_the_window_switched_off_are_refused():
    """Qwen2-MoE's config stores a switched-off window as 0, not None; transformers' model
    fails on sliding layers then, as on those without a window."""
    from transformers import AutoConfig

    from runtime.config import model_spec

    config = AutoConfig.for_model("qwen2_moe", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                  use_sliding_window=False, sliding_window=24,
                                  layer_types=["sliding_attention", "full_attention"])
    assert config.sliding_window == 0
    with pytest.raises(ValueError, match="sliding_window is not set"):
        model_spec(config)


def test_a_key_only_other_families_read_changes_nothing():
    """use_bidirectional_attention: Gemma's models read it (refused above); Llama's never do."""
    from transformers import AutoConfig

    from runtime.config import model_spec

    def spec(**extra):
        return model_spec(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4,
                                               num_hidden_layers=1, **extra))

    assert spec(use_bidirectional_attention=True) == spec()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_norms_in_half_precision_round_once_as_transformers_does(tiny, family, dtype):
    """transformers scales the fp32 normalised x by 1 + weight in fp32, then rounds (Llama's
    norm rounds x first): every Gemma norm, q/k norms too, gives its output bit for bit."""
    import transformers

    from runtime.loader import load_model
    from runtime.model import RMSNorm

    ours = load_model(tiny.dir(family), dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny.dir(family), dtype=dtype).eval()
    theirs = dict(hf.model.named_modules())
    checked = 0
    x = torch.randn(8, 5, ours.spec.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    for name, module in ours.named_modules():
        if isinstance(module, RMSNorm):
            rows = x[..., :module.weight.shape[0]]
            with torch.no_grad():
                assert torch.equal(module(rows), theirs[name](rows)), name
            checked += 1
    assert checked > 2 * ours.spec.num_layers
    engine = make_engine(tiny.dir(family), dtype=dtype)
    [completion] = engine.generate(greedy_requests(PROMPTS[:1], 4))
    assert completion.error is None and len(completion.token_ids) == 4


@pytest.mark.parametrize("family,overrides", [
    ("gemma", {"hidden_size": 72}),  # sqrt(72) is no bf16 value: the embedding scale rounds first
    ("gemma3", {"hidden_size": 72}),
    ("olmo2", {}), ("olmo3", {}),  # norms scale the fp32 normalised x; q, k rotate in fp32
    ("mixtral", {}),  # router weights stay fp32
    ("qwen3_moe", {"num_experts_per_tok": 4}),  # a token's k expert outputs summed, rounded once
    ("granite", {}), ("gemma2", {}),  # logits scaled / soft-capped in the model's dtype
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_where_transformers_rounds(tiny, monkeypatch, family, overrides, dtype):
    """On the torch kernels, bit for bit: every family-specific rounding step in its place."""
    import transformers

    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "torch")
    model_dir = tiny.dir(family, **overrides)
    prompt = PROMPTS[4][:40]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    expected = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    [scored] = make_engine(model_dir, dtype=dtype).generate(
        [Request("p", prompt_token_ids=prompt, params=SamplingParams(max_tokens=1, prompt_logprobs=0))])
    assert scored.prompt_logprobs[1:] == expected


@pytest.mark.parametrize("model_type,window", [("mistral", 0), ("mistral", -4), ("qwen3", 0), ("gemma2", 0)])
def test_a_window_of_no_tokens_is_refused(model_type, window):
    """A window of 0 masked every key on one path and failed mid-run on another."""
    from transformers import AutoConfig

    from runtime.config import model_spec

    config = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    config.sliding_window = window
    config.use_sliding_window = True
    with pytest.raises(ValueError, match=rf"sliding_window must be a whole number of tokens >= 1 .*got {window}"):
        model_spec(config)


def test_longrope_given_per_layer_type_bounds_the_context_too():
    """Gemma 3 / OLMo 3 give RoPE parameters per layer type: a LongRoPE table among them
    switches to its long factors past original_max_position_embeddings, as the flat one does."""
    from transformers import AutoConfig

    from runtime.config import model_spec

    longrope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                    original_max_position_embeddings=64)
    for model_type in ("gemma3_text", "olmo3"):
        config = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, head_dim=16,
                                      num_hidden_layers=2, max_position_embeddings=512,
                                      layer_types=["sliding_attention", "full_attention"],
                                      rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 10000.0},
                                                       "full_attention": longrope})
        assert model_spec(config).max_position_embeddings == 64


# Keys of another family's config, which this family's transformers model never reads (some
# checkpoints carry them): each would change our output if we honoured it. Mistral and Mixtral
# have no use_sliding_window switch, so their window applies whatever it says.
@pytest.mark.parametrize("family,overrides", [
    ("llama", dict(attention_multiplier=0.5, logits_scaling=2.0, final_logit_softcapping=1.0,
                   embedding_multiplier=3.0, residual_multiplier=0.5, qkv_bias=True)),
    ("qwen3", dict(clip_qkv=0.05, mlp_bias=True)),
    ("gemma", dict(query_pre_attn_scalar=4, hidden_activation="gelu")),
    ("gemma3", dict(attn_logit_softcapping=0.5)),
    ("qwen2_moe", dict(attention_bias=True)),
    ("mixtral", dict(shared_expert_intermediate_size=32)),  # only Qwen2-MoE has a shared expert
    ("mistral", dict(sliding_window=4, use_sliding_window=False)),
    ("mixtral", dict(sliding_window=4, use_sliding_window=False)),
    ("llama", dict(sliding_window=4096)),  # past the context: transformers' cache keeps it all
    ("llama", dict(no_rope_layers=[0, 0])),  # SmolLM3's layers without RoPE
    # SmolLM3's switch only picks its default layer types; Qwen2-MoE's config makes its window 0.
    ("smollm3", dict(use_sliding_window=False, layer_types=["full_attention", "sliding_attention"])),
    ("qwen2_moe", dict(use_sliding_window=False, sliding_window=32768)),
])
def test_config_keys_the_familys_model_ignores_are_ignored(tiny, family, overrides):
    engine = make_engine(tiny.dir(family, **overrides))
    completions = engine.generate(greedy_requests(PROMPTS, MAX_TOKENS))
    for prompt, completion in zip(PROMPTS, completions):
        tokens, logprobs = tiny.greedy(family, prompt, MAX_TOKENS, **overrides)
        assert_matches(completion, tokens, logprobs, max_tokens=MAX_TOKENS)


def test_layer_types_leave_a_window_over_every_layer_where_the_family_reads_none(tiny):
    """Mixtral's model windows every layer whatever a stray layer_types says. transformers'
    generate trips over the key (its cache windows by it), so the oracle is its forward pass
    over the whole sequence, step by step."""
    overrides = dict(layer_types=["full_attention", "sliding_attention"])
    prompt = list(random_prompts([40], seed=5)[0])  # past the window of 24
    [completion] = make_engine(tiny.dir("mixtral", **overrides)).generate(greedy_requests([prompt], 6))
    model, ids = tiny.hf("mixtral", **overrides), list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert completion.token_ids == ids[len(prompt):]


@pytest.mark.parametrize("tensor,stored,problem", [
    ("model.layers.0.self_attn.q_proj.weight", lambda t: t.to(torch.int8), NotImplementedError),
    ("model.embed_tokens.weight", lambda t: t[:1], ValueError),  # would broadcast to every row
    ("model.norm.weight", lambda t: t[:1], ValueError),
])
def test_tensors_the_config_does_not_describe_are_refused_at_load(tiny, tmp_path, tensor, stored, problem):
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny.dir("llama"), model)
    tensors = load_file(model / "model.safetensors")
    tensors[tensor] = stored(tensors[tensor]).contiguous()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    match = (rf"{re.escape(str(model))}: {re.escape(tensor)} is stored as torch.int8: quantised" if problem is NotImplementedError
             else "in the checkpoint; the config makes it")
    with pytest.raises(problem, match=match):
        make_engine(model)


def test_model_safetensors_wins_over_an_index_left_from_an_earlier_sharded_save(tiny, tmp_path):
    """save_pretrained sharded, then whole into the same folder: transformers deletes the shards
    but leaves their index, and reads model.safetensors."""
    import shutil

    model = tmp_path / "resaved"
    shutil.copytree(tiny.dir("llama"), model)
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    prompt = random_prompts([9], seed=4)[0]
    [completion] = make_engine(model).generate(greedy_requests([prompt], 6))
    assert completion.token_ids == hf_greedy(tiny.hf("llama"), prompt, 6)[0]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_tensor_stored_in_two_weight_files_is_refused(tiny, tmp_path, streaming):
    """A folder of unindexed files (no model.safetensors): a stale copy beside the model would
    otherwise win or lose by its file name."""
    import shutil

    model = tmp_path / "two-copies"
    shutil.copytree(tiny.dir("llama"), model)
    (model / "model.safetensors").rename(model / "weights.safetensors")
    shutil.copy(model / "weights.safetensors", model / "weights-old.safetensors")
    with pytest.raises(ValueError, match="tensor '.*' is stored in more than one weight file"):
        make_engine(model, **({"weight_budget_bytes": 1 << 30} if streaming else {}))


@pytest.mark.parametrize("streaming", [False, True])
def test_a_tied_model_storing_its_matrix_as_the_lm_head_alone_loads(tiny, tmp_path, streaming):
    """transformers reads such a checkpoint's one matrix into the embedding and the head."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "head-only"
    shutil.copytree(tiny.dir("smollm"), model)
    tensors = load_file(model / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    prompt = random_prompts([9], seed=4)[0]
    engine = make_engine(model, **({"weight_budget_bytes": 1 << 30} if streaming else {}))
    [completion] = engine.generate(greedy_requests([prompt], 6))
    assert completion.token_ids == hf_greedy(tiny.hf("smollm"), prompt, 6)[0]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("differs", [False, True])
def test_a_tied_model_storing_a_head_of_its_own_uses_it_as_transformers_does(tiny, tmp_path, streaming, differs):
    """Both matrices stored: tied where they are equal, apart (transformers warns) where not."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    model = tmp_path / "own-head"
    shutil.copytree(tiny.dir("smollm"), model)
    tensors = load_file(model / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = torch.randn_like(embedding) if differs else embedding.clone()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    prompt = random_prompts([9], seed=4)[0]
    engine = make_engine(model, **({"weight_budget_bytes": 1 << 30} if streaming else {}))
    [completion] = engine.generate(greedy_requests([prompt], 6))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert completion.token_ids == hf_greedy(oracle, prompt, 6)[0]
    tied = engine.model.lm_head.weight is engine.model.embed_tokens.weight
    assert tied == (not differs)


def test_an_untied_model_missing_its_embedding_is_refused(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "no-embedding"
    shutil.copytree(tiny.dir("qwen2"), model)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.embed_tokens.weight"):
        make_engine(model)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_base_model_s_own_save_loads_as_transformers_loads_it(tiny, tmp_path, streaming):
    """LlamaModel.save_pretrained names tensors without "model."; transformers adds it back.
    Tied, it is the whole model; untied, it has no head (transformers would make one at random):
    refused, saying so."""
    import transformers

    from tiny_models import hf_model

    prompt = random_prompts([9], seed=4)[0]
    for family, tied in (("smollm", True), ("llama", False)):
        model = tmp_path / f"base-{family}"
        config = transformers.AutoConfig.from_pretrained(tiny.dir(family))
        assert config.tie_word_embeddings == tied
        torch.manual_seed(0)
        transformers.AutoModel.from_config(config).save_pretrained(model)
        args = {"weight_budget_bytes": 1 << 30} if streaming else {}
        if tied:
            [completion] = make_engine(model, **args).generate(greedy_requests([prompt], 6))
            assert completion.token_ids == hf_greedy(hf_model(model), prompt, 6)[0]
        else:
            with pytest.raises(KeyError, match="no tensor 'lm_head.weight' \\(a base model saved without its head"):
                make_engine(model, **args)


def test_an_index_naming_no_tensors_says_so(tiny, tmp_path):
    import shutil

    model = tmp_path / "empty-index"
    shutil.copytree(tiny.dir("llama"), model)
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ValueError, match="its weight_map names no tensors"):
        make_engine(model)


def test_a_path_that_is_not_a_model_directory_says_so(tmp_path):
    from runtime import Engine

    for missing in (tmp_path / "nowhere", tmp_path):
        with pytest.raises(FileNotFoundError, match=f"{missing}: not a model directory"):
            Engine(missing, num_threads=1)
