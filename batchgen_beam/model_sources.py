"""Where a model's weights come from: the default model, a local directory, or a gs:// prefix.

A gs:// model is downloaded once per machine into the cache directory and reused from there, so
every SDK process on a worker loads the same local copy.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import pathlib
import re
import tempfile

# Written into the model directory before it is moved into place, so its presence means "complete".
_COMPLETE_MARKER = ".complete"


class ModelDownloadError(OSError):
    """A downloaded file does not match the object it was downloaded from."""


def check_text_path(what: str, path: str) -> None:
    """ValueError for a path that is not text: a file name in another encoding than the
    locale's reaches Python with its bytes as lone surrogates ("lat\\udce9in1"), which Beam's
    coders and safetensors, taking UTF-8, fail on deep in their own code."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as bad:
        raise ValueError(f"{what} {path!r}: the path is not UTF-8 text (a byte of another encoding at "
                         f"index {bad.start}); rename it") from None


def model_location(location: str | os.PathLike | None, what: str = "model") -> str | None:
    """A model's or adapter's location as engines are configured with it: a URI as given, a
    local folder absolute ("~" expanded, no trailing slash), so every spelling of one folder
    (a Path, "./m", "m/") names one engine."""
    if location is None:
        return None
    location = os.fspath(location)
    check_text_path(what, location)
    return location if "://" in location else os.path.abspath(os.path.expanduser(location))


def resolve_model(model: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a local directory holding the model's config.json and *.safetensors weights.

    ``None`` means the default model; ``gs://bucket/prefix`` is downloaded on first use.
    """
    if model is None:
        # Imported here: the runtime package pulls in torch, which a gs:// cache hit does not need.
        from runtime.default_model import default_model_dir
        return default_model_dir()
    model = os.fspath(model)
    if model.startswith("gs://"):
        return _from_gcs(model)
    _refuse_other_uris(model, "model")
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    _check_model_dir(path, str(path))
    return path


def resolve_adapter(adapter: str | os.PathLike) -> pathlib.Path:
    """Return a local directory holding a PEFT LoRA adapter; ``gs://bucket/prefix`` is
    downloaded on first use, as a model is."""
    adapter = os.fspath(adapter)
    if adapter.startswith("gs://"):
        return _from_gcs(adapter, _check_adapter_dir)
    _refuse_other_uris(adapter, "LoRA adapter")
    path = pathlib.Path(adapter).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"LoRA adapter directory {path} does not exist")
    _check_adapter_dir(path, str(path))
    return path


def _refuse_other_uris(location: str, what: str) -> None:
    """ValueError for a URI that is not gs:// (s3://, https://, GS://): taken as a local path it
    was reported as a missing folder with its slashes collapsed ("s3:/bucket/m")."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", location):
        raise ValueError(f"{what} {location!r}: expected a local folder or a gs:// URI (lower-case "
                         f"gs; no other scheme is supported)")


def check_local_folders(model: str | os.PathLike | None = None,
                        adapter: str | os.PathLike | None = None) -> None:
    """That a local model or adapter folder holds one (FileNotFoundError or ValueError saying
    what is wrong), so a mistake is named where the job is set up; the default model and gs://
    ones are fetched, and checked, only where an engine needs them."""
    if model is not None and not os.fspath(model).startswith("gs://"):
        resolve_model(model)
    if adapter is not None and not os.fspath(adapter).startswith("gs://"):
        resolve_adapter(adapter)


