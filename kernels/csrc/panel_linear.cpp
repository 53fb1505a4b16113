// y = x @ weight^T + bias (fp32 x and y) on a weight packed once into panels of kPanel output
// columns, each panel k-major: packed[p][i][j] = weight[p * kPanel + j][i] (zeros past the last
// output). The weight is fp32, or bf16 (the logit screen, runtime/logit_screen.py: half the bytes
// to read, widened exactly to fp32 as loaded).
// A register tile of up to kMaxRows rows of x meets a whole panel: per step along k, the
// panel's two vectors are loaded once and every row's x[i] is broadcast into them, so each load
// feeds 2 * rows fused multiply-adds and no output needs a horizontal sum. The dot-product form
// of small_rows_linear.cpp (four weight rows against four x rows, a lane sum per output) ran at
// about half the FMA peak even cache-hot; this form reaches it from ~8 rows and meets the memory
// floor below (benchmarks/cpu_kernels_micro.py; kernels/linear_rows.py picks by row count).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "vec16.h"

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel: two 16-lane vectors
#ifdef __AVX512F__
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weight vectors + a broadcast: 27 of 32 zmm
#else
constexpr int kMaxRows = 3;  // AVX2 has 16 ymm, and a 16-lane vector takes two
#endif
// At most this many rows of x per pass over a thread's panels: a block's rows stay in L2 while
// the panels stream through (all of a 2,048-row prefill per panel came from L3, 7% slower).
constexpr int64_t kRowBlock = 192;

// The rows of each pass: as few passes as kRowBlock allows, of even sizes. Every pass streams
// all the weights, which a pass of few rows cannot hide behind its arithmetic: 200 rows as 192
// and 8 paid a whole memory-bound read of the weights for the 8.
inline int64_t rows_per_pass(int64_t rows) {
  const int64_t passes = std::max<int64_t>(1, (rows + kRowBlock - 1) / kRowBlock);  // 0 rows: none
  return (rows + passes - 1) / passes;
}
// While a panel is computed its rows of x also ask for the panel this many further on, into L2
// (prefetcht1): the memory stream then overlaps the arithmetic of every row group (the default
// model's linears at 13 rows: 27 -> 24 ms against one panel ahead).
constexpr int64_t kAhead = 2;

// Each output sums k products. In one running sum every addition rounds at the sum's size:
// where a few inputs are large (an LLM's massive activations, ~1e3 on a few channels of a few
// tokens) that error grows with k, and at k = 1,536 it was 5-30x MKL's, whose sgemm sums in
// blocks (a prompt logprob 1e-3 off transformers' through 30 layers). So each tile sums this
// many steps along k, then adds them to its total: the error grows with k / kSumSteps + kSumSteps.
constexpr int64_t kSumSteps = 64;

// One tile: R rows of x, k-major (x[i * R + r], as pack_rows left them), against one panel; the
// group-th of `groups` tiles on this panel prefetches every groups-th step of the panel ahead,
// so the reads spread over all of them.
template <int R, typename W>
void tile(const float* x, int64_t k, const W* panel, float* y, int64_t n_total, int64_t cols,
          const float* bias, const W* ahead, int64_t group, int64_t groups) {
  vec16 total[R][2] = {};
  int64_t countdown = group + 1;
  for (int64_t i0 = 0; i0 < k; i0 += kSumSteps) {
    vec16 acc[R][2] = {};
    for (int64_t i = i0, end = std::min(k, i0 + kSumSteps); i < end; ++i) {
      const W* w = panel + i * kPanel;
      const vec16 w0 = load16(w), w1 = load16(w + 16);
      if (ahead && --countdown == 0) {
        countdown = groups;
        __builtin_prefetch(ahead + i * kPanel, 0, 2);
        __builtin_prefetch(ahead + i * kPanel + 16, 0, 2);
      }
      for (int r = 0; r < R; ++r) {
        const float xv = x[i * R + r];
        acc[r][0] += w0 * xv;
        acc[r][1] += w1 * xv;
      }
    }
    for (int r = 0; r < R; ++r) {
      total[r][0] += acc[r][0];
      total[r][1] += acc[r][1];
    }
  }
  float b[kPanel] = {};
  for (int64_t j = 0; bias && j < cols; ++j) b[j] = bias[j];
  for (int r = 0; r < R; ++r) {
    float out[kPanel];
    store16(out, total[r][0] + load16(b));
    store16(out + 16, total[r][1] + load16(b + 16));
    for (int64_t j = 0; j < cols; ++j) y[r * n_total + j] = out[j];
  }
}

