"""The generate pipeline end to end on Dataflow and on Flink: one output row per input record.

Dataflow: BATCHGEN_DATAFLOW_PROJECT, BATCHGEN_DATAFLOW_REGION, BATCHGEN_DATAFLOW_BUCKET (gs://)
and Google credentials. Flink: BATCHGEN_FLINK_MASTER (host:port of a running Flink cluster's REST
endpoint). Both run the bundled prompts (a few of them) on the default model.
"""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from runner_env import REPO, env_or_skip, reachable_or_skip

PROMPTS = REPO / "batchgen_beam" / "data" / "prompts.jsonl"


def _write_input(path, count: int = 8) -> int:
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[:count]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def _run(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "pipelines.generate", *args], cwd=REPO, check=True,
                   timeout=3600)


def test_dataflow_generate():
    env = env_or_skip("BATCHGEN_DATAFLOW_PROJECT", "BATCHGEN_DATAFLOW_REGION", "BATCHGEN_DATAFLOW_BUCKET")
    if not (os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
            or os.path.exists(os.path.expanduser("~/.config/gcloud/application_default_credentials.json"))):
        pytest.skip("no Google credentials (GOOGLE_APPLICATION_CREDENTIALS or gcloud ADC)")
    try:
        from google.cloud import dataflow  # noqa: F401 - what Beam's DataflowRunner submits with
    except ImportError:
        pytest.fail("Beam's Dataflow client is missing: pip install -e '.[gcp]'")
    from apache_beam.io.filesystems import FileSystems

    bucket = env["BATCHGEN_DATAFLOW_BUCKET"].rstrip("/")
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[:8]
    with FileSystems.create(f"{bucket}/batchgen-it/input.jsonl") as f:
        f.write(("\n".join(lines) + "\n").encode())
    _run(["--runner=DataflowRunner", f"--project={env['BATCHGEN_DATAFLOW_PROJECT']}",
          f"--region={env['BATCHGEN_DATAFLOW_REGION']}", f"--temp_location={bucket}/tmp",
          "--setup_file=./setup.py", f"--input={bucket}/batchgen-it/input.jsonl",
          f"--output={bucket}/batchgen-it/out/rows", "--format=jsonl"])
    outputs = FileSystems.match([f"{bucket}/batchgen-it/out/rows*"])[0].metadata_list
    rows = [json.loads(line) for m in outputs for line in FileSystems.open(m.path).read().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(json.loads(line)["id"] for line in lines)


def test_flink_generate(tmp_path):
    master = env_or_skip("BATCHGEN_FLINK_MASTER")["BATCHGEN_FLINK_MASTER"]
    reachable_or_skip(master)
    count = _write_input(tmp_path / "input.jsonl")
    _run(["--runner=FlinkRunner", f"--flink_master={master}", "--environment_type=LOOPBACK",
          f"--input={tmp_path / 'input.jsonl'}", f"--output={tmp_path / 'rows'}"])
    rows = [r for f in tmp_path.glob("rows*.parquet") for r in pq.read_table(f).to_pylist()]
    assert len(rows) == count and all(r["error"] is None for r in rows)
