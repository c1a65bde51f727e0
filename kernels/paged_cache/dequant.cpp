// quantmla::dequantize_pages — packed pages → float32 rows [ĉ | k̂_R], on a CPU.
//
// The torch reference is `cpu.dequantize_pages_torch` (same arithmetic: (code − z) · s in float32,
// so the two agree bit for bit). One pass over the packed bytes, a token per iteration, tokens
// spread over threads; 1- and 2-bit codes are unpacked a byte at a time from a table of each
// byte's code values and then scaled in a loop the compiler vectorizes (twice as fast as shifts
// for 2-bit), 4- and 8-bit directly, 3- and 6-bit a three-byte word at a time. Rows that `keep`
// marks false are written as zeros without reading their bytes (stale pages, unfinished rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

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

}  // namespace

TORCH_LIBRARY(quantmla, m) {
  m.def(
      "dequantize_pages(Tensor storage, Tensor pages, Tensor keep, int page_tokens, int[] content, "
      "int[] rope) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantmla, CPU, m) { m.impl("dequantize_pages", &dequantize_pages); }
