// Fused paged decode attention for CPU.
//
// One query token per sequence attends to that sequence's context, read straight from
// the paged KV cache (no gather copy). Work items run on ATen's intra-op pool
// (at::parallel_for), so they share torch's threads and honour torch.set_num_threads.
// Two walks, the same bits:
// - row order (unquantized caches, AVX-512 or AVX2, at least 2 sequences per thread or a
//   step small enough for one thread):
//   an item is a sequence, every kv head at once, and the passes read each cache row
//   [kv_heads, head_dim] whole, in memory order, which the hardware prefetchers stream
//   (from DRAM 1.6x the per-head walk on a 2-core Zen 4: see attend_rows_avx512);
// - per head (everything else): an item is (sequence, kv head, group of up to 8 query
//   heads sharing that kv head), so a lone sequence still spreads over the threads.
//
// Per item, walking the block table: K pass, scores = (scale * q) . k for every context
// token (fp32); softmax, exp(score - max) and its sum per head; V pass, out = sum_t p_t
// v_t / sum. Each K and V row is read once (the V pass walks the table again per group
// of 16-float chunks when heads x chunks exceed the registers: large head_dim x group).
// fp32 / bf16 / fp16 inputs; all arithmetic in fp32. Three code paths, the best the
// build machine has (-march=native) chosen unless ``isa`` names one: AVX-512 (F, BW, VL),
// AVX2 + FMA + F16C (the same tiles in 8-float registers, for head_dim a multiple of 8;
// an AVX-512 build has it too), and portable loops the compiler vectorises.
//
// Quantized caches (kv_format 1 fp8_e4m3, 2 fp8_e5m2, 3 nvfp4; row layouts in
// workers/models/kv_format.py): uint8 rows. Each pass decodes a block's rows of the
// item's kv head into an fp32 scratch (block_size x padded_dim, L1-resident) and runs the
// fp32 code on it, so every quantized byte is read once per item and the result equals
// the fp32 kernel on the dequantized cache bit for bit. FP8 decodes through fp16
// (e5m2 is fp16's top byte; e4m3's fields fit fp16's, times 2^8; e4m3 rows holding a NaN
// code go through the table) and NVFP4's E2M1 codes through a 16-lane permute; the
// portable build uses 256-entry tables (torch's own fp8 -> float conversions).
//
// Key add-back (quantized caches only): an optional bfloat16 table key_add [positions,
// kv_heads, head_dim] is added to every decoded key row of the token at that position (the
// calibrated key offset a quantized cache subtracts before storing, see the key transform
// in workers/models/kv_format.py), fused into the decode (one FMA), before the dot
// products. bfloat16 halves what every item reads of it (~4x a row of FP8 in float32).
//
// Registered as torch.ops.pdserve_kernels.paged_decode_attention(q, k_cache, v_cache,
// block_tables, context_lens, scale, kv_format=0, key_add=None, isa=-1). Its fused twin
// paged_write_decode_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables,
// context_lens, scale, isa=-1) first writes the step's K/V rows into their slots
// (unquantized caches): one call per layer where index_copy_ x2 and the op were three.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PDS_AVX512 1
#else
#define PDS_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDS_AVX2 1
#else
#define PDS_AVX2 0
#endif
#if PDS_AVX512 || PDS_AVX2
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxGroup = 8;  // query heads per work item

// Whether rows_walk may run (paged_attention_row_walk: the benchmark's A/B and the
// tests' check that both walks give the same bits).
std::atomic<bool> g_row_walk{true};

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (max-subtracted scores): x = n ln2 + r with |r| <= ln2/2,
// e^r by the Cephes degree-6 polynomial (~1 ulp), 2^n built in the exponent bits.
// GCC 12 does not vectorise a loop over it (the clamp stays a branch: "control flow in
// loop"), so the x86 paths use exp_nonpos8 below, the same steps on 8 lanes.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;  // e^-87 ~ 1.6e-38: still a normal float
  float n = x * 1.44269504088896341f;
  n = (n + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

#if PDS_AVX512 || PDS_AVX2
// exp_nonpos on 8 lanes: the clamp as max(-87, x) (which, like the ternary, passes a NaN
// through), then the scalar function's steps with the fused multiply-adds GCC contracts
// them into, so a lane computes what the scalar code does.
inline __m256 exp_nonpos8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// x[0 .. m) = exp_nonpos(x - mx), sums += the results (lanes by position mod 8); mx and
// sums hold m rounded up to 8 floats. x may be read (not written) up to 7 floats past m.
inline void exp_sub_sum8(float* x, const float* mx, float* sums, int64_t m) {
  for (int64_t j = 0; j < m; j += 8) {
    const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(mx + j)));
    if (j + 8 <= m) {
      _mm256_storeu_ps(x + j, e);
      _mm256_storeu_ps(sums + j, _mm256_add_ps(_mm256_loadu_ps(sums + j), e));
    } else {
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m - j)), lane);
      _mm256_maskstore_ps(x + j, keep, e);
      const __m256 kept = _mm256_and_ps(e, _mm256_castsi256_ps(keep));
      _mm256_storeu_ps(sums + j, _mm256_add_ps(_mm256_loadu_ps(sums + j), kept));
    }
  }
}
#endif

// Scores are token-major: s[t * ns + j] for head j of ns (only the first ng are real).
// Replaces them by exp(s - max over t of head j) and writes 1 / sum per real head.
// Every 16 * ns elements the head pattern repeats, so the loops run over that period
// with per-lane max and sum arrays and vectorise without gathers. Vec (the x86 paths):
// the exp runs 8 lanes at a time (exp_sub_sum8); s must then have 7 floats of room past
// len * ns.
template <bool Vec = false>
inline void softmax_token_major(float* s, int64_t len, int ns, int ng, float* inv) {
  const int64_t n = len * ns, period = 16 * ns;
  alignas(64) float mrep[16 * kMaxGroup], srep[16 * kMaxGroup];
  std::fill(mrep, mrep + period, -std::numeric_limits<float>::infinity());
  for (int64_t base = 0; base < n; base += period) {
    const int64_t m = std::min(period, n - base);
    const float* x = s + base;
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) mrep[j] = x[j] > mrep[j] ? x[j] : mrep[j];
  }
  float mx[kMaxGroup], sum[kMaxGroup];
  std::fill(mx, mx + ns, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + ns, 0.0f);
  for (int64_t j = 0; j < period; ++j) mx[j % ns] = std::max(mx[j % ns], mrep[j]);
  for (int64_t j = 0; j < period; ++j) {
    mrep[j] = mx[j % ns];
    srep[j] = 0.0f;
  }
  for (int64_t base = 0; base < n; base += period) {
    const int64_t m = std::min(period, n - base);
    float* x = s + base;
#if PDS_AVX512 || PDS_AVX2
    if constexpr (Vec) {
      exp_sub_sum8(x, mrep, srep, m);
      continue;
    }
#endif
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) {
      const float e = exp_nonpos(x[j] - mrep[j]);
      x[j] = e;
      srep[j] += e;
    }
  }
  for (int64_t j = 0; j < period; ++j) sum[j % ns] += srep[j];
  for (int j = 0; j < ng; ++j) inv[j] = 1.0f / sum[j];
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i]);
}

struct Geometry {
  int64_t block_size, head_dim, padded_dim;
  int64_t k_block, k_token, v_block, v_token;  // element strides
  int64_t row_bytes;                           // one cache row (values and scales)
};

// One sequence's block ids (validated copies, int64).
using Table = const int64_t*;

// ---- quantized rows (kv_format codes, as in workers/models/kv_format.py) ----

enum KVCode : int { kAuto = 0, kFp8E4M3 = 1, kFp8E5M2 = 2, kNvfp4 = 3 };
constexpr int kNvfp4Group = 16;
constexpr float kNvfp4TensorScale = 1.0f;  // kv_format.NVFP4_TENSOR_SCALE
// E2M1 codes: magnitudes 0 .. 6, bit 3 the sign (code 8 is -0, as in the reference).
alignas(64) constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// FP8 byte -> float, from torch's own conversions (built once).
struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int i = 0; i < 256; ++i) {
      const auto b = static_cast<uint8_t>(i);
      e4m3[i] = static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
      e5m2[i] = static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
    }
  }
};
const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables;
  return tables;
}

