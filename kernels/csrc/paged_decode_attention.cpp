// Paged decode attention on CPU: one query token per sequence over its cached keys and values,
// read in place through the sequence's block table (kernels/attention.py's torch op gathers
// them into a padded copy first, which costs more than the attention itself at large batch).
//
// Same contract as kernels.attention.paged_decode_attention: q [batch, heads, head_dim];
// k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; block_tables [batch, max_blocks];
// context_lens [batch]; block table entries past a sequence's context are never read.
// Each (run of rows, kv head) is one task: its query heads (GQA) share every key and value row
// loaded, and an online softmax keeps one pass over the context. A run is consecutive rows that
// read the same keys and values, as a sequence verifying guessed tokens has (its rows at
// positions p + k, ..., p: runtime/speculate.py): one pass over its KV serves them all, each row
// masked to its own context, with every sum in the order that row alone would take, so its
// output is the same bit for bit.

#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec16.h"

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

struct Shape {
  int64_t heads, kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_strides[3], cache_strides[3];  // q: batch, head, dim; caches: block, slot, kv head
};

// A task's next block (one kv head's rows of it) is pulled towards the core while the current
// block computes: blocks sit anywhere in the cache, so the hardware prefetcher cannot guess it.
// One row is requested per row computed, into L2 (prefetcht1): a burst of the whole block into
// L1 overflowed its miss buffers, and the prefetches past them were dropped (the default model's
// 30 layers on the AMD EPYC, KV scattered: batch 64 x 300 85 -> 48 ms, 200 x 150 150 -> 85 ms).
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* k_rows, const scalar_t* v_rows, int64_t rows,
                          int64_t row_stride, int64_t head_dim) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t d = 0; d < head_dim; d += kLine) {
      __builtin_prefetch(k_rows + t * row_stride + d, 0, 2);
      __builtin_prefetch(v_rows + t * row_stride + d, 0, 2);
    }
}

// Offset of the block after the one ending at `end` (kv head kvh's rows) and how many of its
// rows the context reads: none at the context's end.
inline std::pair<int64_t, int64_t> next_block(const int64_t* table, int64_t end, int64_t context,
                                              const Shape& s, int64_t kvh) {
  if (end >= context) return {0, 0};
  return {table[end / s.block_size] * s.cache_strides[0] + kvh * s.cache_strides[2],
          std::min(s.block_size, context - end)};
}

// The first key a row of this context reads.
inline int64_t first_key(int64_t context, std::optional<int64_t> sliding_window) {
  return sliding_window ? std::max<int64_t>(0, context - *sliding_window) : int64_t{0};
}

// Consecutive rows that read the same keys: `rows` rows from `row`, none longer than the first,
// whose block tables agree with the first's on every block they read. [first, end) spans the
// keys any of them reads, with no gap: a key between two rows' windows that neither reads
// would be read through the first's table, whose entries there need not be valid.
struct Run {
  int64_t row, rows, first, end;
};
// At most this many rows a run (its scratch holds their kMaxRunRows * group query heads): a
// sequence and its guesses (runtime/speculate.py) fit in one.
constexpr int64_t kMaxRunRows = 16;

std::vector<Run> runs_of(const int64_t* tables, const int64_t* context_lens, int64_t batch,
                         const Shape& s, std::optional<int64_t> sliding_window) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t context = context_lens[i], first = first_key(context, sliding_window);
    if (!runs.empty()) {
      Run& run = runs.back();
      const int64_t* lead = tables + run.row * s.max_blocks;
      const int64_t* own = tables + i * s.max_blocks;
      bool shares = run.rows < kMaxRunRows && context <= run.end && context >= run.first;
      for (int64_t b = first / s.block_size; shares && b <= (context - 1) / s.block_size; ++b)
        shares = own[b] == lead[b];
      if (shares) {
        ++run.rows;
        run.first = std::min(run.first, first);
        continue;
      }
    }
    runs.push_back({i, 1, first, context});
  }
  return runs;
}

