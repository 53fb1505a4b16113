"""Side-by-side reporting shared by the benchmarks: same-work checks, ratios, JSON and a PNG."""

import json
import os
import platform
from pathlib import Path

import torch

from benchmarks.workloads import WorkItem

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine(threads: int) -> dict:
    import transformers

    return {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": threads, "cpus": os.cpu_count()}


def progress(results: list[dict]) -> None:
    """Print the latest system's time as soon as it finishes (a long run shows where it is)."""
    r = results[-1]
    print(f"{r['system']:<52} {r['batch_completion_s']:8.1f} s  "
          f"(x{r['batch_completion_s'] / results[0]['batch_completion_s']:.2f} of ours)", flush=True)


def compare(results: list[dict], items: list[WorkItem]) -> list[str]:
    """Fill in tokens/s, the ratio to ours (results[0]) and token agreement; return any mismatch
    in the work done (a system that generated a different number of tokens for some request),
    which its row carries too (`work_mismatch`), so its ratio is never read without it."""
    ours, mismatches = results[0], []
    for r in results:
        r["tokens_per_s"] = r["output_tokens"] / r["batch_completion_s"]
        r["ours_faster_by"] = r["batch_completion_s"] / ours["batch_completion_s"]
        wrong = [it.id for it in items if len(r["tokens"].get(it.id, ())) != it.max_tokens]
        if wrong:
            r["work_mismatch"] = f"{len(wrong)} request(s) with a different output length, e.g. {wrong[:3]}"
            mismatches.append(f"{r['system']}: {r['work_mismatch']}")
        if r is not ours:
            differing = [it.id for it in items if r["tokens"].get(it.id) != ours["tokens"][it.id]]
            r["requests_token_identical_to_ours"] = f"{len(items) - len(differing)}/{len(items)}"
            # where each one first differs: a late near-tie flip reads apart from a broken model
            r["first_differing_token"] = {rid: _first_difference(r["tokens"].get(rid) or [], ours["tokens"][rid])
                                          for rid in differing}
        load = "in the clock" if r["load_s"] is None else f"{r['load_s']:.1f} s"
        print(f"{r['system']:<52} {r['batch_completion_s']:8.1f} s {r['tokens_per_s']:7.1f} tok/s  "
              f"ours faster x{r['ours_faster_by']:.2f}  (load {load})", flush=True)
    for line in mismatches:
        print(f"WORK MISMATCH {line}", flush=True)
    return mismatches


def _first_difference(theirs: list[int], ours: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))


def write(name: str, report: dict, results: list[dict]) -> Path:
    """Write results/<name>.json (per-request tokens dropped) and, with matplotlib, <name>.png."""
    report["results"] = [{k: v for k, v in r.items() if k != "tokens"} for r in results]
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"{name}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return out
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["system"] for r in results]
    times = [r["batch_completion_s"] for r in results]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(results) + 1.5))
    bars = ax.barh(labels[::-1], times[::-1], color=["#4c72b0"] * (len(results) - 1) + ["#dd8452"])
    for bar, r in zip(bars, results[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {r['batch_completion_s']:.0f} s (x{r['ours_faster_by']:.2f})"
                + (" WORK MISMATCH" if "work_mismatch" in r else ""), va="center")
    ax.set_xlabel("batch completion time, s (ratio to batchgen engine)")
    ax.set_title(f"{report['workload']}: {report['requests']} requests, {report['output_tokens']} output tokens")
    ax.set_xlim(0, max(times) * 1.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')}")
    return out


def timelines(path: Path, title: str, panels: dict[str, list[list[dict]]]) -> None:
    """One panel per system: each engine's running requests over time (samples with t, busy,
    running), its idle stretches shaded. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.4 * len(panels) + 0.6), sharex=True,
                             squeeze=False)
    for ax, (system, engines) in zip(axes[:, 0], panels.items()):
        for index, (samples, color) in enumerate(zip(engines, ("#4c72b0", "#dd8452", "#55a868", "#c44e52"))):
            times = [s["t"] for s in samples]
            ax.step(times, [s["running"] for s in samples], where="post", color=color,
                    label=f"engine {index}")
            for s, following in zip(samples, samples[1:]):
                if not s["busy"]:
                    ax.axvspan(s["t"], following["t"], color=color, alpha=0.15, lw=0)
        ax.set_title(system, fontsize=10)
        ax.set_ylabel("running")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since first submit")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
