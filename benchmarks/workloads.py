"""The benchmark workloads of DESIGN.md §8, defined once so every system runs the same work."""

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "batchgen_beam" / "data" / "prompts.jsonl"


@dataclass(frozen=True)
class WorkItem:
    id: str
    prompt_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos), so every system does identical work
    sampling: dict = field(default_factory=dict)  # temperature, top_p, seed; greedy when empty

    def request(self, logprobs: int | None = None):
        """This item as our engine's request."""
        from runtime import Request, SamplingParams

        return Request(self.id, prompt_token_ids=self.prompt_ids,
                       params=SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, logprobs=logprobs,
                                             **self.sampling))


# W1 sampled: chat-style sampling, each request seeded by its index.
W1_SAMPLING = {"temperature": 0.7, "top_p": 0.9}


def w1_sampling(index: int, sampled: bool) -> dict:
    return {**W1_SAMPLING, "seed": index} if sampled else {}


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


def w1(tokenizer, num_requests: int, sampled: bool = False) -> list[WorkItem]:
    """Request i: bundled prompt i % len(prompts), chat template applied, W1 output length;
    greedy, or sampled with W1_SAMPLING and seed i."""
    prompts = bundled_prompts()
    items = []
    for i, max_tokens in enumerate(w1_output_lengths(num_requests)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}],
                                             tokenize=False, add_generation_prompt=True)
        items.append(WorkItem(f"w1-{i}", tokenizer.encode(text, add_special_tokens=False), max_tokens,
                              w1_sampling(i, sampled)))
    return items


# W2's model: a random-initialised Qwen3-MoE of ~0.5 B parameters (32 experts, top-4), speaking
# the default model's tokenizer so W1's prompts carry over token for token.
W2_CONFIG = dict(vocab_size=49152, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=512, intermediate_size=2048, norm_topk_prob=True,
                 tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=10000.0,
                 bos_token_id=1, eos_token_id=2, pad_token_id=2)


def w2_model_dir() -> Path:
    """Build W2's model once (seeded, so identical everywhere) into the cache; return its directory."""
    import shutil

    import torch
    import transformers

    from runtime.default_model import cache_dir, default_model_dir

    target = cache_dir() / "models" / "w2-qwen3moe-32x4"
    if (target / "config.json").is_file():
        return target
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**W2_CONFIG)).eval()
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, staging / name)
    staging.rename(target)
    return target
