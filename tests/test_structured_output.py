"""Structured output (`json_schema`, `regex`, `choice`): completions are JSON that matches the
schema, text the regex matches, one of the choices. The oracle for greedy output is
transformers' logits, masked step by step by an independent llguidance matcher, then the
argmax."""

import itertools
import json
import logging
import pickle
import re

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from transformers import AutoTokenizer

from helpers import CallCounter, assert_idle_and_clean, collect, live_sequences, make_engine
from runtime import Request, SamplingParams
from runtime.structured import grammar_of
from tiny_models import hf_model

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["ok", "pick", "tags"], "additionalProperties": False}
PROMPTS = ["Tell me a story", "Hello there", "What is photosynthesis?"]


def matches_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"ok", "pick", "tags"}
            and isinstance(value["ok"], bool) and value["pick"] in ("red", "green", "blue")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 2
            and all(tag in ("a", "b") for tag in value["tags"]))


@torch.inference_mode()
def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                         defaults={"whitespace_flexible": False})


def oracle_greedy(model_dir, prompt_ids: list[int], grammar: str, max_tokens: int) -> list[int]:
    """transformers' logits, masked by a matcher of the grammar, argmax; until the grammar ends."""
    model, tokenizer = hf_model(model_dir), AutoTokenizer.from_pretrained(model_dir)
    vocab = model.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), grammar,
                                   log_level=0)
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    ids, out = list(prompt_ids), []
    while len(out) < max_tokens and not matcher.is_stopped():
        logits = model(torch.tensor([ids])).logits[0, -1:].float()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        llguidance.torch.apply_token_bitmask_inplace(logits, mask)
        token = int(logits.argmax())
        assert matcher.consume_token(token)
        ids.append(token)
        out.append(token)
    return out


def requests(prompts, **params) -> list[Request]:
    params.setdefault("max_tokens", 48)
    return [Request(f"r{i}", prompt=p, params=SamplingParams(json_schema=SCHEMA, **params))
            for i, p in enumerate(prompts)]


