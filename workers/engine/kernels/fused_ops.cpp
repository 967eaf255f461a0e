// Fused elementwise ops of the decoder layer for CPU, bit-exact with torch's own ops.
//
//   rms_norm(x, w, eps)            transformers' LlamaRMSNorm: fp32 statistics, the
//                                  normalised row cast to x's dtype, then times w
//   add_rms_norm(x, r, w, eps)     x += r in place (in x's dtype), then rms_norm(x)
//   rope_(qk, cos, sin)            qk = qk * cos + rotate_half(qk) * sin, in place
//   silu_mul(gate_up)              silu(gate_up[..., :I]) * gate_up[..., I:]
//   argmax_rows(x)                 torch.argmax(x, dim=-1) of float32 [rows, n] (the
//                                  greedy sampler's; an index, so exact by construction:
//                                  the first largest, a NaN counting as the largest)
//
// Each reproduces, bit for bit, the torch expression the decoder uses (see
// workers/models/decoder.py), on float32 and bfloat16:
// - every op torch rounds (one op = one rounding to the tensor dtype; bf16 ops compute
//   in fp32 and round to bf16, nearest-even) is rounded here too, in the same order, and
//   nothing is fused into an FMA that torch computes as a multiply then an add (GCC
//   contracts a * b + c by default in C++, hence the keep() barriers);
// - the sum of squares follows torch's cascade_sum (SumKernel.cpp) for a contiguous
//   inner reduction: ``lanes``-wide Vectorized<float> accumulators (8: torch registers
//   its sum kernel without an AVX-512 variant, so AVX-512 machines run the AVX2 one),
//   four of them interleaved, carried into coarser levels every 16 steps, then the
//   scalar tail and the lanes summed one by one; mean = sum / D, rsqrt = 1 / sqrt;
// - silu is x / (1 + exp(-x)) with torch's exp: Sleef's expf_u10 (reproduced below,
//   same constants and operation order) on the vectorised part of each row and the C
//   library's expf on the scalar tail torch's cpu_kernel_vec leaves: the last
//   I mod (2 * Vectorized<T>::size()) elements of a row, ``lanes`` = Vectorized<float>
//   width (16 under torch's AVX-512 kernels); none when I is a multiple of 64.
// Torch splits a reduction row across threads only when one row has >= 32768 elements,
// and an elementwise row only at chunk boundaries that, for even I and 2 threads, fall
// on a multiple of I / 2; beyond that the bit-exactness holds as long as torch keeps
// these kernels (tests/unit/test_fused_kernels.py checks it).
//
// AVX-512 (F, BW, VL) code when the build machine has it (-march=native); on AVX2 + FMA
// machines without it, 8-lane code for float32 rows; portable scalar loops otherwise.
// Rows run on ATen's intra-op pool (at::parallel_for) when an op touches more than
// kGrain elements, on the calling thread below that.
//
// Registered as torch.ops.pdserve_kernels.{rms_norm, add_rms_norm, rope_, silu_mul,
// argmax_rows}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "pds_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PDS_FUSED_AVX512 1
#include <immintrin.h>
#else
#define PDS_FUSED_AVX512 0
#endif
// AVX2 + FMA without AVX-512: the float32 rows of every op in 8 lanes (bfloat16 stays
// scalar there: auto picks float32 on such CPUs).
#if !PDS_FUSED_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define PDS_FUSED_AVX2 1
#include <immintrin.h>
#else
#define PDS_FUSED_AVX2 0
#endif

