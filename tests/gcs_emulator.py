"""A local, in-memory Google Cloud Storage for tests (`gcp-storage-emulator` on 127.0.0.1).

Register with `pytest_plugins = ["gcs_emulator"]` in tests/conftest.py and request the
`gcs_emulator` fixture. For the whole session it points google-cloud-storage and Beam's gs://
filesystem at the emulator, with no credentials, so nothing leaves the loopback interface.
"""

import http.client
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

_START_TIMEOUT_S = 30


class GcsEmulator:
    def __init__(self, host: str):
        self.host = host  # the STORAGE_EMULATOR_HOST value, http://127.0.0.1:PORT

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        return storage.Client(project="test", credentials=AnonymousCredentials())

    def bucket(self, name: str):
        """The bucket `name`, created if it does not exist yet."""
        client = self.client()
        return client.lookup_bucket(name) or client.create_bucket(name)

    def upload_dir(self, local_dir, uri: str) -> str:
        """Upload every file under `local_dir` to `gs://bucket/prefix` (`uri`); return `uri`."""
        bucket_name, _, prefix = uri[len("gs://"):].partition("/")
        bucket = self.bucket(bucket_name)
        local_dir = pathlib.Path(local_dir)
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            name = "/".join(filter(None, [prefix.strip("/"), path.relative_to(local_dir).as_posix()]))
            bucket.blob(name).upload_from_filename(path)
        return uri


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(proc: subprocess.Popen, port: int, log: pathlib.Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with {proc.returncode}:\n{log.read_text()}")
        # http.client ignores *_proxy variables, so this probe cannot leave the machine.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        try:
            conn.request("GET", "/")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise RuntimeError(f"gcp-storage-emulator did not answer within {_START_TIMEOUT_S} s")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("gcs_emulator") / "emulator.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
             "--port", str(port), "--in-memory", "--quiet"],
            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_until_up(proc, port, log)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
            # Credential lookups must not probe the GCE metadata server (169.254.169.254).
            mp.setenv("NO_GCE_CHECK", "true")
            # requests honours *_proxy variables; the emulator must be reached directly.
            no_proxy = ",".join(filter(None, ["127.0.0.1,localhost", os.environ.get("no_proxy")]))
            mp.setenv("no_proxy", no_proxy)
            mp.setenv("NO_PROXY", no_proxy)
            # Beam's gs:// filesystem asks google.auth for default credentials, retrying for ~30 s
            # when there are none, then connects anonymously; go anonymous at once. (Only when
            # google-auth-httplib2 is installed does Beam look; without it, Beam is anonymous.)
            from apache_beam.internal.gcp import auth
            mp.setattr(auth, "get_service_credentials", lambda pipeline_options: None)
            yield GcsEmulator(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
