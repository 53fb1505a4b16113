"""A PEFT LoRA adapter merged at load: greedy output is token-exact with transformers + PEFT
running the adapter unmerged on the same base weights."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from helpers import assert_matches, greedy_requests, make_engine, random_prompts
from tiny_models import hf_greedy, hf_model

PROMPTS = random_prompts((5, 17, 40), seed=11)
MAX_TOKENS = 16
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, adapter_dir, seed=0, **config):
    """A PEFT adapter with random A and B (PEFT zeroes B by default, a no-op adapter), saved;
    returns the PEFT model, the oracle."""
    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base_dir), LoraConfig(init_lora_weights=False, **config)).eval()
    with torch.no_grad():  # updates large enough to change greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(adapter_dir)
    return model


@pytest.mark.parametrize("family,config", [
    ("llama", dict(r=4, lora_alpha=8, target_modules=ALL_LINEARS)),
    ("qwen2", dict(r=2, lora_alpha=3, target_modules=["k_proj", "up_proj"], use_rslora=True)),
    ("phi3", dict(r=4, lora_alpha=4, target_modules=["qkv_proj", "down_proj"])),  # stored packed
], ids=["llama-every-linear", "qwen2-some-rslora", "phi3-packed"])
def test_merged_adapter_matches_peft(tiny, tmp_path, family, config):
    base = tiny.dir(family)
    oracle = make_adapter(base, tmp_path / "adapter", **config)
    engine = make_engine(base, lora=tmp_path / "adapter")
    plain = make_engine(base)
    changed = False
    for prompt, ours, without in zip(PROMPTS, engine.generate(greedy_requests(PROMPTS, MAX_TOKENS)),
                                     plain.generate(greedy_requests(PROMPTS, MAX_TOKENS))):
        tokens, logprobs = hf_greedy(oracle, prompt, MAX_TOKENS)
        assert_matches(ours, tokens, logprobs, max_tokens=MAX_TOKENS)
        changed |= ours.token_ids != without.token_ids
    assert changed  # the adapter mattered


def test_adapters_that_change_more_than_the_linears_are_refused(tiny, tmp_path):
    base = tiny.dir("llama")
    make_adapter(base, tmp_path / "dora", r=2, lora_alpha=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(NotImplementedError, match="use_dora=True"):
        make_engine(base, lora=tmp_path / "dora")
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter directory"):
        make_engine(base, lora=tmp_path)
    with pytest.raises(NotImplementedError, match="weight streaming"):
        make_engine(base, lora=tmp_path / "dora", weight_budget_bytes=10 ** 6)
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    assert config["use_dora"]


def test_an_adapter_whose_tensors_disagree_with_its_rank_is_refused(tiny, tmp_path):
    """r scales the update (alpha / r): tensors of another rank than the config's would merge
    at the wrong scale, where PEFT refuses to load them."""
    base = tiny.dir("llama")
    make_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj"])
    path = tmp_path / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "r": 8}))
    with pytest.raises(ValueError, match="A and B have rank 4 and 4; adapter_config.json says r=8"):
        make_engine(base, lora=tmp_path / "adapter")
