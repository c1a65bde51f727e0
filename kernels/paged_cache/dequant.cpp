// quantmla::dequantize_pages — packed pages → float32 rows [ĉ | k̂_R], on a CPU;
// quantmla::quantize_pages — token rows → their codes, scales and zeros at (page, slot): the writer;
// quantmla::decode_pages / decode_rows — one query token per request over its pages, fused (below).
//
// The torch reference of the first is `cpu.dequantize_pages_torch` (same arithmetic: (code − z) · s in float32,
// so the two agree bit for bit). One pass over the packed bytes, a token per iteration, tokens
// spread over threads; 1- and 2-bit codes are unpacked a byte at a time from a table of each
// byte's code values and then scaled in a loop the compiler vectorizes (twice as fast as shifts
// for 2-bit), 4- and 8-bit directly, 3- and 6-bit a three-byte word at a time. Rows that `keep`
// marks false are written as zeros without reading their bytes (stale pages, unfinished rows).
// The writer's reference is `writer.write_torch` (`quantmla.quant.quantize`, then `pack`): float32
// group range with 0 inside, s = max((hi − lo) / m, 1e-8), z = round(−lo / s) with the unrounded s,
// s and z rounded to the metadata dtype, codes clamp(round(x / s) + z, 0, m), round half to even
// (by the 1.5 · 2^23 add, exact where it matters) — the same IEEE operations in the same order, so
// the bytes are identical for finite input.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "vector_math.h"

