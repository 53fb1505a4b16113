"""Tiny random-initialised models of each family, saved as HF safetensors directories, and
transformers as the oracle on the same weights."""

import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=24)),
    "ministral": (transformers.MinistralConfig, transformers.MinistralForCausalLM,
                  dict(head_dim=16, sliding_window=24, layer_types=["full_attention", "sliding_attention"])),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
    "smollm": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               dict(tie_word_embeddings=True, num_key_value_heads=1)),
    # Layer 1 without RoPE and with a sliding window, as SmolLM3 pairs them; biases everywhere.
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
                dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=24,
                     attention_bias=True, mlp_bias=True)),
    # q|k|v and gate|up stored packed; RoPE on 12 of each head's 16 dims, as Phi-4-mini's 0.75.
    # Every Granite multiplier away from 1, and q|k|v|o biases.
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
                     logits_scaling=2.5, attention_bias=True)),
    # GeGLU, norms of 1 + weight, embeddings scaled by sqrt(hidden).
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(head_dim=16)),
    # Gemma's, plus per-head q/k norms, norms around both sublayers, a sliding layer and a full
    # one with their own RoPE tables (the full one's scaled), query_pre_attn_scalar.
    # Gemma's, plus norms around both sublayers, soft caps low enough to bend scores and logits,
    # a sliding layer and a full one.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=1.5,
                    final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"])),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1000000.0}})),
    # Norms at the sublayers' outputs, q/k norms over whole projections, biases.
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(attention_bias=True)),
    # OLMo 2's, plus a sliding layer and a full one whose RoPE is YaRN-scaled.
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM,
              dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                       "rope_theta": 500000.0,
                                                       "original_max_position_embeddings": 128}})),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
             dict(partial_rotary_factor=0.75, sliding_window=24)),
}

# Mixture-of-experts families (tests/test_moe.py): small experts, dense and sparse layers mixed
# where the family allows it, and each family's own router and attention options switched on.
MOE_FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=24)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2,  # layer 0 dense
                       use_sliding_window=True, sliding_window=24)),  # layer 0 sliding too
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=[1], attention_bias=True)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, clip_qkv=1.5)),
}
ALL_FAMILIES = {**FAMILIES, **MOE_FAMILIES}


def make_tiny_model(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    config_cls, model_cls, extra = ALL_FAMILIES[family]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # transformers zeroes biases and sets norms to 1 (Gemma's to 0):
        for name, param in model.named_parameters():  # random ones show whether they are used
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
            elif "norm" in name:
                param.add_(torch.randn_like(param), alpha=config.initializer_range)
    model.save_pretrained(directory)
    return directory


def hf_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def save_fused_experts(per_expert: Path, fused: Path) -> Path:
    """The same MoE checkpoint as transformers 5 holds it in memory: experts fused per layer
    (`mlp.experts.gate_up_proj` [E, 2I, H]) where save_pretrained wrote one tensor per expert."""
    fused.mkdir()
    shutil.copy(per_expert / "config.json", fused / "config.json")
    state = hf_model(per_expert).state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file({name: t.contiguous() for name, t in state.items()}, str(fused / "model.safetensors"))
    return fused


# A greedy step whose two best fp32 logits lie closer than this (a few ulps of O(1) logits) is
# decided by rounding: any other summation order (another batch, another kernel) may flip it.
NEAR_TIE = 1e-5


@torch.inference_mode()
def hf_greedy_with_margin(model, prompt_ids: list[int],
                          max_new_tokens: int) -> tuple[list[int], list[float], float]:
    """transformers' greedy continuation, the log-softmax of each chosen token, and the smallest
    gap between the two best logits over its steps."""
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logits = [step_logits[0].float() for step_logits in out.logits]
    logprobs = [torch.log_softmax(row, -1)[t].item() for row, t in zip(logits, tokens)]
    margin = min(float(top[0] - top[1]) for top in (row.topk(2).values for row in logits))
    return tokens, logprobs, margin


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the log-softmax of each chosen token; refuses a
    continuation with a near-tie, which would test rounding rather than the engine."""
    tokens, logprobs, margin = hf_greedy_with_margin(model, prompt_ids, max_new_tokens)
    assert_decisive(margin, prompt_ids)
    return tokens, logprobs


def assert_decisive(margin: float, prompt_ids) -> None:
    assert margin >= NEAR_TIE, (f"the reference continuation of {list(prompt_ids)} has a near-tie "
                                f"(top-2 logit gap {margin:.2g}): choose another prompt")


def make_lora_adapter(base_dir, adapter_dir, seed=0, base_model=None, **config):
    """A PEFT adapter with random A and B (PEFT zeroes B by default, a no-op adapter), saved;
    returns the PEFT model, the oracle."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base_model = hf_model(base_dir) if base_model is None else base_model
    model = get_peft_model(base_model, LoraConfig(init_lora_weights=False, **config)).eval()
    with torch.no_grad():  # updates large enough to change greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(adapter_dir)
    return model


def image_text_config(kind: str):
    """A tiny Gemma 3 (4B-27B layout) or Mistral Small 3.1 image-text config."""
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                initializer_range=0.1, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    if kind == "gemma3":
        return transformers.Gemma3Config(
            text_config=dict(FAMILIES["gemma3"][2], **text), vision_config=vision, mm_tokens_per_image=4,
            image_token_index=299, boi_token_index=297, eoi_token_index=298)
    # Mistral Small 3.1: its own LM head, whatever the text config says (transformers ties by
    # the whole model's flag).
    return transformers.Mistral3Config(
        text_config=dict(text, model_type="mistral", sliding_window=24, tie_word_embeddings=True),
        vision_config=dict(vision, model_type="pixtral", head_dim=16), image_token_index=299,
        tie_word_embeddings=False)


def make_tiny_tokenizer(directory: Path, vocab_size: int = 384):
    """A byte-level BPE trained on the bundled prompts, with a ChatML template like SmolLM2's:
    enough for text prompts, chat messages and stop strings on tiny models, with no download."""
    import json as _json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    prompts_file = Path(__file__).resolve().parent.parent / "batchgen_beam" / "data" / "prompts.jsonl"
    texts = [_json.loads(line)["prompt"] for line in prompts_file.read_text(encoding="utf-8").splitlines()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(directory)
    return fast


def make_tiny_chat_model(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny model with a real tokenizer and chat template (ids: pad 0, bos 1, eos 2)."""
    tokenizer = make_tiny_tokenizer(directory)
    return make_tiny_model(family, directory, seed=seed, vocab_size=len(tokenizer), **overrides)
