#!/usr/bin/env bash
# Launch the generate pipeline on a Flink cluster through Beam's Flink runner.
#   FLINK_MASTER=localhost:8081 integration_tests/run_flink.sh --input ... --output ...
# LOOPBACK runs the Python SDK workers in this process's machine (fine for a local cluster);
# on a real cluster use --environment_type=DOCKER or PROCESS with this package installed.
# Paths in the flags are read from the caller's directory (the launcher does not cd).
set -euo pipefail
: "${FLINK_MASTER:?set FLINK_MASTER (host:port of the Flink REST endpoint)}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python -m pipelines.generate \
  --runner=FlinkRunner --flink_master="$FLINK_MASTER" \
  --environment_type="${ENVIRONMENT_TYPE:-LOOPBACK}" --parallelism="${PARALLELISM:-2}" \
  "$@"
