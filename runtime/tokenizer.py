"""The model directory's tokenizer, if it has one (tiny test models may not)."""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    model_dir = Path(model_dir)
    if not any((model_dir / name).exists() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))