def _check_adapter_dir(path: pathlib.Path, source: str) -> None:
    """ValueError where the adapter lacks its config or weights: a gs:// copy taken mid-upload
    would otherwise be cached as complete, and a local folder of something else is named before
    an engine tries to merge it."""
    from runtime.lora import ADAPTER_WEIGHTS  # what merging reads

    for name in ("adapter_config.json", ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise ValueError(f"LoRA adapter {source} has no {name}")


def _check_model_dir(path: pathlib.Path, source: str) -> None:
    """ValueError where the directory lacks what loading needs: a config and the weights (every
    shard its index names; a gs:// copy missing one would otherwise be cached as complete)."""
    if not path.is_dir():
        raise ValueError(f"model {source} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model {source} has no config.json")
    from runtime.loader import pickled_note, safetensors_files  # the list loading reads

    try:
        weights = safetensors_files(path)
    except FileNotFoundError:
        raise ValueError(f"model {source} has no *.safetensors weights{pickled_note(path)}") from None
    except ValueError as exc:  # an index that is not one
        raise ValueError(f"model {source}: {exc}") from None
    missing = [f.name for f in weights if not f.is_file()]
    if missing:
        raise ValueError(f"model {source}: its safetensors index names weights that are not "
                         f"there: {', '.join(missing[:3])}")


def _from_gcs(uri: str, check=_check_model_dir) -> pathlib.Path:
    """The local copy of the folder at `uri`; `check(folder, uri)` vets a download before it is
    cached."""
    from runtime.default_model import cache_dir, remove_killed_work

    bucket, _, prefix = uri[len("gs://"):].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise ValueError(f"expected gs://bucket/prefix (the folder holding it), got {uri!r}")
    if any(part in (".", "..") for part in (bucket, *prefix.split("/"))):
        # GCS takes them as names, but the local copy's path would leave the cache
        raise ValueError(f"{uri!r}: a gs:// folder with a '.' or '..' in its path is not supported")
    uri = f"gs://{bucket}/{prefix}"
    # The suffix keeps the copy of gs://b/models/x out of the copy of gs://b/models (which would
    # otherwise be its parent directory).
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    target = cache_dir() / "gcs" / bucket / f"{prefix}-{digest}"
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several SDK processes per worker start at once: one downloads, the others wait and reuse it.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _COMPLETE_MARKER).is_file():
            remove_killed_work(target)
            _download(uri, bucket, prefix, target, check)
    return target


def _storage_client():
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials
        # The emulator takes no credentials, and looking for real ones may probe the network.
        return storage.Client(project="test", credentials=AnonymousCredentials())
    return storage.Client()


def _download(uri: str, bucket: str, prefix: str, target: pathlib.Path, check) -> None:
    # The trailing "/" keeps gs://b/model from also matching gs://b/model-v2/...; the delimiter
    # keeps to the folder's own files, all that loading reads (a mirrored repository's
    # original/ weights or a checkpoints/ folder are not fetched); names ending in "/" are
    # folder placeholders that some tools create.
    from google.auth.exceptions import DefaultCredentialsError

    try:
        client = _storage_client()
    except DefaultCredentialsError as missing:  # its message names no bucket
        raise PermissionError(f"{uri}: no Google Cloud credentials to read it with ({missing})") from None
    blobs = [b for b in client.list_blobs(bucket, prefix=prefix + "/", delimiter="/")
             if not b.name.endswith("/")]
    if not blobs:
        raise FileNotFoundError(f"no objects under {uri}/")
    # Work next to the target so that the final os.replace is an atomic rename on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as work:
        staging = pathlib.Path(work) / "model"
        staging.mkdir()
        for blob in blobs:
            name = blob.name[len(prefix) + 1:]
            if name in ("", ".", "..") or "/" in name:  # the delimiter keeps out the others
                raise ValueError(f"refusing object name {blob.name!r}: it is not a file of the folder")
            dest = staging / name
            # A listed blob carries its generation, so each file is the version that was listed.
            blob.download_to_filename(dest)
            _verify(blob, dest)
        check(staging, uri)
        (staging / _COMPLETE_MARKER).touch()
        if target.exists():
            # Only a directory without the marker gets here: a leftover that cannot be trusted.
            os.rename(target, pathlib.Path(work) / "stale")
        os.replace(staging, target)


def _verify(blob, path: pathlib.Path) -> None:
    """Check the file on disk against the object's size and whichever hashes the server gave."""
    import google_crc32c

    size = path.stat().st_size
    if size != blob.size:
        raise ModelDownloadError(
            f"gs://{blob.bucket.name}/{blob.name}: got {size} bytes, expected {blob.size}")
    md5, crc32c = hashlib.md5(), google_crc32c.Checksum()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            md5.update(chunk)
            crc32c.update(chunk)
    # Composite objects have no md5; both hashes come base64-encoded, as the JSON API sends them.
    for name, expected, digest in (("md5", blob.md5_hash, md5.digest()),
                                   ("crc32c", blob.crc32c, crc32c.digest())):
        if expected and base64.b64encode(digest).decode() != expected:
            raise ModelDownloadError(f"gs://{blob.bucket.name}/{blob.name}: {name} mismatch")