// body(scratch, run, kv_head, table) for every (run, kv head) task, each thread with its own
// scratch from make_scratch(); `table` is the run's first row's. Tasks are handed out one at a
// time: contexts are ragged and the cores may be shared, so a static split would leave threads
// idle behind the one holding the longest sequences. A thread claims its next task before it
// runs the current one and prefetches that task's first block meanwhile: within a task each
// block's rows pull the next block in, but nothing pulled a task's first, which short contexts
// feel most (the default model's 30 layers at 200 sequences x 75-150 tokens: 53.5 -> 50.5 ms).
template <typename scalar_t, typename MakeScratch, typename Body>
void for_each_task(const Shape& s, const std::vector<Run>& runs, const scalar_t* k_cache,
                   const scalar_t* v_cache, const int64_t* block_tables,
                   const MakeScratch& make_scratch, const Body& body) {
  const int64_t tasks = static_cast<int64_t>(runs.size()) * s.kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t task = next.fetch_add(1); task < tasks;) {
      const int64_t upcoming = next.fetch_add(1);
      if (upcoming < tasks) {
        const Run& run = runs[upcoming / s.kv_heads];
        const int64_t row = s.cache_strides[1], slot = run.first % s.block_size;
        const int64_t offset =
            block_tables[run.row * s.max_blocks + run.first / s.block_size] * s.cache_strides[0] +
            (upcoming % s.kv_heads) * s.cache_strides[2] + slot * row;
        prefetch_rows(k_cache + offset, v_cache + offset,
                      std::min(s.block_size - slot, run.end - run.first), row, s.head_dim);
      }
      const Run& run = runs[task / s.kv_heads];
      body(scratch, run, task % s.kv_heads, block_tables + run.row * s.max_blocks);
      task = upcoming;
    }
  });
}

// Each query head of a run's task: its row's keys [first, end), as query h = row * group + g.
template <typename acc_t>
struct Queries {
  std::vector<acc_t> m, l;           // the online softmax's running max and sum
  std::vector<int64_t> first, end;   // the keys each reads
  explicit Queries(int64_t heads) : m(heads), l(heads), first(heads), end(heads) {}

  // The keys of the block [start, stop) that query h reads, as [lo, hi) counted from start.
  std::pair<int64_t, int64_t> in_block(int64_t h, int64_t start, int64_t stop) const {
    return {std::max(first[h], start) - start, std::min(end[h], stop) - start};
  }

  void start(const Run& run, const Shape& s, const int64_t* context_lens,
             std::optional<int64_t> sliding_window) {
    for (int64_t h = 0; h < run.rows * s.group; ++h) {
      end[h] = context_lens[run.row + h / s.group];
      first[h] = first_key(end[h], sliding_window);
      m[h] = -std::numeric_limits<acc_t>::infinity();
      l[h] = 0;
    }
  }
};

// Gemma 2's soft cap on the scaled scores, before the softmax: cap * tanh(score / cap).
template <typename acc_t>
void cap_scores(acc_t* scores, int64_t n, acc_t cap) {
  for (int64_t t = 0; t < n; ++t) scores[t] = cap * std::tanh(scores[t] / cap);
}

template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
            const int64_t* block_tables, const int64_t* context_lens, scalar_t* out,
            const Shape& s, const std::vector<Run>& runs, double scale,
            std::optional<int64_t> sliding_window, std::optional<double> softcap) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t G = s.group, D = s.head_dim, B = s.block_size, H = kMaxRunRows * G;
  struct Scratch {
    std::vector<acc_t> qs, acc, scores;
    Queries<acc_t> queries;
    Scratch(int64_t H, int64_t D, int64_t B) : qs(H * D), acc(H * D), scores(H * B), queries(H) {}
  };
  for_each_task(s, runs, k_cache, v_cache, block_tables, [&] { return Scratch(H, D, B); },
                [&](Scratch& scratch, const Run& run, int64_t kvh, const int64_t* table) {
      auto& [qs, acc, scores, queries] = scratch;
      const int64_t heads = run.rows * G;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* qh = q + (run.row + h / G) * s.q_strides[0] + (kvh * G + h % G) * s.q_strides[1];
        for (int64_t d = 0; d < D; ++d)
          qs[h * D + d] = static_cast<acc_t>(qh[d * s.q_strides[2]]) * static_cast<acc_t>(scale);
      }
      std::fill(acc.begin(), acc.begin() + heads * D, acc_t(0));
      queries.start(run, s, context_lens, sliding_window);

      for (int64_t start = run.first; start < run.end;) {
        const int64_t end = std::min(run.end, (start / B + 1) * B);  // this block's last + 1
        const int64_t offset = table[start / B] * s.cache_strides[0] + kvh * s.cache_strides[2];
        const scalar_t* k_rows = k_cache + offset;
        const scalar_t* v_rows = v_cache + offset;
        const int64_t n = end - start, slot0 = start % B;
        const auto [next, next_rows] = next_block(table, end, run.end, s, kvh);
        const int64_t row = s.cache_strides[1];
        for (int64_t t = 0; t < n; ++t) {
          if (t < next_rows)
            prefetch_rows(k_cache + next + t * row, v_cache + next + t * row, 1, row, D);
          const scalar_t* k = k_rows + (slot0 + t) * row;
          for (int64_t h = 0; h < heads; ++h) scores[h * B + t] = dot(&qs[h * D], k, D);
        }
        if (next_rows > n)  // a partial block: the rows it had no turn for
          prefetch_rows(k_cache + next + n * row, v_cache + next + n * row, next_rows - n, row, D);
        for (int64_t h = 0; h < heads; ++h) {
          const auto [lo, hi] = queries.in_block(h, start, end);
          if (lo >= hi) continue;
          acc_t* sg = &scores[h * B];
          acc_t& m = queries.m[h];
          acc_t& l = queries.l[h];
          if (softcap) cap_scores(sg + lo, hi - lo, static_cast<acc_t>(*softcap));
          const acc_t block_max = *std::max_element(sg + lo, sg + hi);
          if (block_max > m) {  // rescale what was summed under the old max
            const acc_t alpha = std::exp(m - block_max);
            l *= alpha;
            for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= alpha;
            m = block_max;
          }
          for (int64_t t = lo; t < hi; ++t) {
            sg[t] = std::exp(sg[t] - m);
            l += sg[t];
          }
          acc_t* a = &acc[h * D];
          for (int64_t t = lo; t < hi; ++t) {
            const acc_t p = sg[t];
            const scalar_t* v = v_rows + (slot0 + t) * row;
            for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<acc_t>(v[d]);
          }
        }
        start = end;
      }

      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* o = out + ((run.row + h / G) * s.heads + kvh * G + h % G) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[h * D + d] / queries.l[h]);
      }
  });
}

