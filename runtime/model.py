"""Decoder-only models of the Llama lineage in plain torch (Llama, Mistral, Ministral, Qwen2,
Qwen3, SmolLM, SmolLM3, Phi-3, Granite, Gemma 1-3, OLMo 2-3; with runtime/moe.py's expert blocks
Mixtral, Qwen-MoE, OLMoE), over one flattened batch of tokens from many sequences: decode
tokens first, then prefill chunks. No padding. runtime/config.py's ModelSpec says where the
families differ (norm placement, activation, RoPE tables, multipliers, soft caps).

Projections are packed at load time (q|k|v, gate|up): one matmul each instead of three and two.
On CPU, a step of decode rows through a dense stack runs as one call of the C++ kernels
(`decode_stack`), the same kernels in the same order, without a Python call per op.
"""

from dataclasses import dataclass

import torch
from torch import nn

from kernels import (add_rms_norm, apply_rope, argmax, decode_stack, decode_stack_runs, gelu_and_mul,
                     gelu_tanh_and_mul, linear, pack_linear_weight, paged_decode_attention,
                     paged_prefill_attention, rms_norm, rms_norm_fp32_scale, silu_and_mul, write_kv)
from runtime.config import ModelSpec
from runtime.logit_screen import LogitScreen, screened_argmax


@dataclass
class PrefillChunk:
    """One sequence's chunk of consecutive tokens inside the flattened batch."""
    token_start: int  # first row in the flattened batch
    num_tokens: int
    start_pos: int  # position of the chunk's first token in its sequence
    block_table: torch.Tensor  # [blocks]


@dataclass
class DecodeGroup:
    """Consecutive decode rows attended to in one call: all of them, or where the attention pads
    to the longest context, rows of similar length (runtime/runner.py)."""
    token_start: int
    block_tables: torch.Tensor  # [rows, max_blocks of the group]
    context_lens: torch.Tensor  # [rows]


@dataclass
class AttentionBatch:
    """Where each token's KV goes and what each query attends to."""
    slot_mapping: torch.Tensor  # [tokens] flat cache slot per token
    decodes: list[DecodeGroup]  # single-token decode rows come first in the batch
    prefills: list[PrefillChunk]


