"""What a real-runner test needs, or a skip that says why it is missing (README.md "Running on
Dataflow and Flink")."""

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def env_or_skip(*names: str) -> dict[str, str]:
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        pytest.skip(f"set {', '.join(missing)} to run this test")
    return {n: os.environ[n] for n in names}


def reachable_or_skip(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "localhost", int(port)), timeout=3):
            return
    except (OSError, ValueError) as error:
        pytest.skip(f"no job server at {address}: {error}")
