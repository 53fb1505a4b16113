"""resolve_model and resolve_adapter: local directories, and gs:// prefixes downloaded through
the GCS emulator."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from batchgen_beam import model_sources
from batchgen_beam.model_sources import ModelDownloadError, check_local_folders, resolve_adapter, resolve_model

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache directory per test, so every gs:// resolution starts with nothing local."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def model_uri(gcs_emulator, tiny):
    return gcs_emulator.upload_dir(tiny.dir("llama"), "gs://models/tiny/llama")


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in directory.rglob("*") if p.is_file() and p.name != ".complete"}


# --- local directories -------------------------------------------------------------------------

def test_local_dir_resolves_to_itself(tiny):
    directory = tiny.dir("llama")
    assert resolve_model(directory) == directory
    assert resolve_model(str(directory)) == directory


def test_local_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "missing")
    # A URI other than gs:// is named as one (it was a missing folder "s3:/bucket/m").
    for uri in ("s3://bucket/m", "GS://bucket/m", "https://example.com/m"):
        for resolve, what in ((resolve_model, "model"), (resolve_adapter, "LoRA adapter")):
            with pytest.raises(ValueError, match=f"{what} '{re.escape(uri)}': expected a local folder or a gs:// URI"):
                resolve(uri)
        with pytest.raises(ValueError, match="expected a local folder or a gs:// URI"):
            check_local_folders(uri)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(tmp_path / "file")
    (tmp_path / "model").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        resolve_model(tmp_path / "model")
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(b"pickled")  # the folder of an older save
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights \(pytorch_model.bin is a pickled checkpoint, "
                                         r"which is not read: save the model with save_pretrained\(\.\.\., "
                                         r"safe_serialization=True\)\)"):
        resolve_model(tmp_path / "model")


def test_paths_that_are_not_utf8_text_are_named_where_the_pipeline_is_built(tmp_path):
    """A file name in Latin-1 under a UTF-8 locale: a raw UnicodeEncodeError from Beam's coders
    or a digest of the folder, naming nothing."""
    from batchgen_beam import Generate
    from batchgen_beam.io import ReadRecords, WriteRows

    bad = str(tmp_path / "lat\udce9in1")
    for build, what in ((lambda: Generate(bad), "model"),
                        (lambda: Generate(None, engine_args={"lora": bad}), "LoRA adapter"),
                        (lambda: ReadRecords(bad + "/*.jsonl"), "input pattern"),
                        (lambda: WriteRows(bad + "/out"), "output prefix")):
        with pytest.raises(ValueError, match=rf"^{what} '.*lat\\udce9in1.*': the path is not UTF-8 text "
                                             rf"\(a byte of another encoding at index \d+\); rename it$"):
            build()


def test_an_engine_expands_a_home_folder(tiny, monkeypatch):
    from runtime import Engine

    monkeypatch.setenv("HOME", str(tiny.dir("llama").parent))
    assert Engine(f"~/{tiny.dir('llama').name}", num_threads=1).model_dir == tiny.dir("llama")


def test_none_is_the_default_model(monkeypatch, tmp_path):
    import runtime.default_model
    monkeypatch.setattr(runtime.default_model, "default_model_dir", lambda: tmp_path)
    assert resolve_model(None) == tmp_path


# --- gs:// --------------------------------------------------------------------------------------

def test_gcs_download_is_byte_identical_and_loads(model_uri, tiny, cache):
    from runtime.loader import load_model

    path = resolve_model(model_uri)
    assert path.is_relative_to(cache / "gcs" / "models" / "tiny")
    assert path.name.startswith("llama-") and (path / ".complete").is_file()
    assert _files(path) == _files(tiny.dir("llama"))
    # A trailing slash names the same model, and so the same local copy.
    assert resolve_model(model_uri + "/") == path
    assert load_model(path).embed_tokens.weight.shape[0] == 256


def test_gcs_second_call_reuses_the_copy_offline(model_uri, monkeypatch):
    path = resolve_model(model_uri)

    def no_network():
        raise AssertionError("the cached copy should be used without contacting GCS")
    monkeypatch.setattr(model_sources, "_storage_client", no_network)
    assert resolve_model(model_uri) == path


@pytest.mark.parametrize("damage", ["truncate", "flip_byte"])
def test_gcs_corrupt_download_is_rejected_and_not_cached(model_uri, cache, monkeypatch, damage):
    from google.cloud.storage import Blob

    real_download = Blob.download_to_filename

    def damaged_download(blob, filename, *args, **kwargs):
        real_download(blob, filename, *args, **kwargs)
        if filename.name.endswith(".safetensors"):
            data = bytearray(pathlib.Path(filename).read_bytes())
            if damage == "truncate":
                del data[-10:]
            else:
                data[len(data) // 2] ^= 0xFF
            pathlib.Path(filename).write_bytes(bytes(data))

    monkeypatch.setattr(Blob, "download_to_filename", damaged_download)
    expected = "bytes, expected" if damage == "truncate" else "md5 mismatch"
    with pytest.raises(ModelDownloadError, match=expected):
        resolve_model(model_uri)
    parent = cache / "gcs" / "models" / "tiny"
    # Nothing was moved into place and the staging directory is gone.
    assert [p.name for p in parent.iterdir()] == [p.name for p in parent.glob(".llama-*.lock")]

    monkeypatch.setattr(Blob, "download_to_filename", real_download)
    assert (resolve_model(model_uri) / ".complete").is_file()


def test_gcs_errors(gcs_emulator):
    gcs_emulator.bucket("empty")
    with pytest.raises(FileNotFoundError, match="no objects under gs://empty/nothing/"):
        resolve_model("gs://empty/nothing")
    with pytest.raises(ValueError, match="gs://bucket/prefix"):
        resolve_model("gs://empty")
    # A prefix that only shares a beginning with another folder is not that folder.
    bucket = gcs_emulator.bucket("near")
    bucket.blob("llama-v2/config.json").upload_from_string(b"{}")
    with pytest.raises(FileNotFoundError):
        resolve_model("gs://near/llama")
    # Objects without weights are not a model, and are not cached as one.
    with pytest.raises(ValueError, match="gs://near/llama-v2 has no \\*.safetensors"):
        resolve_model("gs://near/llama-v2")
    # Nor is a sharded model with a shard missing; once it is uploaded, the model resolves.
    bucket.blob("sharded/config.json").upload_from_string(b"{}")
    bucket.blob("sharded/model-1.safetensors").upload_from_string(b"x")
    index = b'{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}'
    bucket.blob("sharded/model.safetensors.index.json").upload_from_string(index)
    with pytest.raises(ValueError, match="names weights that are not there: model-2.safetensors"):
        resolve_model("gs://near/sharded")
    bucket.blob("sharded/model-2.safetensors").upload_from_string(b"y")
    assert (resolve_model("gs://near/sharded") / "model-2.safetensors").read_bytes() == b"y"


def test_gcs_a_download_a_killed_process_left_is_removed(model_uri, cache):
    """Only the lock holder downloads: a work folder found then is a killed download's, a
    model's size, which nothing else would ever remove."""
    parent = cache / "gcs" / "models" / "tiny"
    digest_name = resolve_model(model_uri).name
    shutil.rmtree(parent / digest_name)
    killed = parent / f".{digest_name}.k1ll3d" / "model"
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half written")
    assert (resolve_model(model_uri) / ".complete").is_file()
    assert sorted(p.name for p in parent.iterdir()) == [f".{digest_name}.lock", digest_name]