namespace {

using bf16 = c10::BFloat16;

// Elements per op below which it runs on the calling thread (torch's GRAIN_SIZE).
constexpr int64_t kGrain = 32768;

using pds::keep;  // pds_common.h: the FMA-contraction barrier, and element -> float
using pds::to_f;

// v rounded to T, as a float (identity for float).
template <typename T>
inline float rnd(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

// ---------------------------------------------------------------- exp (Sleef u10)

// Sleef's xexpf (expf u10): the algorithm of Sleef_expf16_u10, which torch's
// Vectorized<float>::exp() calls, lane by lane.
constexpr float kR_LN2f = 1.442695040888963407359924681001892137426645954152985934135449406931f;
constexpr float kL2Uf = 0.693145751953125f;
constexpr float kL2Lf = 1.428606765330187045e-06f;
constexpr float kExpC[6] = {0.000198527617612853646278381f, 0.00139304355252534151077271f,
                            0.00833336077630519866943359f, 0.0416664853692054748535156f,
                            0.166666671633720397949219f, 0.5f};

inline float pow2i(int32_t q) {
  const int32_t bits = static_cast<int32_t>(static_cast<uint32_t>(q + 0x7f) << 23);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float sleef_expf(float d) {
  if (std::isnan(d)) return d;
  const float t = keep(d * kR_LN2f);
  const int32_t q = static_cast<int32_t>(std::nearbyint(t));
  const float qf = static_cast<float>(q);
  float s = std::fma(qf, -kL2Uf, d);
  s = std::fma(qf, -kL2Lf, s);
  float u = kExpC[0];
  for (int i = 1; i < 6; ++i) u = std::fma(u, s, kExpC[i]);
  u = 1.0f + std::fma(keep(s * s), u, s);
  const int32_t qh = q >> 1;
  u = keep(keep(u * pow2i(qh)) * pow2i(q - qh));
  if (d < -104.0f) u = 0.0f;
  if (100.0f < d) u = INFINITY;
  return keep(u);
}

// ---------------------------------------------------------------- row bookkeeping

// Flattens the leading dims of a tensor whose last dim is contiguous: row r's offset.
struct Rows {
  int64_t count = 1, len = 0;
  std::vector<int64_t> sizes, strides;  // leading dims, outermost first

  explicit Rows(const at::Tensor& t) : len(t.size(-1)) {
    for (int64_t d = 0; d + 1 < t.dim(); ++d) {
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
      count *= t.size(d);
    }
  }
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return off;
  }
};

inline int64_t row_grain(int64_t len) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(len, 1));
}

// ---------------------------------------------------------------- sum of squares

inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// torch's row_sum(multi_row_sum<4 rows>) over `size` W-lane vectors; element e of the
// row is sq(e). Writes the W lane sums to out.
template <typename F>
void lanes_row_sum(const F& sq, int64_t size, int W, float* out) {
  float acc[4][4][16] = {};  // [level][interleaved row][lane]
  const int64_t rows = size / 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / 4);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  auto add = [&](float* a, int64_t v) {
    for (int l = 0; l < W; ++l) a[l] += sq(v * W + l);
  };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add(acc[0][k], 4 * i + k);
    for (int lv = 1; lv < 4; ++lv) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) {
          acc[lv][k][l] += acc[lv - 1][k][l];
          acc[lv - 1][k][l] = 0.0f;
        }
      if ((i & (mask << (lv * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < 4; ++k) add(acc[0][k], 4 * i + k);
  for (int lv = 1; lv < 4; ++lv)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[lv][k][l];
  for (int64_t v = rows * 4; v < size; ++v) add(acc[0][0], v);
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  std::copy(acc[0][0], acc[0][0] + W, out);
}

// torch's x.pow(2).sum(-1) for one contiguous row of n (cascade_sum, inner reduction).
template <typename T>
float sumsq_generic(const T* x, int64_t n, int W) {
  auto sq = [x](int64_t e) {
    const float f = to_f(x[e]);
    return keep(f * f);
  };
  float part[16];
  if (n < W) {  // scalar_inner_sum
    lanes_row_sum(sq, n, 1, part);
    return part[0];
  }
  const int64_t nv = n / W;
  lanes_row_sum(sq, nv, W, part);
  float sum = 0.0f;
  for (int64_t e = nv * W; e < n; ++e) sum += sq(e);
  for (int l = 0; l < W; ++l) sum += part[l];
  return sum;
}

// ---------------------------------------------------------------- AVX-512 helpers

#if PDS_FUSED_AVX512

using pds::keepv;

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

inline __m512 ld(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 ld(const bf16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Rounded to bf16 (nearest even, NaN kept NaN), as floats.
inline __m512 round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}

template <typename T>
inline __m512 rndv(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return keepv(v);
  } else {
    return round_bf16(v);
  }
}

// Stores v (already representable in T) rounded to T.
inline void st(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void st(bf16* p, __m512 v, __mmask16 m) {
  const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(b));
}

inline __m512 pow2iv(__m512i q) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(0x7f)), 23));
}

