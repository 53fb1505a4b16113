// Paged decode attention on CPU: one query token per sequence over its cached keys and values,
// read in place through the sequence's block table (kernels/attention.py's torch op gathers
// them into a padded copy first, which costs more than the attention itself at large batch).
//
// Same contract as kernels.attention.paged_decode_attention: q [batch, heads, head_dim];
// k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; block_tables [batch, max_blocks];
// context_lens [batch]; block table entries past a sequence's context are never read.
// Each (sequence, kv head) is one task: its query heads (GQA) share every key and value row
// loaded, and an online softmax keeps one pass over the context.

#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

// Independent partial sums, so the compiler vectorises the loop without reassociating floats.
constexpr int64_t kLanes = 16;

template <typename acc_t, typename scalar_t>
inline acc_t dot(const acc_t* q, const scalar_t* k, int64_t n) {
  acc_t part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] += q[i + j] * static_cast<acc_t>(k[i + j]);
  acc_t sum = 0;
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  for (; i < n; ++i) sum += q[i] * static_cast<acc_t>(k[i]);
  return sum;
}

// Pulls a block's rows for one kv head into the CPU caches while the current block computes:
// blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next one
// (measured: a quarter less time with each sequence's blocks scattered).
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* k_rows, const scalar_t* v_rows, int64_t rows,
                          int64_t row_stride, int64_t head_dim) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t d = 0; d < head_dim; d += kLine) {
      __builtin_prefetch(k_rows + t * row_stride + d);
      __builtin_prefetch(v_rows + t * row_stride + d);
    }
}

struct Shape {
  int64_t heads, kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_strides[3], cache_strides[3];  // q: batch, head, dim; caches: block, slot, kv head
};

template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
            const int64_t* block_tables, const int64_t* context_lens, scalar_t* out,
            const Shape& s, int64_t batch, double scale, std::optional<int64_t> sliding_window) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t tasks = batch * s.kv_heads, G = s.group, D = s.head_dim, B = s.block_size;
  // Tasks are handed out one at a time: contexts are ragged and the cores may be shared, so a
  // static split would leave threads idle behind the one holding the longest sequences.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<acc_t> qs(G * D), acc(G * D), scores(G * B), m(G), l(G);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t seq = task / s.kv_heads, kvh = task % s.kv_heads;
      const int64_t context = context_lens[seq];
      const int64_t first = sliding_window ? std::max<int64_t>(0, context - *sliding_window) : 0;
      const int64_t* table = block_tables + seq * s.max_blocks;
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* qh = q + seq * s.q_strides[0] + (kvh * G + g) * s.q_strides[1];
        for (int64_t d = 0; d < D; ++d)
          qs[g * D + d] = static_cast<acc_t>(qh[d * s.q_strides[2]]) * static_cast<acc_t>(scale);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(m.begin(), m.end(), -std::numeric_limits<acc_t>::infinity());
      std::fill(l.begin(), l.end(), acc_t(0));

      for (int64_t start = first; start < context;) {
        const int64_t end = std::min(context, (start / B + 1) * B);  // this block's last + 1
        const int64_t offset = table[start / B] * s.cache_strides[0] + kvh * s.cache_strides[2];
        const scalar_t* k_rows = k_cache + offset;
        const scalar_t* v_rows = v_cache + offset;
        const int64_t n = end - start, slot0 = start % B;
        if (end < context) {
          const int64_t next = table[end / B] * s.cache_strides[0] + kvh * s.cache_strides[2];
          prefetch_rows(k_cache + next, v_cache + next, std::min(B, context - end),
                        s.cache_strides[1], D);
        }
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* k = k_rows + (slot0 + t) * s.cache_strides[1];
          for (int64_t g = 0; g < G; ++g) scores[g * B + t] = dot(&qs[g * D], k, D);
        }
        for (int64_t g = 0; g < G; ++g) {
          acc_t* sg = &scores[g * B];
          const acc_t block_max = *std::max_element(sg, sg + n);
          if (block_max > m[g]) {  // rescale what was summed under the old max
            const acc_t alpha = std::exp(m[g] - block_max);
            l[g] *= alpha;
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
            m[g] = block_max;
          }
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = std::exp(sg[t] - m[g]);
            l[g] += sg[t];
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* v = v_rows + (slot0 + t) * s.cache_strides[1];
          for (int64_t g = 0; g < G; ++g) {
            const acc_t p = scores[g * B + t];
            acc_t* a = &acc[g * D];
            for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<acc_t>(v[d]);
          }
        }
        start = end;
      }

      for (int64_t g = 0; g < G; ++g) {
        scalar_t* o = out + (seq * s.heads + kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g * D + d] / l[g]);
      }
    }
  });
}

// Every block a sequence reads must exist: a bad table or length would read outside the cache.
void check_tables(const int64_t* tables, const int64_t* context_lens, int64_t batch,
                  int64_t max_blocks, int64_t block_size, int64_t num_blocks,
                  std::optional<int64_t> sliding_window) {
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t context = context_lens[i];
    TORCH_CHECK(context >= 1 && context <= max_blocks * block_size, "context_lens[", i, "] = ",
                context, " is outside 1..", max_blocks * block_size, " (the block table's span)");
    const int64_t first = sliding_window ? std::max<int64_t>(0, context - *sliding_window) : 0;
    for (int64_t b = first / block_size; b <= (context - 1) / block_size; ++b) {
      const int64_t block = tables[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", i, "][", b, "] = ", block,
                  " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale,
                                     std::optional<int64_t> sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "the C++ paged decode attention runs CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [batch, heads, head_dim] and the "
              "caches [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must have the same shape and layout");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must have the same dtype");
  TORCH_CHECK(k_cache.stride(3) == 1, "the caches' head_dim must be contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "q and the caches differ in head_dim");
  TORCH_CHECK(heads % kv_heads == 0, "heads (", heads, ") must be a multiple of kv_heads (",
              kv_heads, ")");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && context_lens.dim() == 1 &&
              context_lens.size(0) == batch,
              "block_tables must be [batch, max_blocks] and context_lens [batch]");
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, "sliding_window must be at least 1");

  const auto tables = block_tables.to(torch::kLong).contiguous();
  const auto lens = context_lens.to(torch::kLong).contiguous();
  const int64_t block_size = k_cache.size(1);
  check_tables(tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), batch, tables.size(1),
               block_size, k_cache.size(0), sliding_window);

  auto out = torch::empty({batch, heads, head_dim}, q.options());
  const Shape shape{heads, kv_heads, heads / kv_heads, head_dim, block_size, tables.size(1),
                    {q.stride(0), q.stride(1), q.stride(2)},
                    {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)}};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), shape, batch, scale,
                     sliding_window);
  });
  return out;
}
