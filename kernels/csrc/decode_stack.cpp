// A decode step through a dense Llama-family decoder stack (with the norms, q/k norms, RoPE
// tables, activations and soft caps of the families decode_stack.h lists) in one call. Each layer runs the same kernels, in the same order, on the same values as
// runtime/model.py's DecoderLayer does for a batch of decode rows, so the hidden states come out
// bit-identical; what it saves is the ~300 Python calls, module hooks and dispatches of a
// 30-layer step (about 5 ms, a tenth of a small-batch step on the default model).

#include "decode_stack.h"

DecodeStack::DecodeStack(std::vector<DecodeLayer> layers, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double scale)
    : layers_(std::move(layers)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), eps_(eps), scale_(scale) {
  TORCH_CHECK(!layers_.empty(), "a decode stack needs at least one layer");
  for (const auto& layer : layers_) {
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(),
                "q_norm and k_norm come together or not at all");
    TORCH_CHECK(layer.input_norm.has_value() == layer.post_norm.has_value(),
                "input_norm and post_norm come together or not at all");
    TORCH_CHECK(layer.q_norm.has_value() || !layer.qk_norm_whole, "qk_norm_whole without q/k norms");
    TORCH_CHECK(layer.activation == "silu" || layer.activation == "gelu" || layer.activation == "gelu_tanh",
                "activation must be silu, gelu or gelu_tanh, got ", layer.activation);
  }
}

torch::Tensor DecodeStack::forward(torch::Tensor x,
                                   const std::vector<std::pair<torch::Tensor, torch::Tensor>>& rope,
                                   const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                   const torch::Tensor& context_lens,
                                   std::vector<std::pair<torch::Tensor, torch::Tensor>> kv_caches) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "one (k, v) cache per layer: got ",
              kv_caches.size(), " for ", layers_.size(), " layers");
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t hidden = x.size(1);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecodeLayer& layer = layers_[i];
    auto& [k_cache, v_cache] = kv_caches[i];
    const auto qkv = panel_linear(layer.input_norm ? rms_norm(x, *layer.input_norm, eps_) : x,
                                  layer.qkv, q_size + 2 * kv_size, layer.qkv_bias);
    auto q = qkv.narrow(1, 0, q_size);
    auto k = qkv.narrow(1, q_size, kv_size);
    if (layer.q_norm && layer.qk_norm_whole) {
      q = rms_norm(q, *layer.q_norm, eps_);
      k = rms_norm(k, *layer.k_norm, eps_);
    }
    q = q.view({-1, num_heads_, head_dim_});
    k = k.view({-1, num_kv_heads_, head_dim_});
    if (layer.q_norm && !layer.qk_norm_whole) {
      q = rms_norm(q, *layer.q_norm, eps_);
      k = rms_norm(k, *layer.k_norm, eps_);
    }
    if (layer.rope_table >= 0) {
      const auto& [cos, sin] = rope.at(layer.rope_table);
      q = apply_rope(q, cos, sin);
      k = apply_rope(k, cos, sin);
    }
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, num_kv_heads_, head_dim_});
    write_kv(k_cache, v_cache, slot_mapping, k, v);
    const auto attended = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                 scale_, layer.sliding_window, layer.softcap);
    auto projected = panel_linear(attended.view({-1, q_size}), layer.o, hidden, layer.o_bias);
    if (layer.attention_out_norm) projected = rms_norm(projected, *layer.attention_out_norm, eps_);
    if (layer.residual_multiplier != 1.0) projected.mul_(layer.residual_multiplier);
    torch::Tensor normed, residual;
    if (layer.post_norm) {
      std::tie(normed, residual) = add_rms_norm(projected, x, *layer.post_norm, eps_);
    } else {  // OLMo 2: the MLP takes the residual stream itself
      residual = normed = x + projected;
    }
    const int64_t intermediate = layer.down.size(1);
    const auto gate_up = panel_linear(normed, layer.gate_up, intermediate * 2, layer.gate_up_bias);
    torch::Tensor activated;
    if (layer.activation == "silu") {
      activated = silu_and_mul(gate_up);
    } else {  // GeGLU: torch's own GELU, as kernels.activation's ops take it
      const auto gate = gate_up.narrow(1, 0, intermediate), up = gate_up.narrow(1, intermediate, intermediate);
      activated = at::gelu(gate, layer.activation == "gelu_tanh" ? "tanh" : "none") * up;
    }
    auto mlp_out = panel_linear(activated, layer.down, hidden, layer.down_bias);
    if (layer.mlp_out_norm) mlp_out = rms_norm(mlp_out, *layer.mlp_out_norm, eps_);
    if (layer.residual_multiplier != 1.0) mlp_out.mul_(layer.residual_multiplier);
    x = residual.add_(mlp_out);
  }
  return x;
}
