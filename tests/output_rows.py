"""Output rows read back, as a consumer of the job's files would: from Arrow tables (Parquet)
and JSON lines."""

import json

import pyarrow as pa

from batchgen_beam.rows import OUTPUT_SCHEMA, row_to_arrow_dict


def row_from_arrow_dict(record: dict) -> dict:
    return {**record, "passthrough": json.loads(record["passthrough"])}


def rows_to_arrow(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([row_to_arrow_dict(r) for r in rows], schema=OUTPUT_SCHEMA)


def arrow_to_rows(table: pa.Table) -> list[dict]:
    return [row_from_arrow_dict(r) for r in table.to_pylist()]


def row_from_json(line: str | bytes) -> dict:
    return json.loads(line)
