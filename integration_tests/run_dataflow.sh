#!/usr/bin/env bash
# Launch the generate pipeline on Dataflow.
#   PROJECT=my-project REGION=us-central1 BUCKET=gs://my-bucket \
#   integration_tests/run_dataflow.sh [extra pipeline flags, e.g. --model gs://my-bucket/models/x]
# Workers install this package from setup.py; one engine process per worker VM serves every
# SDK process on it, so pick a machine type by memory for the model plus its KV cache.
set -euo pipefail
: "${PROJECT:?set PROJECT}" "${REGION:?set REGION}" "${BUCKET:?set BUCKET (gs://...)}"
cd "$(dirname "$0")/.."
python -m pipelines.generate \
  --runner=DataflowRunner --project="$PROJECT" --region="$REGION" \
  --temp_location="$BUCKET/tmp" --staging_location="$BUCKET/staging" \
  --setup_file=./setup.py --machine_type="${MACHINE_TYPE:-n2-highmem-8}" \
  --input="${INPUT:-$BUCKET/input/prompts.jsonl}" --output="${OUTPUT:-$BUCKET/output/generations}" \
  "$@"