namespace {

using quantmla_cpu::dot;

// one path's constants, in the order the Python side passes them
struct PathInfo {
  int64_t dim, bits, group, codes, scales, zeros, meta, column;  // meta: 4 float32, 2 bfloat16, -2 float16
  int64_t meta_bytes() const { return meta == 4 ? 4 : 2; }
};

PathInfo path_info(at::IntArrayRef p) {
  TORCH_CHECK(p.size() == 8, "a path is (dim, bits, group, codes, scales, zeros, meta, column)");
  return {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
}

inline float meta_value(const uint8_t* at, int64_t meta) {
  if (meta == 4) {
    float f;
    std::memcpy(&f, at, 4);
    return f;
  }
  uint16_t bits;
  std::memcpy(&bits, at, 2);
  if (meta == 2) return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// code values of every byte, per width: one 4- to 32-byte copy per packed byte
template <int BITS>
struct ByteCodes {
  static constexpr int per_byte = 8 / BITS;
  float values[256][per_byte];
  ByteCodes() {
    for (int byte = 0; byte < 256; ++byte)
      for (int m = 0; m < per_byte; ++m)
        values[byte][m] = static_cast<float>((byte >> (m * BITS)) & ((1 << BITS) - 1));
  }
};

template <int BITS>
inline void unpack_group(const uint8_t* codes, int64_t group, float z, float s, float* out) {
  if constexpr (BITS == 8) {
    for (int64_t i = 0; i < group; ++i) out[i] = (static_cast<float>(codes[i]) - z) * s;
  } else if constexpr (BITS == 4) {  // two shifts per byte vectorize; the table measured slower
    for (int64_t i = 0; i < group / 2; ++i) {
      const int byte = codes[i];
      out[2 * i] = (static_cast<float>(byte & 15) - z) * s;
      out[2 * i + 1] = (static_cast<float>(byte >> 4) - z) * s;
    }
  } else {
    static const ByteCodes<BITS> table;
    constexpr int per_byte = 8 / BITS;
    for (int64_t i = 0; i < group / per_byte; ++i)
      std::memcpy(out + i * per_byte, table.values[codes[i]], sizeof(float) * per_byte);
    for (int64_t i = 0; i < group; ++i) out[i] = (out[i] - z) * s;  // vectorized
  }
}

void dequantize_token(const uint8_t* page, int64_t t, const PathInfo& p, float* row) {
  const int64_t groups = p.dim / p.group;
  const int64_t word_bytes = (p.bits == 3 || p.bits == 6) ? 3 : 1;
  const int64_t per_word = word_bytes * 8 / p.bits;
  const uint8_t* codes = page + p.codes + t * (p.dim * p.bits / 8);
  const uint8_t* scales = page + p.scales + t * groups * p.meta_bytes();
  const uint8_t* zeros = page + p.zeros + t * groups;
  float* out = row + p.column;
  const int64_t group_bytes = p.group * p.bits / 8;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = meta_value(scales + g * p.meta_bytes(), p.meta);
    const float z = static_cast<float>(zeros[g]);
    const uint8_t* c = codes + g * group_bytes;
    float* o = out + g * p.group;
    switch (p.bits) {
      case 8: unpack_group<8>(c, p.group, z, s, o); break;
      case 4: unpack_group<4>(c, p.group, z, s, o); break;
      case 2: unpack_group<2>(c, p.group, z, s, o); break;
      case 1: unpack_group<1>(c, p.group, z, s, o); break;
      default: {  // 3 and 6 bits: three-byte little-endian words
        const int mask = (1 << p.bits) - 1;
        for (int64_t w = 0; w < group_bytes / word_bytes; ++w) {
          const uint8_t* b = c + w * word_bytes;
          const uint32_t word = b[0] | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16);
          for (int64_t m = 0; m < per_word; ++m)
            o[w * per_word + m] = (static_cast<float>((word >> (m * p.bits)) & mask) - z) * s;
        }
      }
    }
  }
}

at::Tensor dequantize_pages(const at::Tensor& storage, const at::Tensor& pages, const at::Tensor& keep,
                            int64_t page_tokens, at::IntArrayRef content, at::IntArrayRef rope) {
  TORCH_CHECK(storage.device().is_cpu() && storage.scalar_type() == at::kByte && storage.dim() == 2 &&
                  storage.is_contiguous(),
              "storage: contiguous uint8 (pages, page bytes) on the CPU");
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 1, "pages: int64 (n,)");
  const PathInfo paths[2] = {path_info(content), path_info(rope)};
  for (const auto& p : paths)
    TORCH_CHECK(p.group > 0 && p.dim % p.group == 0 && (p.group * p.bits) % 8 == 0 &&
                    (p.bits == 1 || p.bits == 2 || p.bits == 3 || p.bits == 4 || p.bits == 6 ||
                     p.bits == 8) &&
                    (p.meta == 2 || p.meta == 4 || p.meta == -2),
                "unsupported path (dim ", p.dim, ", bits ", p.bits, ", group ", p.group, ")");
  const int64_t n = pages.size(0), width = paths[0].dim + paths[1].dim, tokens = n * page_tokens;
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.numel() == tokens && keep.is_contiguous(),
              "keep: bool, one per token of the pages");
  auto out = at::empty({tokens, width}, storage.options().dtype(at::kFloat));
  const uint8_t* base = storage.data_ptr<uint8_t>();
  const int64_t* index = pages.data_ptr<int64_t>();
  const bool* kept = keep.data_ptr<bool>();
  const int64_t page_bytes = storage.size(1), stored = storage.size(0);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(index[i] >= 0 && index[i] < stored, "page ", index[i], " outside the storage");
  float* rows = out.data_ptr<float>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = rows + r * width;
      if (!kept[r]) {
        std::memset(row, 0, width * sizeof(float));
        continue;
      }
      const uint8_t* page = base + index[r / page_tokens] * page_bytes;
      for (const auto& p : paths) dequantize_token(page, r % page_tokens, p, row);
    }
  });
  return out;
}

inline float meta_round(float v, int64_t meta) {  // the metadata dtype's value of v (RNE)
  if (meta == 4) return v;
  return meta == 2 ? static_cast<float>(c10::BFloat16(v)) : static_cast<float>(c10::Half(v));
}