def test_greedy_json_matches_transformers_under_the_same_mask(tiny_chat):
    model_dir = tiny_chat.dir("llama")
    engine = make_engine(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Beside rows without a schema: those take the greedy screen, these the masked logits.
    plain = [Request("plain", prompt=PROMPTS[0], params=SamplingParams(max_tokens=8))]
    completions = engine.generate(requests(PROMPTS) + plain)
    for prompt, completion in zip(PROMPTS, completions):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = oracle_greedy(model_dir, prompt_ids, json_grammar(SCHEMA), 48)
        assert completion.token_ids == expected
        assert completion.finish_reason == "stop"  # where the JSON value ends
        assert matches_schema(json.loads(completion.text))
    assert completions[-1].error is None and completions[-1].completion_tokens == 8
    assert_idle_and_clean(engine)


def test_sampled_forks_and_evictions_keep_to_the_schema(tiny_chat):
    """Samples at temperature 1.5, three forks per prompt, and a KV cache so small that
    sequences are evicted and recompute: every completion is still the schema's JSON."""
    engine = make_engine(tiny_chat.dir("qwen3"), num_blocks=8, preemption="evict")
    evict = CallCounter(engine.scheduler, "evict")
    compiled = CallCounter(engine.stop_rule.grammars, "matcher")
    completions = engine.generate(requests(PROMPTS * 2, temperature=1.5, n=3, seed=7))
    assert len(evict) > 0
    # Once per request: the forks copy sample 0's matcher instead of compiling on the step thread.
    assert len(compiled) == len(PROMPTS) * 2
    for completion in completions:
        assert len(completion.outputs) == 3
        for sample in completion.outputs:
            assert sample.finish_reason == "stop", sample
            assert matches_schema(json.loads(sample.text))
    assert_idle_and_clean(engine)


def test_greedy_choice_and_regex_match_transformers_under_the_same_mask(tiny_chat):
    """A classification label (choice) and a pattern (regex): the engine's tokens are the
    oracle's, the choice is one of the list, the regex matches the whole text."""
    model_dir = tiny_chat.dir("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    labels = ["positive", "negative", "not sure (mixed)"]
    pattern = "[0-9]{3}-[a-z]{2,4}"
    engine = make_engine(model_dir)
    completions = engine.generate(
        [Request(f"c{i}", prompt=p, params=SamplingParams(max_tokens=16, choice=labels))
         for i, p in enumerate(PROMPTS)]
        + [Request(f"r{i}", prompt=p, params=SamplingParams(max_tokens=16, regex=pattern))
           for i, p in enumerate(PROMPTS)])
    grammars = [llguidance.LLMatcher.grammar_from_regex("(positive|negative|not sure \\(mixed\\))"),
                llguidance.LLMatcher.grammar_from_regex(pattern)]
    for i, completion in enumerate(completions):
        prompt_ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)
        assert completion.token_ids == oracle_greedy(model_dir, prompt_ids, grammars[i // len(PROMPTS)], 16)
    assert all(c.text in labels and c.finish_reason == "stop" for c in completions[:len(PROMPTS)])
    assert all(re.fullmatch(pattern, c.text) for c in completions[len(PROMPTS):])
    assert_idle_and_clean(engine)


def test_a_stop_string_completed_by_the_grammars_last_token_still_cuts_the_text(tiny_chat):
    """The grammar's end and a stop string in the same token: the text ends before the stop,
    as it would without a grammar."""
    engine = make_engine(tiny_chat.dir("qwen3"))
    labels = ["maybe so"]
    free, stopped = engine.generate([
        Request("free", prompt=PROMPTS[0], params=SamplingParams(max_tokens=16, choice=labels)),
        Request("stop", prompt=PROMPTS[0], params=SamplingParams(max_tokens=16, choice=labels,
                                                                  stop=["so", "xyz"]))])
    assert free.text == "maybe so"
    assert stopped.token_ids == free.token_ids and stopped.finish_reason == "stop"
    assert (stopped.text, stopped.outputs[0].stop_reason) == ("maybe ", "so")


@pytest.mark.parametrize("with_kv", [False, True])
def test_migrating_mid_json_continues_the_same_json(tiny_chat, with_kv):
    """The target engine's matcher replays the tokens generated before the move."""
    model_dir = tiny_chat.dir("llama")
    [expected] = make_engine(model_dir).generate(requests(PROMPTS[:1]))
    source, target = make_engine(model_dir), make_engine(model_dir)
    source.submit(requests(PROMPTS[:1])[0])
    for _ in range(5):
        source.step()
    [seq] = live_sequences(source, "r0")
    assert 0 < seq.num_generated < expected.completion_tokens
    target.migrate_in(pickle.loads(pickle.dumps(source.migrate_out("r0", with_kv=with_kv))))
    moved = collect(target)["r0"]
    assert moved.token_ids == expected.token_ids and moved.finish_reason == "stop"
    assert_idle_and_clean(source)
    assert_idle_and_clean(target)


def test_properties_come_in_the_schemas_order(tiny_chat):
    """As OpenAI and vLLM write them: a schema puts "reasoning" before "answer" on purpose."""
    for order in (["reasoning", "answer"], ["answer", "reasoning"]):
        schema = {"type": "object", "additionalProperties": False, "required": order,
                  "properties": {name: {"type": "integer", "minimum": 0, "maximum": 9} for name in order}}
        [completion] = make_engine(tiny_chat.dir("llama")).generate(
            [Request("a", prompt="Hello", params=SamplingParams(json_schema=schema, max_tokens=32))])
        assert list(json.loads(completion.text)) == order, completion.text


def test_a_completion_cut_at_max_tokens_is_unfinished_json(tiny_chat):
    [completion] = make_engine(tiny_chat.dir("llama")).generate(requests(PROMPTS[:1], max_tokens=3))
    assert completion.finish_reason == "length" and completion.completion_tokens == 3
    assert completion.text.startswith("{")


def test_the_schema_is_held_as_canonical_json_and_checked():
    a = SamplingParams(json_schema={"type": "object", "required": ["x"]})
    b = SamplingParams(json_schema='{"type":"object",\n  "required": ["x"]}')
    assert a == b and a.json_schema == '{"type": "object", "required": ["x"]}'
    assert a.adjusts_logits and not a.argmax_only
    exact = {"type": "object", "properties": {"maximum": {"type": "integer", "maximum": -(2 ** 53)}}}
    assert json.loads(SamplingParams(json_schema=exact).json_schema) == exact  # a property named so
    deep = '{"type":"array","items":' * 200 + '{"type":"integer"}' + "}" * 200  # past the reader's depth
    for bad, message in [("{not json", "not JSON"), (["a"], "got list"),
                         ({"type": "nonsense"}, "compiles: .*nonsense"), (deep, "compiles: .*recursion limit"),
                         ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 2 ** 53 + 1}}},
                          "within 2\\*\\*53: minimum 9007199254740993 is past it")]:
        with pytest.raises(ValueError, match=f"json_schema must be .*{message}"):
            SamplingParams(json_schema=bad)
    with pytest.raises(ValueError, match="regex must be a regular expression .*unclosed group"):
        SamplingParams(regex="(a")
    for bad in ("ab\\", "\\", "a\\\\\\"):  # llguidance would drop the unfinished escape
        with pytest.raises(ValueError, match="regex must be .*a backslash that escapes nothing"):
            SamplingParams(regex=bad)
    assert SamplingParams(regex="a\\\\").regex == "a\\\\"  # an escaped backslash
    for bad in ("yes", ["yes", ""], [1], {"yes": 1}):
        with pytest.raises(ValueError, match="choice must be a list of non-empty strings"):
            SamplingParams(choice=bad)
    with pytest.raises(ValueError, match="one at most"):
        SamplingParams(regex="a+", choice=["a"])
    assert SamplingParams(choice=["a", "b"]).choice == ("a", "b")