// E8M0 row scale: 2^(b - 127) (b = 0 is the subnormal 2^-127, b = 255 overflows to inf,
// as torch.exp2 gives).
inline float e8m0(uint8_t b) {
  const uint32_t bits = b ? static_cast<uint32_t>(b) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Per-thread scratch: a block's decoded K and V rows (block_size x padded_dim each).
struct Scratch {
  float* k;
  float* v;
  const Fp8Tables* fp8;
  const c10::BFloat16* key_add = nullptr;  // this item's kv head in key_add, or null
  int64_t key_add_stride = 0;              // elements from one position to the next
};

// Adds n add-back rows (`add`, `add_stride` elements apart; null: nothing) to n decoded
// rows (stride P).
inline void add_rows(const c10::BFloat16* add, int64_t add_stride, int64_t n, int64_t P,
                     int64_t D, float* rows) {
  if (add == nullptr) return;
  for (int64_t r = 0; r < n; ++r) {
    const c10::BFloat16* a = add + r * add_stride;
    float* out = rows + r * P;
    for (int64_t d = 0; d < D; ++d) out[d] += static_cast<float>(a[d]);
  }
}

// One row of code F -> out[0 .. P), zero past D, through the tables.
template <int F>
inline void decode_row_table(const uint8_t* row, int64_t D, int64_t P, const Fp8Tables& fp8,
                             float* out) {
  if constexpr (F == kNvfp4) {
    const uint8_t* scales = row + D / 2;
    for (int64_t i = 0; i < D / 2; ++i) {
      const float s = fp8.e4m3[scales[2 * i / kNvfp4Group]] * kNvfp4TensorScale;
      out[2 * i] = kE2M1[row[i] & 15] * s;
      out[2 * i + 1] = kE2M1[row[i] >> 4] * s;
    }
  } else {
    const float* table = F == kFp8E4M3 ? fp8.e4m3 : fp8.e5m2;
    const float s = e8m0(row[D]);
    for (int64_t d = 0; d < D; ++d) out[d] = table[row[d]] * s;
  }
  std::fill(out + D, out + P, 0.0f);
}

#if PDS_AVX512

// n rows of code F (byte stride `stride`) -> fp32 rows of padded_dim, zero past head_dim,
// plus the add-back rows `add` (`add_stride` elements apart; null: none), fused.
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int F>
inline void decode_rows(const uint8_t* src, int64_t n, int64_t stride, const Geometry& g,
                        const Scratch& sc, float* dst, const c10::BFloat16* add,
                        int64_t add_stride) {
  const int64_t D = g.head_dim, P = g.padded_dim, C = P / 16;
  if constexpr (F == kNvfp4) {
    const __m512 table = _mm512_load_ps(kE2M1);
    const __m128i low = _mm_set1_epi8(0x0F);
    const float* e4m3 = sc.fp8->e4m3;
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* row = src + r * stride;
      const uint8_t* scales = row + D / 2;
      float* out = dst + r * P;
      const c10::BFloat16* a = add != nullptr ? add + r * add_stride : nullptr;
      // Two groups of 16 per 16 packed bytes; element 2i is byte i's low nibble.
      int64_t c = 0;
      for (; c + 2 <= C; c += 2) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * c));
        const __m128i lo = _mm_and_si128(b, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        const __m512 v0 =
            _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table);
        const __m512 v1 =
            _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), table);
        const float s0 = e4m3[scales[c]] * kNvfp4TensorScale;
        const float s1 = e4m3[scales[c + 1]] * kNvfp4TensorScale;
        if (a != nullptr) {  // head_dim is a multiple of 16 here: whole chunks
          _mm512_storeu_ps(out + 16 * c, _mm512_fmadd_ps(v0, _mm512_set1_ps(s0),
                                                         load_bf16(a + 16 * c, 0xFFFF)));
          _mm512_storeu_ps(out + 16 * c + 16,
                           _mm512_fmadd_ps(v1, _mm512_set1_ps(s1),
                                           load_bf16(a + 16 * c + 16, 0xFFFF)));
        } else {
          _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(v0, _mm512_set1_ps(s0)));
          _mm512_storeu_ps(out + 16 * c + 16, _mm512_mul_ps(v1, _mm512_set1_ps(s1)));
        }
      }
      if (c < C) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
        const __m128i lo = _mm_and_si128(b, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        const __m512 v0 =
            _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table);
        const float s0 = e4m3[scales[c]] * kNvfp4TensorScale;
        _mm512_storeu_ps(out + 16 * c,
                         a != nullptr ? _mm512_fmadd_ps(v0, _mm512_set1_ps(s0),
                                                        load_bf16(a + 16 * c, 0xFFFF))
                                      : _mm512_mul_ps(v0, _mm512_set1_ps(s0)));
      }
    }
  } else {
    // Through fp16 (exact): e5m2 is fp16's top byte. e4m3 s eeee mmm -> fp16
    // s 0eeee mmm0000000 is the value / 2^8 (exponent bias 15 instead of 7; e = 0 lands
    // on fp16's subnormals, m * 2^-17, as e4m3's m * 2^-9), the 2^8 folded into the row
    // scale: one rounding of the same product as the reference's. e4m3's NaN (0x7F/0xFF,
    // one 64-byte compare per row) and scale bytes > 246 (2^8 x scale would overflow)
    // take the table path.
    const __mmask16 last = D % 16 ? static_cast<__mmask16>((1u << (D % 16)) - 1)
                                  : static_cast<__mmask16>(0xFFFF);
    const __m256i keep = _mm256_set1_epi16(~0x4000);
    const __m512i mag7 = _mm512_set1_epi8(0x7F);
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* row = src + r * stride;
      float* out = dst + r * P;
      const c10::BFloat16* a = add != nullptr ? add + r * add_stride : nullptr;
      const uint8_t sb = row[D];
      float s;
      if constexpr (F == kFp8E4M3) {
        __mmask64 nan = 0;
        for (int64_t o = 0; o < D; o += 64) {
          const __mmask64 m = D - o >= 64 ? ~0ull : (1ull << (D - o)) - 1;
          nan |= _mm512_cmpeq_epi8_mask(
              _mm512_and_si512(_mm512_maskz_loadu_epi8(m, row + o), mag7), mag7);
        }
        if (nan || sb > 246) {
          decode_row_table<F>(row, D, P, *sc.fp8, out);
          add_rows(a, 0, 1, P, D, out);
          continue;
        }
        s = e8m0(static_cast<uint8_t>(sb + 8));
      } else {
        s = e8m0(sb);
      }
      const __m512 sv = _mm512_set1_ps(s);
      for (int64_t c = 0; c < C; ++c) {
        const __mmask16 m = c + 1 < C ? static_cast<__mmask16>(0xFFFF) : last;
        const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, row + 16 * c));
        __m256i h;
        if constexpr (F == kFp8E5M2)
          h = _mm256_slli_epi16(w, 8);
        else
          h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1), keep);
        const __m512 x = _mm512_cvtph_ps(h);
        const __m512 y = a != nullptr
                             ? _mm512_fmadd_ps(x, sv, load_bf16(a + 16 * c, m))
                             : _mm512_mul_ps(x, sv);
        _mm512_storeu_ps(out + 16 * c, y);
      }
    }
  }
}

#else

template <int F>
inline void decode_rows(const uint8_t* src, int64_t n, int64_t stride, const Geometry& g,
                        const Scratch& sc, float* dst, const c10::BFloat16* add,
                        int64_t add_stride) {
  for (int64_t r = 0; r < n; ++r)
    decode_row_table<F>(src + r * stride, g.head_dim, g.padded_dim, *sc.fp8,
                        dst + r * g.padded_dim);
  add_rows(add, add_stride, n, g.padded_dim, g.head_dim, dst);
}

#endif  // PDS_AVX512

// Where a pass reads a block's rows: the cache itself (Plain) or, for a quantized
// format, the fp32 scratch the rows are decoded into (Quant). rows() returns the first
// row and sets row_stride (elements).
template <typename T>
struct Plain {
  using Cache = T;
  using Row = T;
  static constexpr bool kQuantized = false;
  static const T* rows(const T* block, int64_t, int64_t stride, const Geometry&,
                       const Scratch&, float*, int64_t& row_stride,
                       const c10::BFloat16* = nullptr) {
    row_stride = stride;
    return block;
  }
};

template <int F>
struct Quant {
  using Cache = uint8_t;
  using Row = float;
  static constexpr bool kQuantized = true;
  // `add`: add-back rows for these n rows (key_add, see the top), or null.
  static const float* rows(const uint8_t* block, int64_t n, int64_t stride, const Geometry& g,
                           const Scratch& sc, float* buf, int64_t& row_stride,
                           const c10::BFloat16* add = nullptr) {
    decode_rows<F>(block, n, stride, g, sc, buf, add, sc.key_add_stride);
    row_stride = g.padded_dim;
    return buf;
  }
};

#if PDS_AVX512 || PDS_AVX2
// Query heads computed together in the K pass (7 is padded to 8).
constexpr int padded_group(int ng) { return ng == 7 ? 8 : ng; }

// Blocks sit at unrelated addresses, so the hardware prefetchers cannot run ahead of
// the block walk: each pass prefetches the next block's rows itself.
template <int Hint, typename T>
inline void prefetch_rows(const T* base, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t o = 0; o < rows; ++o) {
    const char* r = reinterpret_cast<const char*>(base + o * stride);
    for (int64_t off = 0; off < bytes; off += 64)
      _mm_prefetch(r + off, static_cast<_mm_hint>(Hint));
  }
}

