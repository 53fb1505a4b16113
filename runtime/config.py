"""What the engine needs to know about a model, read from its HF `config.json`."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from runtime.numbers import is_whole

# model_type -> the biases of its attention's q|k|v and o projections: fixed, or the config key
# that sets them. Each family reads only the config keys its transformers model reads: a key
# from another family (Granite's multipliers on a Qwen, a q|k|v bias flag on a Llama) changes
# nothing.
_FAMILIES = {
    "llama": ("attention_bias",) * 2,
    "mistral": (False, False),
    "ministral": (False, False),  # Mistral's, the window on the sliding layer types only
    "qwen2": (True, False),
    "qwen3": ("attention_bias",) * 2,  # plus q/k norm
    "smollm3": ("attention_bias",) * 2,  # some layers without RoPE (NoPE)
    "granite": ("attention_bias",) * 2,  # the four multipliers below
    "phi3": (False, False),  # q|k|v and gate|up stored packed; partial rotary (Phi-4-mini)
    "gemma": ("attention_bias",) * 2,  # GeGLU, norms scaling by 1 + weight, embeddings by sqrt(hidden)
    "gemma2": ("attention_bias",) * 2,  # Gemma's, plus norms around both sublayers, soft caps
    "gemma3_text": ("attention_bias",) * 2,  # Gemma 2's, plus q/k norm, a RoPE table per layer type
    "olmo2": ("attention_bias",) * 2,  # q/k norm over whole projections, norms at sublayer outputs
    "olmo3": ("attention_bias",) * 2,  # OLMo 2's, plus sliding layers with their RoPE table
    # MoE families (expert blocks in runtime/moe.py)
    "mixtral": (False, False),
    "qwen2_moe": ("qkv_bias", False),
    "qwen3_moe": ("attention_bias",) * 2,  # plus q/k norm
    "olmoe": ("attention_bias",) * 2,  # plus q/k norm over whole projections, clip_qkv
}
_MLP_BIAS = ("llama", "smollm3", "granite")  # mlp_bias; the others' MLPs have no biases
# Families with sliding-window attention (see _sliding_windows for a window on the others), and
# those of them that also read use_sliding_window (Mistral, Mixtral and Phi-3 apply any window given).
_WINDOWED = ("mistral", "ministral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3_text",
             "olmo3", "mixtral", "qwen2_moe", "qwen3_moe")
_USE_SLIDING_WINDOW = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Families whose models window the layers layer_types names (the others window every layer);
# SmolLM3's use_sliding_window only chooses its default layer_types.
_LAYER_TYPES = ("ministral", "qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text", "olmo3", "qwen2_moe")
_GRANITE = ("granite",)  # embedding, residual and attention multipliers, logits scaling
_QUERY_PRE_ATTN_SCALAR = ("gemma2", "gemma3_text")
_ATTN_SOFTCAP = ("gemma2",)  # Gemma 3's config has the key, but its attention never applies it
_FINAL_SOFTCAP = ("gemma2", "gemma3_text")
_CLIP_QKV = ("olmoe",)
_HIDDEN_ACTIVATION = ("gemma2", "gemma3_text")  # name the MLP's activation hidden_activation
_QK_NORM = ("qwen3", "qwen3_moe", "olmoe", "gemma3_text", "olmo2", "olmo3")
_QK_NORM_OVER_ALL_HEADS = ("olmoe", "olmo2", "olmo3")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_OLMO2 = ("olmo2", "olmo3")
_NORMS = {"gemma2": "sandwich", "gemma3_text": "sandwich", "olmo2": "post", "olmo3": "post"}
_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_ONE_TABLE = "rope"  # the RoPE table's name where every layer shares one
# hidden_act -> the gated MLP's activation (kernels.activation's act_and_mul ops).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
# Families whose default RoPE turns only partial_rotary_factor of each head's dims.
_PARTIAL_ROTARY = ("phi3",)
# Families whose transformers model reads rope_parameters per layer type ({"sliding_attention":
# {...}, "full_attention": {...}}); the others read one set, and fail on such a config.
_ROPE_PER_LAYER_TYPE = ("gemma3_text", "olmo3")
# Image-text models whose language model we run on text alone (runtime/loader.py finds its
# tensors under the checkpoint's language_model prefix).
_IMAGE_TEXT = ("gemma3", "mistral3")


@dataclass(frozen=True)
class MoESpec:
    """Sparse MLP layers: a router sends each token to top_k of num_experts SwiGLU experts."""
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # rescale the top-k router probabilities to sum to 1
    shared_expert_size: int  # Qwen2-MoE: a dense expert for every token behind a sigmoid gate; 0: none
    sparse_layers: tuple[bool, ...]  # per layer: MoE block, or the dense MLP (intermediate_size)
    # Qwen-MoE and OLMoE round the router weights to the model's dtype before scaling the
    # experts' outputs; Mixtral scales them by the fp32 weights (one rounding after).
    round_router_weights: bool = True


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    rope_layers: tuple[str | None, ...]  # per layer: the name of its RoPE table; None: no RoPE
    eos_token_ids: tuple[int, ...]
    # Granite's scalars: embeddings times embedding_multiplier, each attention and MLP output
    # times residual_multiplier before its residual add, attention scores scaled by
    # attention_multiplier (else head_dim ** -0.5), logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU), gelu or gelu_tanh (GeGLU)
    norm_offset: float = 0.0  # Gemma: every RMSNorm scales by offset + weight
    # In bf16 / fp16, rounding as transformers rounds: Gemma's and OLMo 2's norms apply their
    # scale to the fp32 normalised x (one rounding, where Llama's round x first); Gemma scales
    # its embeddings by sqrt(hidden) rounded to the model's dtype (Granite by the exact float);
    # OLMo 2 rotates q and k by fp32 cos / sin.
    norm_scale_in_fp32: bool = False
    embedding_multiplier_in_model_dtype: bool = False
    rope_in_fp32: bool = False
    norms: str = "pre"  # at sublayer inputs; "post": at outputs (OLMo 2); "sandwich": both (Gemma 2, 3)
    attn_softcap: float | None = None  # Gemma 2: attention scores capped to softcap * tanh(s / softcap)
    final_softcap: float | None = None  # Gemma 2: the logits likewise
    qk_norm_per_head: bool = True  # False (OLMoE, OLMo 2): over all heads' q (and k) at once
    clip_qkv: float | None = None  # OLMoE: clamp q, k, v to [-clip, clip]
    moe: MoESpec | None = None


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The config of the language model in model_dir: the whole model's, or an image-text
    model's text_config."""
    # Checked here: for a path that is not a directory transformers talks of hub repo ids.
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: not a model directory (no config.json there)")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (ValueError, AttributeError) as exc:  # not JSON, or JSON but not an object
        raise ValueError(f"{path}: not a model config (a JSON object): {exc}") from None
    if model_type not in _IMAGE_TEXT:  # checked before transformers, whose error names no file
        _check_supported(model_type, f"{path}: ")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers' checks (KeyError, huggingface_hub's strict dataclasses) name no file
        raise ValueError(f"{path}: transformers cannot read this config ({type(exc).__name__}: {exc})") from exc
    if config.model_type not in _IMAGE_TEXT:
        return config
    text = config.text_config
    text.tie_word_embeddings = config.tie_word_embeddings  # transformers ties by the whole model's
    if getattr(config, "eos_token_id", None) is not None:  # generate stops at the whole model's ids first
        text.eos_token_id = config.eos_token_id
    if config.model_type == "gemma3":  # Gemma3ForConditionalGeneration does not cap its logits
        text.final_logit_softcapping = None
    return text


