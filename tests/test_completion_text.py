"""A completion's text is decoded after its prompt, as vLLM's detokenizer decodes it (primed
with the prompt's token ids), and stop strings are searched in that same text."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers import make_engine
from runtime.request import Request, SamplingParams
from runtime.sequence import Event, SampledToken, Sequence
from tiny_models import make_tiny_model

PROMPTS = Path(__file__).resolve().parent.parent / "batchgen_beam" / "data" / "prompts.jsonl"


def _texts() -> list[str]:
    return [json.loads(line)["prompt"] for line in PROMPTS.read_text(encoding="utf-8").splitlines()]


def sentencepiece_like(directory: Path) -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral's shape: a Metaspace pre-tokenizer that marks the text's first word
    with "\u2581" too, whose decoder drops the space of a text's first piece."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.train_from_iterator(_texts(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def wordpiece_like(directory: Path) -> PreTrainedTokenizerFast:
    """BERT's shape, with transformers' clean_up_tokenization_spaces on (which the incremental
    decoder does not apply)."""
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(_texts() + ["I don't know. It's a dog's life, isn't it?"],
                                trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[SEP]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[SEP]",
                                        clean_up_tokenization_spaces=True)
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def sentencepiece_engine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sentencepiece")
    tokenizer = sentencepiece_like(directory)
    make_tiny_model("llama", directory, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    return make_engine(directory)


def feed(engine, prompt_ids: list[int], completion: list[int], **params) -> Sequence:
    """A sequence of `engine`'s that generated `completion` after `prompt_ids`."""
    seq = Sequence("s", "r", 0, list(prompt_ids), len(prompt_ids), SamplingParams(max_tokens=len(completion), **params),
                   None, engine.stop_rule)
    seq.send(Event.ADMITTED)
    for token in completion:
        seq.send(Event.TOKEN, SampledToken(token))
        if seq.finish_reason is not None:
            break
    if seq.text is None:
        seq.text = seq.completion_text(seq.generated_ids)
    return seq


def after_prompt(tokenizer, prompt_ids: list[int], completion: list[int]) -> str:
    """vLLM's text for a prompt that ends on a character boundary: what the completion adds to
    the prompt's decoded text."""
    prompt_text = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(prompt_ids + completion)
    assert whole.startswith(prompt_text) and not prompt_text.endswith("\ufffd")
    return whole[len(prompt_text):]


def test_a_sentencepiece_completion_keeps_its_first_space(sentencepiece_engine):
    """Decoded alone, "\u2581the" reads "the"; after the prompt "Hello" it reads " the", as
    vLLM's text has it and as the logprobs' token texts show it (so they join into it)."""
    engine = sentencepiece_engine
    tokenizer = engine.tokenizer
    the = tokenizer.convert_tokens_to_ids("\u2581the")
    assert tokenizer.decode([the]) == "the"
    [completion] = engine.generate([Request("r", prompt="Hello", params=SamplingParams(
        max_tokens=3, logit_bias={the: 100}))])
    assert completion.token_ids == [the] * 3
    assert completion.text == " the the the"
    stopped = feed(engine, tokenizer.encode("Hello", add_special_tokens=False), [the, the], stop=[" the"])
    assert (stopped.finish_reason, stopped.text) == ("stop", "")


@pytest.mark.parametrize("skip", [True, False])
def test_a_prompt_ending_in_special_tokens_still_comes_before_the_completion(sentencepiece_engine, skip):
    """Skipped, special tokens decode to nothing: however many end the prompt, the prompt's
    text before them still comes first, so the first word keeps its space."""
    engine = sentencepiece_engine
    tokenizer = engine.tokenizer
    the = tokenizer.convert_tokens_to_ids("\u2581the")
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    for specials in (0, 7, 8, 9, 40):
        prompt = hello + [tokenizer.bos_token_id] * specials
        expected = " the the" if skip else after_prompt(tokenizer, prompt, [the, the])  # "<s><s>... the the"
        assert feed(engine, prompt, [the, the], skip_special_tokens=skip).text == expected, specials
        stopped = feed(engine, prompt, [the, the], stop=[" the"], skip_special_tokens=skip)
        assert (stopped.finish_reason, stopped.text) == ("stop", ""), specials


@pytest.mark.parametrize("seed", range(3))
def test_completion_text_is_what_it_adds_to_the_prompt_s_text(sentencepiece_engine, tiny_chat, tmp_path, seed):
    """Any prompt and completion cut from real text, for each kind of tokenizer: the text is
    the prompt's text continued, less the prompt's text."""
    import random

    rng = random.Random(seed)
    wordpiece = tmp_path / "wordpiece"
    tokenizer = wordpiece_like(wordpiece)
    make_tiny_model("llama", wordpiece, vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1)
    engines = [sentencepiece_engine, make_engine(tiny_chat.dir("qwen3")), make_engine(wordpiece)]
    for engine in engines:
        tokenizer = engine.tokenizer
        for text in rng.sample(_texts(), 8):
            ids = tokenizer.encode(text, add_special_tokens=False)
            cut = rng.randrange(1, len(ids))
            prompt, completion = ids[:cut], ids[cut:cut + 12]
            if tokenizer.decode(prompt).endswith("\ufffd"):
                continue
            expected = after_prompt(tokenizer, prompt, completion)
            if isinstance(tokenizer.backend_tokenizer.model, models.WordPiece):
                # the incremental decoder leaves transformers' clean-up out: compare without it
                expected = after_prompt(_without_cleanup(tokenizer), prompt, completion)
            assert feed(engine, prompt, completion).text == expected, (text, cut)


