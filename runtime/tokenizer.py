"""The model directory's tokenizer, if it has one (tiny test models may not)."""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

from jinja2 import TemplateSyntaxError, nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    model_dir = Path(model_dir)
    if not any((model_dir / name).exists() for name in _TOKENIZER_FILES):
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if len(tokenizer) <= len(tokenizer.all_special_ids):
        # transformers builds one of nothing but the special tokens from a tokenizer_config.json
        # whose vocabulary file is missing: every text would then encode to nothing.
        present = [name for name in _TOKENIZER_FILES if (model_dir / name).exists()]
        raise ValueError(f"{model_dir}: the tokenizer has no tokens but its {len(tokenizer)} special "
                         f"ones; its vocabulary file (tokenizer.json, or tokenizer.model / vocab.json) "
                         f"is missing or empty (found {', '.join(present)})")
    processor_template = model_dir / "chat_template.json"
    if tokenizer.chat_template is None and processor_template.exists():
        # Image-text checkpoints may keep their template only in their processor's file, which
        # AutoTokenizer does not read (AutoProcessor and vLLM do).
        tokenizer.chat_template = json.loads(processor_template.read_text())["chat_template"]
    return tokenizer


class TokenTexts:
    """Tokens' texts as OpenAI's logprobs show them: `TokenTexts(tokenizer)(completion)` is
    `text(token_id, position)`, the text of `token_id` (the completion's token there, or an
    alternative to it) after the completion's tokens before `position`.
    - A token after a character boundary is decoded alone, special tokens included, with the
      leading spaces that its SentencePiece piece's "▁" markers stand for, which decoding a
      piece alone drops (vLLM's rule).
    - A character split across tokens (byte-level pieces of CJK text or emoji) shows whole on
      the token that completes it, and a token that leaves one unfinished shows without it (""
      if that is all it holds), as vLLM shows them; here a token that ends one character and
      starts the next too. Each is read after the tokens since the last character boundary.
    So the completion's tokens' texts join into its text, up to an EOS token or a stop string.
    Without a tokenizer: "token_id:<id>", vLLM's name for a token it does not decode."""

    MAX_UNFINISHED = 16  # tokens that finish no character: bytes that never will (broken UTF-8)

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self._tokenizer = tokenizer
        self._alone: dict[int, str] = {}

    def __call__(self, completion: Sequence[int]) -> Callable[[int, int], str]:
        if self._tokenizer is None:
            return lambda token_id, position: f"token_id:{token_id}"
        completion = list(completion)
        boundaries = self._boundaries(completion)
        shown: dict[int, str] = {}  # per position: the unfinished run's text shown so far

        def text(token_id: int, position: int) -> str:
            start = boundaries[position]
            if start == position:
                return self.alone(token_id).rstrip("\ufffd")
            if position not in shown:
                shown[position] = self._finished(completion[start:position])
            joined = self._finished(completion[start:position] + [token_id])
            return joined[_common_prefix(shown[position], joined):]

        return text

    def alone(self, token_id: int) -> str:
        if token_id not in self._alone:
            text = self._tokenizer.decode([token_id])
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                markers = len(piece) - len(piece.lstrip("▁"))
                text = " " * (markers - (len(text) - len(text.lstrip(" ")))) + text
            self._alone[token_id] = text
        return self._alone[token_id]

    def _boundaries(self, completion: list[int]) -> list[int]:
        """Per position: the last position at or before it where a character boundary falls."""
        boundaries, start = [], 0
        for position in range(len(completion)):
            boundaries.append(start)
            finished = not self._tokenizer.decode(completion[start:position + 1]).endswith("\ufffd")
            if finished or position + 1 - start >= self.MAX_UNFINISHED:
                start = position + 1
        return boundaries

    def _finished(self, token_ids: list[int]) -> str:
        """Their text up to the last character they finish."""
        return self._tokenizer.decode(token_ids).rstrip("\ufffd")


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


_TEMPLATE_PARSER = ImmutableSandboxedEnvironment(extensions=[loopcontrols])


def takes_content_parts(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template loops over a message's content, so takes OpenAI's list of text
    parts and joins them its own way (Gemma 3's, Llama 4's, Mistral Small 3.1's do); other
    templates take a string, made of the parts joined by newlines. vLLM tells them apart the
    same way, by the template's syntax tree."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: apply_chat_template renders "default"
        template = template.get("default")
    if not isinstance(template, str):
        return False
    try:
        tree = _TEMPLATE_PARSER.parse(template)
    except TemplateSyntaxError:  # e.g. a training template's {% generation %} tag
        return False
    for loop in tree.find_all(nodes.For):
        source = loop.iter
        while isinstance(source, nodes.Filter):  # message['content'] | selectattr(...)
            source = source.node
        if (isinstance(source, nodes.Getitem) and isinstance(source.arg, nodes.Const)
                and source.arg.value == "content"):
            return True
        if isinstance(source, nodes.Getattr) and source.attr == "content":
            return True
    return False


class TextStream:
    """A completion's text as its tokens arrive (what stop strings are searched in). With the
    tokenizers library's `backend` (a fast tokenizer's), through its incremental decoder: O(1) a
    token, where decoding the whole completion each token costs O(n) (milliseconds a token for
    long completions, on the engine's thread); the bytes of a character split across tokens
    wait for the rest of it, as vLLM's detokenizer (the same decoder) holds them back. Without
    it, `detokenize(ids, skip_special_tokens)` decodes the whole completion each token, a
    trailing U+FFFD (a character still incomplete) held back likewise."""

    def __init__(self, detokenize: Callable[[list[int], bool], str], skip_special_tokens: bool,
                 backend: Tokenizer | None = None):
        self.text = ""
        self._detokenize, self._skip, self._ids, self._backend = detokenize, skip_special_tokens, [], backend
        self._stream = None if backend is None else DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token: int) -> None:
        self._ids.append(token)
        if self._stream is not None:
            try:
                self.text += self._stream.step(self._backend, token) or ""
                return
            except Exception as exc:  # tokenizers raises a bare Exception for it
                if "Invalid prefix" not in str(exc):
                    raise
                # A byte-fallback tokenizer's text need not only grow: a stray byte after a
                # character's bytes turns them all into U+FFFD, which the incremental decoder
                # cannot follow (vLLM issue 17448). This completion decodes whole from here on.
                self._stream = None
        self.text = self._detokenize(self._ids, self._skip).rstrip("\ufffd")
