"""Logits adjusted before a token is chosen: min_tokens, logit_bias and the repetition penalty
token-exact with transformers' greedy `generate` (min_new_tokens, sequence_bias,
repetition_penalty), frequency and presence penalties (OpenAI's definition, which transformers
lacks) against transformers' logits penalised by hand, adjusted rows mixed into batches of
screened greedy and sampled rows, and min_tokens holding back stop strings."""

import codecs
from collections import Counter

import numpy as np
import pytest
import torch

from helpers import EOS, assert_matches, make_engine, random_prompts
from tiny_models import hf_model
from runtime import Request, SamplingParams
from runtime.sampling import SampledToken, SampleRow, adjust_logits, sample
from runtime.sequence import Event, Sequence, StopRule

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
    # The screen took the plain rows only (and their drafts' rows that took no token).
    rejected = engine.stats.draft_tokens - engine.stats.accepted_draft_tokens
    assert engine.stats.screened_rows == sum(got[f"g{i}"].completion_tokens for i in range(len(PROMPTS))) + rejected


def test_logit_bias_matches_transformers_sequence_bias(tiny):
    family = "llama"
    engine = make_engine(tiny.dir(family), greedy_screen=True)
    bias = {17: 4.0, 90: 2.5, 33: -100.0}
    plain = tiny.greedy(family, PROMPTS[2], MAX_TOKENS)[0]
    bias[plain[0]] = -100.0  # its first token may not come
    requests = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=MAX_TOKENS, logit_bias=bias))
                for i, p in enumerate(PROMPTS)]
    hf = tiny.hf(family)
    for prompt, completion in zip(PROMPTS, engine.generate(requests)):
        tokens = hf_generate(hf, prompt, sequence_bias=[[[t], b] for t, b in bias.items()])[0]
        assert completion.token_ids == tokens, completion.id
    assert completion.token_ids[0] != plain[0]


def test_allowed_token_ids_match_transformers_prefix_allowed_tokens(tiny):
    """vLLM's allowed_token_ids: only these may be chosen, every step (transformers' oracle:
    prefix_allowed_tokens_fn); beside unrestricted rows in the same batch."""
    family = "qwen3"
    engine = make_engine(tiny.dir(family), greedy_screen=True)
    allowed = [5, 9, 17, 33, 90, 101]
    requests = [Request(f"a{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=MAX_TOKENS, allowed_token_ids=allowed,
                                                                             logprobs=0))
                for i, p in enumerate(PROMPTS)]
    requests += [Request("plain", prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=MAX_TOKENS))]
    got = {c.id: c for c in engine.generate(requests)}
    hf = tiny.hf(family)
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = hf_generate(hf, prompt, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
        assert_matches(got[f"a{i}"], tokens, logprobs)  # logprobs: the model's own, as vLLM's
        assert set(got[f"a{i}"].token_ids) <= set(allowed)
    assert got["plain"].token_ids == tiny.greedy(family, PROMPTS[0], MAX_TOKENS)[0]
    assert not set(got["plain"].token_ids) <= set(allowed)  # the restriction changed something


def test_bad_words_match_transformers_bad_words_ids(tiny_chat):
    """vLLM's bad_words: a word's last token is banned wherever the output ends with the rest of
    it, the word read as it tokenizes alone and after a space (transformers' oracle:
    bad_words_ids, the same rule over token ids)."""
    family = "llama"
    engine = make_engine(tiny_chat.dir(family))
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("Tell me a story about", add_special_tokens=False)
    [plain] = engine.generate([Request("plain", prompt_token_ids=prompt, params=SamplingParams(max_tokens=MAX_TOKENS))])

    def variants(word):  # vLLM's reading: alone, and after a space where that is another token
        alone, spaced = (tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word))
        return [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])

    def said(ids):
        return any(plain.token_ids[i:i + len(ids)] == ids for i in range(len(plain.token_ids)))

    # Words the model says as they tokenize (a ban on them must change the output).
    words = dict.fromkeys(tokenizer.decode([t]).strip() for t in plain.token_ids)
    bad = [w for w in words if w.isalpha() and any(map(said, variants(w)))][:2]
    assert bad, "no word of the plain output to ban"
    [banned] = engine.generate([Request("banned", prompt_token_ids=prompt,
                                        params=SamplingParams(max_tokens=MAX_TOKENS, bad_words=bad))])
    ids = [ids for word in bad for ids in variants(word)]
    tokens = hf_generate(hf_model(tiny_chat.dir(family)), prompt, bad_words_ids=ids)[0]
    assert banned.token_ids == tokens
    assert banned.token_ids != plain.token_ids