// Sleef_expf16_u10 (AVX512F build: every mla an FMA).
inline __m512 sleef_expv(__m512 d) {
  const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(kR_LN2f)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-kL2Uf), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-kL2Lf), s);
  __m512 u = _mm512_set1_ps(kExpC[0]);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC[1]));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC[2]));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC[3]));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC[4]));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC[5]));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(keepv(_mm512_mul_ps(s, s)), u, s));
  const __m512i qh = _mm512_srai_epi32(q, 1);
  u = keepv(_mm512_mul_ps(keepv(_mm512_mul_ps(u, pow2iv(qh))),
                          pow2iv(_mm512_sub_epi32(q, qh))));
  u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_NLT_UQ), u);
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ),
                         _mm512_set1_ps(INFINITY));
  return keepv(u);
}

#endif  // PDS_FUSED_AVX512

// ---------------------------------------------------------------- 8-lane helpers
// (AVX-512 builds use them for torch's 8-lane sum; AVX2 builds for the float32 rows.)

#if PDS_FUSED_AVX512 || PDS_FUSED_AVX2

inline __m256 keep8(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// sumsq_generic with W = 8 (torch's AVX2 sum kernel), in 256-bit registers.
template <typename T>
float sumsq_lanes8(const T* x, int64_t n) {
  if (n < 8) return sumsq_generic(x, n, 8);
  auto sq = [x](int64_t v) {
    const __m256 a = ld8(x + 8 * v);
    return keep8(_mm256_mul_ps(a, a));
  };
  const int64_t nv = n / 8, rows = nv / 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / 4);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  __m256 acc[4][4];
  for (auto& lv : acc)
    for (auto& a : lv) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq(4 * i + k));
    for (int lv = 1; lv < 4; ++lv) {
      for (int k = 0; k < 4; ++k) {
        acc[lv][k] = _mm256_add_ps(acc[lv][k], acc[lv - 1][k]);
        acc[lv - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (mask << (lv * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq(4 * i + k));
  for (int lv = 1; lv < 4; ++lv)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[lv][k]);
  __m256 p = acc[0][0];
  for (int64_t v = rows * 4; v < nv; ++v) p = _mm256_add_ps(p, sq(v));
  for (int k = 1; k < 4; ++k) p = _mm256_add_ps(p, acc[0][k]);
  float sum = 0.0f;
  for (int64_t e = nv * 8; e < n; ++e) {
    const float f = to_f(x[e]);
    sum += keep(f * f);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, p);
  for (float l : lanes) sum += l;
  return sum;
}

#endif  // PDS_FUSED_AVX512 || PDS_FUSED_AVX2

// ---------------------------------------------------------------- rms_norm

// out = w * T(x * rsqrt(mean(x^2) + eps)) for one row; x already holds the row's
// final values (after any residual add).
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps, int W) {
#if PDS_FUSED_AVX512
  const float sum = W == 8 ? sumsq_lanes8(x, n) : sumsq_generic(x, n, W);
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(sum / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 h = rndv<T>(_mm512_mul_ps(ld(x + i, m), r));
    st(out + i, _mm512_mul_ps(ld(w + i, m), h), m);
  }
#else
#if PDS_FUSED_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (W == 8) {  // the loops below, 8 lanes at a time (two multiplies: nothing to fuse)
      const float rs = 1.0f / std::sqrt(sumsq_lanes8(x, n) / static_cast<float>(n) + eps);
      const __m256 r = _mm256_set1_ps(rs);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
      for (; i < n; ++i) out[i] = w[i] * (x[i] * rs);
      return;
    }
  }
#endif
  const float sum = sumsq_generic(x, n, W);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float h = rnd<T>(to_f(x[i]) * r);
    out[i] = static_cast<T>(to_f(w[i]) * h);
  }
#endif
}

// x[i] = T(x[i] + res[i]) for one row.
template <typename T>
void add_row(T* x, const T* res, int64_t n) {
#if PDS_FUSED_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    st(x + i, _mm512_add_ps(ld(x + i, m), ld(res + i, m)), m);
  }
