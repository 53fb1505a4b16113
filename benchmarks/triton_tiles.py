"""Launch shapes for the Triton attention and expert kernels on a CUDA machine: each candidate
(rows per program, columns or positions per step, reduction step, warps) timed on
benchmarks.gpu_check's shapes, its error against the torch op checked, the torch op timed too.
The DECODE_TILES, PREFILL_TILES (kernels/triton/attention.py) and TILES (kernels/triton/moe.py)
tables come from this one.

    python -m benchmarks.triton_tiles [--dtypes fp32 bf16] [--out benchmarks/results/triton_tiles.json]

Prints the best shapes per op and dtype and writes every row as JSON. Exit status 2 without a
CUDA device. About 2.5 minutes per dtype on an H200, most of it compiling.
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_check import DTYPES, TOLERANCE, TORCH_OPS, _decode, _grouped_experts, _prefill, _upcast

ATTENTION = [dict(max_block_m=m, block_n=n, num_warps=w)
             for m, n, w in itertools.product((16, 32, 64), (16, 32, 64), (2, 4, 8))]
EXPERTS = [dict(max_block_m=m, block_n=n, block_k=k, num_warps=w)
           for m, n, k, w in itertools.product((16, 32, 64), (32, 64, 128), (16, 32), (4, 8))]
# (op, inputs, candidates); decode has one query per sequence, so only 16-row tiles.
CASES = [("paged_decode_attention", _decode, [c for c in ATTENTION if c["max_block_m"] == 16]),
         ("paged_prefill_attention", _prefill, ATTENTION),
         ("grouped_experts", _grouped_experts, EXPERTS)]


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def sweep(dtype_names: list[str]) -> list[dict]:
    import kernels.triton as kt
    from triton.testing import do_bench

    rows = []
    for (op, inputs, candidates), dtype_name in itertools.product(CASES, dtype_names):
        dtype = DTYPES[dtype_name]
        torch.manual_seed(0)
        args = inputs(dtype)
        want = _first(getattr(TORCH_OPS, op)(*_upcast(args)))
        scale = max(1.0, want.abs().max().item())
        torch_ms = do_bench(lambda: getattr(TORCH_OPS, op)(*args), return_mode="median")
        timed = []
        for shape in candidates:
            tiles = kt.common.Tiles(**shape)
            run = lambda: getattr(kt, op)(*args, tiles=tiles)  # noqa: E731
            try:
                error = (_first(run()).float() - want).abs().max().item()
            except Exception as failure:  # a shape the compiler refuses (out of shared memory)
                timed.append(dict(op=op, dtype=dtype_name, **shape, failed=repr(failure)[:200]))
                continue
            ms = do_bench(run, warmup=5, rep=30, return_mode="median")
            timed.append(dict(op=op, dtype=dtype_name, **shape, triton_ms=ms, torch_ms=torch_ms,
                              speedup=torch_ms / ms, max_abs_err=error,
                              ok=error <= TOLERANCE[dtype] * scale))
        valid = sorted((r for r in timed if r.get("ok")), key=lambda r: r["triton_ms"])
        for rank, row in enumerate(valid[:3]):
            shape = {k: row[k] for k in ("max_block_m", "block_n", "block_k", "num_warps") if k in row}
            print(f"{op:24} {dtype_name:5} #{rank + 1} {shape}  {row['triton_ms']:8.3f} ms"
                  f"  torch {torch_ms:8.3f} ms  x{row['speedup']:5.2f}", flush=True)
        rows += timed
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/triton_tiles.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the Triton kernels compile for a GPU", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = sweep(args.dtypes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                        rows=rows), indent=1))
    print(f"{len(rows)} shapes in {time.perf_counter() - start:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