def _bounded(low, high, low_excluded: bool, high_excluded: bool, draft4: bool) -> dict:
    schema = {"type": "number"}
    if draft4:  # draft-04's form: a boolean beside minimum / maximum
        schema.update(minimum=low, exclusiveMinimum=low_excluded, maximum=high, exclusiveMaximum=high_excluded)
    else:
        schema.update({"exclusiveMinimum" if low_excluded else "minimum": low,
                       "exclusiveMaximum" if high_excluded else "maximum": high})
    return {"type": "object", "properties": {"x": schema}, "required": ["x"]}


def test_a_schema_whose_excluded_bound_the_grammar_engine_would_let_through_is_refused(tiny_chat):
    """llguidance 1.9.1 took {"exclusiveMinimum": 1, "maximum": 1.5} to allow 1 (an excluded whole
    number less than 1 from the other bound, on its side away from zero): a completion broke its
    schema. Every schema is now either refused, or its grammar keeps out exactly what it excludes."""
    model_dir = tiny_chat.dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = llguidance.hf.from_tokenizer(tokenizer, n_vocab=hf_model(model_dir).config.vocab_size)

    def takes(grammar: str, number: str) -> bool:
        matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
        text = '{"x":' + number + "}"
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    refused = 0
    for whole, distance, below, low_excluded, high_excluded, draft4 in itertools.product(
            (0, 1, 7, -1, -7), (0.25, 0.75, 1.0, 1.5), (False, True), *[(True, False)] * 3):
        low, high = (whole - distance, whole) if below else (whole, whole + distance)
        schema = _bounded(low, high, low_excluded, high_excluded, draft4)
        try:
            grammar = grammar_of(json_schema=SamplingParams(json_schema=schema).json_schema)
        except ValueError as exc:
            assert re.search(r"json_schema must be a schema whose excluded bounds the grammar engine keeps out: "
                             r".* less than 1 from it", str(exc)), exc
            refused += 1
            continue
        for value in (low, high, (low + high) / 2):
            allowed = ((value > low if low_excluded else value >= low)
                       and (value < high if high_excluded else value <= high))
            assert takes(grammar, str(int(value) if value == int(value) else value)) == allowed, (schema, value)
            if value == 0:  # JSON's other spelling of it: the grammar need not take it, only keep it out
                assert allowed or not takes(grammar, "-0"), schema
    # Only those the grammar engine gets wrong: an excluded lower 0, 1 or 7 with the other bound
    # 0.25 or 0.75 above, an excluded upper 0, -1 or -7 with it below; each with that bound
    # excluded or not, in both forms.
    assert refused == 2 * 3 * 2 * 2 * 2


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "number", "exclusiveMinimum": 1}, {"maximum": 1.5}]},
    {"$defs": {"low": {"type": "number", "exclusiveMinimum": 1}}, "$ref": "#/$defs/low", "maximum": 1.5},
    {"exclusiveMinimum": 1, "anyOf": [{"type": "number", "maximum": 1.5}, {"type": "string"}]},
    {"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/definitions/up"}, {"minimum": -0.5}]}},
     "definitions": {"up": {"type": "number", "exclusiveMaximum": 0}}},
    {"allOf": [{"anyOf": [{"type": "number", "exclusiveMinimum": 1}, {"type": "string"}]}, {"maximum": 1.5}]},
    {"$defs": {"either": {"anyOf": [{"type": "number", "exclusiveMinimum": 1}, {"type": "string"}]}},
     "$ref": "#/$defs/either", "maximum": 1.5},
    {"exclusiveMinimum": 1, "anyOf": [{"anyOf": [{"type": "number", "maximum": 1.5}]}, {"type": "string"}]},
    {"$defs": {"a b": {"type": "number", "exclusiveMinimum": 1}}, "$ref": "#/$defs/a%20b", "maximum": 1.5},
], ids=["allOf", "ref-and-sibling", "anyOf-under-a-bound", "nested-ref-in-allOf", "alternatives-in-allOf",
        "alternatives-behind-a-ref", "alternatives-in-alternatives", "percent-escaped-ref"])
