"""The vLLM CPU peer, run inside its own virtualenv (benchmarks/setup_vllm.sh): standard library and
vllm only, since that venv does not have our package.

    .venv-vllm/bin/python benchmarks/vllm_peer.py WORK.json RESULT.json

WORK.json: {"model": dir, "threads": n, "items": [{"id", "prompt_ids", "max_tokens", "sampling"}, ...]}.
RESULT.json: load_s, batch_completion_s and the generated ids per request. fp32, greedy or each
item's sampling (temperature, top_p; not its seed, below), every request generating exactly
max_tokens (ignore_eos), all submitted at once.
"""

import json
import os
import sys
import time


def main(work_path: str, result_path: str) -> None:
    work = json.load(open(work_path, encoding="utf-8"))
    last_cpu = work["threads"] - 1
    # Without these vLLM binds fewer threads and keeps a core in reserve for its front end.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{last_cpu}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=work["model"], dtype="float32", seed=0)
    load = time.perf_counter() - start
    items = work["items"]
    prompts = [TokensPrompt(prompt_token_ids=it["prompt_ids"]) for it in items]
    # A request's own seed fails vLLM 0.32's CPU worker ("CPU Generator does not use offset"):
    # sampled requests draw from its engine-wide seed instead.
    sampling = [{k: v for k, v in it.get("sampling", {}).items() if k != "seed"} for it in items]
    params = [SamplingParams(**{"temperature": 0.0, **own}, max_tokens=it["max_tokens"], ignore_eos=True)
              for it, own in zip(items, sampling)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = {it["id"]: list(out.outputs[0].token_ids) for it, out in zip(items, outputs)}
    json.dump({"system": f"vLLM CPU {vllm.__version__}", "load_s": load, "batch_completion_s": elapsed,
               "output_tokens": sum(map(len, tokens.values())), "tokens": tokens},
              open(result_path, "w", encoding="utf-8"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