inline void store_meta(uint8_t* at, float v, int64_t meta) {
  if (meta == 4) {
    std::memcpy(at, &v, 4);
    return;
  }
  const uint16_t bits = meta == 2 ? c10::BFloat16(v).x : c10::Half(v).x;
  std::memcpy(at, &bits, 2);
}

// round half to even, as nearbyint in the default mode, in adds the compiler vectorizes: exact
// for |v| < 2^22; beyond, the result stays beyond every code range, so the clamp is unchanged
inline float round_even(float v) {
  constexpr float magic = 12582912.0f;  // 1.5 · 2^23
  return (v + magic) - magic;
}

constexpr int64_t kMaxGroup = 1024;

void quantize_token(const float* x, uint8_t* page, int64_t t, const PathInfo& p) {
  const int64_t groups = p.dim / p.group, levels = (int64_t(1) << p.bits) - 1;
  const int64_t word_bytes = (p.bits == 3 || p.bits == 6) ? 3 : 1;
  const int64_t per_word = word_bytes * 8 / p.bits, group_bytes = p.group * p.bits / 8;
  uint8_t* codes = page + p.codes + t * (p.dim * p.bits / 8);
  uint8_t* scales = page + p.scales + t * groups * p.meta_bytes();
  uint8_t* zeros = page + p.zeros + t * groups;
  uint8_t code[kMaxGroup];
  const float top = static_cast<float>(levels);
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * p.group;
    float lo = 0.0f, hi = 0.0f;
    for (int64_t i = 0; i < p.group; ++i) {
      lo = std::min(lo, xg[i]);
      hi = std::max(hi, xg[i]);
    }
    const float scale = std::max((hi - lo) / top, 1e-8f);
    const float zero = meta_round(std::nearbyint(-lo / scale), p.meta);
    const float s = meta_round(scale, p.meta);
    store_meta(scales + g * p.meta_bytes(), s, p.meta);
    zeros[g] = static_cast<uint8_t>(zero);
    for (int64_t i = 0; i < p.group; ++i) {  // vectorized
      const float q = round_even(xg[i] / s) + zero;
      // NaN (x / s with s = 0: a floored scale under float16's range) is code 0, as torch casts it
      code[i] = static_cast<uint8_t>(q != q ? 0.0f : std::min(std::max(q, 0.0f), top));
    }
    uint8_t* c = codes + g * group_bytes;
    if (p.bits == 8) {
      std::memcpy(c, code, p.group);
    } else if (p.bits == 4) {
      for (int64_t i = 0; i < group_bytes; ++i) c[i] = code[2 * i] | (code[2 * i + 1] << 4);
    } else {
      for (int64_t w = 0; w < group_bytes / word_bytes; ++w) {
        uint32_t word = 0;
        for (int64_t m = 0; m < per_word; ++m) word |= uint32_t(code[w * per_word + m]) << (m * p.bits);
        for (int64_t b = 0; b < word_bytes; ++b) c[w * word_bytes + b] = (word >> (8 * b)) & 0xFF;
      }
    }
  }
}

