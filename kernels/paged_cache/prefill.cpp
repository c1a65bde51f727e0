// quantmla::window_merge — the exact copies' part of a quantized prefill chunk, on a CPU, merged in
// place into the chunk's other partial results (the passes over its dequantized copies).
//
// Query i (position start + r) reads the exact copy of key j iff j is a sink (the first
// len(sink_pos) keys, at positions sink_pos) with j ≤ i, or 0 ≤ i − j < recent (the band: the other
// keys, at contiguous positions base ..). Queries run in blocks of 64 per head (a task): a block's
// band keys are one contiguous slice of its head's keys, so its scores and weighted values are two
// matrix products on views (BLAS, no copies), and a row's band is a contiguous range of that slice
// (no mask); the sinks, a handful, are dot products. The block's (out, lse) is merged into what
// `out` / `lse` hold (vLLM's merge_attn_states; lse −inf: nothing read yet). One call replaces the
// torch path's sinks pass, band passes and their merges (`window_passes_torch` in prefill.py, its
// reference) and their ~15 tensor operations per head and block. float32 and float64 (the tests).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

using quantmla_cpu::dot;

constexpr int64_t kBlock = 64;  // queries per task

// e^x for x ≤ 0 in a loop the compiler vectorizes: 2^k · e^r with k = round(x / ln 2) (the exponent
// bits), r = x − k ln 2 in two parts (Cody–Waite), e^r by a degree-6 minimax polynomial on
// |r| ≤ ln 2 / 2: relative error ≤ 1.2e-7, as expf's; x below −87 (weight < 1.7e-38) is clamped
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // 1.5 · 2^23: round
  const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.383684193e-3f;
  p = p * r + 8.374815782e-3f;
  p = p * r + 4.166822564e-2f;
  p = p * r + 1.666642017e-1f;
  p = p * r + 4.999999208e-1f;
  p = p * r + 1.000000036e+0f;
  p = p * r + 1.000000001e+0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
}
inline double exp_nonpositive(double x) { return std::exp(x); }  // float64: the tests' precision

