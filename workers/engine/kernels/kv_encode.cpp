// The quantized KV cache's write path: KVFormat.quantize (workers/models/kv_format.py)
// as one native pass per row, byte for byte equal to the torch reference.
//
//   quantize_kv_rows(x, kv_format)   x [..., head_dim] float32 / bfloat16 / float16
//                                    -> uint8 [..., row_elems]
//
// kv_format 1 (fp8_e4m3), 2 (fp8_e5m2): e = frexp(amax / fmax).exponent clamped to
// [-127, 127]; values (x * 2**-e).clamp(+-fmax) rounded by c10's float -> float8
// conversion (the one torch's .to() uses); then the byte e + 127.
// kv_format 3 (nvfp4): per 16 values, E4M3 nearest (amax / 6).clamp(max=448) and its two
// neighbouring bit patterns; each candidate's E2M1 codes (nearest magnitude, ties to the
// lower one, as torch.bucketize(right=False) on the midpoints) and squared error, summed
// in the order of torch's sum kernel over a contiguous 16-value row (the 8-lane
// Vectorized<float> cascade: lane k = sq[k] + sq[k + 8], then lanes 0..7 one by one);
// the first least error wins (torch.argmin). Codes packed low nibble first, then the
// group scales.
//
// Every float operation the reference rounds (x.float(), amax / fmax, x * 2**-e,
// g / s, q * s - g, its square, the adds) is rounded here the same way, in float32,
// with no FMA contraction (keep() barriers). AVX-512 for the nvfp4 groups when the
// build machine has it, scalar otherwise. Rows run on ATen's intra-op pool when the
// input has more than kGrain elements, on the calling thread below that.
//
// Registered as torch.ops.pdserve_kernels.quantize_kv_rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "pds_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define PDS_KVENC_AVX512 1
#include <immintrin.h>
#else
#define PDS_KVENC_AVX512 0
#endif

namespace {

constexpr int64_t kGrain = 32768;  // elements per parallel chunk (about)
constexpr int kGroup = 16;
constexpr int kE8M0Bias = 127;
constexpr float kLevels[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr float kBounds[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

using pds::keep;  // pds_common.h: the FMA-contraction barrier, and element -> float
using pds::to_f;

// max(m, |v|) propagating NaN, as torch's amax.
inline float amax_step(float m, float v) {
  const float a = std::fabs(v);
  return (a > m || std::isnan(a)) ? a : m;
}

// E4M3 bit pattern -> float, all 256 (a NaN group maximum gives a NaN pattern).
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      c10::Float8_e4m3fn f(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits());
      v[b] = static_cast<float>(f);
    }
  }
};

const E4M3Table& e4m3_table() {
  static const E4M3Table t;
  return t;
}

// ------------------------------------------------------------------------------- FP8

template <typename T, typename F8>
void fp8_row_scalar(const T* x, uint8_t* out, int64_t n, float fmax, float* buf) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = to_f(x[i]);
    amax = amax_step(amax, buf[i]);
  }
  int e = 0;
  std::frexp(amax / fmax, &e);  // torch.frexp: amax 0 gives e 0
  e = std::min(std::max(e, -kE8M0Bias), kE8M0Bias);
  const float scale = std::ldexp(1.0f, -e);  // exp2(-e): exact, subnormal 2**-127 too
  for (int64_t i = 0; i < n; ++i) {
    float v = buf[i] * scale;
    v = std::min(std::max(v, -fmax), fmax);
    out[i] = F8(v).x;
  }
  out[n] = static_cast<uint8_t>(e + kE8M0Bias);
}

#if PDS_KVENC_AVX512
// c10's fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value on 16 lanes, step for
// step (the same integer rounding and the same float add for the subnormal range), so
// equal to the scalar conversion for every float32 input (checked exhaustively when
// this was written). The result is in the low byte of each 32-bit lane.
template <bool E4M3>
inline __m512i fp8_from_fp32_v(__m512 f) {
  constexpr uint32_t fp8_max = E4M3 ? (UINT32_C(1087) << 20) : (UINT32_C(143) << 23);
  constexpr uint32_t denorm = E4M3 ? (UINT32_C(141) << 23) : (UINT32_C(134) << 23);
  constexpr uint32_t min_normal = E4M3 ? (UINT32_C(121) << 23) : (UINT32_C(113) << 23);
  constexpr int mbits = E4M3 ? 20 : 21;
  constexpr uint32_t bias = E4M3 ? ((uint32_t)(7 - 127) << 23) + 0x7FFFF
                                 : ((uint32_t)(15 - 127) << 23) + 0xFFFFF;
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
  const __m512i a = _mm512_xor_si512(bits, sign);
  // normal range: round to nearest even by integer arithmetic
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, mbits), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((int32_t)bias)), odd);
  r = _mm512_and_si512(_mm512_srli_epi32(r, mbits), _mm512_set1_epi32(0xFF));
  if (E4M3) {  // a carry into 0x7F (NaN) saturates to 0x7E
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(r, _mm512_set1_epi32(0x7F));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7E));
  }
  // below the smallest normal: the float add puts the rounded value in the low bits
  const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((int32_t)min_normal));
  const __m512 dn = _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)denorm));
  const __m512i rs = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), dn)),
      _mm512_set1_epi32((int32_t)denorm));
  r = _mm512_mask_mov_epi32(r, small, _mm512_and_si512(rs, _mm512_set1_epi32(0xFF)));
  // beyond the range: saturate (E4M3) or infinity (E5M2); NaN stays NaN
  const __mmask16 big = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32((int32_t)fp8_max));
  const __mmask16 isnan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, big, _mm512_set1_epi32(E4M3 ? 0x7E : 0x7C));
  r = _mm512_mask_mov_epi32(r, isnan, _mm512_set1_epi32(0x7F));
  return _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
}