def test_a_bad_word_bans_its_last_token_only_after_the_rest_of_it():
    logits = torch.zeros(10)
    adjust_logits(logits, SampleRow(SamplingParams(), output_ids=[4, 7, 3], bad_words=[(7, 3, 5), (4, 6), (2,), (1, 4, 7, 3, 8)]))
    # (4, 6): the output does not end with 4; (1, 4, 7, 3, 8): longer than the output and its next token
    assert (logits == float("-inf")).nonzero().flatten().tolist() == [2, 5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_whose_values_leave_no_token_is_its_own_error(tiny_chat, temperature):
    """Every token excluded (the one allowed token is a bad word): an error row that is the
    request's doing, greedy too (whose argmax would take token 0), the others unharmed."""
    engine = make_engine(tiny_chat.dir("llama"))
    [word] = [w for w in ("hello", "the", "a") if len(engine.tokenizer.encode(w, add_special_tokens=False)) == 1][:1]
    [only] = engine.tokenizer.encode(word, add_special_tokens=False)
    nothing_left = SamplingParams(max_tokens=4, temperature=temperature, seed=1, allowed_token_ids=[only],
                                  bad_words=[word])
    refused, ok = engine.generate([Request("none", prompt_token_ids=PROMPTS[0], params=nothing_left),
                                   Request("ok", prompt_token_ids=PROMPTS[1], params=SamplingParams(max_tokens=4))])
    assert refused.finish_reason == "error" and refused.invalid
    assert "no token is left to choose" in refused.error
    assert ok.error is None and ok.completion_tokens >= 1


def test_allowed_tokens_that_would_only_end_it_before_min_tokens_leave_none(tiny):
    """Only EOS allowed, but min_tokens bans it: nothing to choose (a grammar that allows only
    its end may end before min_tokens, as vLLM lets it; a bare allowed set may not)."""
    engine = make_engine(tiny.dir("llama"))
    [done] = engine.generate([Request("r", prompt_token_ids=PROMPTS[0],
                                      params=SamplingParams(max_tokens=5, allowed_token_ids=[EOS], min_tokens=3))])
    assert done.finish_reason == "error" and done.invalid and "no token is left to choose" in done.error


def test_bad_words_and_allowed_token_ids_a_model_cannot_take_are_refused(tiny, tiny_chat):
    with pytest.raises(ValueError, match="allowed_token_ids: token ids must be < the vocabulary's 256"):
        make_engine(tiny.dir("llama")).submit(Request("r", prompt_token_ids=[3], params=SamplingParams(allowed_token_ids=[256])))
    with pytest.raises(ValueError, match="bad_words: need a model with a tokenizer"):
        make_engine(tiny.dir("llama")).submit(Request("r", prompt_token_ids=[3], params=SamplingParams(bad_words=["x"])))
    for params, message in (({"bad_words": [""]}, "bad_words must be non-empty strings"),
                            ({"allowed_token_ids": [-1]}, "allowed_token_ids must be >= 0")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**params)


def test_a_sequences_logit_bias_becomes_tensors_once(tiny, monkeypatch):
    """Not every step: over a whole vocabulary that took tens of milliseconds a token, on the
    step thread every request waits on."""
    import runtime.sequence

    made = []
    real = runtime.sequence.logit_bias_tensors
    monkeypatch.setattr(runtime.sequence, "logit_bias_tensors", lambda bias: made.append(bias) or real(bias))
    engine = make_engine(tiny.dir("llama"))
    bias = {t: 0.5 for t in range(engine.spec.vocab_size)}
    [done] = engine.generate([Request("r", prompt_token_ids=PROMPTS[0], params=SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias))])
    assert done.completion_tokens == MAX_TOKENS and len(made) == 1