// row[t] ← e^(row[t] − m) for t < count; returns their sum
template <class T>
inline T exp_sum(T* row, int64_t count, T m) {
  T lanes[8] = {};
  int64_t t = 0;
  for (; t + 8 <= count; t += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += (row[t + j] = exp_nonpositive(row[t + j] - m));
  T sum = 0;
  for (; t < count; ++t) sum += (row[t] = exp_nonpositive(row[t] - m));
  for (int j = 0; j < 8; ++j) sum += lanes[j];
  return sum;
}

// row[t] ← scaling · row[t] for t < count; returns their maximum (−inf for none)
template <class T>
inline T scale_max(T* row, int64_t count, T scaling) {
  for (int64_t t = 0; t < count; ++t) row[t] *= scaling;
  T lanes[8];
  std::fill(lanes, lanes + 8, -std::numeric_limits<T>::infinity());
  int64_t t = 0;
  for (; t + 8 <= count; t += 8)
    for (int j = 0; j < 8; ++j) lanes[j] = lanes[j] < row[t + j] ? row[t + j] : lanes[j];
  T top = -std::numeric_limits<T>::infinity();
  for (; t < count; ++t) top = top < row[t] ? row[t] : top;
  for (int j = 0; j < 8; ++j) top = top < lanes[j] ? lanes[j] : top;
  return top;
}

// one head's block of queries r0 .. r0 + 63: its band and sinks, merged into out / lse
template <class T>
void window_block(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const std::vector<int64_t>& sink_pos, int64_t base, int64_t start, int64_t recent,
                  T scaling, int64_t h, int64_t r0, const at::Tensor& out, const at::Tensor& lse) {
  const T inf = std::numeric_limits<T>::infinity();
  const int64_t n = q.size(1), sinks = sink_pos.size(), banded = keys.size(1) - sinks;
  const int64_t d_v = values.size(2), width = q.size(2);
  const int64_t rows = std::min(kBlock, n - r0), i0 = start + r0;
  const int64_t lo = std::max(base, i0 - recent + 1), hi = std::min(base + banded - 1, i0 + rows - 1);
  const int64_t span = std::max<int64_t>(0, hi - lo + 1);
  const int64_t q_row = q.stride(1), k_row = keys.stride(1), v_row = values.stride(1);
  const int64_t o_row = out.stride(1), l_row = lse.stride(1);
  const T* qh = q.data_ptr<T>() + h * q.stride(0) + r0 * q_row;
  const T* kh = keys.data_ptr<T>() + h * keys.stride(0);
  const T* vh = values.data_ptr<T>() + h * values.stride(0);
  T* oh = out.data_ptr<T>() + h * out.stride(0) + r0 * o_row;
  T* lh = lse.data_ptr<T>() + h * lse.stride(0) + r0 * l_row;
  at::Tensor p;  // (rows, span): the band's scores, then its weights
  if (span) p = at::mm(q.select(0, h).narrow(0, r0, rows), keys.select(0, h).narrow(0, sinks + lo - base, span).t());
  T* pp = span ? p.data_ptr<T>() : nullptr;
  std::vector<T> sink_w(rows * sinks, T(0)), top(rows, -inf), total(rows, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    T* w = sink_w.data() + r * sinks;
    T m = -inf;
    for (int64_t k = 0; k < sinks; ++k)
      if (sink_pos[k] <= i) m = std::max(m, w[k] = scaling * dot(qh + r * q_row, kh + k * k_row, width));
    // slice columns [a, b] are positions i − recent < j ≤ i; the rest weigh 0
    const int64_t a = std::max<int64_t>(0, i - recent + 1 - lo), b = std::min(span - 1, i - lo);
    T* row = pp + r * span;
    m = std::max(m, scale_max(row + a, b - a + 1, scaling));
    if (m == -inf) {  // reads no exact copy
      std::fill(row, row + span, T(0));
      continue;
    }
    T sum = 0;
    if (b < a) {  // no band key: the sinks alone
      std::fill(row, row + span, T(0));
    } else {
      std::fill(row, row + a, T(0));
      std::fill(row + b + 1, row + span, T(0));
      sum = exp_sum(row + a, b - a + 1, m);
    }
    for (int64_t k = 0; k < sinks; ++k) sum += (w[k] = sink_pos[k] <= i ? std::exp(w[k] - m) : T(0));
    top[r] = m;
    total[r] = sum;
  }
  at::Tensor weighted;  // (rows, d_v), contiguous
  if (span) weighted = at::mm(p, values.select(0, h).narrow(0, sinks + lo - base, span));
  const T* pw = span ? weighted.data_ptr<T>() : nullptr;
  std::vector<T> v(d_v);
  for (int64_t r = 0; r < rows; ++r) {
    if (top[r] == -inf) continue;
    if (span) std::copy(pw + r * d_v, pw + (r + 1) * d_v, v.begin());
    else std::fill(v.begin(), v.end(), T(0));
    for (int64_t k = 0; k < sinks; ++k) {
      const T wk = sink_w[r * sinks + k];
      const T* vk = vh + k * v_row;
      for (int64_t d = 0; d < d_v; ++d) v[d] += wk * vk[d];
    }
    const T part = top[r] + std::log(total[r]), old = lh[r * l_row];
    const T both = old == -inf ? part : std::max(part, old) + std::log1p(std::exp(-std::abs(part - old)));
    const T keep = old == -inf ? T(0) : std::exp(old - both), add = std::exp(part - both) / total[r];
    T* o = oh + r * o_row;
    for (int64_t d = 0; d < d_v; ++d) o[d] = o[d] * keep + v[d] * add;
    lh[r * l_row] = both;
  }
}

// q (H, n, W), keys (H, m, W), values (H, m, d_v) of one dtype (float32 / float64), any strides
// with unit last stride; out (H, n, d_v), lse (H, n) updated in place
void window_merge(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  at::IntArrayRef sink_pos, int64_t base, int64_t start, int64_t recent, double scaling,
                  const at::Tensor& out, const at::Tensor& lse) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3 && out.dim() == 3 && lse.dim() == 2,
              "q, keys, values, out: (H, rows, width); lse: (H, n)");
  for (const auto* t : {&keys, &values, &out, &lse})
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device().is_cpu(), "one CPU dtype for every tensor");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "float32 or float64");
  for (const auto* t : {&q, &keys, &values, &out})
    TORCH_CHECK(t->stride(2) == 1, "q, keys, values, out: rows with unit stride");
  TORCH_CHECK(keys.size(0) == q.size(0) && keys.size(2) == q.size(2) && values.size(1) == keys.size(1) &&
                  out.size(1) == q.size(1) && out.size(2) == values.size(2) && lse.size(1) == q.size(1) &&
                  static_cast<int64_t>(sink_pos.size()) <= keys.size(1),
              "shapes: keys (H, m, W) as q's heads and width, values (H, m, d_v), out (H, n, d_v)");
  const std::vector<int64_t> sinks(sink_pos.begin(), sink_pos.end());
  const int64_t heads = q.size(0), blocks = (q.size(1) + kBlock - 1) / kBlock;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "window_merge", [&] {
    at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task)
        window_block<scalar_t>(q, keys, values, sinks, base, start, recent, static_cast<scalar_t>(scaling),
                               task / blocks, task % blocks * kBlock, out, lse);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantmla, m) {
  m.def(
      "window_merge(Tensor q, Tensor keys, Tensor values, int[] sink_pos, int base, int start, "
      "int recent, float scaling, Tensor(a!) out, Tensor(b!) lse) -> ()");
}

TORCH_LIBRARY_IMPL(quantmla, CPU, m) { m.impl("window_merge", &window_merge); }
