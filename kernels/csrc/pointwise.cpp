// The small per-token ops of a decoder layer, each one pass over its rows instead of the five to
// eight torch ops (and as many temporaries) of kernels/norm.py, rope.py and activation.py, whose
// contracts and rounding they keep: math in fp32 (RoPE and SiLU in fp64 for fp64, as torch),
// rounded to the input dtype wherever the torch op rounds. A decode step runs about 150 of them; at small batch their dispatch costs as much
// as their arithmetic.

#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vec16.h"

namespace {

// Rows are independent: split them across threads only where there is enough work to pay for it.
constexpr int64_t kGrain = 1 << 14;  // elements

template <typename F>
void for_rows(int64_t rows, int64_t row_size, const F& body) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_size));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// The math type (fp32 for fp32, bf16 and fp16; fp64 for fp64) and back.
template <typename scalar_t>
using acc_t = at::opmath_type<scalar_t>;

template <typename scalar_t>
inline acc_t<scalar_t> up(scalar_t v) { return static_cast<acc_t<scalar_t>>(v); }

// kernels.norm.rms_norm on one row: x * rsqrt(mean(x^2) + eps) in fp32 (for every dtype, fp64
// too, as transformers' Llama norm computes it), rounded to the dtype, times weight (rounded again).
// Sixteen independent partial sums, so the compiler vectorises the loop without reassociating
// floats (one running sum was a chain of dependent adds, a row's latency times its length).
template <typename scalar_t>
inline float sum_of_squares(const scalar_t* x, int64_t h) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= h; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += static_cast<float>(x[i + j]) * static_cast<float>(x[i + j]);
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += part[j];
  for (; i < h; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return sum;
}

template <typename scalar_t>
inline void norm_row(const scalar_t* x, const scalar_t* weight, int64_t h, double eps, scalar_t* out) {
  const float sum = sum_of_squares(x, h);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + static_cast<float>(eps));
  for (int64_t i = 0; i < h; ++i)
    out[i] = static_cast<scalar_t>(up(weight[i]) * up(static_cast<scalar_t>(static_cast<float>(x[i]) * inv)));
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "the C++ pointwise ops run CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "weight must be [hidden], x [..., hidden]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must have the same dtype");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_norm(x, weight);
  const auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t h = x.size(-1), rows = h ? xc.numel() / h : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r) { norm_row(xp + r * h, wp, h, eps, op + r * h); });
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_norm(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "x and residual must have the same shape and dtype");
  const auto xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  auto out = torch::empty_like(xc), sum = torch::empty_like(xc);
  const int64_t h = x.size(-1), rows = h ? xc.numel() / h : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* rp = rc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t *op = out.data_ptr<scalar_t>(), *sp = sum.data_ptr<scalar_t>();
    for_rows(rows, h, [&](int64_t r) {
      for (int64_t i = r * h; i < (r + 1) * h; ++i)  // rounded to the dtype, as `x + residual` is
        sp[i] = static_cast<scalar_t>(up(xp[i]) + up(rp[i]));
      norm_row(sp + r * h, wp, h, eps, op + r * h);
    });
  });
  return {out, sum};
}

// x [tokens, heads, head_dim] as the ops below read it: each token's heads contiguous, the tokens
// any distance apart (q, k or v split off the packed q|k|v projection needs no copy); else a
// contiguous copy.
namespace {
torch::Tensor token_rows(const torch::Tensor& x) {
  return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
}
}  // namespace

// kernels.rope.apply_rope: x [tokens, heads, head_dim], cos and sin [tokens, rotary dims];
// out = x * cos + rotate_half(x) * sin over the first rotary dims, each product and the sum
// rounded to a half dtype as torch rounds them (in fp32 and fp64 the compiler may fuse one
// product into the sum: within an ulp of torch, and no less accurate), the dims past them
// copied. x is read in place where token_rows allows.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "the C++ pointwise ops run CPU tensors");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
              cos.size(0) == x.size(0) && cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0,
              "x must be [tokens, heads, head_dim], cos and sin [tokens, rotary dims] (even, at "
              "most head_dim)");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "x, cos and sin must have the same dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), rotary = cos.size(1),
                half = rotary / 2;
  const auto xc = token_rows(x);
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  auto out = torch::empty({tokens, heads, d}, x.options());
  const int64_t token_stride = xc.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "apply_rope", [&] {
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *cp = cc.data_ptr<scalar_t>(),
                   *sp = sc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(tokens, heads * d, [&](int64_t t) {
      const scalar_t *c = cp + t * rotary, *s = sp + t * rotary;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* xh = xp + t * token_stride + h * d;
        scalar_t* oh = op + (t * heads + h) * d;
        for (int64_t i = 0; i < rotary; ++i) {
          const auto rotated = i < half ? -up(xh[i + half]) : up(xh[i - half]);
          const scalar_t a = static_cast<scalar_t>(up(xh[i]) * up(c[i]));
          const scalar_t b = static_cast<scalar_t>(rotated * up(s[i]));
          oh[i] = static_cast<scalar_t>(up(a) + up(b));
        }
        std::copy(xh + rotary, xh + d, oh + rotary);
      }
    });
  });
  return out;
}

