"""The model directory's tokenizer, if it has one (tiny test models may not)."""

from pathlib import Path

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
    return tokenizer


class TextStream:
    """A completion's text as its tokens arrive (what stop strings are searched in), through the
    tokenizers library's incremental decoder: O(1) a token, where decoding the whole completion
    again each token costs O(n) (milliseconds a token for long completions, on the engine's
    thread). The bytes of a character split across tokens wait for the rest of it, as vLLM's
    detokenizer (the same decoder) holds them back."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool):
        self.text = ""
        self._tokenizer, self._skip, self._ids = tokenizer, skip_special_tokens, []
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token: int) -> None:
        self._ids.append(token)
        if self._stream is not None:
            try:
                self.text += self._stream.step(self._tokenizer.backend_tokenizer, token) or ""
                return
            except Exception as exc:  # tokenizers raises a bare Exception for it
                if "Invalid prefix" not in str(exc):
                    raise
                # A byte-fallback tokenizer's text need not only grow: a stray byte after a
                # character's bytes turns them all into U+FFFD, which the incremental decoder
                # cannot follow (vLLM issue 17448). This completion decodes whole from here on.
                self._stream = None
        self.text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip).rstrip("\ufffd")


def has_text_stream(tokenizer: PreTrainedTokenizerBase) -> bool:
    return getattr(tokenizer, "backend_tokenizer", None) is not None