void quantize_pages(at::Tensor& storage, const at::Tensor& pages, const at::Tensor& slots,
                    const at::Tensor& content_rows, const at::Tensor& rope_rows, int64_t page_tokens,
                    at::IntArrayRef content, at::IntArrayRef rope) {
  TORCH_CHECK(storage.device().is_cpu() && storage.scalar_type() == at::kByte && storage.dim() == 2 &&
                  storage.is_contiguous(),
              "storage: contiguous uint8 (pages, page bytes) on the CPU");
  const int64_t n = pages.numel();
  TORCH_CHECK(pages.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  slots.numel() == n && pages.is_contiguous() && slots.is_contiguous(),
              "pages, slots: contiguous int64 (n,)");
  const PathInfo paths[2] = {path_info(content), path_info(rope)};
  for (const auto& p : paths) TORCH_CHECK(p.group <= kMaxGroup, "groups of at most ", kMaxGroup, " values");
  const at::Tensor* rows[2] = {&content_rows, &rope_rows};
  for (int k = 0; k < 2; ++k)
    TORCH_CHECK(rows[k]->scalar_type() == at::kFloat && rows[k]->is_contiguous() &&
                    rows[k]->dim() == 2 && rows[k]->size(0) == n && rows[k]->size(1) == paths[k].dim,
                "rows: contiguous float32 (n, dim) per path");
  const int64_t* page = pages.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t page_bytes = storage.size(1), stored = storage.size(0);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(page[i] >= 0 && page[i] < stored && slot[i] >= 0 && slot[i] < page_tokens,
                "token ", i, ": (page ", page[i], ", slot ", slot[i], ") outside the storage");
  uint8_t* base = storage.data_ptr<uint8_t>();
  const float* x[2] = {content_rows.data_ptr<float>(), rope_rows.data_ptr<float>()};
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int k = 0; k < 2; ++k)
        quantize_token(x[k] + i * paths[k].dim, base + page[i] * page_bytes, slot[i], paths[k]);
  });
}


// ---- decode: one query token per request over its pages, fused (no float32 rows in memory) ----
// Each task is one request's run of positions (or its protection rows): a page's rows are loaded
// (dequantized, or BF16 rows converted) into a small buffer, scored against every head's query,
// and folded into that head's running max / sum / weighted latent (online softmax, once per
// page); the tasks' partial states are merged per (request, head) at the end. Reference:
// `cpu.decode_packed` / `cpu.decode_rows` (float64 in the tests).

constexpr int64_t kSplit = 256;  // positions per task

struct Task {
  int64_t b, lo, hi;  // positions [lo, hi) of request b; lo < 0: its protection rows
};

// one task's partial state: per head, max, sum and the unnormalized weighted latent
struct State {
  float* m;
  float* l;
  float* acc;  // heads × d_c
};

// fold rows (count × width, float) into the state of every head
void fold(const float* q, int64_t heads, int64_t width, int64_t d_c, float scaling, const float* rows,
          int64_t count, State st, float* scores) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * width;
    float top = -INFINITY;
    for (int64_t t = 0; t < count; ++t) {
      scores[t] = scaling * dot(qh, rows + t * width, width);
      top = std::max(top, scores[t]);
    }
    const float m = std::max(st.m[h], top);
    float* acc = st.acc + h * d_c;
    if (st.m[h] != -INFINITY && st.m[h] != m) {
      const float alpha = std::exp(st.m[h] - m);
      st.l[h] *= alpha;
      for (int64_t d = 0; d < d_c; ++d) acc[d] *= alpha;
    }
    st.m[h] = m;
    for (int64_t t = 0; t < count; ++t) {
      const float p = std::exp(scores[t] - m);
      st.l[h] += p;
      const float* row = rows + t * width;
      for (int64_t d = 0; d < d_c; ++d) acc[d] += p * row[d];  // vectorized
    }
  }
}

// the tasks' states merged per (request, head) → (o (B, H, d_c), lse (B, H))
std::tuple<at::Tensor, at::Tensor> merge(const std::vector<Task>& tasks, const at::Tensor& m,
                                         const at::Tensor& l, const at::Tensor& acc, int64_t batch,
                                         int64_t heads, int64_t d_c) {
  auto o = at::zeros({batch, heads, d_c}, m.options());
  auto lse = at::full({batch, heads}, -INFINITY, m.options());
  const float *pm = m.data_ptr<float>(), *pl = l.data_ptr<float>(), *pa = acc.data_ptr<float>();
  float *po = o.data_ptr<float>(), *plse = lse.data_ptr<float>();
  std::vector<std::vector<int64_t>> of(batch);
  for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i) of[tasks[i].b].push_back(i);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      float top = -INFINITY;
      for (int64_t i : of[b]) top = std::max(top, pm[i * heads + h]);
      if (top == -INFINITY) continue;
      float total = 0.0f;
      float* out = po + bh * d_c;
      for (int64_t i : of[b]) {
        const float w = std::exp(pm[i * heads + h] - top);
        if (w == 0.0f) continue;
        total += w * pl[i * heads + h];
        const float* a = pa + (i * heads + h) * d_c;
        for (int64_t d = 0; d < d_c; ++d) out[d] += w * a[d];
      }
      for (int64_t d = 0; d < d_c; ++d) out[d] /= total;
      plse[bh] = top + std::log(total);
    }
  });
  return {o, lse};
}