// The fp32 path for head dims of DV x 16 lanes: each score is one vector dot folded by a shuffle
// tree (a 16-long scalar chain per score was most of the generic path's time), and each query
// head's output row stays in registers while it takes a block's values. Same contract and the
// same online softmax as `attend`, which serves the other dtypes and head dims.
template <int DV>
void attend_f32(const float* q, const float* k_cache, const float* v_cache,
                const int64_t* block_tables, const int64_t* context_lens, float* out,
                const Shape& s, const std::vector<Run>& runs, double scale,
                std::optional<int64_t> sliding_window, std::optional<double> softcap) {
  const int64_t G = s.group, B = s.block_size, H = kMaxRunRows * G;
  // A block's scores, padded to whole vectors, and one vector more: a query whose keys start
  // inside the block (a sliding window's first) reads its last vector past the block's end.
  const int64_t width = (B + 15) / 16 * 16 + 16;
  struct Scratch {
    std::vector<vec16> qs, acc;
    std::vector<float> scores;
    Queries<float> queries;
    Scratch(int64_t H, int64_t width) : qs(H * DV), acc(H * DV), scores(H * width), queries(H) {}
  };
  for_each_task(s, runs, k_cache, v_cache, block_tables, [&] { return Scratch(H, width); },
                [&](Scratch& scratch, const Run& run, int64_t kvh, const int64_t* table) {
      auto& [qs, acc, scores, queries] = scratch;
      const int64_t heads = run.rows * G;
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q + (run.row + h / G) * s.q_strides[0] + (kvh * G + h % G) * s.q_strides[1];
        for (int c = 0; c < DV; ++c)
          for (int j = 0; j < 16; ++j)
            qs[h * DV + c][j] = qh[(c * 16 + j) * s.q_strides[2]] * static_cast<float>(scale);
      }
      std::fill(acc.begin(), acc.begin() + heads * DV, vec16{});
      queries.start(run, s, context_lens, sliding_window);

      for (int64_t start = run.first; start < run.end;) {
        const int64_t end = std::min(run.end, (start / B + 1) * B);
        const int64_t offset = table[start / B] * s.cache_strides[0] + kvh * s.cache_strides[2];
        const int64_t n = end - start, slot0 = start % B, row = s.cache_strides[1];
        const float* k_rows = k_cache + offset + slot0 * row;
        const float* v_rows = v_cache + offset + slot0 * row;
        const auto [next, next_rows] = next_block(table, end, run.end, s, kvh);
        for (int64_t t = 0; t < n; ++t) {
          if (t < next_rows)
            prefetch_rows(k_cache + next + t * row, v_cache + next + t * row, 1, row, DV * 16);
          vec16 k[DV];
          for (int c = 0; c < DV; ++c) k[c] = load16(k_rows + t * row + c * 16);
          for (int64_t h = 0; h < heads; ++h) {
            const vec16* qh = &qs[h * DV];
            vec16 p = qh[0] * k[0];
            for (int c = 1; c < DV; ++c) p += qh[c] * k[c];
            scores[h * width + t] = lane_sum(p);
          }
        }
        if (next_rows > n)
          prefetch_rows(k_cache + next + n * row, v_cache + next + n * row, next_rows - n, row,
                        DV * 16);
        for (int64_t h = 0; h < heads; ++h) {
          const auto [lo, hi] = queries.in_block(h, start, end);
          if (lo >= hi) continue;
          float* sg = &scores[h * width];
          float& m = queries.m[h];
          float& l = queries.l[h];
          if (softcap) cap_scores(sg + lo, hi - lo, static_cast<float>(*softcap));
          vec16 a[DV];
          for (int c = 0; c < DV; ++c) a[c] = acc[h * DV + c];
          const float block_max = *std::max_element(sg + lo, sg + hi);
          if (block_max > m) {  // rescale what was summed under the old max
            const float alpha = std::exp(m - block_max);
            l *= alpha;
            for (int c = 0; c < DV; ++c) a[c] *= alpha;
            m = block_max;
          }
          for (int64_t t0 = lo; t0 < hi; t0 += 16) {
            const lanes16 in_block = lanes16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} <
                                      static_cast<int32_t>(hi - t0);
            const vec16 e = exp16(load16(sg + t0) - m);
            lanes16 bits;
            __builtin_memcpy(&bits, &e, sizeof(bits));
            bits &= in_block;  // lanes past the query's last key weigh nothing
            vec16 weights;
            __builtin_memcpy(&weights, &bits, sizeof(weights));
            store16(sg + t0, weights);
            l += lane_sum(weights);
          }
          for (int64_t t = lo; t < hi; ++t)
            for (int c = 0; c < DV; ++c) a[c] += sg[t] * load16(v_rows + t * row + c * 16);
          for (int c = 0; c < DV; ++c) acc[h * DV + c] = a[c];
        }
        start = end;
      }

      for (int64_t h = 0; h < heads; ++h) {
        float* o = out + ((run.row + h / G) * s.heads + kvh * G + h % G) * DV * 16;
        for (int c = 0; c < DV; ++c) store16(o + c * 16, acc[h * DV + c] / queries.l[h]);
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
                                     std::optional<int64_t> sliding_window,
                                     std::optional<double> softcap) {
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
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "heads (", heads,
              ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && context_lens.dim() == 1 &&
              context_lens.size(0) == batch,
              "block_tables must be [batch, max_blocks] and context_lens [batch]");
  TORCH_CHECK(!at::isFloatingType(block_tables.scalar_type()) &&
                  !at::isFloatingType(context_lens.scalar_type()),
              "block_tables and context_lens must be integer tensors");
  TORCH_CHECK(!sliding_window || *sliding_window >= 1, "sliding_window must be at least 1");
  TORCH_CHECK(!softcap || *softcap > 0, "softcap must be positive");

  const auto tables = block_tables.to(torch::kLong).contiguous();
  const auto lens = context_lens.to(torch::kLong).contiguous();
  const int64_t block_size = k_cache.size(1);
  check_tables(tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), batch, tables.size(1),
               block_size, k_cache.size(0), sliding_window);

  auto out = torch::empty({batch, heads, head_dim}, q.options());
  const Shape shape{heads, kv_heads, heads / kv_heads, head_dim, block_size, tables.size(1),
                    {q.stride(0), q.stride(1), q.stride(2)},
                    {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)}};
  const auto runs = runs_of(tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), batch, shape,
                            sliding_window);
  if (q.scalar_type() == at::kFloat && head_dim % 16 == 0 && head_dim <= 16 * 8) {
    const auto run = [&](auto dv) {
      attend_f32<decltype(dv)::value>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                                      v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                                      lens.data_ptr<int64_t>(), out.data_ptr<float>(), shape, runs,
                                      scale, sliding_window, softcap);
    };
    switch (head_dim / 16) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 5: run(std::integral_constant<int, 5>{}); break;
      case 6: run(std::integral_constant<int, 6>{}); break;
      case 7: run(std::integral_constant<int, 7>{}); break;
      case 8: run(std::integral_constant<int, 8>{}); break;
    }
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                     v_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), shape, runs, scale,
                     sliding_window, softcap);
  });
  return out;
}