template <typename T>
inline __m512 load16_masked(const T* p, __mmask16 m);
template <>
inline __m512 load16_masked<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
template <>
inline __m512 load16_masked<c10::BFloat16>(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline __m512 load16_masked<c10::Half>(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

template <typename T, bool E4M3>
void fp8_row_v(const T* x, uint8_t* out, int64_t n, float fmax, float* buf) {
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = load16_masked<T>(x + i, m);  // masked lanes read as 0
    _mm512_storeu_ps(buf + i, v);  // buf has room for whole vectors
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const float amax = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(vmax);
  int e = 0;
  std::frexp(amax / fmax, &e);  // torch.frexp: amax 0 gives e 0
  e = std::min(std::max(e, -kE8M0Bias), kE8M0Bias);
  const __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, -e));
  const __m512 hi = _mm512_set1_ps(fmax), lo = _mm512_set1_ps(-fmax);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(buf + i), scale);
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));  // operand order: NaN stays NaN
    _mm512_mask_cvtepi32_storeu_epi8(out + i, m, fp8_from_fp32_v<E4M3>(v));
  }
  out[n] = static_cast<uint8_t>(e + kE8M0Bias);
}
#endif

template <typename T, typename F8>
void fp8_row(const T* x, uint8_t* out, int64_t n, float fmax, float* buf) {
#if PDS_KVENC_AVX512
  fp8_row_v<T, std::is_same<F8, c10::Float8_e4m3fn>::value>(x, out, n, fmax, buf);
#else
  fp8_row_scalar<T, F8>(x, out, n, fmax, buf);
#endif
}

// ------------------------------------------------------------------------------ NVFP4

// Argmin of three errors as torch.argmin: the first least; a NaN counts as the least.
inline int argmin3(const float* err) {
  int best = 0;
  for (int c = 1; c < 3; ++c) {
    if (std::isnan(err[best])) break;
    if (std::isnan(err[c]) || err[c] < err[best]) best = c;
  }
  return best;
}

inline void candidates(float amax, uint8_t* cand) {
  float t = amax / 6.0f;  // * NVFP4_TENSOR_SCALE (1.0)
  t = std::min(t, 448.0f);
  const int b = c10::Float8_e4m3fn(t).x;
  cand[0] = static_cast<uint8_t>(b);
  cand[1] = static_cast<uint8_t>(std::max(b - 1, 0));
  cand[2] = static_cast<uint8_t>(std::min(b + 1, 0x7E));
}

// Scalar: codes of g / s and the error sum in torch's order.
inline float group_codes_scalar(const float* g, float s, uint8_t* codes) {
  float sq[kGroup];
  for (int i = 0; i < kGroup; ++i) {
    float y = s > 0.0f ? g[i] / s : 0.0f;
    y = std::min(std::max(y, -6.0f), 6.0f);
    const float a = std::fabs(y);
    int mag = 0;
    for (int j = 0; j < 7; ++j) mag += a > kBounds[j];
    const bool neg = y < 0.0f && mag > 0;
    codes[i] = static_cast<uint8_t>(mag | (neg ? 8 : 0));
    const float q = neg ? -kLevels[mag] : kLevels[mag];
    const float d = keep(keep(q * s) - g[i]);
    sq[i] = keep(d * d);
  }
  float acc = 0.0f;
  for (int k = 0; k < 8; ++k) acc = keep(acc + keep(sq[k] + sq[k + 8]));
  return acc;
}

inline void pack_codes(const uint8_t* codes, uint8_t* out) {
  for (int i = 0; i < kGroup / 2; ++i)
    out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
}

#if PDS_KVENC_AVX512
using pds::keepv;

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Codes (as 32-bit lanes) of g / s and the error sum in torch's order.
inline float group_codes_v(__m512 g, float s, __m512i* codes_out) {
  const __m512 sv = _mm512_set1_ps(s);
  __m512 y = s > 0.0f ? _mm512_div_ps(g, sv) : _mm512_setzero_ps();
  y = _mm512_min_ps(_mm512_set1_ps(6.0f), _mm512_max_ps(_mm512_set1_ps(-6.0f), y));
  const __m512 a = _mm512_abs_ps(y);
  __m512i mag = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1);
  for (int j = 0; j < 7; ++j) {
    const __mmask16 gt = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kBounds[j]), _CMP_GT_OQ);
    mag = _mm512_mask_add_epi32(mag, gt, mag, one);
  }
  const __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ) &
                        _mm512_cmpgt_epi32_mask(mag, _mm512_setzero_si512());
  const __m512i code = _mm512_mask_or_epi32(mag, neg, mag, _mm512_set1_epi32(8));
  static const float table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const __m512 q = _mm512_permutexvar_ps(code, _mm512_loadu_ps(table));
  const __m512 d = keepv(_mm512_sub_ps(keepv(_mm512_mul_ps(q, sv)), g));
  const __m512 sq = keepv(_mm512_mul_ps(d, d));
  const __m256 lanes =
      _mm256_add_ps(_mm512_castps512_ps256(sq), _mm512_extractf32x8_ps(sq, 1));
  alignas(32) float l[8];
  _mm256_store_ps(l, lanes);
  float acc = 0.0f;
  for (int k = 0; k < 8; ++k) acc = keep(acc + l[k]);
  *codes_out = code;
  return acc;
}