// The row walk's prefetch. Within a run of consecutive blocks the hardware prefetchers
// follow the walk, and prefetching there too only costs (a 2-core Zen 4: ~0-7% slower);
// where the next block sits elsewhere (tables of a long-lived server, whose free blocks
// come back in any order) they cannot, so row o of the block's n rows asks for its
// share of the next block's lines, spread so that the requests in flight stay few.
// 256 SmolLM2 contexts, 2-core Zen 4: 5-7% less time in shuffled blocks, 8% in the
// tables a long-lived server's block manager ends up with (no two blocks of a table
// adjacent). Those still take 1.6-1.9x the time of consecutive blocks, as a bare read
// of them does: the memory system's cost, not the walk's (see the README).
//
// Bytes from a row's start through the last row's row_elems elements.
template <typename T>
inline int64_t span_bytes(int64_t rows, int64_t row_stride, int64_t row_elems) {
  return rows > 0 ? ((rows - 1) * row_stride + row_elems) * static_cast<int64_t>(sizeof(T)) : 0;
}
template <typename T>
inline void prefetch_share(const T* next, int64_t bytes, int64_t o, int64_t n) {
  const char* p = reinterpret_cast<const char*>(next);
  const int64_t lines = (bytes + 63) / 64;
  for (int64_t l = o * lines / n, e = (o + 1) * lines / n; l < e; ++l)
    _mm_prefetch(p + l * 64, _MM_HINT_T0);
}
// A pass's next block where the table jumps to it (else nothing: null, 0 bytes).
template <typename T>
struct NextBlock {
  const T* p = nullptr;
  int64_t bytes = 0;
  // Row o of the current block's n rows asks for its share of the next block's lines.
  void prefetch(int64_t o, int64_t n) const { prefetch_share(p, bytes, o, n); }
};
// Block b + 1 of ``cache`` (its ``rows`` rows of row_elems elements, row_stride apart).
template <typename T>
inline NextBlock<T> next_block(const T* cache, Table table, int64_t b, int64_t nblocks,
                               int64_t rows, int64_t block_stride, int64_t row_stride,
                               int64_t row_elems) {
  if (b + 1 >= nblocks || table[b + 1] == table[b] + 1) return {};
  return {cache + table[b + 1] * block_stride, span_bytes<T>(rows, row_stride, row_elems)};
}

#endif

#if PDS_AVX512

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// Horizontal sums of four vectors at once: [sum a, sum b, sum c, sum d].
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Tokens per K tile: NGP * TT accumulators, a multiple of 4 for reduce4, at most 20 of
// 32 registers.
constexpr int tile_tokens(int ngp) { return ngp == 1 || ngp == 2 || ngp == 3 || ngp == 5 ? 4 : 2; }
// 16-float chunks per V pass: NG * CH accumulators + NG weights + 1 row in registers.
constexpr int v_chunks(int ng) { return std::min(16, 28 / ng - 1); }