def model_spec(config: PretrainedConfig) -> ModelSpec:
    model_type = config.model_type
    _check_supported(model_type)
    hidden_act = (_family_key(config, "hidden_activation", _HIDDEN_ACTIVATION)
                  or getattr(config, "hidden_act", "silu"))
    # The expert kernels compute SwiGLU only: another activation would run, silently wrong.
    supported = ["silu", "swish"] if model_type in _MOE_FAMILIES else sorted(_ACTIVATIONS)
    if hidden_act not in supported:
        raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported yet (supported: "
                                  f"{', '.join(supported)})")
    quantization = getattr(config, "quantization_config", None)
    if quantization:  # GPTQ, AWQ, bitsandbytes, fp8, ...: weights we would read as plain floats
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise NotImplementedError(f"quantization_config ({method}): quantised checkpoints are not supported")
    if _family_key(config, "use_bidirectional_attention", _GEMMA):  # (the others' models never read it)
        raise NotImplementedError("use_bidirectional_attention is not supported (causal attention only)")
    gemma = model_type in _GEMMA
    query_scalar = _family_key(config, "query_pre_attn_scalar", _QUERY_PRE_ATTN_SCALAR)
    qkv_bias, o_bias = (bias if isinstance(bias, bool) else bool(getattr(config, bias, False))
                        for bias in _FAMILIES[model_type])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos = config.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    granite = model_type in _GRANITE
    return ModelSpec(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=_rope_context_limit(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(_family_key(config, "mlp_bias", _MLP_BIAS)),
        qk_norm=model_type in _QK_NORM,
        sliding_windows=_sliding_windows(config),
        rope_layers=_rope_layers(config),
        eos_token_ids=eos_ids,
        embedding_multiplier=(config.hidden_size ** 0.5 if gemma
                              else config.embedding_multiplier if granite else 1.0),
        residual_multiplier=config.residual_multiplier if granite else 1.0,
        attention_multiplier=(query_scalar ** -0.5 if query_scalar
                              else config.attention_multiplier if granite else None),
        logits_scaling=config.logits_scaling if granite else 1.0,
        activation=_ACTIVATIONS[hidden_act],
        norm_offset=1.0 if gemma else 0.0,
        norm_scale_in_fp32=gemma or model_type in _OLMO2,
        embedding_multiplier_in_model_dtype=gemma,
        rope_in_fp32=model_type in _OLMO2,
        norms=_NORMS.get(model_type, "pre"),
        attn_softcap=_family_key(config, "attn_logit_softcapping", _ATTN_SOFTCAP),
        final_softcap=_family_key(config, "final_logit_softcapping", _FINAL_SOFTCAP),
        qk_norm_per_head=model_type not in _QK_NORM_OVER_ALL_HEADS,
        clip_qkv=_family_key(config, "clip_qkv", _CLIP_QKV),
        moe=_moe_spec(config),
    )


def _check_supported(model_type: str | None, where: str = "") -> None:
    if model_type not in _FAMILIES:
        raise NotImplementedError(f"{where}model_type {model_type!r} is not supported yet "
                                  f"(supported: {sorted(_FAMILIES)})")


def _family_key(config: PretrainedConfig, key: str, families: tuple[str, ...]):
    """The config's value for a key that only these families' models read, else None."""
    return getattr(config, key, None) if config.model_type in families else None


def _rope_layers(config: PretrainedConfig) -> tuple[str | None, ...]:
    """Each layer's RoPE table (rope_cos_sin's keys): its layer type's where the config gives
    RoPE parameters per layer type (Gemma 3), else the one table; None where SmolLM3's
    no_rope_layers says the layer has none."""
    layers = range(config.num_hidden_layers)
    if _rope_parameters_per_layer_type(config):
        tables = [config.layer_types[i] for i in layers]
    else:
        tables = [_ONE_TABLE] * config.num_hidden_layers
    has_rope = _family_key(config, "no_rope_layers", ("smollm3",)) or [1] * config.num_hidden_layers  # 1: RoPE
    return tuple(table if has_rope[i] else None for i, table in zip(layers, tables))


def _moe_spec(config: PretrainedConfig) -> MoESpec | None:
    """Router and expert shapes as transformers 5 reads them, or None for a dense model."""
    model_type = config.model_type
    if model_type in ("mixtral", "olmoe"):  # every layer sparse, experts of intermediate_size
        expert_size, sparse = config.intermediate_size, [True] * config.num_hidden_layers
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        expert_size, step = config.moe_intermediate_size, config.decoder_sparse_step
        candidates = [i for i in range(config.num_hidden_layers)
                      if i not in config.mlp_only_layers and config.num_experts > 0]
        if candidates and not is_whole(step, 1):  # read only where a layer may be sparse
            raise ValueError(f"decoder_sparse_step must be a whole number >= 1, got {step!r}")
        sparse = [i in candidates and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]
    else:
        return None
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    if any(sparse) and not is_whole(num_experts, 1):
        raise ValueError(f"the number of experts must be a whole number >= 1, got {num_experts!r}")
    if any(sparse) and not (is_whole(top_k, 1) and top_k <= num_experts):
        raise ValueError(f"num_experts_per_tok must be a whole number in 1..{num_experts} (the "
                         f"number of experts), got {top_k!r}")
    return MoESpec(
        num_experts=num_experts,  # Mixtral's num_local_experts, through the attribute map
        top_k=top_k,
        intermediate_size=expert_size,
        norm_topk_prob=model_type == "mixtral" or bool(config.norm_topk_prob),  # Mixtral always does
        shared_expert_size=_family_key(config, "shared_expert_intermediate_size", ("qwen2_moe",)) or 0,
        sparse_layers=tuple(sparse),
        round_router_weights=model_type != "mixtral",
    )


def _sliding_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    foreign = getattr(config, "sliding_window", None)
    if (config.model_type not in _WINDOWED and foreign is not None
            and foreign < config.max_position_embeddings):
        # transformers' model attends to the whole prompt, but generate's cache then keeps only
        # the window for the decode steps: neither all-window nor no-window attention matches.
        raise NotImplementedError(
            f"sliding_window {foreign} on model_type {config.model_type!r} is not supported "
            f"(transformers windows only its decode steps' cache for it)")
    window = _family_key(config, "sliding_window", _WINDOWED)
    # Switched off, Qwen2-MoE's config makes the window 0 (the others' None): no window.
    if config.model_type in _USE_SLIDING_WINDOW and not getattr(config, "use_sliding_window", True):
        window = None
    if window is not None and not is_whole(window, 1):
        raise ValueError(f"sliding_window must be a whole number of tokens >= 1 (or null for "
                         f"none), got {window!r}")
    layer_types = _family_key(config, "layer_types", _LAYER_TYPES)
    if layer_types is None:  # Mistral: one window (or none) for every layer
        return (window,) * config.num_hidden_layers
    if "sliding_attention" in layer_types and window is None:
        raise ValueError(f"model_type {config.model_type!r}: layer_types has sliding_attention "
                         f"layers but sliding_window is not set (transformers refuses it too)")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _rope_context_limit(config: PretrainedConfig) -> int:
    """The longest context we compute as transformers does. LongRoPE (Phi-3's 128k variants)
    turns with its short factors up to original_max_position_embeddings and switches every
    position to its long factors past it, keys already cached included: we run it to there."""
    limit = config.max_position_embeddings
    for params in _rope_parameter_sets(config):
        if params.get("rope_type") == "longrope":
            limit = min(limit, params["original_max_position_embeddings"])
    return limit


def _rope_parameter_sets(config: PretrainedConfig) -> list[dict]:
    """The RoPE parameters of each table: one per layer type where the config gives them so."""
    params = getattr(config, "rope_parameters", None) or {}
    if _rope_parameters_per_layer_type(config):
        return [params[kind] for kind in sorted(set(config.layer_types))]
    return [params]


def _rope_parameters_per_layer_type(config: PretrainedConfig) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None) or []
    per_layer_type = bool(layer_types) and all(isinstance(params.get(kind), dict) for kind in set(layer_types))
    if per_layer_type and config.model_type not in _ROPE_PER_LAYER_TYPE:
        raise NotImplementedError(
            f"model_type {config.model_type!r} with rope_parameters per layer type "
            f"({', '.join(sorted(set(layer_types)))}) is not supported: its transformers model reads one "
            f"set for every layer (only {', '.join(_ROPE_PER_LAYER_TYPE)} read them per layer type)")
    return per_layer_type