def test_min_tokens_matches_transformers_min_new_tokens(tiny):
    """EOS biased up so that the model would end at once: min_tokens holds it back, like
    transformers' min_new_tokens, and it ends right after."""
    family = "qwen2"
    engine = make_engine(tiny.dir(family))
    eos_bias = {EOS: 30.0}
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=6, logit_bias=eos_bias, logprobs=0)
    completions = engine.generate([Request(f"r{i}", prompt_token_ids=p, params=params)
                                   for i, p in enumerate(PROMPTS)])
    hf = tiny.hf(family)
    for prompt, completion in zip(PROMPTS, completions):
        tokens, logprobs = hf_generate(hf, prompt, min_new_tokens=6, sequence_bias=[[[EOS], 30.0]])
        assert_matches(completion, tokens, logprobs, max_tokens=MAX_TOKENS)
        assert len(tokens) == 7 and tokens[-1] == EOS
    # Stop ids past the vocabulary can never come, so there is nothing of them to ban.
    past = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=6, logit_bias=eos_bias, logprobs=0,
                          stop_token_ids=[10**6, EOS])
    again = engine.generate([Request(f"p{i}", prompt_token_ids=p, params=past) for i, p in enumerate(PROMPTS)])
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]
    [early] = engine.generate([Request("no-min", prompt_token_ids=PROMPTS[0], params=SamplingParams(
        max_tokens=MAX_TOKENS, logit_bias=eos_bias))])
    assert early.token_ids == [EOS]


def letter_sequence(tokens, max_tokens=10, **params) -> Sequence:
    """A sequence over a 10-letter vocabulary (token t is the t-th letter; 9 is the tokenizer's
    EOS, 8 another the model's config names), fed `tokens` until it finishes."""
    rule = StopRule(eos_token_ids=frozenset({8, 9}), max_model_len=100,
                    detokenize=lambda ids, skip_special_tokens: "".join("abcdefghij"[t] for t in ids),
                    tokenizer_eos=9)
    seq = Sequence("s", "r", 0, [0], 1, SamplingParams(max_tokens=max_tokens, **params), None, rule)
    seq.send(Event.ADMITTED)
    for token in tokens:
        seq.send(Event.TOKEN, SampledToken(token))
        if seq.is_finished:
            break
    return seq


def test_min_tokens_holds_back_stop_strings_and_stop_ids():
    """vLLM's rules: before min_tokens nothing stops the sequence; after it, a stop string
    ending in the text of a token past the min_tokens-th does, one that ended earlier does not.
    Of stop strings completed by the same token, the first to end wins, then the first listed.
    A stop token's text is left out unless the stop is kept (include_stop_str_in_output)."""
    def run(tokens, **params):
        seq = letter_sequence(tokens, **params)
        return seq.generated_ids, seq.finish_reason, seq.text

    assert run([1, 2, 3, 4], stop=["bc"]) == ([1, 2], "stop", "")
    assert run([1, 2, 3, 4, 5], stop=["bc"], min_tokens=3) == ([1, 2, 3, 4, 5], None, None)
    assert run([1, 2, 3, 4], stop=["cd"], min_tokens=3) == ([1, 2, 3, 4], None, None)  # ends in token 3
    assert run([1, 2, 3, 4], stop=["de"], min_tokens=3) == ([1, 2, 3, 4], "stop", "bc")  # in token 4
    assert run([2], stop=["c"], min_tokens=1) == ([2], None, None)
    assert run([9, 5, 9], min_tokens=2) == ([9, 5, 9], "stop", "jf")  # EOS counts from token 2 on
    assert run([6, 6, 6], stop_token_ids=[6], min_tokens=3) == ([6, 6, 6], "stop", "gg")
    assert run([1, 6], stop_token_ids=[6], include_stop_str_in_output=True) == ([1, 6], "stop", None)
    assert run([0, 1, 2, 3], stop=["bcd", "abcd"]) == ([0, 1, 2, 3], "stop", "a")
    words = StopRule(eos_token_ids=frozenset(), max_model_len=100,
                     detokenize=lambda ids, skip_special_tokens: "".join(["N", "am", "e", " three"][t] for t in ids))
    seq = Sequence("w", "r", 0, [0], 1, SamplingParams(stop=["e three", " th"]), None, words)
    seq.send(Event.ADMITTED)
    for token in (0, 1, 2, 3):  # " three" completes both: " th" ends first
        seq.send(Event.TOKEN, SampledToken(token))
    assert (seq.finish_reason, seq.text) == ("stop", "Name")
    # include_stop_str_in_output: the text keeps the stop string (the first of two to end).
    assert run([1, 2, 3, 4], stop=["bcd", "bc"], include_stop_str_in_output=True) == ([1, 2], "stop", "bc")
    assert run([1, 2, 3, 4], stop=["cd"], include_stop_str_in_output=True) == ([1, 2, 3], "stop", "bcd")


def test_stop_reason_names_the_stop_string_or_stop_token_that_ended_it():
    """vLLM's stop_reason: the stop string or stop_token_ids entry (or an EOS id of the model's
    other than its tokenizer's); None for the tokenizer's EOS, length and a grammar's end."""
    def stop_reason(tokens, **params):
        seq = letter_sequence(tokens, max_tokens=4, **params)
        assert seq.is_finished
        return seq.finish_reason, seq.stop_reason

    assert stop_reason([1, 2], stop=["x", "bc"]) == ("stop", "bc")
    assert stop_reason([1, 2, 3], stop=["cd", "bcd"]) == ("stop", "cd")  # the first to end
    assert stop_reason([1, 6], stop_token_ids=[7, 6]) == ("stop", 6)
    assert stop_reason([1, 9], stop_token_ids=[9]) == ("stop", None)  # EOS, though also listed
    assert stop_reason([1, 9], stop_token_ids=[9], ignore_eos=True) == ("stop", 9)
    assert stop_reason([1, 9]) == ("stop", None)
    assert stop_reason([1, 8]) == ("stop", 8)  # the config's EOS: a stop token to vLLM
    assert stop_reason([1, 2, 3, 4], stop=["z"], stop_token_ids=[7]) == ("length", None)


def test_a_stop_string_completed_by_a_kept_stop_token_wins_as_in_vllm():
    """With include_stop_str_in_output the ending token's text is kept, so vLLM checks stop
    strings on it: one it completes is the stop_reason and cuts the text after it."""
    def ended(tokens, **params):
        seq = letter_sequence(tokens, **params)
        return seq.finish_reason, seq.stop_reason, seq.text

    assert ended([1, 6, 2], stop_token_ids=[6], stop=["g"], include_stop_str_in_output=True) \
        == ("stop", "g", "bg")
    assert ended([1, 9], stop=["j"], include_stop_str_in_output=True) == ("stop", "j", "bj")
    assert ended([1, 9], stop=["j"]) == ("stop", None, "b")  # the EOS's text is left out
    assert ended([1, 9], stop=["j"], min_tokens=1, include_stop_str_in_output=True) \
        == ("stop", "j", "bj")
    assert ended([1, 6], stop_token_ids=[6], stop=["x"], include_stop_str_in_output=True) \
        == ("stop", 6, None)


BYTE_PIECES = [b"P", b"a", b"\xc3", b"\xa9", b" hi", b"\xe2", b"\x82", b"\xac", b"x", b""]


def per_byte_replace(error: UnicodeDecodeError):
    return "\ufffd" * (error.end - error.start), error.end


codecs.register_error("test_per_byte_replace", per_byte_replace)