#else
  int64_t i = 0;
#if PDS_FUSED_AVX2
  if constexpr (std::is_same_v<T, float>)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(res + i)));
#endif
  for (; i < n; ++i) x[i] = static_cast<T>(to_f(x[i]) + to_f(res[i]));
#endif
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dim");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "x must be float32 or bfloat16, got ",
              dt);
  TORCH_CHECK(weight.scalar_type() == dt, "weight dtype (", weight.scalar_type(),
              ") must match x (", dt, ")");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.stride(0) == 1,
              "weight must be a contiguous [", x.size(-1), "] vector");
  TORCH_CHECK(x.stride(-1) == 1, "x's last dim must be contiguous");
  TORCH_CHECK(lanes >= 1 && lanes <= 16, "lanes must be in [1, 16]");
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, int W, at::Tensor& out) {
  const Rows xr(x);
  const Rows rr(residual ? *residual : x);
  const int64_t n = xr.len;
  T* xp = static_cast<T*>(x.data_ptr());
  const T* rp = residual ? static_cast<const T*>(residual->data_ptr()) : nullptr;
  const T* wp = static_cast<const T*>(weight.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, xr.count, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = xp + xr.offset(r);
      if (rp) add_row(row, rp + rr.offset(r), n);
      rms_row(row, wp, op + r * n, n, feps, W);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  check_norm_args(x, weight, lanes);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, nullptr, weight, eps, static_cast<int>(lanes), out);
  } else {
    rms_norm_impl<bf16>(x, nullptr, weight, eps, static_cast<int>(lanes), out);
  }
  return out;
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps, int64_t lanes) {
  check_norm_args(x, weight, lanes);
  TORCH_CHECK(residual.device().is_cpu() && residual.scalar_type() == x.scalar_type() &&
                  residual.sizes() == x.sizes(),
              "residual must be a CPU tensor of x's shape and dtype");
  TORCH_CHECK(residual.stride(-1) == 1, "residual's last dim must be contiguous");
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, &residual, weight, eps, static_cast<int>(lanes), out);
  } else {
    rms_norm_impl<bf16>(x, &residual, weight, eps, static_cast<int>(lanes), out);
  }
  return out;
}

// ---------------------------------------------------------------- rope

// One head row in place: x[:h] = x[:h] c[:h] - x[h:] s[:h]; x[h:] = x[h:] c[h:] + x[:h] s[h:]
// (each product rounded to T, then the sum).
template <typename T>
void rope_row(T* x, const T* c, const T* s, int64_t half) {
#if PDS_FUSED_AVX512
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 x1 = ld(x + i, m), x2 = ld(x + half + i, m);
    const __m512 a1 = rndv<T>(_mm512_mul_ps(x1, ld(c + i, m)));
    const __m512 b1 = rndv<T>(_mm512_mul_ps(_mm512_xor_ps(x2, sign), ld(s + i, m)));
    const __m512 a2 = rndv<T>(_mm512_mul_ps(x2, ld(c + half + i, m)));
    const __m512 b2 = rndv<T>(_mm512_mul_ps(x1, ld(s + half + i, m)));
    st(x + i, _mm512_add_ps(a1, b1), m);
    st(x + half + i, _mm512_add_ps(a2, b2), m);
  }
#else
  int64_t i = 0;
#if PDS_FUSED_AVX2
  if constexpr (std::is_same_v<T, float>) {  // each product kept apart from its sum
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= half; i += 8) {
      const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
      const __m256 a1 = keep8(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)));
      const __m256 b1 = keep8(_mm256_mul_ps(_mm256_xor_ps(x2, sign), _mm256_loadu_ps(s + i)));
      const __m256 a2 = keep8(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)));
      const __m256 b2 = keep8(_mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i)));
      _mm256_storeu_ps(x + i, _mm256_add_ps(a1, b1));
      _mm256_storeu_ps(x + half + i, _mm256_add_ps(a2, b2));
    }
  }
#endif
  for (; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[half + i]);
    const float a1 = keep(rnd<T>(x1 * to_f(c[i])));
    const float b1 = keep(rnd<T>(-x2 * to_f(s[i])));
    const float a2 = keep(rnd<T>(x2 * to_f(c[half + i])));
    const float b2 = keep(rnd<T>(x1 * to_f(s[half + i])));
    x[i] = static_cast<T>(a1 + b1);
    x[half + i] = static_cast<T>(a2 + b2);
  }
