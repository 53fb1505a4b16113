#!/usr/bin/env bash
# Launch the generate pipeline on Dataflow (needs Beam's Dataflow client: pip install -e '.[gcp]').
#   PROJECT=my-project REGION=us-central1 BUCKET=gs://my-bucket \
#   integration_tests/run_dataflow.sh [extra pipeline flags, e.g. --model gs://my-bucket/models/x]
# INPUT (a gs:// pattern; unset: the bundled prompts, shipped inside the pipeline), OUTPUT
# (default $BUCKET/output/generations) and MACHINE_TYPE (default n2-highmem-8) may be set too.
# Workers install this package from setup.py; one engine process per worker VM serves every
# SDK process on it, so pick a machine type by memory for the model plus its KV cache.
# Paths in the flags are gs:// ones: the workers cannot reach this machine's files.
set -euo pipefail
: "${PROJECT:?set PROJECT}" "${REGION:?set REGION}" "${BUCKET:?set BUCKET (gs://...)}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
python -c "from google.cloud import dataflow" 2>/dev/null || {
  echo "Beam's Dataflow client is missing: pip install -e '$ROOT[gcp]'" >&2; exit 1; }
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python -m pipelines.generate \
  --runner=DataflowRunner --project="$PROJECT" --region="$REGION" \
  --temp_location="$BUCKET/tmp" --staging_location="$BUCKET/staging" \
  --setup_file="$ROOT/setup.py" --machine_type="${MACHINE_TYPE:-n2-highmem-8}" \
  ${INPUT:+--input="$INPUT"} --output="${OUTPUT:-$BUCKET/output/generations}" \
  "$@"