def test_gcs_a_folder_whose_path_leaves_the_cache_is_refused(gcs_emulator, cache):
    for uri in ("gs://bk/../../outside/model", "gs://bk/a/./b", "gs://../x"):
        with pytest.raises(ValueError, match="'.' or '..' in its path"):
            resolve_model(uri)
    assert not (cache.parent / "outside").exists()


def test_gcs_without_credentials_names_the_folder(cache, monkeypatch):
    from google.auth.exceptions import DefaultCredentialsError

    def no_credentials():
        raise DefaultCredentialsError("Your default credentials were not found.")
    monkeypatch.setattr(model_sources, "_storage_client", no_credentials)
    with pytest.raises(PermissionError, match="gs://bk/models/x: no Google Cloud credentials"):
        resolve_model("gs://bk/models/x")


def test_gcs_concurrent_processes_download_once(model_uri, tmp_path, cache):
    # Each process logs its downloads; both wait for each other before resolving, and a download
    # is slowed down so the second process arrives while the first still holds the lock.
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        from batchgen_beam import model_sources
        log, me, other = (pathlib.Path(a) for a in sys.argv[1:])
        real_download = model_sources._download
        def logged_download(*args):
            with open(log, "a") as f:
                f.write("download\\n")
            time.sleep(0.5)
            real_download(*args)
        model_sources._download = logged_download
        me.touch()
        while not other.exists():
            time.sleep(0.01)
        print(model_sources.resolve_model({model_uri!r}))
    """)
    log, ready = tmp_path / "downloads.log", [tmp_path / "ready0", tmp_path / "ready1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(log), str(ready[i]), str(ready[1 - i])],
                              stdout=subprocess.PIPE, text=True, env=env) for i in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert log.read_text() == "download\n"
    assert outputs[0] == outputs[1] and (pathlib.Path(outputs[0]) / ".complete").is_file()


# --- Beam's own gs:// filesystem ----------------------------------------------------------------

def test_beam_gcs_filesystem_reads_and_writes_through_the_emulator(gcs_emulator):
    from apache_beam.io.filesystems import FileSystems

    gcs_emulator.bucket("beam-io")
    with FileSystems.create("gs://beam-io/dir/hello.txt") as f:
        f.write(b"hello\nworld\n")
    assert [m.path for m in FileSystems.match(["gs://beam-io/dir/*"])[0].metadata_list] == [
        "gs://beam-io/dir/hello.txt"]
    with FileSystems.open("gs://beam-io/dir/hello.txt") as f:
        assert f.read() == b"hello\nworld\n"
    # Renames are how Beam's file sinks commit their output (a batch copy, then a batch delete).
    FileSystems.rename(["gs://beam-io/dir/hello.txt"], ["gs://beam-io/dir/final.txt"])
    final = gcs_emulator.client().bucket("beam-io").blob("dir/final.txt")
    assert final.download_as_bytes() == b"hello\nworld\n"
    assert not FileSystems.exists("gs://beam-io/dir/hello.txt")


def test_a_lora_adapter_resolves_locally_or_from_gcs(gcs_emulator, tiny, tmp_path, cache):
    from tiny_models import make_lora_adapter

    local = tmp_path / "adapter"
    make_lora_adapter(tiny.dir("llama"), local, r=2, lora_alpha=4, target_modules=["q_proj"])
    assert resolve_adapter(str(local)) == local
    with pytest.raises(FileNotFoundError, match="LoRA adapter directory .* does not exist"):
        resolve_adapter(tmp_path / "missing")
    with pytest.raises(ValueError, match="LoRA adapter .* has no adapter_config.json"):
        resolve_adapter(tiny.dir("llama"))  # a model's folder, not an adapter's
    uri = gcs_emulator.upload_dir(local, "gs://adapters/tiny/q")
    copy = resolve_adapter(uri)
    assert copy.is_relative_to(cache / "gcs" / "adapters") and _files(copy) == _files(local)
    gcs_emulator.upload_dir(tiny.dir("llama"), "gs://adapters/not-one")
    with pytest.raises(ValueError, match="LoRA adapter gs://adapters/not-one has no adapter_config.json"):
        resolve_adapter("gs://adapters/not-one")
    # Mid-upload (adapter_config.json sorts first): refused, not cached, fetched once complete.
    bucket = gcs_emulator.bucket("adapters")
    bucket.blob("uploading/adapter_config.json").upload_from_filename(local / "adapter_config.json")
    with pytest.raises(ValueError, match="gs://adapters/uploading has no adapter_model.safetensors"):
        resolve_adapter("gs://adapters/uploading")
    assert _files(resolve_adapter(gcs_emulator.upload_dir(local, "gs://adapters/uploading"))) == _files(local)


def test_gcs_fetches_only_the_folders_own_files(gcs_emulator, tiny, tmp_path):
    """Loading reads the folder's own files: a subfolder (a mirrored repository's original/
    weights) is not fetched, and an object under a doubled slash, which would name an absolute
    path, is neither fetched nor written anywhere."""
    uri = gcs_emulator.upload_dir(tiny.dir("llama"), "gs://models/mirror")
    bucket = gcs_emulator.bucket("models")
    bucket.blob("mirror/original/consolidated.pth").upload_from_string(b"x" * 1000)
    escape = tmp_path / "escaped.txt"
    bucket.blob(f"mirror/{escape}").upload_from_string(b"outside")  # "mirror//tmp/..."
    copy = resolve_model(uri)
    assert _files(copy) == _files(tiny.dir("llama"))
    assert not escape.exists()
