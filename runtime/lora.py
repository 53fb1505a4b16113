"""A PEFT LoRA adapter merged into the model's weights at load: W += scale * B @ A for each
adapted linear, so a fine-tuned model runs at the base model's speed. One adapter per engine
(the whole batch job runs the fine-tuned model); per-request adapters are not supported.

adapter_config.json gives r, lora_alpha, use_rslora (scale alpha / sqrt(r), else alpha / r)
and target_modules; adapter_model.safetensors holds `base_model.model.<HF name>.lora_A.weight`
[r, in] and `lora_B.weight` [out, r] per adapted linear. Options that change more than the
adapted linears (DoRA, full copies of modules, biases, per-module ranks) are refused.
"""

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.loader import packed_part

_PREFIX = "base_model.model."
# Config values that change the computation beyond W += scale * B @ A, and their neutral value.
_REFUSED = {"use_dora": False, "modules_to_save": None, "bias": "none", "lora_bias": False,
            "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None}


def read_adapter_config(adapter_dir: str | Path) -> dict:
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir}: not a LoRA adapter directory (no adapter_config.json)")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise NotImplementedError(f"adapter type {config['peft_type']!r} is not supported (LORA only)")
    for key, neutral in _REFUSED.items():
        if config.get(key, neutral) not in (neutral, None, [], {}):
            raise NotImplementedError(f"LoRA adapter option {key}={config[key]!r} is not supported")
    return config


@torch.no_grad()
def merge_lora(model, adapter_dir: str | Path) -> int:
    """Add the adapter's low-rank updates to the model's weights, in place; returns how many
    linears it changed. Call before the weights are packed or copied (runtime/loader.py)."""
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    params = dict(model.named_parameters())
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        others = sorted(n for n in names if not n.endswith((".lora_A.weight", ".lora_B.weight")))
        if others:  # biases, DoRA magnitudes, whole modules: more than W += scale * B @ A
            raise NotImplementedError(f"{adapter_dir}: adapter tensors other than LoRA's A and B "
                                      f"are not supported ({others[0]}, ...)")
        merged = 0
        for a_name in sorted(n for n in names if n.endswith(".lora_A.weight")):
            hf_name = a_name[:-len(".lora_A.weight")].removeprefix(_PREFIX)
            b_name = a_name.replace(".lora_A.", ".lora_B.")
            if b_name not in names:
                raise ValueError(f"{adapter_dir}: {a_name} has no {b_name}")
            if ".experts." in hf_name:
                raise NotImplementedError(f"LoRA on MoE experts is not supported ({hf_name})")
            ours, rows = packed_part(hf_name.removeprefix("model."), model.spec)
            if ours == "lm_head" and model.spec.tie_word_embeddings:
                raise NotImplementedError("LoRA on a LM head tied to the embeddings is not supported")
            weight = params.get(f"{ours}.weight")
            if weight is None:
                raise ValueError(f"{adapter_dir}: the adapter changes {hf_name}, which the model lacks")
            a, b = weights.get_tensor(a_name).float(), weights.get_tensor(b_name).float()
            if a.shape[0] != r or b.shape[-1] != r:  # the scale alpha / r would be wrong
                raise ValueError(f"{adapter_dir}: {hf_name}'s A and B have rank {a.shape[0]} and "
                                 f"{b.shape[-1]}; adapter_config.json says r={r}")
            update = b @ a
            target = weight[rows]
            if update.shape != target.shape:
                raise ValueError(f"{adapter_dir}: {hf_name}'s update is {tuple(update.shape)}, the "
                                 f"weight {tuple(target.shape)}")
            target += (scale * update).to(weight.dtype)
            merged += 1
    if not merged:
        raise ValueError(f"{adapter_dir}: the adapter holds no LoRA weights")
    return merged
