// Loops the compiler vectorizes, shared by the C++ CPU ops (dequant.cpp, prefill.cpp).
#pragma once

#include <cstdint>

namespace quantmla_cpu {

// a · b over n elements: 16 independent partial sums, so the loop vectorizes without -ffast-math
template <class T>
inline T dot(const T* a, const T* b, int64_t n) {
  T lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
  T sum = 0;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  return sum;
}

}  // namespace quantmla_cpu