inline void pack_codes_v(__m512i code, uint8_t* out) {
  // lanes 2i and 2i+1 -> one byte: low | high << 4
  const __m512i hi = _mm512_srli_epi64(code, 32 - 4);  // odd lane moved into the even one
  const __m512i both = _mm512_and_si512(_mm512_or_si512(code, hi), _mm512_set1_epi64(0xFF));
  const __m128i bytes = _mm512_cvtepi64_epi8(both);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
}
#endif

template <typename T>
void nvfp4_row(const T* x, uint8_t* out, int64_t n) {
  const E4M3Table& tab = e4m3_table();
  const int64_t groups = n / kGroup;
  uint8_t* scales = out + n / 2;
  for (int64_t gi = 0; gi < groups; ++gi) {
    const T* gx = x + gi * kGroup;
    uint8_t cand[3];
    float err[3];
#if PDS_KVENC_AVX512
    const __m512 g = load16<T>(gx);
    candidates(_mm512_cmp_ps_mask(g, g, _CMP_UNORD_Q)
                   ? std::numeric_limits<float>::quiet_NaN()
                   : _mm512_reduce_max_ps(_mm512_abs_ps(g)),
               cand);
    __m512i codes[3];
    for (int c = 0; c < 3; ++c) err[c] = group_codes_v(g, tab.v[cand[c]], &codes[c]);
    const int best = argmin3(err);
    pack_codes_v(codes[best], out + gi * (kGroup / 2));
#else
    float g[kGroup];
    float amax = 0.0f;
    for (int i = 0; i < kGroup; ++i) {
      g[i] = to_f(gx[i]);
      amax = amax_step(amax, g[i]);
    }
    candidates(amax, cand);
    uint8_t codes[3][kGroup];
    for (int c = 0; c < 3; ++c) err[c] = group_codes_scalar(g, tab.v[cand[c]], codes[c]);
    const int best = argmin3(err);
    pack_codes(codes[best], out + gi * (kGroup / 2));
#endif
    scales[gi] = cand[best];
  }
}

// ------------------------------------------------------------------------------- op

template <typename T>
void encode_rows(const T* xp, uint8_t* op, int64_t rows, int64_t n, int64_t row_elems,
                 int64_t code) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(code == 3 ? 0 : (n + 15) / 16 * 16);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = xp + r * n;
      uint8_t* out = op + r * row_elems;
      if (code == 1)
        fp8_row<T, c10::Float8_e4m3fn>(x, out, n, 448.0f, buf.data());
      else if (code == 2)
        fp8_row<T, c10::Float8_e5m2>(x, out, n, 57344.0f, buf.data());
      else
        nvfp4_row<T>(x, out, n);
    }
  });
}

at::Tensor quantize_kv_rows(const at::Tensor& x_in, int64_t kv_format) {
  TORCH_CHECK(x_in.device().is_cpu(), "quantize_kv_rows: x must be a CPU tensor");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) > 0,
              "quantize_kv_rows: x must have a non-empty last dim (head_dim)");
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "quantize_kv_rows: x must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(kv_format >= 1 && kv_format <= 3,
              "quantize_kv_rows: unknown kv_format code ", kv_format,
              " (1 fp8_e4m3, 2 fp8_e5m2, 3 nvfp4)");
  const int64_t n = x_in.size(-1);
  TORCH_CHECK(kv_format != 3 || n % kGroup == 0,
              "quantize_kv_rows: nvfp4 needs head_dim divisible by 16, got head_dim ", n);
  const int64_t row_elems = kv_format == 3 ? n / 2 + n / kGroup : n + 1;
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = row_elems;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kByte));
  const int64_t rows = x.numel() / n;
  if (rows == 0) return out;
  uint8_t* op = out.data_ptr<uint8_t>();
  if (dt == at::kFloat)
    encode_rows(x.data_ptr<float>(), op, rows, n, row_elems, kv_format);
  else if (dt == at::kBFloat16)
    encode_rows(x.data_ptr<c10::BFloat16>(), op, rows, n, row_elems, kv_format);
  else
    encode_rows(x.data_ptr<c10::Half>(), op, rows, n, row_elems, kv_format);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def("quantize_kv_rows(Tensor x, int kv_format) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("quantize_kv_rows", &quantize_kv_rows);
}
