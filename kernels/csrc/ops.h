// The C++ CPU kernels' entry points (defined in this folder's .cpp files): bound to Python by
// bindings.cpp and called directly by decode_stack.cpp.

#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale,
                                     std::optional<int64_t> sliding_window,
                                     std::optional<double> softcap);
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                           const std::optional<torch::Tensor>& bias);
torch::Tensor small_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                const std::optional<torch::Tensor>& bias);
torch::Tensor grouped_small_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                        const torch::Tensor& counts);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps);
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
torch::Tensor argmax(const torch::Tensor& logits);
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
              const torch::Tensor& k, const torch::Tensor& v);