// a request's protection rows: row r of buffer slot `slots[b]` (float32 or bfloat16), valid where
// the ring rule of `cpu._protected_positions` places a cached position (sinks at r < sink, every
// later token at sink + pos % recent, the last `recent` of them held)
struct Protection {
  const void* rows = nullptr;  // (slots, held, width)
  bool bf16 = false;
  const int64_t* slots = nullptr;
  const int64_t* lens = nullptr;
  int64_t held = 0, sink = 0, recent = 1;

  bool valid(int64_t b, int64_t r) const {
    const int64_t last = lens[b] - 1;
    int64_t pos = r;
    if (r >= sink) {
      const int64_t m = ((last - (r - sink)) % recent + recent) % recent;  // Python's modulo
      pos = last - m;
    }
    return pos >= 0 && pos <= last && (r < sink || pos >= sink);
  }

  void load(int64_t b, int64_t r, int64_t width, float* out) const {
    const int64_t at = (slots[b] * held + r) * width;
    if (bf16) {
      const c10::BFloat16* src = static_cast<const c10::BFloat16*>(rows) + at;
      for (int64_t i = 0; i < width; ++i) out[i] = static_cast<float>(src[i]);
    } else {
      std::memcpy(out, static_cast<const float*>(rows) + at, width * sizeof(float));
    }
  }
};

// runs every task: `load(b, lo, count, rows)` fills rows for positions lo .. lo + count − 1 of
// request b (within one page); a task with lo < 0 folds the request's protection rows
template <class Load>
std::tuple<at::Tensor, at::Tensor> decode_tasks(const std::vector<Task>& tasks, const at::Tensor& q,
                                                const Protection& prot, double scaling, int64_t d_c,
                                                int64_t page_tokens, Load load) {
  const int64_t batch = q.size(0), heads = q.size(1), width = q.size(2), n = tasks.size();
  auto m = at::full({n, heads}, -INFINITY, q.options());
  auto l = at::zeros({n, heads}, q.options());
  auto acc = at::zeros({n, heads, d_c}, q.options());
  const float* pq = q.data_ptr<float>();
  const int64_t block = std::max<int64_t>(page_tokens, 16);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(block * width), scores(block);
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      State st{m.data_ptr<float>() + i * heads, l.data_ptr<float>() + i * heads,
               acc.data_ptr<float>() + i * heads * d_c};
      const float* qb = pq + task.b * heads * width;
      if (task.lo < 0) {  // protection rows
        int64_t count = 0;
        for (int64_t r = 0; r < prot.held; ++r) {
          if (!prot.valid(task.b, r)) continue;
          prot.load(task.b, r, width, rows.data() + count * width);
          if (++count == block) {
            fold(qb, heads, width, d_c, static_cast<float>(scaling), rows.data(), count, st, scores.data());
            count = 0;
          }
        }
        if (count) fold(qb, heads, width, d_c, static_cast<float>(scaling), rows.data(), count, st, scores.data());
        continue;
      }
      for (int64_t pos = task.lo; pos < task.hi;) {
        const int64_t count = std::min(page_tokens - pos % page_tokens, task.hi - pos);
        load(task.b, pos, count, rows.data());
        fold(qb, heads, width, d_c, static_cast<float>(scaling), rows.data(), count, st, scores.data());
        pos += count;
      }
    }
  });
  return merge(tasks, m, l, acc, batch, heads, d_c);
}