class Linear(nn.Linear):
    """nn.Linear through kernels.linear: on CPU, a C++ kernel on a copy of the weight that `pack`
    arranges for it (k-major panels), at the row counts where it beats MKL's sgemm."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Once the weight is final (loaded, in its dtype and on its device): a copy changed
        afterwards would go stale."""
        self.packed = pack_linear_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # Gemma's norms in bf16 / fp16 hold their scale (1 + weight) in fp32 and apply it before
        # rounding, as transformers does (runtime/loader.py sets it).
        self.fp32_scale = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_scale:
            return rms_norm_fp32_scale(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        if self.fp32_scale:
            residual = x + residual
            return self(residual), residual
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        # Qwen3 normalises each head's q and k; OLMoE all heads' at once (before the head split).
        self.qk_norm_per_head = spec.qk_norm_per_head
        q_norm_size, k_norm_size = (spec.head_dim,) * 2 if spec.qk_norm_per_head else (self.q_size, self.kv_size)
        self.q_norm = RMSNorm(q_norm_size, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, spec.rms_norm_eps) if spec.qk_norm else None
        self.clip_qkv = spec.clip_qkv
        self.sliding_window = spec.sliding_windows[layer]
        self.softcap = spec.attn_softcap
        self.rope = spec.rope_layers[layer]
        self.scale = spec.attention_multiplier or spec.head_dim ** -0.5

    def forward(self, x, rope: dict, batch: AttentionBatch, k_cache, v_cache):
        """rope: cos and sin at each token's position, by RoPE table name."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = rope[self.rope]
            if cos.dtype != q.dtype:  # fp32 tables on half q, k (OLMo 2): rotate in fp32, round once
                q, k = apply_rope(q.float(), cos, sin).to(q.dtype), apply_rope(k.float(), cos, sin).to(k.dtype)
            else:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(k_cache, v_cache, batch.slot_mapping, k, v)

        out = torch.empty_like(q)
        for group in batch.decodes:
            rows = slice(group.token_start, group.token_start + len(group.context_lens))
            out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, group.block_tables,
                                               group.context_lens, self.scale, self.sliding_window,
                                               self.softcap)
        for chunk in batch.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = paged_prefill_attention(q[rows], k_cache, v_cache, chunk.block_table,
                                                chunk.start_pos, self.scale, self.sliding_window,
                                                self.softcap)
        return self.o_proj(out.view(-1, self.q_size))


_ACT_AND_MUL = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


class MLP(nn.Module):
    """Gated: act(gate) * up, then down; SwiGLU, or GeGLU (Gemma)."""

    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None):
        super().__init__()
        size = intermediate_size or spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * size, bias=spec.mlp_bias)
        self.down_proj = Linear(size, spec.hidden_size, bias=spec.mlp_bias)
        self.activation = spec.activation
        self._act_and_mul = _ACT_AND_MUL[spec.activation]

    def forward(self, x):
        return self.down_proj(self._act_and_mul(self.gate_up_proj(x)))


def make_mlp(spec: ModelSpec, layer: int) -> nn.Module:
    """The layer's MLP: dense, or on an MoE model's sparse layers the expert block."""
    if spec.moe is not None and spec.moe.sparse_layers[layer]:
        from runtime.moe import SparseMoeBlock  # imported here: runtime.moe builds on this module
        return SparseMoeBlock(spec)
    return MLP(spec)


class DecoderLayer(nn.Module):
    """Where the norms sit (ModelSpec.norms), by HF's names: "pre" (Llama) norms each sublayer's
    input, input_layernorm and post_attention_layernorm (before the MLP, despite its name);
    "post" (OLMo 2) norms each sublayer's output, post_attention_layernorm and
    post_feedforward_layernorm; "sandwich" (Gemma 2, 3) does both, with pre_feedforward_layernorm
    before the MLP."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.norms = spec.norms

        def norm():
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if self.norms != "post":
            self.input_layernorm = norm()
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = norm()
        if self.norms == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.norms != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp = make_mlp(spec, layer)
        self.residual_multiplier = spec.residual_multiplier

    def forward(self, x, rope, batch, k_cache, v_cache):
        if self.norms == "post":
            x = x + self.post_attention_layernorm(self.self_attn(x, rope, batch, k_cache, v_cache))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        attended = self.self_attn(self.input_layernorm(x), rope, batch, k_cache, v_cache)
        if self.norms == "sandwich":
            attended = self.post_attention_layernorm(attended)
            normed, x = self.pre_feedforward_layernorm.add_and_norm(attended, x)
            return x + self.post_feedforward_layernorm(self.mlp(normed))
        normed, x = self.post_attention_layernorm.add_and_norm(self._scaled(attended), x)
        return x + self._scaled(self.mlp(normed))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as its residual add takes it (Granite scales it)."""
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


# Per ModelSpec.norms, the layer's norms of the attention's input, the MLP's input, the
# attention's output and the MLP's output, as the decode stack takes them (None: no such norm).
_STACK_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm", None, None),
    "sandwich": ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, None, "post_attention_layernorm", "post_feedforward_layernorm"),
}


def decode_stack_layer(layer: DecoderLayer, rope_names: list[str]) -> dict | None:
    """The layer's parameters as kernels.cpu_kernels.decode_stack takes them (its RoPE table as
    an index into rope_names), or None where the stack cannot run it (expert MLP, clipping, or a
    projection left unpacked)."""
    attention, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not MLP or attention.clip_qkv is not None:
        return None
    projections = dict(qkv=attention.qkv_proj, o=attention.o_proj, gate_up=mlp.gate_up_proj,
                       down=mlp.down_proj)
    if any(linear.packed is None for linear in projections.values()):
        return None
    if any(isinstance(m, RMSNorm) and m.fp32_scale for m in layer.modules()):
        return None  # its norms take weights of the activations' dtype
    input_norm, post_norm, attention_out_norm, mlp_out_norm = (
        None if name is None else getattr(layer, name).weight for name in _STACK_NORMS[layer.norms])
    q_norm, k_norm = attention.q_norm, attention.k_norm
    return dict(input_norm=input_norm, post_norm=post_norm, attention_out_norm=attention_out_norm,
                mlp_out_norm=mlp_out_norm,
                q_norm=None if q_norm is None else q_norm.weight,
                k_norm=None if k_norm is None else k_norm.weight,
                qk_norm_whole=q_norm is not None and not attention.qk_norm_per_head,
                sliding_window=attention.sliding_window, softcap=attention.softcap,
                rope_table=-1 if attention.rope is None else rope_names.index(attention.rope),
                residual_multiplier=layer.residual_multiplier, activation=mlp.activation,
                **{name: linear.packed for name, linear in projections.items()},
                **{f"{name}_bias": linear.bias for name, linear in projections.items()})


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        """rope_tables: runtime.config.rope_cos_sin's."""
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_names = sorted(rope_tables)
        self.set_rope_tables(rope_tables)
        self._decode_stack = None  # built at the first step that can use it; False: it cannot
        self.logit_screen: LogitScreen | None = None  # see screen_logits

    def set_rope_tables(self, rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for name, (cos, sin) in rope_tables.items():
            self.register_buffer(f"rope_cos_{name}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{name}", sin, persistent=False)

    def _stack_for(self, batch: AttentionBatch, x: torch.Tensor):
        """The C++ decode stack, where it can run this step: decode rows only (one ragged group),
        the C++ kernels taking x (kernels.decode_stack_runs), every layer one it runs."""
        if batch.prefills or len(batch.decodes) != 1 or not decode_stack_runs(x):
            return None
        if self._decode_stack is None:
            layers = [decode_stack_layer(layer, self.rope_names) for layer in self.layers]
            attention = self.layers[0].self_attn
            self._decode_stack = None not in layers and decode_stack(
                layers, attention.num_heads, attention.num_kv_heads, attention.head_dim,
                self.spec.rms_norm_eps, attention.scale)
        return self._decode_stack or None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Final hidden states [tokens, hidden] (normed); logits are computed separately, only
        for the rows that sample."""
        x = self.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            multiplier = self.spec.embedding_multiplier
            x = x * (torch.tensor(multiplier, dtype=x.dtype) if self.spec.embedding_multiplier_in_model_dtype
                     else multiplier)
        table_dtype = torch.float32 if self.spec.rope_in_fp32 else x.dtype
        rope = {name: (getattr(self, f"rope_cos_{name}")[positions].to(table_dtype),
                       getattr(self, f"rope_sin_{name}")[positions].to(table_dtype)) for name in self.rope_names}
        stack = self._stack_for(batch, x)
        if stack is not None:
            [group] = batch.decodes
            x = stack.forward(x, [rope[name] for name in self.rope_names], batch.slot_mapping,
                              group.block_tables, group.context_lens, kv_caches)
        else:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x = layer(x, rope, batch, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits, rounded where transformers rounds them: finished in the model's dtype."""
        return self.finish_logits(self.lm_head(hidden)).float()

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The lm_head's output as the model's logits: scaled (Granite), soft-capped (Gemma 2)."""
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        if self.spec.final_softcap is not None:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits

    @property
    def logits_grow_with_head(self) -> bool:
        """Whether finish_logits keeps the lm_head output's order (the screen's premise): a soft
        cap does; a negative logits_scaling reverses it."""
        return self.spec.logits_scaling > 0

    def screen_logits(self) -> None:
        """From here on, greedy tokens come from a bf16 screen of the vocabulary verified in
        fp32 (runtime/logit_screen.py); once the weights are final, as it keeps a copy."""
        if not self.logits_grow_with_head:
            raise ValueError(f"greedy_screen: logits_scaling {self.spec.logits_scaling} reverses the "
                             "logits' order, and the screen picks the largest of the lm_head's outputs")
        self.logit_screen = LogitScreen.of(self.lm_head.weight)

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Each row's greedy token (the argmax of its fp32 logits), its fp32 logit (NaN where the
        row holds one), and how many rows the screen, if on, could not clear and gave their full
        logits."""
        if self.logit_screen is None:
            logits = self.compute_logits(hidden)
            tokens = argmax(logits)
            return tokens, logits.gather(1, tokens[:, None])[:, 0].float(), 0
        return screened_argmax(hidden, self.lm_head.weight, self.logit_screen, self.compute_logits,
                               self.finish_logits)