// K tile: scores of TT consecutive rows against NGP query heads, written token-major
// to out[0 .. TT * NGP).
template <typename T, int NGP, int TT>
inline void k_tile(const float* qf, int64_t P, int64_t C, const __mmask16* masks,
                   const T* const* rows, float* out) {
  __m512 acc[TT * NGP];
#pragma GCC unroll 32
  for (int i = 0; i < TT * NGP; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512 kv[TT];
#pragma GCC unroll 8
    for (int i = 0; i < TT; ++i) kv[i] = load16(rows[i] + 16 * c, masks[c]);
#pragma GCC unroll 8
    for (int j = 0; j < NGP; ++j) {
      const __m512 qv = _mm512_loadu_ps(qf + j * P + 16 * c);
#pragma GCC unroll 8
      for (int i = 0; i < TT; ++i) acc[i * NGP + j] = _mm512_fmadd_ps(qv, kv[i], acc[i * NGP + j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < TT * NGP; i += 4)
    _mm_storeu_ps(out + i, reduce4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
}

// NG query heads (qf: rows of padded_dim fp32, pre-scaled, zero past head_dim and for
// the padding head) against one context; acc_out[j * P + d] = attention output.
// scores needs (len + 4) * 8 floats. Src: Plain<T> (cache rows of T) or Quant<F>.
template <typename Src, int NG>
void attend_avx512(const float* qf, const typename Src::Cache* kc,
                   const typename Src::Cache* vc, Table table, int64_t len, const Geometry& g,
                   const __mmask16* masks, const Scratch& sc, float* scores, float* acc_out) {
  using Row = typename Src::Row;
  constexpr int NGP = padded_group(NG), TT = tile_tokens(NGP);
  const int64_t B = g.block_size, P = g.padded_dim, C = P / 16;
  const int64_t row_bytes = g.row_bytes;
  const int64_t nblocks = (len + B - 1) / B;
  // K pass. A partial tile repeats the block's last row; its extra scores land on the
  // next tokens' slots (rewritten later) or past len.
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t t0 = b * B, n = std::min(B, len - t0);
    if (b + 1 < nblocks)
      prefetch_rows<_MM_HINT_T0>(kc + table[b + 1] * g.k_block, std::min(B, len - t0 - B),
                                 g.k_token, row_bytes);
    // This block's V rows into L2 for the V pass (~5-10% when the cache is in DRAM).
    prefetch_rows<_MM_HINT_T1>(vc + table[b] * g.v_block, n, g.v_token, row_bytes);
    int64_t rs;
    const Row* kb = Src::rows(kc + table[b] * g.k_block, n, g.k_token, g, sc, sc.k, rs,
                              sc.key_add ? sc.key_add + t0 * sc.key_add_stride : nullptr);
    for (int64_t o = 0; o < n; o += TT) {
      const Row* rows[TT];
#pragma GCC unroll 8
      for (int i = 0; i < TT; ++i) rows[i] = kb + std::min<int64_t>(o + i, n - 1) * rs;
      k_tile<Row, NGP, TT>(qf, P, C, masks, rows, scores + (t0 + o) * NGP);
    }
  }
  float inv[kMaxGroup];
  softmax_token_major<true>(scores, len, NGP, NG, inv);
  if constexpr (Src::kQuantized) {
    // V pass over blocks, each block's V rows decoded once; CH chunks of 16 at a time
    // with the accumulators parked in acc_out between blocks. Same FMAs in the same
    // order as the register-resident pass below, so the same result.
    constexpr int CH = v_chunks(NG);
    std::fill(acc_out, acc_out + NG * P, 0.0f);
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t t0 = b * B, n = std::min(B, len - t0);
      if (b + 1 < nblocks)
        prefetch_rows<_MM_HINT_T0>(vc + table[b + 1] * g.v_block, std::min(B, len - t0 - B),
                                   g.v_token, row_bytes);
      int64_t rs;
      const float* vb = Src::rows(vc + table[b] * g.v_block, n, g.v_token, g, sc, sc.v, rs);
      for (int64_t c0 = 0; c0 < C; c0 += CH) {
        const int64_t nc = std::min<int64_t>(CH, C - c0);
        __m512 acc[NG][CH];
#pragma GCC unroll 8
        for (int j = 0; j < NG; ++j)
#pragma GCC unroll 16
          for (int c = 0; c < CH; ++c)
            acc[j][c] = c < nc ? _mm512_loadu_ps(acc_out + j * P + 16 * (c0 + c))
                               : _mm512_setzero_ps();
        const float* pt = scores + t0 * NGP;
        for (int64_t o = 0; o < n; ++o, pt += NGP) {
          const float* vr = vb + o * rs + 16 * c0;  // zero past head_dim
          __m512 p[NG];
#pragma GCC unroll 8
          for (int j = 0; j < NG; ++j) p[j] = _mm512_set1_ps(pt[j]);
#pragma GCC unroll 16
          for (int c = 0; c < CH; ++c) {
            if (c < nc) {
              const __m512 vv = _mm512_loadu_ps(vr + 16 * c);
#pragma GCC unroll 8
              for (int j = 0; j < NG; ++j) acc[j][c] = _mm512_fmadd_ps(p[j], vv, acc[j][c]);
            }
          }
        }
#pragma GCC unroll 8
        for (int j = 0; j < NG; ++j)
#pragma GCC unroll 16
          for (int c = 0; c < CH; ++c)
            if (c < nc) _mm512_storeu_ps(acc_out + j * P + 16 * (c0 + c), acc[j][c]);
      }
    }
    for (int j = 0; j < NG; ++j) {
      const __m512 s = _mm512_set1_ps(inv[j]);
      for (int64_t c = 0; c < C; ++c)
        _mm512_storeu_ps(acc_out + j * P + 16 * c,
                         _mm512_mul_ps(_mm512_loadu_ps(acc_out + j * P + 16 * c), s));
    }
  } else {
    // V pass, CH chunks of 16 at a time.
    constexpr int CH = v_chunks(NG);
    for (int64_t c0 = 0; c0 < C; c0 += CH) {
      const int64_t nc = std::min<int64_t>(CH, C - c0);
      __m512 acc[NG][CH];
#pragma GCC unroll 8
      for (int j = 0; j < NG; ++j)
#pragma GCC unroll 16
        for (int c = 0; c < CH; ++c) acc[j][c] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t t0 = b * B, n = std::min(B, len - t0);
        const Row* vb = vc + table[b] * g.v_block + 16 * c0;
        if (c0 == 0 && b + 1 < nblocks)
          prefetch_rows<_MM_HINT_T0>(vc + table[b + 1] * g.v_block, std::min(B, len - t0 - B),
                                     g.v_token, row_bytes);
        const float* pt = scores + t0 * NGP;
        for (int64_t o = 0; o < n; ++o, pt += NGP) {
          const Row* vr = vb + o * g.v_token;
          __m512 p[NG];
#pragma GCC unroll 8
          for (int j = 0; j < NG; ++j) p[j] = _mm512_set1_ps(pt[j]);
#pragma GCC unroll 16
          for (int c = 0; c < CH; ++c) {
            if (c < nc) {
              const __m512 vv = load16(vr + 16 * c, masks[c0 + c]);
#pragma GCC unroll 8
              for (int j = 0; j < NG; ++j) acc[j][c] = _mm512_fmadd_ps(p[j], vv, acc[j][c]);
            }
          }
        }
      }
#pragma GCC unroll 8
      for (int j = 0; j < NG; ++j) {
        const __m512 s = _mm512_set1_ps(inv[j]);
#pragma GCC unroll 16
        for (int c = 0; c < CH; ++c)
          if (c < nc)
            _mm512_storeu_ps(acc_out + j * P + 16 * (c0 + c), _mm512_mul_ps(acc[j][c], s));
      }
    }
  }
}

// Row order: one item is a whole sequence, every kv head at once, and both passes read
// the cache rows in memory order (a token's KH heads are one contiguous row span). The
// per-head walk above reads a head's slice of each row, head_dim of every kv_heads *
// head_dim elements: the hardware prefetchers do not stream that pattern, and from DRAM
// a 2-core Zen 4 read it at 9.5 GB/s against 21.6 GB/s in memory order (one thread, a
// bare read of 256 SmolLM2 contexts). Per score and per output the FMAs are
// attend_avx512's, in the same order (reduce4's tree for each lane does not depend on
// the vectors beside it), so both walks give the same bits.
// Compiled for a few shapes (rows_kernel), with every accumulator in a register: KH *
// NGP in the K pass, KH * NG * C in the V pass (GCC spills what does not fit in 32);
// attend_rows_any takes any other shape.

template <typename T, int NG, int KH, int C>
void attend_rows_avx512(const float* qf, const T* kc, const T* vc, Table table, int64_t len,
                        const Geometry& g, int64_t, int64_t k_head, int64_t v_head,
                        const uint16_t* masks, float* scores, int64_t s_stride,
                        float* acc_out) {
  constexpr int NGP = padded_group(NG), NA = KH * NGP, NR = (NA + 3) / 4 * 4;
  static_assert(NR <= 24 && KH * NG * C <= 48, "accumulators for this shape do not fit");
  const int64_t B = g.block_size, P = g.padded_dim;
  const int64_t nblocks = (len + B - 1) / B;
  alignas(64) float tmp[NR];
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t t0 = b * B, n = std::min(B, len - t0);
    const T* kb = kc + table[b] * g.k_block;
    const NextBlock<T> next = next_block(kc, table, b, nblocks, std::min(B, len - t0 - B),
                                         g.k_block, g.k_token, KH * k_head);
    for (int64_t o = 0; o < n; ++o) {
      next.prefetch(o, n);
      const T* r = kb + o * g.k_token;
      __m512 acc[NR];
#pragma GCC unroll 32
      for (int i = 0; i < NR; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int h = 0; h < KH; ++h)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m512 kv = load16(r + h * k_head + 16 * c, masks[c]);
#pragma GCC unroll 8
          for (int j = 0; j < NGP; ++j)
            acc[h * NGP + j] =
                _mm512_fmadd_ps(_mm512_loadu_ps(qf + (h * NGP + j) * P + 16 * c), kv,
                                acc[h * NGP + j]);
        }
#pragma GCC unroll 8
      for (int i = 0; i < NR; i += 4)
        _mm_store_ps(tmp + i, reduce4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
#pragma GCC unroll 8
      for (int h = 0; h < KH; ++h)
#pragma GCC unroll 8
        for (int j = 0; j < NGP; ++j)
          scores[h * s_stride + (t0 + o) * NGP + j] = tmp[h * NGP + j];
    }
  }
  float inv[KH * kMaxGroup];
  for (int h = 0; h < KH; ++h)
    softmax_token_major<true>(scores + h * s_stride, len, NGP, NG, inv + h * NG);
  __m512 acc[KH * NG * C];
#pragma GCC unroll 64
  for (int i = 0; i < KH * NG * C; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t t0 = b * B, n = std::min(B, len - t0);
    const T* vb = vc + table[b] * g.v_block;
    const NextBlock<T> next = next_block(vc, table, b, nblocks, std::min(B, len - t0 - B),
                                         g.v_block, g.v_token, KH * v_head);
    for (int64_t o = 0; o < n; ++o) {
      next.prefetch(o, n);
      const T* r = vb + o * g.v_token;
#pragma GCC unroll 8
      for (int h = 0; h < KH; ++h) {
        const float* pt = scores + h * s_stride + (t0 + o) * NGP;
        __m512 p[NG];
#pragma GCC unroll 8
        for (int j = 0; j < NG; ++j) p[j] = _mm512_set1_ps(pt[j]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m512 vv = load16(r + h * v_head + 16 * c, masks[c]);
#pragma GCC unroll 8
          for (int j = 0; j < NG; ++j)
            acc[(h * NG + j) * C + c] = _mm512_fmadd_ps(p[j], vv, acc[(h * NG + j) * C + c]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < KH; ++h)
#pragma GCC unroll 8
    for (int j = 0; j < NG; ++j) {
      const __m512 s = _mm512_set1_ps(inv[h * NG + j]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(acc_out + (h * NG + j) * P + 16 * c,
                         _mm512_mul_ps(acc[(h * NG + j) * C + c], s));
    }
}

// The row walk's vector operations on 16 floats (attend_rows_any).
struct Wide {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static V row(const T* p, const uint16_t* masks, int64_t c) { return load16(p, masks[c]); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __m128 sum4(V a, V b, V c, V d) { return reduce4(a, b, c, d); }
  static int64_t chunks(const Geometry& g) { return g.padded_dim / 16; }
};

#endif  // PDS_AVX512

#if PDS_AVX2

// ---- AVX2 + FMA: the AVX-512 path's tiles in 8-float registers (16 of them) ----
// head_dim a multiple of 8 (checked by the caller), so rows need no masks.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// [sum a, sum b, sum c, sum d].
inline __m128 reduce4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

inline float reduce1_avx2(__m256 a) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

// K tile shapes: TT tokens x NGP query heads of accumulators. Up to 4 heads keep the
// heads' q chunks in registers and stream the rows (TT * NGP + NGP + 1 registers); more
// heads keep the TT rows' chunks and stream q (TT * NGP + TT + 1).
constexpr bool q_in_regs8(int ngp) { return ngp <= 4; }
constexpr int tile_tokens8(int ngp) {
  return ngp == 1 ? 8 : ngp == 2 ? 6 : ngp == 3 ? 4 : ngp == 8 ? 1 : 2;
}
// 8-float chunks per V pass: NG * CH accumulators + NG weights + 1 row.
constexpr int v_chunks8(int ng) { return std::max(1, std::min(16, 15 / ng - 1)); }

template <typename T, int NGP, int TT>
inline void k_tile_avx2(const float* qf, int64_t P, int64_t C, const T* const* rows,
                        float* out) {
  __m256 acc[TT * NGP];
#pragma GCC unroll 32
  for (int i = 0; i < TT * NGP; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    if constexpr (q_in_regs8(NGP)) {
      __m256 qv[NGP];
#pragma GCC unroll 8
      for (int j = 0; j < NGP; ++j) qv[j] = _mm256_loadu_ps(qf + j * P + 8 * c);
#pragma GCC unroll 8
      for (int i = 0; i < TT; ++i) {
        const __m256 kv = load8(rows[i] + 8 * c);
#pragma GCC unroll 8
        for (int j = 0; j < NGP; ++j) acc[i * NGP + j] = _mm256_fmadd_ps(qv[j], kv, acc[i * NGP + j]);
      }
    } else {
      __m256 kv[TT];
#pragma GCC unroll 8
      for (int i = 0; i < TT; ++i) kv[i] = load8(rows[i] + 8 * c);
#pragma GCC unroll 8
      for (int j = 0; j < NGP; ++j) {
        const __m256 qv = _mm256_loadu_ps(qf + j * P + 8 * c);
#pragma GCC unroll 8
        for (int i = 0; i < TT; ++i) acc[i * NGP + j] = _mm256_fmadd_ps(qv, kv[i], acc[i * NGP + j]);
      }
    }
  }
  constexpr int full = TT * NGP / 4 * 4;
#pragma GCC unroll 8
  for (int i = 0; i < full; i += 4)
    _mm_storeu_ps(out + i, reduce4_avx2(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
#pragma GCC unroll 4
  for (int i = full; i < TT * NGP; ++i) out[i] = reduce1_avx2(acc[i]);
}

// attend_avx512's passes (same walk, same FMA order per output chunk: a quantized cache
// gives the float32 kernel's result on its dequantization); the K pass spreads its
// prefetches over the tiles.
template <typename Src, int NG>
void attend_avx2(const float* qf, const typename Src::Cache* kc, const typename Src::Cache* vc,
                 Table table, int64_t len, const Geometry& g, const Scratch& sc,
                 float* scores, float* acc_out) {
  using Row = typename Src::Row;
  constexpr int NGP = padded_group(NG), TT = tile_tokens8(NGP), CH = v_chunks8(NG);
  const int64_t B = g.block_size, P = g.padded_dim, C = g.head_dim / 8;
  const int64_t row_bytes = g.row_bytes;
  const int64_t nblocks = (len + B - 1) / B;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t t0 = b * B, n = std::min(B, len - t0);
    const int64_t n_next = b + 1 < nblocks ? std::min(B, len - t0 - B) : 0;
    const auto* k_next = kc + (b + 1 < nblocks ? table[b + 1] : 0) * g.k_block;
    const auto* v_here = vc + table[b] * g.v_block;
    int64_t rs;
    const Row* kb = Src::rows(kc + table[b] * g.k_block, n, g.k_token, g, sc, sc.k, rs,
                              sc.key_add ? sc.key_add + t0 * sc.key_add_stride : nullptr);
    for (int64_t o = 0; o < n; o += TT) {
      // This tile's share of the prefetches (the same rows of the next block's K, these
      // rows' V for after the softmax): spread over the tiles, not issued as one burst of
      // a block's lines that fills the load queue (measured 5-9% faster on an AVX2 EPYC).
#pragma GCC unroll 8
      for (int i = 0; i < TT; ++i) {
        if (o + i < n_next)
          prefetch_rows<_MM_HINT_T0>(k_next + (o + i) * g.k_token, 1, 0, row_bytes);
        if (o + i < n) prefetch_rows<_MM_HINT_T1>(v_here + (o + i) * g.v_token, 1, 0, row_bytes);
      }
      const Row* rows[TT];
#pragma GCC unroll 8
      for (int i = 0; i < TT; ++i) rows[i] = kb + std::min<int64_t>(o + i, n - 1) * rs;
      k_tile_avx2<Row, NGP, TT>(qf, P, C, rows, scores + (t0 + o) * NGP);
    }
  }
  float inv[kMaxGroup];
  softmax_token_major<true>(scores, len, NGP, NG, inv);
  // One chunk group of the V pass over n rows (stride rs) into acc (registers).
  auto v_rows = [&](const Row* vb, int64_t rs, int64_t n, const float* pt, int64_t c0,
                    int64_t nc, __m256 (&acc)[NG][CH]) {
    for (int64_t o = 0; o < n; ++o, pt += NGP) {
      const Row* vr = vb + o * rs + 8 * c0;
      __m256 p[NG];
#pragma GCC unroll 8
      for (int j = 0; j < NG; ++j) p[j] = _mm256_broadcast_ss(pt + j);
#pragma GCC unroll 16
      for (int c = 0; c < CH; ++c) {
        if (c < nc) {
          const __m256 vv = load8(vr + 8 * c);
#pragma GCC unroll 8
          for (int j = 0; j < NG; ++j) acc[j][c] = _mm256_fmadd_ps(p[j], vv, acc[j][c]);
        }
      }
    }
  };
  if constexpr (Src::kQuantized) {
    // Blocks outer (each block's V rows decoded once), accumulators parked in acc_out.
    std::fill(acc_out, acc_out + NG * P, 0.0f);
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t t0 = b * B, n = std::min(B, len - t0);
      if (b + 1 < nblocks)
        prefetch_rows<_MM_HINT_T0>(vc + table[b + 1] * g.v_block, std::min(B, len - t0 - B),
                                   g.v_token, row_bytes);
      int64_t rs;
      const Row* vb = Src::rows(vc + table[b] * g.v_block, n, g.v_token, g, sc, sc.v, rs);
      for (int64_t c0 = 0; c0 < C; c0 += CH) {
        const int64_t nc = std::min<int64_t>(CH, C - c0);
        __m256 acc[NG][CH];
#pragma GCC unroll 8
        for (int j = 0; j < NG; ++j)
#pragma GCC unroll 16
          for (int c = 0; c < CH; ++c)
            acc[j][c] = c < nc ? _mm256_loadu_ps(acc_out + j * P + 8 * (c0 + c))
                               : _mm256_setzero_ps();
        v_rows(vb, rs, n, scores + t0 * NGP, c0, nc, acc);
#pragma GCC unroll 8
        for (int j = 0; j < NG; ++j)
#pragma GCC unroll 16
          for (int c = 0; c < CH; ++c)
            if (c < nc) _mm256_storeu_ps(acc_out + j * P + 8 * (c0 + c), acc[j][c]);
      }
    }
    for (int j = 0; j < NG; ++j) {
      const __m256 s = _mm256_set1_ps(inv[j]);
      for (int64_t c = 0; c < C; ++c)
        _mm256_storeu_ps(acc_out + j * P + 8 * c,
                         _mm256_mul_ps(_mm256_loadu_ps(acc_out + j * P + 8 * c), s));
    }
  } else {
    // Chunk groups outer, accumulators in registers over the whole context.
    for (int64_t c0 = 0; c0 < C; c0 += CH) {
      const int64_t nc = std::min<int64_t>(CH, C - c0);
      __m256 acc[NG][CH];
#pragma GCC unroll 8
      for (int j = 0; j < NG; ++j)
#pragma GCC unroll 16
        for (int c = 0; c < CH; ++c) acc[j][c] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t t0 = b * B, n = std::min(B, len - t0);
        if (c0 == 0 && b + 1 < nblocks)
          prefetch_rows<_MM_HINT_T0>(vc + table[b + 1] * g.v_block, std::min(B, len - t0 - B),
                                     g.v_token, row_bytes);
        v_rows(vc + table[b] * g.v_block, g.v_token, n, scores + t0 * NGP, c0, nc, acc);
      }
#pragma GCC unroll 8
      for (int j = 0; j < NG; ++j) {
        const __m256 s = _mm256_set1_ps(inv[j]);
#pragma GCC unroll 16
        for (int c = 0; c < CH; ++c)
          if (c < nc)
            _mm256_storeu_ps(acc_out + j * P + 8 * (c0 + c), _mm256_mul_ps(acc[j][c], s));
      }
    }
  }
}

// The row walk's vector operations on 8 floats (head_dim a multiple of 8: no masks).
struct Narrow {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static V row(const T* p, const uint16_t*, int64_t) { return load8(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m128 sum4(V a, V b, V c, V d) { return reduce4_avx2(a, b, c, d); }
  static int64_t chunks(const Geometry& g) { return g.head_dim / 8; }
};

#endif  // PDS_AVX2

#if PDS_AVX512 || PDS_AVX2
// The row walk for any shape, on Vec's registers (Wide: 16 floats, Narrow: 8): per kv
// head NGP K accumulators (rounded up to 4 for sum4), the V accumulators in acc_out
// (KH * NG * head_dim of them), the same FMAs per output over the tokens in order.
// Every score goes through sum4, as the per-head walks' K tiles do (Narrow: for every
// group size but 5, which rows_kernel leaves to that walk), so the walks give the same
// bits.
template <typename Vec, typename T, int NG>
void attend_rows_any(const float* qf, const T* kc, const T* vc, Table table, int64_t len,
                     const Geometry& g, int64_t KH, int64_t k_head, int64_t v_head,
                     const uint16_t* masks, float* scores, int64_t s_stride,
                     float* acc_out) {
  using V = typename Vec::V;
  constexpr int W = Vec::kLanes, NGP = padded_group(NG), NR = (NGP + 3) / 4 * 4;
  const int64_t B = g.block_size, P = g.padded_dim, C = Vec::chunks(g);
  const int64_t nblocks = (len + B - 1) / B;
  alignas(16) float tmp[NR];
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t t0 = b * B, n = std::min(B, len - t0);
    const T* kb = kc + table[b] * g.k_block;
    const NextBlock<T> next = next_block(kc, table, b, nblocks, std::min(B, len - t0 - B),
                                         g.k_block, g.k_token, KH * k_head);
    for (int64_t o = 0; o < n; ++o) {
      next.prefetch(o, n);
      const T* r = kb + o * g.k_token;
      for (int64_t h = 0; h < KH; ++h) {
        V acc[NR];
#pragma GCC unroll 8
        for (int i = 0; i < NR; ++i) acc[i] = Vec::zero();
        const float* qh = qf + h * NGP * P;
        for (int64_t c = 0; c < C; ++c) {
          const V kv = Vec::row(r + h * k_head + W * c, masks, c);
#pragma GCC unroll 8
          for (int j = 0; j < NGP; ++j) acc[j] = Vec::fma(Vec::load(qh + j * P + W * c), kv, acc[j]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < NR; i += 4)
          _mm_store_ps(tmp + i, Vec::sum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
        float* out = scores + h * s_stride + (t0 + o) * NGP;
#pragma GCC unroll 8
        for (int j = 0; j < NGP; ++j) out[j] = tmp[j];
      }
    }
  }
  float inv[8 * kMaxGroup];
  for (int64_t h = 0; h < KH; ++h)
    softmax_token_major<true>(scores + h * s_stride, len, NGP, NG, inv + h * NG);
  std::fill(acc_out, acc_out + KH * NG * P, 0.0f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t t0 = b * B, n = std::min(B, len - t0);
    const T* vb = vc + table[b] * g.v_block;
    const NextBlock<T> next = next_block(vc, table, b, nblocks, std::min(B, len - t0 - B),
                                         g.v_block, g.v_token, KH * v_head);
    for (int64_t o = 0; o < n; ++o) {
      next.prefetch(o, n);
      const T* r = vb + o * g.v_token;
      for (int64_t h = 0; h < KH; ++h) {
        const float* pt = scores + h * s_stride + (t0 + o) * NGP;
        float* ah = acc_out + h * NG * P;
        V p[NG];
#pragma GCC unroll 8
        for (int j = 0; j < NG; ++j) p[j] = Vec::set1(pt[j]);
        for (int64_t c = 0; c < C; ++c) {
          const V vv = Vec::row(r + h * v_head + W * c, masks, c);
#pragma GCC unroll 8
          for (int j = 0; j < NG; ++j) {
            float* a = ah + j * P + W * c;
            Vec::store(a, Vec::fma(p[j], vv, Vec::load(a)));
          }
        }
      }
    }
  }
  for (int64_t i = 0; i < KH * NG; ++i) {
    const V s = Vec::set1(inv[i]);
    for (int64_t c = 0; c < C; ++c)
      Vec::store(acc_out + i * P + W * c, Vec::mul(Vec::load(acc_out + i * P + W * c), s));
  }
}
#endif

// Portable version (any ISA; the compiler vectorises the inner loops).
template <typename Src>
void attend_generic(const float* qf, int ng, const typename Src::Cache* kc,
                    const typename Src::Cache* vc, Table table, int64_t len, const Geometry& g,
                    const Scratch& sc, float* scores, float* acc_out) {
  using Row = typename Src::Row;
  const int64_t B = g.block_size, D = g.head_dim, P = g.padded_dim;
  for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += B) {
    const int64_t n = std::min(B, len - t0);
    int64_t rs;
    const Row* kb = Src::rows(kc + table[b] * g.k_block, n, g.k_token, g, sc, sc.k, rs,
                              sc.key_add ? sc.key_add + t0 * sc.key_add_stride : nullptr);
    for (int64_t o = 0; o < n; ++o) {
      const Row* kr = kb + o * rs;
      for (int j = 0; j < ng; ++j) {
        const float* qj = qf + j * P;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qj[d] * to_f32(kr[d]);
        scores[(t0 + o) * ng + j] = s;
      }
    }
  }
  float inv[kMaxGroup];
  softmax_token_major(scores, len, ng, ng, inv);
  std::fill(acc_out, acc_out + ng * P, 0.0f);
  for (int64_t b = 0, t0 = 0; t0 < len; ++b, t0 += B) {
    const int64_t n = std::min(B, len - t0);
    int64_t rs;
    const Row* vb = Src::rows(vc + table[b] * g.v_block, n, g.v_token, g, sc, sc.v, rs);
    for (int64_t o = 0; o < n; ++o) {
      const Row* vr = vb + o * rs;
      for (int j = 0; j < ng; ++j) {
        const float p = scores[(t0 + o) * ng + j];
        float* a = acc_out + j * P;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * to_f32(vr[d]);
      }
    }
  }
  for (int j = 0; j < ng; ++j)
    for (int64_t d = 0; d < D; ++d) acc_out[j * P + d] *= inv[j];
}

// Code paths (the op's ``isa``; -1: the best this build has for the head_dim).
enum Isa : int64_t { kIsaAuto = -1, kIsaPortable = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };

int64_t resolve_isa(int64_t isa, int64_t head_dim) {
  TORCH_CHECK(isa >= kIsaAuto && isa <= kIsaAvx512, "unknown isa ", isa,
              " (-1 best, 0 portable, 1 AVX2, 2 AVX-512)");
  TORCH_CHECK(isa != kIsaAvx512 || PDS_AVX512, "isa 2 (AVX-512) is not compiled in this build");
  TORCH_CHECK(isa != kIsaAvx2 || PDS_AVX2, "isa 1 (AVX2) is not compiled in this build");
  if (isa == kIsaAuto) isa = PDS_AVX512 ? kIsaAvx512 : (PDS_AVX2 ? kIsaAvx2 : kIsaPortable);
  // The AVX2 tiles take whole 8-float chunks; other head_dims run the portable loops.
  return isa == kIsaAvx2 && head_dim % 8 ? kIsaPortable : isa;
}

int64_t paged_attention_best_isa() { return resolve_isa(kIsaAuto, 64); }

// Allows (on) or forbids the row-order walk; returns whether it was allowed.
bool paged_attention_row_walk(bool on) { return g_row_walk.exchange(on); }

#if PDS_AVX512 || PDS_AVX2
template <typename T>
using RowsFn = void (*)(const float*, const T*, const T*, Table, int64_t, const Geometry&,
                        int64_t, int64_t, int64_t, const uint16_t*, float*, int64_t, float*);

template <typename Vec, typename T>
RowsFn<T> any_kernel(int64_t ng) {
  switch (ng) {
    case 1: return &attend_rows_any<Vec, T, 1>;
    case 2: return &attend_rows_any<Vec, T, 2>;
    case 3: return &attend_rows_any<Vec, T, 3>;
    case 4: return &attend_rows_any<Vec, T, 4>;
    case 5: return &attend_rows_any<Vec, T, 5>;
    case 6: return &attend_rows_any<Vec, T, 6>;
    case 7: return &attend_rows_any<Vec, T, 7>;
    case 8: return &attend_rows_any<Vec, T, 8>;
    default: return nullptr;
  }
}

// The row-order kernel on path `isa` for kh kv heads of ng query heads each, c 16-float
// chunks per head: AVX-512's with every accumulator in a register where compiled for the
// shape, else attend_rows_any; null where the per-head walk must run.
template <typename T>
RowsFn<T> rows_kernel(int64_t isa, int64_t kh, int64_t ng, int64_t c) {
#if PDS_AVX512
  if (isa == kIsaAvx512) {
#define PDS_ROWS(KH, NG, C)                                                                  \
  if (kh == KH && ng == NG && c == C) return &attend_rows_avx512<T, NG, KH, C>;
    PDS_ROWS(3, 3, 4)                   // SmolLM2-135M: 3 kv heads of 3, head_dim 64
    PDS_ROWS(2, 3, 1) PDS_ROWS(2, 3, 2)  // the tests' tiny models
#undef PDS_ROWS
    return any_kernel<Wide, T>(ng);
  }
#endif
#if PDS_AVX2
  if (isa == kIsaAvx2 && ng != 5) return any_kernel<Narrow, T>(ng);
#endif
  return nullptr;
}
#endif

#if PDS_AVX512 || PDS_AVX2
// Unquantized caches whose kv heads sit side by side in a row: one item per sequence in
// row order (attend_rows_*). Only with at least 2 sequences per thread, or when the step
// is small enough to run on one thread anyway (one_thread): fewer sequences split across
// the threads by kv head in the per-head walk. Returns whether it ran.
template <typename T>
bool rows_walk(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const std::vector<int64_t>& tables, int64_t table_stride,
               const std::vector<int64_t>& lens, int64_t max_len, float fscale, int64_t isa,
               bool one_thread, const Geometry& geo, at::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(2);
  const int64_t G = H / KV, P = geo.padded_dim;
  const int64_t k_head = k_cache.stride(2), v_head = v_cache.stride(2);
  if (k_head != D || v_head != D || G > kMaxGroup || KV > 8 ||
      (!one_thread && S < 2 * at::get_num_threads()))
    return false;
  if (!g_row_walk.load(std::memory_order_relaxed)) return false;
  const RowsFn<T> fn = rows_kernel<T>(isa, KV, G, P / 16);
  if (fn == nullptr) return false;
  const int64_t NGP = G == 7 ? 8 : G, s_stride = NGP * (max_len + 8);
  const T* qp = q.data_ptr<T>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, S, one_thread ? S : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(KV * NGP * P, 0.0f), acc(KV * G * P, 0.0f);
    std::vector<float> scores(KV * s_stride);
    std::vector<uint16_t> masks(P / 16, 0xFFFF);  // Wide's row loads (D % 16: the tail's)
    if (D % 16) masks.back() = static_cast<uint16_t>((1u << (D % 16)) - 1);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = lens[s];
      T* orow = op + s * H * D;
      if (len == 0) {
        std::fill(orow, orow + H * D, static_cast<T>(0.0f));
        continue;
      }
      for (int64_t h = 0; h < KV; ++h)
        for (int64_t j = 0; j < G; ++j) {
          const T* qr = qp + s * q_seq + (h * G + j) * q_head;
          float* dst = qf.data() + (h * NGP + j) * P;
          for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(qr[d]) * fscale;
        }
      fn(qf.data(), kp, vp, tables.data() + s * table_stride, len, geo, KV, k_head, v_head,
         masks.data(), scores.data(), s_stride, acc.data());
      for (int64_t i = 0; i < H; ++i) store_row(orow + i * D, acc.data() + i * P, D);
    }
  });
  return true;
}
#endif

// T: q's (and the output's) dtype; F: the cache's kv_format code (0: rows of T).
template <typename T, int F>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const std::vector<int64_t>& tables, int64_t table_stride,
         const std::vector<int64_t>& lens, double scale, const c10::BFloat16* key_add,
         int64_t isa, at::Tensor& out) {
  using Src = std::conditional_t<F == kAuto, Plain<T>, Quant<F>>;
  using CT = typename Src::Cache;
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k_cache.size(2);
  const int64_t G = H / KV;
  const int64_t subgroups = (G + kMaxGroup - 1) / kMaxGroup;
  Geometry geo{k_cache.size(1), D, (D + 15) / 16 * 16,
               k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               k_cache.size(3) * static_cast<int64_t>(sizeof(CT))};
  const Fp8Tables* fp8 = F == kAuto ? nullptr : &fp8_tables();
  const T* qp = q.data_ptr<T>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const CT* kp = k_cache.data_ptr<CT>();
  const CT* vp = v_cache.data_ptr<CT>();
  const int64_t k_head = k_cache.stride(2), v_head = v_cache.stride(2);
  T* op = out.data_ptr<T>();  // contiguous [>= S, H, D]: rows 0 .. S-1 written
  const float fscale = static_cast<float>(scale);

  int64_t max_len = 0, total_len = 0;
  for (int64_t l : lens) {
    max_len = std::max(max_len, l);
    total_len += l;
  }
  const int64_t items = S * KV * subgroups;
  // Small steps are not worth waking the pool for: on a 2-core AVX2 EPYC one lone
  // 142-token context (work 109k) took 19 us on one thread and 33 us on two; the second
  // thread started to pay at about twice that work.
  const int64_t work = total_len * KV * (G + 1) * D;
  const bool one_thread = work < (1 << 18);
  const int64_t grain = one_thread ? std::max<int64_t>(items, 1) : 1;
#if PDS_AVX512 || PDS_AVX2
  if constexpr (F == kAuto) {
    if (rows_walk<T>(q, k_cache, v_cache, tables, table_stride, lens, max_len, fscale, isa,
                     one_thread, geo, out))
      return;
  }
#endif

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    const int64_t P = geo.padded_dim;
    std::vector<float> qf(kMaxGroup * P, 0.0f), acc(kMaxGroup * P, 0.0f);
    std::vector<float> scores(kMaxGroup * (max_len + 8));
    std::vector<float> kbuf(F == kAuto ? 0 : geo.block_size * P);
    std::vector<float> vbuf(F == kAuto ? 0 : geo.block_size * P);
    Scratch sc{kbuf.data(), vbuf.data(), fp8};
    if (key_add != nullptr) sc.key_add_stride = KV * D;
#if PDS_AVX512
    std::vector<__mmask16> masks(P / 16, static_cast<__mmask16>(0xFFFF));
    if (D % 16) masks.back() = static_cast<__mmask16>((1u << (D % 16)) - 1);
#endif
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = it / (KV * subgroups);
      const int64_t h = (it / subgroups) % KV;
      const int64_t sg = it % subgroups;
      const int64_t head0 = h * G + sg * kMaxGroup;
      const int ng = static_cast<int>(std::min<int64_t>(kMaxGroup, G - sg * kMaxGroup));
      const int64_t len = lens[s];
      T* orow = op + (s * H + head0) * D;
      if (len == 0) {
        std::fill(orow, orow + ng * D, static_cast<T>(0.0f));
        continue;
      }
      for (int j = 0; j < ng; ++j) {
        const T* qr = qp + s * q_seq + (head0 + j) * q_head;
        for (int64_t d = 0; d < D; ++d) qf[j * P + d] = to_f32(qr[d]) * fscale;
      }
      if (ng == 7) std::fill(qf.begin() + 7 * P, qf.begin() + 8 * P, 0.0f);  // padding head
      Table table = tables.data() + s * table_stride;
      const CT* kc = kp + h * k_head;
      const CT* vc = vp + h * v_head;
      if (key_add != nullptr) sc.key_add = key_add + h * D;
      bool done = false;
#if PDS_AVX512
      if (isa == kIsaAvx512) {
        done = true;
        switch (ng) {
#define PDS_CASE(N)                                                                          \
  case N:                                                                                    \
    attend_avx512<Src, N>(qf.data(), kc, vc, table, len, geo, masks.data(), sc,           \
                          scores.data(), acc.data());                                        \
    break;
          PDS_CASE(1) PDS_CASE(2) PDS_CASE(3) PDS_CASE(4)
          PDS_CASE(5) PDS_CASE(6) PDS_CASE(7) PDS_CASE(8)
#undef PDS_CASE
          default: break;
        }
      }
#endif
#if PDS_AVX2
      if (isa == kIsaAvx2) {
        done = true;
        switch (ng) {
#define PDS_CASE(N)                                                                          \
  case N:                                                                                    \
    attend_avx2<Src, N>(qf.data(), kc, vc, table, len, geo, sc, scores.data(), acc.data()); \
    break;
          PDS_CASE(1) PDS_CASE(2) PDS_CASE(3) PDS_CASE(4)
          PDS_CASE(5) PDS_CASE(6) PDS_CASE(7) PDS_CASE(8)
#undef PDS_CASE
          default: break;
        }
      }
#endif
      if (!done)
        attend_generic<Src>(qf.data(), ng, kc, vc, table, len, geo, sc, scores.data(),
                            acc.data());
      for (int j = 0; j < ng; ++j) store_row(orow + j * D, acc.data() + j * P, D);
    }
  });
}