std::vector<Task> split(const int64_t* lo, const int64_t* hi, int64_t batch, bool protection) {
  std::vector<Task> tasks;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t a = lo[b]; a < hi[b]; a += kSplit) tasks.push_back({b, a, std::min(hi[b], a + kSplit)});
    if (protection) tasks.push_back({b, -1, -1});
  }
  return tasks;
}

// the inputs both decodes share, and every page a task will read inside the table and storage
void check_decode_inputs(const at::Tensor& table, const at::Tensor& lo, const at::Tensor& hi,
                         const at::Tensor& q, int64_t page_tokens, int64_t stored) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "q: contiguous float32 (B, H, d_c + d_r)");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous() &&
                  table.size(0) == q.size(0),
              "table: contiguous int64 (B, pages)");
  for (const auto* t : {&lo, &hi})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == q.size(0) && t->is_contiguous(),
                "lo, hi: contiguous int64 (B,)");
  const int64_t *tab = table.data_ptr<int64_t>(), cols = table.size(1);
  const int64_t *plo = lo.data_ptr<int64_t>(), *phi = hi.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    for (int64_t pg = plo[b] / page_tokens; plo[b] < phi[b] && pg <= (phi[b] - 1) / page_tokens; ++pg)
      TORCH_CHECK(pg < cols && tab[b * cols + pg] >= 0 && tab[b * cols + pg] < stored,
                  "request ", b, ": page ", pg, " outside its table or the storage");
}

// packed pages: positions [lo_b, hi_b) of each request from its pages, and its protection rows
// (row b: buffer slot slots[b] of `prot` (slots, held, width), float32 or bfloat16; none if empty)
std::tuple<at::Tensor, at::Tensor> decode_pages(const at::Tensor& storage, const at::Tensor& table,
                                                const at::Tensor& lo, const at::Tensor& hi,
                                                const at::Tensor& q, const at::Tensor& prot,
                                                const at::Tensor& slots, const at::Tensor& lens,
                                                int64_t sink, int64_t recent, double scaling,
                                                int64_t page_tokens, at::IntArrayRef content,
                                                at::IntArrayRef rope) {
  TORCH_CHECK(storage.device().is_cpu() && storage.scalar_type() == at::kByte && storage.dim() == 2 &&
                  storage.is_contiguous(),
              "storage: contiguous uint8 (pages, page bytes) on the CPU");
  check_decode_inputs(table, lo, hi, q, page_tokens, storage.size(0));
  const PathInfo paths[2] = {path_info(content), path_info(rope)};
  TORCH_CHECK(paths[0].dim + paths[1].dim == q.size(2), "q's width is d_c + d_r");
  Protection protection;
  const bool protect = prot.numel() > 0;
  if (protect) {
    TORCH_CHECK((prot.scalar_type() == at::kFloat || prot.scalar_type() == at::kBFloat16) &&
                    prot.is_contiguous() && prot.dim() == 3 && prot.size(2) == q.size(2),
                "prot: contiguous float32 or bfloat16 (slots, rows, width)");
    for (const auto* t : {&slots, &lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == q.size(0),
                  "slots, lens: contiguous int64 (B,)");
    TORCH_CHECK(sink >= 0 && recent >= 0 && sink + recent == prot.size(1),
                "the protection buffer holds sink + recent rows");
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b)
      TORCH_CHECK(slot[b] >= 0 && slot[b] < prot.size(0), "request ", b, ": slot ", slot[b], " outside the buffer");
    protection = {prot.data_ptr(), prot.scalar_type() == at::kBFloat16, slot, lens.data_ptr<int64_t>(),
                  prot.size(1), sink, std::max<int64_t>(recent, 1)};
  }
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t cols = table.size(1), page_bytes = storage.size(1);
  const int64_t *plo = lo.data_ptr<int64_t>(), *phi = hi.data_ptr<int64_t>();
  const uint8_t* base = storage.data_ptr<uint8_t>();
  const int64_t width = q.size(2);
  auto load = [&](int64_t b, int64_t pos, int64_t count, float* rows) {
    const uint8_t* page = base + tab[b * cols + pos / page_tokens] * page_bytes;
    for (int64_t t = 0; t < count; ++t)
      for (const auto& p : paths) dequantize_token(page, pos % page_tokens + t, p, rows + t * width);
  };
  return decode_tasks(split(plo, phi, q.size(0), protect), q, protection, scaling, paths[0].dim,
                      page_tokens, load);
}

