"""The benchmark workloads of DESIGN.md §8, defined once so every system runs the same work."""

import json
import random
from dataclasses import dataclass
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "batchgen_beam" / "data" / "prompts.jsonl"


@dataclass(frozen=True)
class WorkItem:
    id: str
    prompt_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos), so every system does identical work


def bundled_prompts() -> list[str]:
    with open(PROMPTS_FILE, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def w1_output_lengths(num_requests: int) -> list[int]:
    """W1's skewed output lengths: 70% short, 25% medium, 5% very long. Keep exactly as is."""
    rng = random.Random(0)
    lengths = []
    for _ in range(num_requests):
        u = rng.random()
        lengths.append(rng.randint(16, 64) if u < 0.70 else rng.randint(128, 256) if u < 0.95
                       else rng.randint(512, 1024))
    return lengths


def w1(tokenizer, num_requests: int) -> list[WorkItem]:
    """Request i: bundled prompt i % len(prompts), chat template applied, W1 output length."""
    prompts = bundled_prompts()
    items = []
    for i, max_tokens in enumerate(w1_output_lengths(num_requests)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                             tokenize=False, add_generation_prompt=True)
        items.append(WorkItem(f"w1-{i}", tokenizer.encode(text, add_special_tokens=False), max_tokens))
    return items
