// DecodeStack (decode_stack.cpp): a dense decoder stack's decode step in one C++ call.

#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"

// One layer's parameters, the projections packed for panel_linear (q|k|v and gate|up packed
// together, as runtime/model.py holds them). Where the norms sit: input_norm norms the
// attention's input and post_norm the MLP's (Llama); Gemma 2 and 3 also norm the attention's
// output (attention_out_norm) and the MLP's (mlp_out_norm); OLMo 2 and 3 norm only those two
// outputs, so input_norm and post_norm are absent. q_norm and k_norm normalise each head
// (Qwen3), or with qk_norm_whole all heads at once before the head split (OLMo 2); rope_table:
// which of the step's (cos, sin) pairs turns q and k, -1 for none (SmolLM3's NoPE layers);
// residual_multiplier scales the attention's and the MLP's outputs before their residual adds
// (Granite). activation: "silu" (SwiGLU), "gelu" or "gelu_tanh" (GeGLU); softcap: the attention
// scores' soft cap (Gemma 2).
struct DecodeLayer {
  std::optional<torch::Tensor> input_norm;
  torch::Tensor qkv, o;
  std::optional<torch::Tensor> post_norm;
  torch::Tensor gate_up, down;
  std::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm;
  bool qk_norm_whole;
  std::optional<int64_t> sliding_window;
  int64_t rope_table;
  double residual_multiplier;
  std::optional<torch::Tensor> attention_out_norm, mlp_out_norm;
  std::string activation;
  std::optional<double> softcap;
};

class DecodeStack {
 public:
  DecodeStack(std::vector<DecodeLayer> layers, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, double eps, double scale);

  // x [rows, hidden]: one decode token per row; rope: (cos, sin) [rows, rotary dims] at their
  // positions, per RoPE table;
  // slot_mapping, block_tables and context_lens as paged_decode_attention and write_kv take
  // them. Returns the last layer's output (before the final norm).
  torch::Tensor forward(torch::Tensor x, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& rope,
                        const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                        const torch::Tensor& context_lens,
                        std::vector<std::pair<torch::Tensor, torch::Tensor>> kv_caches) const;

 private:
  std::vector<DecodeLayer> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};