#endif
}

template <typename T>
void rope_impl(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2);
  T* xp = static_cast<T*>(qk.data_ptr());
  const T* cp = static_cast<const T*>(cos.data_ptr());
  const T* sp = static_cast<const T*>(sin.data_ptr());
  const int64_t xt = qk.stride(0), xh = qk.stride(1), ct = cos.stride(0), st_ = sin.stride(0);
  at::parallel_for(0, tokens * heads, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t t = it / heads, h = it % heads;
      rope_row(xp + t * xt + h * xh, cp + t * ct, sp + t * st_, dim / 2);
    }
  });
}

void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(qk.dim() == 3, "qk must be [tokens, heads, head_dim]");
  const int64_t tokens = qk.size(0), dim = qk.size(2);
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  const auto dt = qk.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "qk must be float32 or bfloat16, got ",
              dt);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == dt, "cos/sin dtype must match qk (", dt, ")");
    TORCH_CHECK((t->dim() == 3 && t->size(1) == 1) || t->dim() == 2,
                "cos/sin must be [tokens, 1, head_dim] or [tokens, head_dim]");
    TORCH_CHECK(t->size(0) == tokens && t->size(-1) == dim && t->stride(-1) == 1,
                "cos/sin must hold one contiguous row of head_dim per token");
  }
  TORCH_CHECK(qk.stride(2) == 1, "qk's last dim must be contiguous");
  if (qk.numel() == 0) return;
  if (dt == at::kFloat) {
    rope_impl<float>(qk, cos, sin);
  } else {
    rope_impl<bf16>(qk, cos, sin);
  }
}

// ---------------------------------------------------------------- silu_mul

#if PDS_FUSED_AVX2
inline __m256 keep_avx2(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

inline __m256 pow2i_avx2(__m256i q) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(0x7f)), 23));
}

// sleef_expf in 8 lanes: the same operations in the same order (so the same bits).
inline __m256 sleef_exp_avx2(__m256 d) {
  const __m256i q = _mm256_cvtps_epi32(keep_avx2(_mm256_mul_ps(d, _mm256_set1_ps(kR_LN2f))));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-kL2Uf), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-kL2Lf), s);
  __m256 u = _mm256_set1_ps(kExpC[0]);
  for (int i = 1; i < 6; ++i) u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kExpC[i]));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f),
                    _mm256_fmadd_ps(keep_avx2(_mm256_mul_ps(s, s)), u, s));
  const __m256i qh = _mm256_srai_epi32(q, 1);
  u = keep_avx2(_mm256_mul_ps(keep_avx2(_mm256_mul_ps(u, pow2i_avx2(qh))),
                              pow2i_avx2(_mm256_sub_epi32(q, qh))));
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
  u = _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY),
                       _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
  return keep_avx2(u);
}
#endif