const char* format_name(int64_t code) {
  switch (code) {
    case kAuto: return "auto";
    case kFp8E4M3: return "fp8_e4m3";
    case kFp8E5M2: return "fp8_e5m2";
    case kNvfp4: return "nvfp4";
    default: return "?";
  }
}

template <typename T>
void dispatch_format(int64_t kv_format, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const std::vector<int64_t>& tables,
                     int64_t table_stride, const std::vector<int64_t>& lens, double scale,
                     const c10::BFloat16* key_add, int64_t isa, at::Tensor& out) {
  switch (kv_format) {
    case kAuto:
      run<T, kAuto>(q, k_cache, v_cache, tables, table_stride, lens, scale, nullptr, isa,
          out);
      break;
    case kFp8E4M3:
      run<T, kFp8E4M3>(q, k_cache, v_cache, tables, table_stride, lens, scale, key_add, isa,
          out);
      break;
    case kFp8E5M2:
      run<T, kFp8E5M2>(q, k_cache, v_cache, tables, table_stride, lens, scale, key_add, isa,
          out);
      break;
    default:
      run<T, kNvfp4>(q, k_cache, v_cache, tables, table_stride, lens, scale, key_add, isa,
          out);
      break;
  }
}

// Checks every input, runs `before` (the fused op's cache writes: only once nothing can
// be refused), then writes the attention of q's S rows into out's first S rows (out:
// contiguous [>= S, num_heads, head_dim] of q's dtype).
template <typename Before>
void decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                 int64_t kv_format, const std::optional<at::Tensor>& key_add, int64_t isa,
                 at::Tensor& out, const Before& before) {
  TORCH_CHECK(kv_format >= kAuto && kv_format <= kNvfp4, "unknown kv_format code ", kv_format,
              " (known: 0 auto, 1 fp8_e4m3, 2 fp8_e5m2, 3 nvfp4)");
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "k_cache/v_cache must be [num_blocks, block_size, kv_heads, row_elems]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "paged_decode_attention is a CPU kernel");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "q must be float32, bfloat16 or float16, got ", dt);
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), B = k_cache.size(1), KV = k_cache.size(2);
  if (kv_format == kAuto) {
    TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt,
                "q, k_cache and v_cache must share a dtype with kv_format 0 (auto); got q ",
                dt, ", k_cache ", k_cache.scalar_type(), ", v_cache ", v_cache.scalar_type());
    TORCH_CHECK(k_cache.size(3) == D, "head_dim of q (", D, ") and cache (", k_cache.size(3),
                ") differ");
  } else {
    const char* name = format_name(kv_format);
    TORCH_CHECK(k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kByte,
                "kv_format ", kv_format, " (", name, ") needs uint8 k_cache and v_cache, got ",
                k_cache.scalar_type(), " and ", v_cache.scalar_type());
    TORCH_CHECK(kv_format != kNvfp4 || D % kNvfp4Group == 0, "kv_format 3 (nvfp4) needs "
                "head_dim divisible by ", kNvfp4Group, "; q's head_dim is ", D);
    const int64_t row = kv_format == kNvfp4 ? D / 2 + D / kNvfp4Group : D + 1;
    TORCH_CHECK(k_cache.size(3) == row, "cache row size ", k_cache.size(3),
                " does not match kv_format ", kv_format, " (", name, ") for q's head_dim ", D,
                ": expected ", row, " bytes per row");
  }
  TORCH_CHECK(KV > 0 && H % KV == 0, "num_heads (", H, ") must be a multiple of kv_heads (",
              KV, ")");
  TORCH_CHECK(B > 0 && D > 0, "empty block_size or head_dim");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "cache rows (last dim) must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == S,
              "block_tables must be [num_seqs, max_blocks]");
  const auto it = block_tables.scalar_type();
  TORCH_CHECK(it == at::kInt || it == at::kLong, "block_tables must be int32 or int64");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == S,
              "context_lens must be [num_seqs]");
  const auto lt = context_lens.scalar_type();
  TORCH_CHECK(lt == at::kInt || lt == at::kLong, "context_lens must be int32 or int64");

  const bool adds = key_add.has_value() && key_add->defined();
  if (adds) {
    TORCH_CHECK(kv_format != kAuto, "key_add is for quantized caches (kv_format 1-3) only");
    TORCH_CHECK(key_add->device().is_cpu() && key_add->scalar_type() == at::kBFloat16 &&
                    key_add->dim() == 3 && key_add->is_contiguous() &&
                    key_add->size(1) == KV && key_add->size(2) == D,
                "key_add must be a contiguous bfloat16 CPU tensor [positions, kv_heads (", KV,
                "), head_dim (", D, ")], got ", key_add->sizes(), " ", key_add->scalar_type());
  }
  at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  if (S == 0 || H == 0) {
    resolve_isa(isa, D);  // an isa this build lacks is refused all the same
    before();
    return;
  }

  // Lengths and the block ids each sequence uses are validated (and copied to int64)
  // up front, so the workers never read outside the cache.
  const int64_t max_blocks = block_tables.size(1);
  std::vector<int64_t> lens(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t i = s * context_lens.stride(0);
    const int64_t l = lt == at::kInt ? context_lens.data_ptr<int32_t>()[i]
                                     : context_lens.data_ptr<int64_t>()[i];
    TORCH_CHECK(l >= 0 && l <= max_blocks * B, "context_lens[", s, "] = ", l,
                " is outside [0, max_blocks * block_size = ", max_blocks * B, "]");
    lens[s] = l;
  }
  const int64_t longest = *std::max_element(lens.begin(), lens.end());
  TORCH_CHECK(!adds || key_add->size(0) >= longest, "key_add has ",
              adds ? key_add->size(0) : 0, " positions; the longest context is ", longest);
  const c10::BFloat16* add = adds ? key_add->data_ptr<c10::BFloat16>() : nullptr;
  const int64_t used = (longest + B - 1) / B;
  std::vector<int64_t> tables(S * used, 0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t b = 0, n = (lens[s] + B - 1) / B; b < n; ++b) {
      const int64_t i = s * block_tables.stride(0) + b * block_tables.stride(1);
      const int64_t id = it == at::kInt ? block_tables.data_ptr<int32_t>()[i]
                                        : block_tables.data_ptr<int64_t>()[i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", s, ", ", b, "] = ", id,
                  " is outside [0, ", num_blocks, ")");
      tables[s * used + b] = id;
    }
  }

  const int64_t path = resolve_isa(isa, D);
  before();
  if (dt == at::kFloat) {
    dispatch_format<float>(kv_format, qc, k_cache, v_cache, tables, used, lens, scale, add,
                           path, out);
  } else if (dt == at::kBFloat16) {
    dispatch_format<c10::BFloat16>(kv_format, qc, k_cache, v_cache, tables, used, lens, scale,
                                   add, path, out);
  } else {
    dispatch_format<c10::Half>(kv_format, qc, k_cache, v_cache, tables, used, lens, scale, add,
                               path, out);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t kv_format,
                                  const std::optional<at::Tensor>& key_add, int64_t isa) {
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  decode_into(q, k_cache, v_cache, block_tables, context_lens, scale, kv_format, key_add, isa,
              out, [] {});
  return out;
}

