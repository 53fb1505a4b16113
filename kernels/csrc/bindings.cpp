// The one extension module of the C++ CPU kernels (kernels/cpu_kernels.py builds it).

#include <torch/extension.h>

#include <optional>
#include <tuple>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale,
                                     std::optional<int64_t> sliding_window);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a block-table KV cache");
  m.def("panel_linear", &panel_linear,
        "x @ weight^T + bias on a weight packed into k-major panels of 32 outputs (fp32)");
  m.def("small_rows_linear", &small_rows_linear, "x @ weight^T + bias for few rows of x (fp32)");
  m.def("grouped_small_rows_linear", &grouped_small_rows_linear,
        "Each expert's few rows (sorted by expert) @ its weight^T (fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("apply_rope", &apply_rope, "Rotary embedding, half-rotation layout");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up on a packed gate|up projection");
  m.def("argmax", &argmax, "Each row's first index of its maximum (fp32 logits)");
  m.def("write_kv", &write_kv, "k and v into the paged caches at flat slots");
}