@pytest.mark.parametrize("errors", ["replace", "test_per_byte_replace"])  # byte-level BPE, byte fallback
def test_min_tokens_floor_ignores_a_character_split_at_the_boundary(errors):
    """The min_tokens-th token ends inside a character: its prefix decodes to placeholders,
    which must not push the start of the stop-string search past the finished character."""
    rule = StopRule(eos_token_ids=frozenset({9}), max_model_len=100,
                    detokenize=lambda ids, skip: b"".join(BYTE_PIECES[t] for t in ids).decode("utf-8", errors))

    def run(tokens, **params):
        seq = Sequence("s", "r", 0, [0], 1, SamplingParams(max_tokens=10, **params), None, rule)
        seq.send(Event.ADMITTED)
        for token in tokens:
            seq.send(Event.TOKEN, SampledToken(token))
            if seq.is_finished:
                break
        return seq.generated_ids, seq.stop_reason, seq.text

    assert run([1, 2, 3, 4], stop=["\u00e9"], min_tokens=2) == ([1, 2, 3], "\u00e9", "a")
    assert run([5, 6, 7, 1, 8, 1], stop=["a"], min_tokens=2) == ([5, 6, 7, 1], "a", "\u20ac")
    assert run([1, 2, 3, 1], stop=["a"], min_tokens=2) == ([1, 2, 3, 1], "a", "a\u00e9")  # not the first


def test_stop_strings_are_searched_in_text_decoded_as_tokens_arrive(tiny_chat):
    """The tokenizers library's incremental decoder gives the text decoding the whole
    completion gives, special tokens kept or skipped, without decoding it again each token."""
    import random

    from transformers import AutoTokenizer

    from runtime.tokenizer import TextStream

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat.dir("qwen3"))
    rng = random.Random(0)
    for skip in (True, False):
        for _ in range(20):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
            stream = TextStream(None, skip, tokenizer.backend_tokenizer)
            for token in ids:
                stream.add(token)
            assert stream.text == tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")

    decodes = []

    def detokenize(ids, skip):
        decodes.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=skip)

    rule = StopRule(frozenset(), 100, detokenize, decoder=tokenizer.backend_tokenizer)
    ids = tokenizer.encode(" one two three four five six", add_special_tokens=False)
    seq = Sequence("s", "r", 0, [0], 1, SamplingParams(max_tokens=50, stop=["six"]), None, rule)
    seq.send(Event.ADMITTED)
    for token in ids:
        seq.send(Event.TOKEN, SampledToken(token))
    assert (seq.finish_reason, seq.text, decodes) == ("stop", " one two three four five ", [])


def test_a_completion_ending_inside_a_character_leaves_it_out_as_vllm_does(tiny_chat):
    """Its text is the incremental decoder's, which holds back a character's first bytes until
    the rest come: at max_tokens, or at EOS right after them, they never do (decoding the
    tokens whole gave U+FFFD for them)."""
    engine = make_engine(tiny_chat.dir("qwen3"))
    tokenizer = engine.tokenizer
    first_byte = tokenizer.encode(" \U0001F600", add_special_tokens=False)[1]
    assert tokenizer.decode([first_byte]) == "\ufffd"
    [at_length] = engine.generate([Request("length", prompt="Hi", params=SamplingParams(
        max_tokens=1, logit_bias={first_byte: 100}))])
    assert (at_length.token_ids, at_length.finish_reason, at_length.text) == ([first_byte], "length", "")
    ok = tokenizer.encode("ok", add_special_tokens=False)
    seq = Sequence("s", "r", 0, [0], 1, SamplingParams(max_tokens=10), None, engine.stop_rule)
    seq.send(Event.ADMITTED)
    for token in [*ok, first_byte, tokenizer.eos_token_id]:
        seq.send(Event.TOKEN, SampledToken(token))
    assert (seq.finish_reason, seq.text) == ("stop", "ok")


def test_a_stray_byte_is_dropped_from_the_text_as_vllm_drops_it():
    """Byte fallback (Llama, Mistral, Gemma): a lone continuation byte after the bytes of a
    character turns them all into U+FFFD when decoded whole; the incremental decoder raises on
    it. vLLM's way on, not a failed step: the text so far stays, a new decoder reads on from the
    token that broke the old one, and the stray byte shows nowhere."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from runtime.tokenizer import TextStream

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "b": 259, "c": 260}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    ids = [259, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 3 + 0x80, 260]  # b, the bytes of the euro sign, 0x80, c
    stream = TextStream(lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), True,
                        tokenizer.backend_tokenizer)
    for token in ids:
        stream.add(token)
    assert tokenizer.decode(ids) == "b\ufffd\ufffd\ufffd\ufffdc"
    assert stream.text == "b\u20acc"


class OneWordGrammars:
    """A stand-in for the structured-output matchers: the grammar is complete once it has
    consumed EOS (token 9), as a regex's is."""
    def matcher(self, grammar, generated_ids):
        return OneWordMatcher()


