// Sixteen fp32 lanes as GCC vector types (one AVX-512 register, two AVX2 ones), and the few
// operations on them that the C++ CPU kernels share: loads and stores, a lane sum, and exp.
#pragma once

#include <cstdint>

namespace {

typedef float vec16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t lanes16 __attribute__((vector_size(16 * sizeof(int32_t))));

inline vec16 load16(const float* p) {
  vec16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { __builtin_memcpy(p, &v, sizeof(v)); }

// bf16 is the upper half of an fp32, so widening one is exact: a shift into place.
typedef uint16_t bf16x16 __attribute__((vector_size(16 * sizeof(uint16_t))));
typedef uint32_t ulanes16 __attribute__((vector_size(16 * sizeof(uint32_t))));

inline vec16 load16(const uint16_t* p) {
  bf16x16 half;
  __builtin_memcpy(&half, p, sizeof(half));
  const ulanes16 wide = __builtin_convertvector(half, ulanes16) << 16;
  vec16 v;
  __builtin_memcpy(&v, &wide, sizeof(v));
  return v;
}

inline float lane_sum(vec16 v) {
  v += __builtin_shuffle(v, lanes16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, lanes16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, lanes16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, lanes16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// exp of 16 lanes at once (std::exp one value at a time was a fifth of a step's attention and
// most of SiLU's time): exp(x) = 2^k exp(r), k = round(x / ln 2), r = x - k ln 2 in two parts
// (Cody-Waite), exp(r) by its degree-7 Taylor polynomial, within 2 ulp of std::exp on
// |r| <= ln 2 / 2. x is clamped to [-87.3, 88]: below, exp is ~1e-38 (softmax inputs are
// x - max <= 0, and lanes that small weigh nothing against the max's exp(0) = 1); above, 2^k
// would leave the exponent's range (exp(88) = 1.7e38 stands in up to ln(FLT_MAX), past which
// exp is inf as std::exp's: SiLU divides by it, and g / 1.7e38 is no zero for g near -FLT_MAX).
inline vec16 exp16(vec16 x) {
  const vec16 lowest = vec16{} - 87.3f, highest = vec16{} + 88.f;
  const vec16 magic = vec16{} + 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds
  const auto overflows = x > 88.7228394f;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  const vec16 k = (x * 1.44269504f + magic) - magic;
  const vec16 r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  vec16 p = vec16{} + 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const lanes16 two_to_k = (__builtin_convertvector(k, lanes16) + 127) << 23;
  vec16 scale;
  __builtin_memcpy(&scale, &two_to_k, sizeof(scale));
  return overflows ? vec16{} + __builtin_inff() : p * scale;
}

}  // namespace
