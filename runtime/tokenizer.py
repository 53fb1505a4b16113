"""The model directory's tokenizer, if it has one (tiny test models may not)."""

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    model_dir = Path(model_dir)
    if not any((model_dir / name).exists() for name in _TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # a corrupt file: transformers' error names neither it nor the folder
        present = [name for name in _TOKENIZER_FILES if (model_dir / name).exists()]
        raise ValueError(f"{model_dir}: its tokenizer does not load from {', '.join(present)}: "
                         f"{type(exc).__name__}: {exc}") from exc
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
    alternative to it) after the completion's tokens before `position`. vLLM's rules:
    - A token is decoded alone, special tokens included, with the leading spaces that its
      SentencePiece piece's markers stand for (decoding a piece alone drops them).
    - A character split across tokens (byte-level pieces of CJK text or emoji): a token whose
      text ends inside one shows "", and the token that completes it shows all the text held
      back since the last character boundary (" 🎉" for ' \xf0\x9f' then '\x8e\x89'); a
      token that cannot continue it (it decodes alone to whole characters) shows its own text,
      and bytes no token completes (a window of tokens that starts inside a character) show
      nowhere.
    So the completion's tokens' texts join into its text, up to an EOS token or a stop string;
    the tokens of a character the completion never finishes show "", as its text holds it back.
    Where vLLM's are lossy we are not: a run of tokens that each end one character and start
    the next shows whole on the token that ends it (vLLM's show "" and U+FFFD), up to
    MAX_RUN tokens: a longer one (a degenerate output, or prompt ids chosen so) breaks there,
    the character across the break showing nowhere, as vLLM's would.
    Without a tokenizer: "token_id:<id>", vLLM's name for a token it does not decode."""

    MAX_STALLED = 16  # tokens in a row that finish no character: bytes that never will (broken UTF-8)
    # Tokens in one run at most: each position decodes its run's suffixes, so a run of any
    # length made the texts of n tokens cost n^3.
    MAX_RUN = 64

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self._tokenizer = tokenizer
        self._alone: dict[int, str] = {}
        self._marker = None if tokenizer is None else _space_marker(tokenizer)
        self._special = set() if tokenizer is None else set(tokenizer.all_special_ids)

    def __call__(self, completion: Sequence[int]) -> Callable[[int, int], str]:
        if self._tokenizer is None:
            return lambda token_id, position: f"token_id:{token_id}"
        completion = list(completion)
        starts, cuts = self._run_starts(completion)

        def text(token_id: int, position: int) -> str:
            if token_id in self._special:
                return self.alone(token_id)
            cut = position in cuts and token_id == completion[position]
            return self._completed(completion[starts[position]:position] + [token_id], cut)

        return text

    def _completed(self, run: list[int], cut: bool = False) -> str:
        """What the last token of a run shows: the text from the latest of the run's tokens
        that starts whole characters (bytes before it that no token completes are left out,
        as vLLM leaves them); "" where the character it ends inside is not done, unless the
        run is cut there (MAX_RUN): then its whole characters."""
        for start in range(len(run) - 1, -1, -1):
            text = self.alone(run[-1]) if start == len(run) - 1 else self._tokenizer.decode(run[start:])
            if "\ufffd" not in text:
                return text
        text = self._tokenizer.decode(run).lstrip("\ufffd")
        if cut:
            return text.rstrip("\ufffd")
        return "" if text.endswith("\ufffd") else text

    def decoded(self, token_id: int) -> str:
        """The token's bytes decoded alone, as they are (vLLM shows an echoed prompt's first
        token so)."""
        return f"token_id:{token_id}" if self._tokenizer is None else self._tokenizer.decode([token_id])

    def alone(self, token_id: int) -> str:
        if token_id not in self._alone:
            text = self._tokenizer.decode([token_id])
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if self._marker is not None and isinstance(piece, str):
                markers = len(piece) - len(piece.lstrip(self._marker))
                text = " " * (markers - (len(text) - len(text.lstrip(" ")))) + text
            self._alone[token_id] = text
        return self._alone[token_id]

    def _run_starts(self, completion: list[int]) -> tuple[list[int], set[int]]:
        """Per position: the last character boundary at or before it, where the run of tokens
        that its text continues starts; and the positions where a run reached MAX_RUN inside
        a character. A special token ends a run (no character continues through it)."""
        starts: list[int] = []
        cuts: set[int] = set()
        start, stalled, finished = 0, 0, 0
        for position, token in enumerate(completion):
            starts.append(start)
            run = completion[start:position + 1]
            # a one-token run (the common case) from the cache that text() reads too
            decoded = self.alone(token) if len(run) == 1 else self._tokenizer.decode(run)
            done = len(decoded.rstrip("\ufffd"))
            stalled = 0 if done > finished else stalled + 1
            finished = done
            inside, full = decoded.endswith("\ufffd"), len(run) >= self.MAX_RUN
            if inside and full:
                cuts.add(position)
            if token in self._special or not inside or stalled >= self.MAX_STALLED or full:
                start, stalled, finished = position + 1, 0, 0
        return starts, cuts


def _space_marker(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The character that stands for a space in a Metaspace (SentencePiece) tokenizer's pieces,
    which decoding a piece alone drops; None for other pre-tokenizers (vLLM's rule)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]:
        if step.get("type") == "Metaspace":
            return step.get("replacement", "\u2581")
    return None


class TextStream:
    """A completion's text as its tokens arrive (what stop strings are searched in, and the
    completion's `text`), decoded after its prompt's last tokens as vLLM's detokenizer decodes
    it after the whole prompt: a SentencePiece completion's first word keeps its space (decoded
    alone, "▁Hi" reads "Hi"), and a character the prompt's last tokens begin shows whole in
    the completion (vLLM's shows the whole prompt's text before it: not copied). With the
    tokenizers library's `backend` (a fast tokenizer's), through its incremental decoder, as
    vLLM's: O(1) a token, the bytes of a character split across tokens held back until the rest
    of it comes. Without it, `detokenize(ids, skip_special_tokens)` decodes the context and the
    completion whole each token, a trailing U+FFFD (a character still incomplete) held back
    likewise."""

    # Prompt tokens decoded before the completion, at least: enough for the decoder's rules at
    # a text's start (a first space dropped) to fall on the prompt, and for a character of up
    # to four bytes split between the two.
    CONTEXT_TOKENS = 8
    # Tokens the context may start earlier so as not to start inside a character: a character
    # has at most three bytes after its first.
    BOUNDARY_TOKENS = 3

    def __init__(self, detokenize: Callable[[list[int], bool], str], skip_special_tokens: bool,
                 backend: Tokenizer | None = None, prompt: Sequence[int] = ()):
        self.text = ""
        self._detokenize, self._skip, self._ids, self._backend = detokenize, skip_special_tokens, [], backend
        self._context = self._context_of(prompt)
        self._stream = None
        if backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token in self._context:  # its text is the prompt's, not the completion's
                self._step(token)

    def _context_of(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's last CONTEXT_TOKENS tokens, or twice, four times... as many where they
        decode to nothing (special tokens, skipped): some of the prompt's text comes before
        the completion's, as the whole prompt's does. Taken from a character's start: a
        byte-fallback decoder turns a whole run of byte tokens cut inside a character into
        U+FFFDs, which the completion's first other token would bring into its text."""
        size = self.CONTEXT_TOKENS
        text = self._decode(prompt[-size:])
        while size < len(prompt) and not text:
            size *= 2
            text = self._decode(prompt[-size:])
        for _ in range(self.BOUNDARY_TOKENS):
            if size >= len(prompt) or not text.startswith("\ufffd"):
                break
            size += 1
            text = self._decode(prompt[-size:])
        return list(prompt[-size:])

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self._skip)
        return self._detokenize(list(ids), self._skip)

    def add(self, token: int) -> None:
        self.extend([token])

    def extend(self, tokens: Sequence[int]) -> None:
        self._ids.extend(tokens)
        if self._stream is not None:
            for token in tokens:
                self.text += self._step(token)
        else:
            self.text = self._decoded_whole().rstrip("\ufffd")

    def _step(self, token: int) -> str:
        try:
            return self._stream.step(self._backend, token) or ""
        except Exception as exc:  # tokenizers raises a bare Exception for it
            if "Invalid prefix" not in str(exc):
                raise
        # A byte-fallback tokenizer's text need not only grow: a stray byte after a character's
        # bytes turns them all into U+FFFD, which the incremental decoder cannot follow (vLLM
        # issue 17448). vLLM's way on: the text so far stays, a new decoder reads on from this
        # token (the stray bytes held back are dropped).
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return self._stream.step(self._backend, token) or ""

    def _decoded_whole(self) -> str:
        """The completion decoded whole after its context, the context's text cut off up to its
        last whole character (the incremental decoder holds the rest back for the completion);
        decoded alone where the context's text does not begin that."""
        whole = self._detokenize(self._context + self._ids, self._skip)
        head = self._context_head
        return whole[len(head):] if whole.startswith(head) else self._detokenize(self._ids, self._skip)

    @functools.cached_property
    def _context_head(self) -> str:
        for end in range(len(self._context), 0, -1):
            text = self._detokenize(self._context[:end], self._skip)
            if not text.endswith("\ufffd"):
                return text
        return ""