// kernels.attention.write_kv: k and v [tokens, kv_heads, head_dim] into the caches [blocks,
// block_size, kv_heads, head_dim] (any strides with head_dim contiguous) at flat slots
// (block * block_size + offset), k and v read in place where token_rows allows; a token's row
// of one head is one copy.
void write_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
              const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && k.device().is_cpu() &&
              v.device().is_cpu() && slot_mapping.device().is_cpu(),
              "the C++ pointwise ops run CPU tensors");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1,
              "the caches must be [blocks, block_size, kv_heads, head_dim] with head_dim "
              "contiguous, both of one shape and layout");
  const int64_t tokens = k.size(0), heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == heads && k.size(2) == head_dim,
              "k and v must be [tokens, kv_heads, head_dim] of the cache's");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "k, v and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens,
              "slot_mapping must hold one slot per token");
  const auto kc = token_rows(k), vc = token_rows(v);
  const auto slots = slot_mapping.to(torch::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot_mapping[", t, "] = ", sp[t],
                " is not a slot of the cache (", num_slots, " slots)");
  const int64_t element = k.element_size(), bytes = head_dim * element;
  const int64_t block_step = k_cache.stride(0) * element, slot_step = k_cache.stride(1) * element,
                head_step = k_cache.stride(2) * element;
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  const int64_t k_step = kc.stride(0) * element, v_step = vc.stride(0) * element;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = (sp[t] / block_size) * block_step + (sp[t] % block_size) * slot_step;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kd + slot + h * head_step, ks + t * k_step + h * bytes, bytes);
      std::memcpy(vd + slot + h * head_step, vs + t * v_step + h * bytes, bytes);
    }
  }
}

// kernels.sampling.argmax on fp32 logits [rows, vocab]: each row's first index of its maximum,
// a NaN counting as the maximum (torch.argmax's rules). Sixteen lanes keep their own maximum and
// where they first met it, and the lanes settle ties by index; torch's reduction read a 200-row
// step's logits at ~5 GB/s (7.8 ms at 200 x 49,152).
torch::Tensor argmax(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "the C++ pointwise ops run CPU tensors");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) >= 1,
              "logits must be fp32 [rows, vocab], vocab >= 1");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(rows, vocab, [&](int64_t r) {
    const float* row = xp + r * vocab;
    float top = row[0];
    int64_t index = 0, i = 0;
    bool has_nan = false;
    if (vocab >= 16) {  // the lanes start on the first 16 values, so each holds a real index
      const lanes16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      vec16 best = load16(row);
      lanes16 at = lane, nan = best != best;
      for (i = 16; i + 16 <= vocab; i += 16) {
        const vec16 v = load16(row + i);
        const lanes16 greater = v > best;  // false for NaN, and for ties: a lane keeps its first
        best = greater ? v : best;
        at = greater ? lane + static_cast<int32_t>(i) : at;
        nan |= v != v;
      }
      top = best[0];
      index = at[0];
      for (int j = 0; j < 16; ++j) {
        has_nan |= nan[j] != 0;
        if (best[j] > top || (best[j] == top && at[j] < index)) {
          top = best[j];
          index = at[j];
        }
      }
    }
    for (; i < vocab; ++i) {  // the tail, past every lane's index: only a larger value wins
      has_nan |= row[i] != row[i];
      if (row[i] > top) {
        top = row[i];
        index = i;
      }
    }
    if (has_nan) index = std::find_if(row, row + vocab, [](float v) { return v != v; }) - row;
    op[r] = index;
  });
  return out;
}

namespace {

// silu(gate) * up over one row, silu rounded to the dtype as the torch op rounds it; fp32 rows
// take 16 lanes at a time through exp16 (std::exp one element at a time was most of the op).
template <typename scalar_t>
void silu_and_mul_row(const scalar_t* gate, const scalar_t* up_half, int64_t size, scalar_t* out) {
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (; i + 16 <= size; i += 16) {
      const vec16 g = load16(gate + i);
      store16(out + i, g / (1.f + exp16(-g)) * load16(up_half + i));
    }
  }
  for (; i < size; ++i) {
    const auto g = up(gate[i]);
    const scalar_t silu = static_cast<scalar_t>(g / (1 + std::exp(-g)));
    out[i] = static_cast<scalar_t>(up(silu) * up(up_half[i]));
  }
}

}  // namespace

// kernels.activation.silu_and_mul: gate_up [..., 2 * size] -> silu(gate) * up [..., size].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "the C++ pointwise ops run CPU tensors");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up's last dim must be even");
  const auto gc = gate_up.contiguous();
  const int64_t size = gate_up.size(-1) / 2, rows = size ? gc.numel() / (2 * size) : 0;
  auto shape = gate_up.sizes().vec();
  shape.back() = size;
  auto out = torch::empty(shape, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, 2 * size, [&](int64_t r) {
      silu_and_mul_row(gp + r * 2 * size, gp + r * 2 * size + size, size, op + r * size);
    });
  });
  return out;
}