// The step's K/V rows into their slots, then decode attention of the first S rows of q
// (S: block_tables' rows; the decode tokens come first in a step), in one call instead
// of two index_copy_ and the op (per layer). Unquantized caches (kv_format 0) only.
// k, v: [T, kv_heads, head_dim] (rows contiguous); slot_mapping: int32/int64 [T], slot
// block * block_size + offset. Every input is checked before any row is written. Returns
// a new contiguous [T, num_heads, head_dim]: rows >= S are left for the caller (prefill).
at::Tensor paged_write_decode_attention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache,
                                        const at::Tensor& slot_mapping,
                                        const at::Tensor& block_tables,
                                        const at::Tensor& context_lens, double scale,
                                        int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "q must be [tokens, num_heads, head_dim], k and v [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache/v_cache must be [num_blocks, block_size, kv_heads, head_dim], alike");
  const int64_t T = q.size(0), KV = k_cache.size(2), D = k_cache.size(3);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(1) == KV && k.size(2) == D,
              "k and v must be [tokens (", T, "), kv_heads (", KV, "), head_dim (", D,
              ")], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "q, k, v and the caches must share a dtype (unquantized caches only)");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && slot_mapping.device().is_cpu(),
              "paged_write_decode_attention is a CPU kernel");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "k, v and cache rows (last dim) must be contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
              "slot_mapping must be [tokens (", T, ")]");
  const auto st = slot_mapping.scalar_type();
  TORCH_CHECK(st == at::kInt || st == at::kLong, "slot_mapping must be int32 or int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) <= T,
              "block_tables must be [decode seqs <= tokens, max_blocks]");
  std::vector<int64_t> slot(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = t * slot_mapping.stride(0);
    slot[t] = st == at::kInt ? slot_mapping.data_ptr<int32_t>()[i]
                             : slot_mapping.data_ptr<int64_t>()[i];
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot_mapping[", t, "] = ", slot[t],
                " is outside [0, num_blocks * block_size = ", slots, ")");
  }
  const int64_t B = k_cache.size(1), row = D * static_cast<int64_t>(k.element_size());
  auto write_rows = [&] {
    auto* kd = static_cast<char*>(k_cache.data_ptr());
    auto* vd = static_cast<char*>(v_cache.data_ptr());
    const auto* ks = static_cast<const char*>(k.data_ptr());
    const auto* vs = static_cast<const char*>(v.data_ptr());
    const int64_t es = k.element_size();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t blk = slot[t] / B, off = slot[t] % B;
      for (int64_t h = 0; h < KV; ++h) {
        std::memcpy(kd + (blk * k_cache.stride(0) + off * k_cache.stride(1) +
                          h * k_cache.stride(2)) * es,
                    ks + (t * k.stride(0) + h * k.stride(1)) * es, row);
        std::memcpy(vd + (blk * v_cache.stride(0) + off * v_cache.stride(1) +
                          h * v_cache.stride(2)) * es,
                    vs + (t * v.stride(0) + h * v.stride(1)) * es, row);
      }
    }
  };
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  decode_into(q.narrow(0, 0, block_tables.size(0)), k_cache, v_cache, block_tables,
              context_lens, scale, kAuto, std::nullopt, isa, out, write_rows);
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_kernels, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int kv_format=0, Tensor? key_add=None, int isa=-1) "
      "-> Tensor");
  m.def(
      "paged_write_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
      "float scale, int isa=-1) -> Tensor");
  m.def("paged_attention_best_isa() -> int", &paged_attention_best_isa);
  m.def("paged_attention_row_walk(bool on) -> bool", &paged_attention_row_walk);
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_write_decode_attention", &paged_write_decode_attention);
}