def rope_cos_sin(config: PretrainedConfig, head_dim: int, max_positions: int
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The model's RoPE tables by name (ModelSpec.rope_layers' names): cos and sin
    [max_positions, rotary dims] in fp32, as transformers computes them. The rotary dims are
    head_dim, or fewer where only the first ones of each head turn."""
    params = getattr(config, "rope_parameters", None) or {}
    if _rope_parameters_per_layer_type(config):
        return {kind: _rope_table(config, params[kind], head_dim, max_positions, kind)
                for kind in sorted(set(config.layer_types))}
    return {_ONE_TABLE: _rope_table(config, params, head_dim, max_positions, None)}


def _rope_table(config: PretrainedConfig, params: dict, head_dim: int, max_positions: int,
                layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", 10000.0)
        dim = head_dim
        if config.model_type in _PARTIAL_ROTARY:
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_scaling = 1.0
    elif rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (transformers knows "
                                  f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    else:
        # "dynamic" too: transformers recomputes its frequencies only for positions past
        # max_position_embeddings, which caps our context, so its initial table is the table.
        extra = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
        if 2 * len(inv_freq) != head_dim and config.model_type not in _PARTIAL_ROTARY:
            # transformers' init honours partial_rotary_factor, but this family's model
            # rotates whole heads and fails on the shorter table.
            raise NotImplementedError(f"partial_rotary_factor with rope_type {rope_type!r} on model_type "
                                      f"{config.model_type!r} is not supported (transformers cannot run it)")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling
