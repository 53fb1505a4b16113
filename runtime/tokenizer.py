"""The model directory's tokenizer, if it has one (tiny test models may not)."""

from pathlib import Path

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