def test_excluded_bounds_are_judged_as_the_grammar_engine_merges_them(schema):
    """Bounds in different objects that llguidance merges into one range (allOf, a $ref and its
    siblings, a parent and its anyOf alternatives) were judged apart and let through."""
    with pytest.raises(ValueError, match="excluded bounds the grammar engine keeps out"):
        SamplingParams(json_schema=schema)


def test_a_schema_nested_past_pythons_stack_is_refused_as_a_bad_value():
    deep = '{"allOf":[' * 2000 + "{}" + "]}" * 2000
    chain = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2000)}, "$ref": "#/$defs/d0"}
    chain["$defs"]["d2000"] = {"type": "number", "exclusiveMinimum": 1, "maximum": 1.5}
    with pytest.raises(ValueError, match=r"json_schema must be a JSON schema .*\(RecursionError: "):
        SamplingParams(json_schema=deep)
    with pytest.raises(ValueError, match="json_schema must be a schema whose excluded bounds"):
        SamplingParams(json_schema=chain)  # followed to its end without recursing


@pytest.mark.parametrize("where", ["const", "enum", "default", "examples", "x-note"])
def test_data_that_looks_like_bounds_is_no_bound(where):
    bounds = {"exclusiveMinimum": 1, "maximum": 1.5, "minimum": 2 ** 60}
    value = [bounds] if where in ("enum", "examples") else bounds
    SamplingParams(json_schema={"type": "object", where: value})


def test_a_grammar_that_fails_only_while_running_ends_its_row_with_a_one_line_reason(tiny_chat):
    """llguidance compiles some regexes lazily: this one fails at the first token. The error
    row says why in a line, without the matcher's state dump."""
    engine = make_engine(tiny_chat.dir("llama"))
    [failed, fine] = engine.generate([Request("big", prompt="Hi", params=SamplingParams(regex="a{99999999}")),
                                      Request("ok", prompt="Hi", params=SamplingParams(max_tokens=3))])
    assert failed.finish_reason == "error" and "\n" not in failed.error
    assert failed.error.startswith("regex: no text it allows goes on from here (the grammar engine refused token ")
    assert failed.error.endswith(": lexer error: too many expressions constructed)")
    assert fine.error is None and fine.completion_tokens == 3


def test_a_model_without_a_tokenizer_refuses_a_schema(tiny):
    engine = make_engine(tiny.dir("llama"))
    with pytest.raises(ValueError, match="structured output needs a model with a tokenizer"):
        engine.submit(Request("r", prompt_token_ids=[5, 6], params=SamplingParams(json_schema=SCHEMA)))


def test_a_grammar_nothing_can_follow_fails_its_request_as_its_own_fault(tiny_chat, caplog):
    """A regex whose language is empty passes the check (llguidance compiles it): the engine
    masks what it samples, so the token that breaks it is the grammar's doing, not the engine's."""
    engine = make_engine(tiny_chat.dir("llama"))
    fine, dead = engine.generate([
        Request("fine", prompt=PROMPTS[0], params=SamplingParams(max_tokens=4, regex="[a-z]+")),
        Request("dead", prompt=PROMPTS[0], params=SamplingParams(max_tokens=4, regex="a[^\\s\\S]b"))])
    assert fine.error is None
    assert dead.error.startswith("regex: no text it allows goes on from here") and dead.invalid
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no engine traceback logged