template <typename W>
using Tile = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t, const float*,
                      const W*, int64_t, int64_t);

template <typename W, int... R>
constexpr std::array<Tile<W>, sizeof...(R)> tiles_of(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, W>...};
}
template <typename W>  // [r - 1]: the tile of r rows
constexpr auto kTiles = tiles_of<W>(std::make_integer_sequence<int, kMaxRows>{});

// How `rows` rows split into tiles: as few as kMaxRows allows, of even sizes; the g-th of
// `groups` has tile_rows(rows, groups, g) rows, and those before it their sum.
inline int64_t num_groups(int64_t rows) { return (rows + kMaxRows - 1) / kMaxRows; }
inline int64_t tile_rows(int64_t rows, int64_t groups, int64_t g) {
  return rows / groups + (g < rows % groups ? 1 : 0);
}

// x's rows, a pass at a time, each tile's rows k-major: the tile then broadcasts from one
// sequential stream. Read in place, a tile's rows are k floats apart, and where that is a
// multiple of 4 KB (k = 1024, 2048, ...) all of them fall in the same L1 set, which holds 8:
// 12 rows evicted each other at every step (2048 x 1024 weights at 256 rows: 20% slower).
void pack_rows(const float* x, int64_t rows, int64_t k, float* packed) {
  // Every tile of every pass, in order: (first row, rows).
  std::vector<std::pair<int64_t, int64_t>> tiles;
  const int64_t pass_rows = rows_per_pass(rows);
  for (int64_t m0 = 0; m0 < rows; m0 += pass_rows) {
    const int64_t in_pass = std::min(pass_rows, rows - m0), groups = num_groups(in_pass);
    for (int64_t g = 0, m = m0; g < groups; m += tile_rows(in_pass, groups, g), ++g)
      tiles.emplace_back(m, tile_rows(in_pass, groups, g));
  }
  // Tiles split evenly between threads (row blocks did not: 210 rows were 192 and 18), each
  // written in order while its rows are read as r sequential streams.
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [m, r] = tiles[t];
      float* out = packed + m * k;
      for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < r; ++j) out[i * r + j] = x[(m + j) * k + i];
    }
  });
}

// The `rows` rows of a pass (packed by pack_rows) against panel p.
template <typename W>
void panel_rows(const float* x, int64_t rows, int64_t k, const W* packed, int64_t p,
                int64_t panels, float* y, int64_t n_total, const float* bias) {
  const int64_t n = p * kPanel, cols = std::min(kPanel, n_total - n);
  const W* panel = packed + p * k * kPanel;
  const W* ahead = p + kAhead < panels ? panel + kAhead * k * kPanel : nullptr;
  const int64_t groups = num_groups(rows);
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t r = tile_rows(rows, groups, g);
    kTiles<W>[r - 1](x + m * k, k, panel, y + m * n_total + n, n_total, cols, bias ? bias + n : nullptr,
                  ahead, g, groups);
    m += r;
  }
}

}  // namespace

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                           const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "panel_linear runs CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "panel_linear takes fp32 x and fp32 or bf16 panels");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed must be contiguous [panels, in, ", kPanel, "]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1), "x must be [rows, in]");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
              "out_features ", out_features, " does not fill ", packed.size(0), " panels");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features &&
                        bias->scalar_type() == at::kFloat),
              "bias must be fp32 [out]");
  const auto xc = x.contiguous();
  auto xt = torch::empty_like(xc);
  const auto bc = bias ? bias->contiguous() : torch::Tensor();
  const int64_t rows = x.size(0), k = x.size(1), panels = packed.size(0);
  auto y = torch::empty({rows, out_features}, x.options());
  pack_rows(xc.data_ptr<float>(), rows, k, xt.data_ptr<float>());
  const float* xp = xt.data_ptr<float>();
  const float* bp = bias ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t pass_rows = rows_per_pass(rows);
  auto run = [&](auto* wp) {
    at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
      for (int64_t m = 0; m < rows; m += pass_rows)
        for (int64_t p = begin; p < end; ++p)
          panel_rows(xp + m * k, std::min(pass_rows, rows - m), k, wp, p, panels,
                     yp + m * out_features, out_features, bp);
    });
  };
  if (packed.scalar_type() == at::kBFloat16)
    run(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()));
  else
    run(packed.data_ptr<float>());
  return y;
}