// out = T(T(g / (1 + exp(-g))) * u) for one row of n; exp as torch: Sleef on
// [0, vec_end), expf past it.
template <typename T>
void silu_mul_row(const T* g, const T* u, T* out, int64_t n, int64_t vec_end) {
  int64_t i = 0;
#if PDS_FUSED_AVX512
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  const __mmask16 all = 0xFFFF;
  for (; i + 16 <= vec_end; i += 16) {
    const __m512 x = ld(g + i, all);
    const __m512 e = sleef_expv(_mm512_xor_ps(x, sign));
    const __m512 sl = rndv<T>(_mm512_div_ps(x, _mm512_add_ps(one, e)));
    st(out + i, _mm512_mul_ps(sl, ld(u + i, all)), all);
  }
#endif
#if PDS_FUSED_AVX2
  if constexpr (std::is_same_v<T, float>) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= vec_end; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 e = sleef_exp_avx2(_mm256_xor_ps(x, sign));
      const __m256 sl = _mm256_div_ps(x, _mm256_add_ps(one, e));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(sl, _mm256_loadu_ps(u + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float x = to_f(g[i]);
    const float e = i < vec_end ? sleef_expf(-x) : std::exp(-x);
    const float sl = rnd<T>(x / (1.0f + e));
    out[i] = static_cast<T>(sl * to_f(u[i]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t lanes) {
  TORCH_CHECK(gate_up.device().is_cpu(), "CPU tensor expected");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "gate_up's last dim must be even ([..., 2 * intermediate])");
  const auto dt = gate_up.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16,
              "gate_up must be float32 or bfloat16, got ", dt);
  TORCH_CHECK(gate_up.stride(-1) == 1, "gate_up's last dim must be contiguous");
  TORCH_CHECK(lanes >= 1 && lanes <= 16, "lanes must be in [1, 16]");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  const int64_t n = shape.back() / 2;
  shape.back() = n;
  at::Tensor out = at::empty(shape, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const Rows rows(gate_up);
  const int64_t W = lanes;
  // torch's cpu_kernel_vec: two Vectorized<T> per step, the rest scalar.
  const int64_t step = 2 * W * (dt == at::kFloat ? 1 : 2);
  const int64_t vec_end = n / step * step;
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* gp = static_cast<const T*>(gate_up.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, rows.count, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = gp + rows.offset(r);
        silu_mul_row(g, g + n, op + r * n, n, vec_end);
      }
    });
  };
  if (dt == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<bf16*>(nullptr));
  }
  return out;
}

// ---------------------------------------------------------------- argmax_rows

// Across L lanes that each hold the first of their largest (value and index): the
// largest value, and of its lanes the smallest index.
template <int L>
void best_of_lanes(const float* vals, const int32_t* idx, float& best, int64_t& best_i) {
  best = vals[0];
  best_i = idx[0];
  for (int l = 1; l < L; ++l) {
    if (vals[l] > best || (vals[l] == best && idx[l] < best_i)) {
      best = vals[l];
      best_i = idx[l];
    }
  }
}

// The index of the first largest element of x[0, n), n >= 1, as torch.argmax gives it:
// ties go to the first; a NaN counts as the largest, so a row with NaNs gives its first.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 1, best_i = 0;
  float best = x[0];
  bool nan = x[0] != x[0];
#if PDS_FUSED_AVX512
  if (n >= 32) {  // per lane, the first of its largest; then across lanes
    __m512 bv = _mm512_loadu_ps(x);
    __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = bi;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
      unordered = static_cast<__mmask16>(unordered | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
      bv = _mm512_mask_mov_ps(bv, gt, v);
      bi = _mm512_mask_mov_epi32(bi, gt, cur);
    }
    alignas(64) float vals[16];
    alignas(64) int32_t idx[16];
    _mm512_store_ps(vals, bv);
    _mm512_store_si512(reinterpret_cast<__m512i*>(idx), bi);
    nan = unordered != 0;
    best_of_lanes<16>(vals, idx, best, best_i);
  }
#elif PDS_FUSED_AVX2
  if (n >= 16) {
    __m256 bv = _mm256_loadu_ps(x);
    __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = bi;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 unordered = _mm256_cmp_ps(bv, bv, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      bv = _mm256_blendv_ps(bv, v, gt);
      bi = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(cur), gt));
    }
    alignas(32) float vals[8];
    alignas(32) int32_t idx[8];
    _mm256_store_ps(vals, bv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), bi);
    nan = _mm256_movemask_ps(unordered) != 0;
    best_of_lanes<8>(vals, idx, best, best_i);
  }
#endif
  for (; i < n; ++i) {  // past the lanes (or all of a short row): later indices, so ">"
    const float v = x[i];
    nan = nan || v != v;
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (x[j] != x[j]) return j;
    }
  }
  return best_i;
}

// torch.argmax(x, dim=-1) of a float32 [rows, n] (last dim contiguous), as int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "CPU tensor expected");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, n], got ", x.dim(), " dims");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) >= 1, "x's rows must not be empty");
  TORCH_CHECK(x.size(1) <= INT32_MAX, "x's rows must be under 2^31 long");
  TORCH_CHECK(x.stride(1) == 1, "x's last dim must be contiguous");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int lanes=8) -> Tensor");
  m.def(
      "add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps, int lanes=8) "
      "-> Tensor");
  m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up, int lanes=16) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
}