def _without_cleanup(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def test_stop_strings_are_found_in_the_completion_s_text(sentencepiece_engine, tiny_chat, tmp_path):
    """Whatever the tokenizer, a stop string cut from a completion's text stops that completion
    there: text and stop strings read one text (a WordPiece tokenizer's transformers decode
    cleans up spaces that its incremental decoder keeps, "don ' t")."""
    wordpiece = tmp_path / "wordpiece"
    tokenizer = wordpiece_like(wordpiece)
    make_tiny_model("llama", wordpiece, vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1)
    for engine in (sentencepiece_engine, make_engine(tiny_chat.dir("qwen3")), make_engine(wordpiece)):
        tokenizer = engine.tokenizer
        prompt = tokenizer.encode("Well,", add_special_tokens=False)
        completion = tokenizer.encode(" I don't know. It's a dog's life, isn't it?", add_special_tokens=False)
        text = feed(engine, prompt, completion).text
        for start in range(0, len(text) - 3):
            stop = text[start:start + 3]
            stopped = feed(engine, prompt, completion, stop=[stop])
            assert (stopped.finish_reason, stopped.text) == ("stop", text[:text.find(stop)]), (engine.model_dir, stop)


def test_a_character_the_prompt_starts_shows_whole_in_the_completion(tiny_chat):
    """A prompt of token ids may end inside a character (its first bytes); the completion's
    first token that finishes it shows it whole, as the incremental decoder primed with the
    prompt emits it (vLLM's own priming shows the prompt's text before it too: not copied)."""
    engine = make_engine(tiny_chat.dir("qwen3"))
    tokenizer = engine.tokenizer
    ids = tokenizer.encode("Hi \U0001F389 there", add_special_tokens=False)
    ends_inside = [cut for cut in range(1, len(ids)) if tokenizer.decode(ids[:cut]).endswith("\ufffd")]
    assert ends_inside, "the tokenizer splits the emoji's bytes"
    for cut in ends_inside:
        held = tokenizer.decode(ids[:cut])
        held = held[len(held.rstrip("\ufffd")):]
        last_whole = max(k for k in range(cut) if not tokenizer.decode(ids[:k]).endswith("\ufffd"))
        expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:last_whole])):]
        assert "\ufffd" not in expected and "\U0001F389" in expected
        assert feed(engine, ids[:cut], ids[cut:]).text == expected, cut


def test_a_prompt_s_stray_byte_leaves_the_completion_s_text_whole():
    """Byte fallback: a lone continuation byte after a character's bytes breaks the incremental
    decoder (see test_a_stray_byte_is_dropped_from_the_text_as_vllm_drops_it); one in
    the prompt's last tokens breaks it at the completion's first token, which a new decoder
    then reads: the completion's text is its own."""
    from runtime.tokenizer import TextStream

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "b": 259, "\u2581c": 260}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    prompt = [259, 3 + 0xE2, 3 + 0x82, 3 + 0xAC, 3 + 0x80]  # b, the bytes of the euro sign, 0x80
    for cut in (0, 1, len(prompt)):
        stream = TextStream(lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), True,
                            tokenizer.backend_tokenizer, prompt=prompt[:cut])
        for token in [260, 259, 260]:
            stream.add(token)
        assert stream.text == " cb c", cut


@pytest.mark.parametrize("incremental", [True, False])
def test_a_prompt_ending_in_characters_spelled_in_bytes_leaves_the_completion_s_text_whole(incremental):
    """Byte fallback (Llama 2, Mistral, Gemma): a prompt ending in CJK characters, three byte
    tokens each. The decoder was primed with the prompt's last 8 tokens, which began inside a
    character: the byte decoder turned that whole run into U+FFFDs, and the completion's first
    word brought them into its text ("\ufffd" * 8 + " c"), where vLLM's has " c"."""
    from runtime.tokenizer import TextStream

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "b": 259, "\u2581c": 260}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    for characters in ("日", "日本", "日本語", "你好吗呢", "\U0001F389日本語", "é日本語"):
        prompt = [259] + [3 + b for b in characters.encode()]
        assert tokenizer.decode(prompt) == "b" + characters
        stream = TextStream(lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip), True,
                            tokenizer.backend_tokenizer if incremental else None, prompt=prompt)
        for token in [260, 259, 260]:
            stream.add(token)
        assert stream.text == " cb c", characters