// row pages (pages, page tokens, width) of float32 or bfloat16: every position [lo_b, hi_b)
std::tuple<at::Tensor, at::Tensor> decode_rows(const at::Tensor& pages, const at::Tensor& table,
                                               const at::Tensor& lo, const at::Tensor& hi,
                                               const at::Tensor& q, double scaling, int64_t d_c) {
  TORCH_CHECK(pages.device().is_cpu() && pages.dim() == 3 && pages.stride(2) == 1 &&
                  (pages.scalar_type() == at::kFloat || pages.scalar_type() == at::kBFloat16) &&
                  pages.size(2) == q.size(2),
              "pages: float32 or bfloat16 (pages, page tokens, d_c + d_r), rows contiguous, on the CPU");
  const int64_t page_tokens = pages.size(1);
  check_decode_inputs(table, lo, hi, q, page_tokens, pages.size(0));
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t cols = table.size(1);
  const int64_t width = q.size(2), page_stride = pages.stride(0), row_stride = pages.stride(1);
  const int64_t *plo = lo.data_ptr<int64_t>(), *phi = hi.data_ptr<int64_t>();
  const auto tasks = split(plo, phi, q.size(0), false);
  auto run = [&](const auto* base) {  // float32 or bfloat16 rows, read in place (a strided view)
    auto load = [&](int64_t b, int64_t pos, int64_t count, float* rows) {
      const auto* src = base + tab[b * cols + pos / page_tokens] * page_stride + (pos % page_tokens) * row_stride;
      for (int64_t t = 0; t < count; ++t)
        for (int64_t i = 0; i < width; ++i) rows[t * width + i] = static_cast<float>(src[t * row_stride + i]);
    };
    return decode_tasks(tasks, q, Protection{}, scaling, d_c, page_tokens, load);
  };
  if (pages.scalar_type() == at::kFloat) return run(pages.data_ptr<float>());
  return run(pages.data_ptr<c10::BFloat16>());
}

}  // namespace

TORCH_LIBRARY(quantmla, m) {
  m.def(
      "dequantize_pages(Tensor storage, Tensor pages, Tensor keep, int page_tokens, int[] content, "
      "int[] rope) -> Tensor");
  m.def(
      "quantize_pages(Tensor(a!) storage, Tensor pages, Tensor slots, Tensor content_rows, "
      "Tensor rope_rows, int page_tokens, int[] content, int[] rope) -> ()");
  m.def(
      "decode_pages(Tensor storage, Tensor table, Tensor lo, Tensor hi, Tensor q, Tensor prot, "
      "Tensor slots, Tensor lens, int sink, int recent, float scaling, int page_tokens, int[] content, "
      "int[] rope) -> (Tensor, Tensor)");
  m.def(
      "decode_rows(Tensor pages, Tensor table, Tensor lo, Tensor hi, Tensor q, float scaling, "
      "int d_c) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(quantmla, CPU, m) {
  m.impl("dequantize_pages", &dequantize_pages);
  m.impl("quantize_pages", &quantize_pages);
  m.impl("decode_pages", &decode_pages);
  m.impl("decode_rows", &decode_rows);
}
