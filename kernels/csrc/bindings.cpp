// The one extension module of the C++ CPU kernels (kernels/cpu_kernels.py builds it).

#include "decode_stack.h"
#include "ops.h"

namespace py = pybind11;

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

  py::class_<DecodeLayer>(m, "DecodeLayer", "One dense decoder layer's packed parameters")
      .def(py::init<std::optional<torch::Tensor>, torch::Tensor, torch::Tensor,
                    std::optional<torch::Tensor>, torch::Tensor, torch::Tensor,
                    std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, std::optional<torch::Tensor>, bool,
                    std::optional<int64_t>, int64_t, double, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, std::string, std::optional<double>>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"),
           py::arg("gate_up"), py::arg("down"), py::arg("qkv_bias"), py::arg("o_bias"),
           py::arg("gate_up_bias"), py::arg("down_bias"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qk_norm_whole"), py::arg("sliding_window"), py::arg("rope_table"), py::arg("residual_multiplier"),
           py::arg("attention_out_norm"), py::arg("mlp_out_norm"), py::arg("activation"),
           py::arg("softcap"));
  py::class_<DecodeStack>(m, "DecodeStack", "A dense decoder stack's decode step in one call")
      .def(py::init<std::vector<DecodeLayer>, int64_t, int64_t, int64_t, double, double>(),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("eps"), py::arg("scale"))
      // The GIL is let go for the step: other Python threads (a Beam DoFn feeding the engine) run.
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
