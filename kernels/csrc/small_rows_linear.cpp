// y = x @ weight^T + bias for the few rows of a decode step (fp32). A step's linears are
// memory-bound at small batch: what counts is reading each weight once. This kernel streams
// every weight row once and reuses it, from registers, for all rows of x. MKL's sgemm costs far
// more at 4-24 rows than at one, though it reads the same bytes (benchmarks/cpu_kernels_micro.py;
// kernels/cpu_kernels.py picks between the two by row count).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#include "vec16.h"

namespace {

constexpr int64_t kLanes = 16;

// y[m][n] = dot(x[m], w[n]) + bias[n] for an nb x mb tile: nb weight rows meet mb input rows,
// nb * mb accumulators in registers. With `ahead` (nb weight rows further on), every `stride`-th
// vector step from `phase` on also asks for one cache line of each of those rows, into L2
// (prefetcht1).
template <int nb, int mb>
inline void tile(const float* x, const float* w, int64_t k, float* y, int64_t n_total,
                 const float* bias, const float* ahead, int64_t phase, int64_t stride) {
  vec16 acc[nb][mb] = {};
  int64_t i = 0, countdown = phase + 1;
  for (; i + kLanes <= k; i += kLanes) {
    vec16 wv[nb], xv[mb];
    if (ahead && --countdown == 0) {
      countdown = stride;
      for (int n = 0; n < nb; ++n) __builtin_prefetch(ahead + n * k + i, 0, 2);
    }
    for (int n = 0; n < nb; ++n) wv[n] = load16(w + n * k + i);
    for (int m = 0; m < mb; ++m) xv[m] = load16(x + m * k + i);
    for (int n = 0; n < nb; ++n)
      for (int m = 0; m < mb; ++m) acc[n][m] += wv[n] * xv[m];
  }
  for (int n = 0; n < nb; ++n)
    for (int m = 0; m < mb; ++m) {
      float sum = lane_sum(acc[n][m]);
      for (int64_t j = i; j < k; ++j) sum += w[n * k + j] * x[m * k + j];
      y[m * n_total + n] = sum + (bias ? bias[n] : 0.f);
    }
}

// All rows of x against nb weight rows, 4 input rows at a time (the weight rows stay in L1).
// The row groups share the prefetch of `ahead`, each taking every groups-th cache line, so the
// reads spread over the whole tile's arithmetic (the first group alone issued them in a burst
// a quarter as long at 13-16 rows).
template <int nb>
void weight_rows(const float* x, int64_t rows, int64_t k, const float* w, const float* ahead,
                 float* y, int64_t n_total, const float* bias) {
  const int64_t groups = (rows + 3) / 4;
  int64_t m = 0, group = 0;
  for (; m + 4 <= rows; m += 4, ++group)
    tile<nb, 4>(x + m * k, w, k, y + m * n_total, n_total, bias, ahead, group, groups);
  const float* xm = x + m * k;
  float* ym = y + m * n_total;
  switch (rows - m) {
    case 3: tile<nb, 3>(xm, w, k, ym, n_total, bias, ahead, group, groups); break;
    case 2: tile<nb, 2>(xm, w, k, ym, n_total, bias, ahead, group, groups); break;
    case 1: tile<nb, 1>(xm, w, k, ym, n_total, bias, ahead, group, groups); break;
  }
}

// Four weight rows per tile: with 4 input rows, 16 accumulators plus their operands fill the
// registers.
constexpr int64_t kTile = 4;
// Each tile prefetches the weight rows of the tile this many further on. The hardware prefetcher
// alone left the weight reads short of the memory's speed at 1-3 rows and unoverlapped with the
// arithmetic at 8-32 (the default model's linears on the AMD EPYC: 1 row 24 -> 18 ms, 3 rows
// 25 -> 19, 8 rows 39 -> 26, 16 rows 55 -> 43, 64 rows 130 -> 115; a plain sum of the weights
// takes 18). Into L1 (one, two or four tiles ahead) or three tiles ahead was slower at 8-32
// rows.
constexpr int64_t kAhead = 2;

int64_t num_tiles(int64_t n_total) { return (n_total + kTile - 1) / kTile; }

// Output columns of tile t: all rows of x against its weight rows (the last tile, if partial,
// one weight row at a time).
void column_tile(const float* x, int64_t rows, int64_t k, const float* w, float* y,
                 int64_t n_total, const float* bias, int64_t t) {
  const int64_t n = t * kTile;
  if (n + kTile <= n_total) {
    const int64_t next = n + kAhead * kTile;
    const float* ahead = next + kTile <= n_total ? w + next * k : nullptr;
    weight_rows<kTile>(x, rows, k, w + n * k, ahead, y + n, n_total, bias ? bias + n : nullptr);
    return;
  }
  for (int64_t j = n; j < n_total; ++j)
    weight_rows<1>(x, rows, k, w + j * k, nullptr, y + j, n_total, bias ? bias + j : nullptr);
}

}  // namespace

torch::Tensor small_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_rows_linear runs CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_rows_linear is fp32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be [rows, in] and weight [out, in]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                        bias->scalar_type() == at::kFloat),
              "bias must be fp32 [out]");
  const auto xc = x.contiguous(), wc = weight.contiguous();
  const auto bc = bias ? bias->contiguous() : torch::Tensor();
  const int64_t rows = x.size(0), k = x.size(1), n_total = weight.size(0);
  auto y = torch::empty({rows, n_total}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bias ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, num_tiles(n_total), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) column_tile(xp, rows, k, wp, yp, n_total, bp, t);
  });
  return y;
}

// The experts of an MoE layer over their routed rows: x [pairs, in] sorted by expert, counts[e]
// rows for expert e; weight [experts, out, in]. Each expert's few rows meet its weights as in
// small_rows_linear; experts without rows cost nothing.
torch::Tensor grouped_small_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                                        const torch::Tensor& counts) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && counts.device().is_cpu(),
              "grouped_small_rows_linear runs CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "grouped_small_rows_linear is fp32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2),
              "x must be [pairs, in] and weight [experts, out, in]");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == weight.size(0),
              "counts must hold one row count per expert");
  const auto xc = x.contiguous(), wc = weight.contiguous();
  const auto cc = counts.to(torch::kLong).contiguous();
  const int64_t experts = weight.size(0), n_total = weight.size(1), k = x.size(1);
  const int64_t* count = cc.data_ptr<int64_t>();
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(count[e] >= 0, "counts[", e, "] is negative");
    first[e + 1] = first[e] + count[e];
  }
  TORCH_CHECK(first[experts] == x.size(0), "counts sum to ", first[experts], ", x has ",
              x.size(0), " rows");
  auto y = torch::empty({x.size(0), n_total}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = num_tiles(n_total);
  at::parallel_for(0, experts * tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = item / tiles;
      if (count[e] == 0) continue;
      column_tile(xp + first[e] * k, count[e], k, wp + e * n_total * k, yp + first[e] * n_total,
                  n_total, nullptr, item % tiles);
    }
  });
  return y;
}