class OneWordMatcher:
    def __init__(self):
        self.stopped = False

    def consume_token(self, token):
        self.stopped = token == 9
        return True

    def is_error(self):
        return False

    def is_stopped(self):
        return self.stopped


@pytest.mark.parametrize("min_tokens", [0, 3, 5])  # 5: the grammar let EOS through before min_tokens
def test_the_eos_that_completes_a_grammar_is_left_out_of_the_text(min_tokens):
    rule = StopRule(eos_token_ids=frozenset({9}), max_model_len=100,
                    detokenize=lambda ids, skip: "".join("abcdefghi<"[t] for t in ids if not (skip and t == 9)),
                    grammars=OneWordGrammars(), tokenizer_eos=9)
    params = SamplingParams(max_tokens=10, regex="a+", skip_special_tokens=False, min_tokens=min_tokens)
    seq = Sequence("s", "r", 0, [0], 1, params, None, rule)
    seq.send(Event.ADMITTED)
    for token in (0, 0, 9):
        seq.send(Event.TOKEN, SampledToken(token))
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", None, "aa")


def test_min_tokens_lets_through_the_only_tokens_a_grammar_allows():
    """vLLM's rule: where banning the tokens that would end it leaves nothing allowed, they are
    allowed after all (the grammar ends the output before min_tokens)."""
    allowed = torch.zeros(1, dtype=torch.int32)
    allowed[0] = 1 << 3  # the grammar allows token 3 only ...
    logits = torch.arange(10, dtype=torch.float32)
    row = SampleRow(SamplingParams(min_tokens=2, regex="x"), banned=torch.tensor([3, 9]), allowed=allowed)
    adjust_logits(logits, row)  # ... which min_tokens bans
    assert logits[3] == 3 and torch.isneginf(logits[torch.arange(10) != 3]).all()
    [token] = sample(torch.arange(10, dtype=torch.float32)[None], [row])
    assert (token.token_id, token.error) == (3, None)


def test_temperatures_below_1e_5_sample_greedily_as_in_vllm():
    """At 1e-6 a draw would only split exact ties at random; greedy takes the lowest id."""
    logits = torch.tensor([[3.0, 3.0, 1.0, 0.5]])
    for seed in range(20):
        params = SamplingParams(temperature=1e-6, seed=seed)
        assert params.greedy
        [token] = sample(logits, [SampleRow(params, np.random.default_rng(seed))])
        assert token.token_id == 0
    assert not SamplingParams(temperature=1e-5).greedy


def test_adjusted_values_are_validated():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="logit_bias must be in"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="logit_bias must be an integer"):
        SamplingParams(logit_bias={"3": 1.0})
    with pytest.raises(ValueError, match="logit_bias must give each token once"):
        SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)])
    assert SamplingParams(logit_bias={5: 1, 2: -1.5}).logit_bias == ((2, -1.5), (5, 1))
    hash(SamplingParams(logit_bias={5: 1}))


def test_logit_bias_outside_the_vocabulary_is_refused(tiny):
    engine = make_engine(tiny.dir("llama"))
    with pytest.raises(ValueError, match="logit_bias: token ids must be < the vocabulary's 256"):
        engine.submit(Request("r", prompt_token_ids=[5], params=SamplingParams(logit_bias={256: 1.0})))


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
                      np.random.default_rng(0), prompt_ids=[1], output_ids=[0, 1, 1]),
            SampleRow(SamplingParams(repetition_penalty=3.0, logprobs=0), output_ids=[3])]
    tokens = sample(logits, rows)
    assert [t.token_id for t in tokens] == [1, 1, 2, 0]
    # A negative logit is multiplied by the repetition penalty: -1.0 * 3 stays below -1.2.
    assert sample(torch.tensor([[-5.0, -5.0, -5.0, -1.0, -1.2]]), rows[3:])[0].token_id == 4
    # Logprobs stay those of the model's own distribution.
    assert tokens[3].logprob == pytest.approx(torch.log_softmax(logits[3], -1)[0].item())
