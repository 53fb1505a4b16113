"""A PEFT LoRA adapter merged into the model's weights at load: W += scale * B @ A for each
adapted linear, so a fine-tuned model runs at the base model's speed. One adapter per engine
(the whole batch job runs the fine-tuned model); per-request adapters are not supported.

adapter_config.json gives r, lora_alpha, use_rslora (scale alpha / sqrt(r), else alpha / r)
and target_modules; adapter_model.safetensors holds `base_model.model.<HF name>.lora_A.weight`
[r, in] and `lora_B.weight` [out, r] per adapted linear, named as the model's checkpoint
names it (the loader's renames apply: an image-text model's language model, older names).
Options that only choose which linears are adapted (target_modules, exclude_modules,
layers_to_transform) are checked against the tensors present: PEFT ignores a tensor its
config does not select, so merging one would run another model. Options that change more
than the adapted linears (DoRA, full copies of modules, biases, per-module ranks) and LoRA on
MoE experts are refused.
"""

import json
import math
import re
from pathlib import Path

import torch

from runtime.loader import canonical_name, open_safetensors, packed_part
from runtime.numbers import is_number, is_whole

_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Config values that change the computation beyond W += scale * B @ A, and their neutral value.
_REFUSED = {"use_dora": False, "modules_to_save": None, "bias": "none", "lora_bias": False,
            "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
            # Activated LoRA applies from its invocation tokens on (it cannot be merged); layer
            # replication builds another stack of layers, which the tensors' names do not say.
            "alora_invocation_tokens": None, "layer_replication": None,
            # BD-LoRA stores a block-diagonal factor compactly: not a plain [r, in] / [out, r].
            "use_bdlora": None}
# init_lora_weights values whose adapters PEFT applies to a base it first changed (W - B0 @ A0,
# in memory, again at every load): merged onto the checkpoint's W they give another model.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
# The parameters of an MoE experts module (transformers 5 fuses them), by their own names.
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
# An image-text model's parts that text-only generation never runs: their updates change nothing.
_NOT_RUN = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
            "multi_modal_projector.")


def read_adapter_config(adapter_dir: str | Path) -> dict:
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir}: not a LoRA adapter directory (no adapter_config.json)")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise NotImplementedError(f"adapter type {config['peft_type']!r} is not supported (LORA only)")
    experts = [p for p in config.get("target_parameters") or []
               if "experts" in p or p.rsplit(".", 1)[-1] in _EXPERT_PARAMETERS]
    if experts:  # PEFT's all-linear on a MoE model adds them (with a rank_pattern for them)
        raise NotImplementedError(f"LoRA on MoE experts is not supported (target_parameters {experts})")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise NotImplementedError(f"LoRA adapter option init_lora_weights={init!r} is not supported: PEFT "
                                  f"subtracts the initial update from the base weights; convert the "
                                  f"adapter to a plain LoRA (PEFT's path_initial_model_for_weight_conversion)")
    for key, neutral in _REFUSED.items():
        if config.get(key, neutral) not in (neutral, None, [], {}):
            raise NotImplementedError(f"LoRA adapter option {key}={config[key]!r} is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not is_whole(r, 1):
        raise ValueError(f"{path}: r must be a positive integer, got r={r!r}")
    if not is_number(alpha, -math.inf):
        raise ValueError(f"{path}: lora_alpha must be a number, got lora_alpha={alpha!r}")
    return config


def _selects(config: dict, module: str) -> bool:
    """Whether PEFT, loading this adapter, adapts `module` (named as in the model PEFT wraps):
    target_parameters names one of its parameters (`<module>.<parameter>`, or its end), or
    exclude_modules does not name it and target_modules does: a regex on the whole name, the
    name itself, or names it ends with, of a layer layers_to_transform holds."""
    def named(patterns) -> bool:
        if isinstance(patterns, str):
            return re.fullmatch(patterns, module) is not None
        return any(module == p or module.endswith(f".{p}") for p in patterns)

    for target in config.get("target_parameters") or ():
        key = f"{module}.{target.rpartition('.')[2]}"
        if key == target or key.endswith(f".{target}"):
            return True
    excluded, targets = config.get("exclude_modules"), config.get("target_modules")
    if excluded and named(excluded):
        return False
    if targets is None:  # PEFT's defaults for the architecture, unless it targets parameters
        return not config.get("target_parameters")
    if isinstance(targets, str) and targets.lower() == "all-linear":  # every linear but the output layer
        return module.rsplit(".", 1)[-1] != "lm_head"
    if isinstance(targets, str) or module in targets:  # no layer filter then
        return named(targets)
    if not named(targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    # A layer's index follows the first `<layers_pattern>.` in the name (any segment if none).
    patterns = config.get("layers_pattern") or [None]
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        found = re.match(r".*?\.[^.]*\.(\d+)\." if pattern is None else rf"(?:^|.*?\.){pattern}\.(\d+)\.", module)
        if found:
            index = int(found.group(1))
            return index == layers if isinstance(layers, int) else index in layers
    return False


def _open_weights(adapter_dir: Path):
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            raise NotImplementedError(f"{adapter_dir}: adapter_model.bin (pickled) adapters are not "
                                      f"supported; save it with safe_serialization=True")
        raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}")
    return open_safetensors(path)


@torch.no_grad()
def merge_lora(model, adapter_dir: str | Path) -> int:
    """Add the adapter's low-rank updates to the model's weights, in place; returns how many
    linears it changed. Call before the weights are packed or copied (runtime/loader.py)."""
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    params = dict(model.named_parameters())
    with _open_weights(adapter_dir) as weights:
        names = set(weights.keys())
        others = sorted(n for n in names if not n.endswith((".lora_A.weight", ".lora_B.weight")))
        if others:  # biases, DoRA magnitudes, whole modules: more than W += scale * B @ A
            raise NotImplementedError(f"{adapter_dir}: adapter tensors other than LoRA's A and B "
                                      f"are not supported ({others[0]}, ...)")
        unpaired = sorted(n for n in names if n.replace(".lora_A.", ".lora_B.") not in names
                          or n.replace(".lora_B.", ".lora_A.") not in names)
        if unpaired:
            raise ValueError(f"{adapter_dir}: {unpaired[0]} has no matching lora_A / lora_B")
        merged = 0
        for a_name in sorted(n for n in names if n.endswith(".lora_A.weight")):
            b_name = a_name.replace(".lora_A.", ".lora_B.")
            module = a_name[:-len(".lora_A.weight")].removeprefix(_PREFIX)
            hf_name = canonical_name(module)
            if hf_name.startswith(_NOT_RUN):
                continue
            if ".experts." in hf_name or hf_name.endswith(".experts"):
                raise NotImplementedError(f"LoRA on MoE experts is not supported ({hf_name})")
            if not _selects(config, module):
                raise ValueError(f"{adapter_dir}: the adapter holds weights for {module}, which "
                                 f"adapter_config.json does not select (target_modules, exclude_modules, "
                                 f"layers_to_transform): PEFT would ignore them")
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
            # Added in fp32 and rounded once, as merging in the adapter's precision would.
            target.copy_(target.float() + scale * update.to(weight.device))
            merged += 1
    if not merged:
        raise ValueError(f"{adapter_dir}: the adapter holds no LoRA weights")
    return merged
