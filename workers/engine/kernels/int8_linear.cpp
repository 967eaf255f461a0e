// Weight-only int8 linear layer for CPU: y = x · (q · scale)ᵀ (+ bias).
//
//   int8_linear(x, q, scale, bias, max_gemv_rows, isa) -> y
//     x      float32 or bfloat16 [..., K] (made contiguous if it is not)
//     q      int8 [N, K], contiguous: the weight, one row per output channel (or the
//            same in gemv_pack's tiles, [ceil(N/4), K/8, 4, 8]; see below)
//     scale  float32 [N]: row n of the weight is q[n] * scale[n]
//     bias   optional [N], float32 or x's dtype
//     y      [..., N] in x's dtype
//
// Small batches (rows M <= max_gemv_rows: decode) run a dequantize-in-register GEMV:
// every weight row is read from memory once for all M rows of x; 16 (AVX-512) or 8
// (AVX2) int8 weights at a time are widened to float32 in registers and multiplied into
// float32 accumulators, a tile of 4 weight rows by up to 4 x rows at a time (16
// independent FMA chains). x (bfloat16: converted to a float32 copy once per call) and
// the accumulators stay in L1. Each output is (sum_k x[m,k] * q[n,k]) * scale[n] +
// bias[n], in float32, then rounded to x's dtype once.
//
// Larger batches (prefill; where the GEMV stops is max_gemv_rows, timed per CPU by
// workers.engine.kernels.time_int8_gemv_rows) dequantize the weight in blocks of rows to
// x's dtype (q * scale rounded to it) and call a GEMM block by block (oneDNN in float32,
// at::mm in bfloat16: block_gemm): there a GEMM's blocking beats any GEMV, and
// dequantizing costs ~1/M of the GEMM.
// In float32 both paths compute the same product up to summation order (~1e-6
// relative); in bfloat16 the GEMM path also rounds each dequantized weight to bfloat16
// (relative 2^-9), as the unquantized bf16 model's weights are.
//
// Code paths, chosen at compile time by what -march=native enables and at run time by
// ``isa``: 2 AVX-512 (F, BW, VL), 1 AVX2 + FMA, 0 portable scalar; -1 picks the best
// compiled in. Asking for a path this build lacks is an error, so tests can run every
// path the machine has (an AVX-512 build compiles the AVX2 path too). Work is split
// over tiles of output rows on ATen's intra-op pool (at::parallel_for), so it honours
// torch.set_num_threads; below kGrain weight bytes x rows it stays on the caller.
//
// f32_gemv(x, w, bias, isa) runs the same GEMV on a float weight (no scales): the
// decode GEMMs of float32 models, and of bfloat16 ones (x and w bfloat16: 8 or 16
// weights at a time widened to float32 by a shift, x converted once per call, float32
// accumulators, each output rounded to bfloat16 once, as a bf16 GEMM does).
//
// gemv_pack(w) -> wp stores a float32, bfloat16 or int8 weight tile by tile, [ceil(N/4)][K/8][4][8]
// (the 4 rows of a tile interleaved in 8-element chunks, the last tile padded with zero
// rows; K a multiple of 8), so one tile's GEMV pass reads one sequential stream instead
// of 4 rows' 4 streams: f32_gemv_packed(x, wp, n, bias, isa) for float weights; int8_linear and
// int8_dequantize take q in either layout (the GEMM path gathers rows back). Measured on
// a 2-core AMD EPYC (AVX2), SmolLM2's 425 MB of fp32 layer weights per decode step:
// 1.2-1.3x faster than the row-major GEMV, 80-90% of a plain 2-thread read's bandwidth.
// The chunk is 8 elements, AVX2's float register; an AVX-512 build runs its AVX2 tile on
// it.
//
// Registered as torch.ops.pdserve_kernels.{int8_linear, int8_dequantize, f32_gemv,
// gemv_pack, f32_gemv_packed}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "pds_common.h"
#include "pds_onednn.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PDS_I8_AVX512 1
#else
#define PDS_I8_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PDS_I8_AVX2 1
#else
#define PDS_I8_AVX2 0
#endif
#if PDS_I8_AVX512 || PDS_I8_AVX2
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

constexpr int kTileN = 4;  // weight rows per tile
constexpr int kTileM = 4;  // x rows per tile
constexpr int kPackW = 8;  // elements per chunk of a weight in tiles (gemv_pack)
// Weight bytes x rows per parallel chunk below which a call stays on one thread.
constexpr int64_t kGrain = 32768;
// Bytes of one dequantized weight block on the GEMM path (fits L2 with room for x).
constexpr int64_t kBlockBytes = 1 << 20;

enum Isa : int64_t { kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The accumulator tile: acc[m][n] = sum_k x[m][k] * q[n][k].
template <int MT, int NT>
struct Tile {
  float acc[MT][NT];
};

// ---------------------------------------------------------------- scalar

// WT: the weight's element type, int8_t (scaled per row afterwards), float or bf16
// (f32_gemv). Each product is rounded before its add (pds::keep): GCC may contract
// ``s += a * b`` into an FMA in one of these loops and not in the other (it did on an
// Emerald Rapids build, -march=native), and the two layouts must give the same bits.
template <int MT, int NT, typename WT>
void tile_scalar(const float* x, int64_t K, const WT* q, Tile<MT, NT>& t) {
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      const float* xr = x + m * K;
      const WT* qr = q + n * K;
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += pds::keep(xr[k] * static_cast<float>(qr[k]));
      t.acc[m][n] = s;
    }
}

template <int MT, int NT, typename WT>
void tile_scalar_packed(const float* x, int64_t K, const WT* p, Tile<MT, NT>& t) {
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k)
        s += pds::keep(x[m * K + k] * static_cast<float>(
                                          p[(k / kPackW) * kTileN * kPackW + n * kPackW +
                                            k % kPackW]));
      t.acc[m][n] = s;
    }
}

// ---------------------------------------------------------------- AVX2

#if PDS_I8_AVX2
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const bf16* p) {  // bfloat16 is float32's top half: exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <int MT, int NT, typename WT>
void tile_avx2(const float* x, int64_t K, const WT* q, Tile<MT, NT>& t) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t kv = K / 8 * 8;
  for (int64_t k = 0; k < kv; k += 8) {
    __m256 w[NT];
    for (int n = 0; n < NT; ++n) w[n] = widen8(q + n * K + k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, w[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float s = hsum256(acc[m][n]);
      for (int64_t k = kv; k < K; ++k) s += x[m * K + k] * static_cast<float>(q[n * K + k]);
      t.acc[m][n] = s;
    }
}

// A tile of the packed layout (see the header): p is the tile's start; rows past NT are
// the padding (or the next rows of a full tile's remainder) and are not read.
template <int MT, int NT, typename WT>
void tile_avx2_packed(const float* x, int64_t K, const WT* p, Tile<MT, NT>& t) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kPackW, p += kTileN * kPackW) {
    __m256 w[NT];
    for (int n = 0; n < NT; ++n) w[n] = widen8(p + n * kPackW);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, w[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) t.acc[m][n] = hsum256(acc[m][n]);
}
#endif

// ---------------------------------------------------------------- AVX-512

#if PDS_I8_AVX512
inline __m512 widen16(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}
inline __m512 widen16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 widen16(const bf16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

template <int MT, int NT, typename WT>
inline void step_avx512(const float* x, int64_t K, const WT* q, int64_t k, __mmask16 mask,
                        __m512 (&acc)[MT][NT]) {
  __m512 w[NT];
  for (int n = 0; n < NT; ++n) w[n] = widen16(q + n * K + k, mask);
  for (int m = 0; m < MT; ++m) {
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_fmadd_ps(xv, w[n], acc[m][n]);
  }
}

template <int MT, int NT, typename WT>
void tile_avx512(const float* x, int64_t K, const WT* q, Tile<MT, NT>& t) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t kv = K / 16 * 16;
  for (int64_t k = 0; k < kv; k += 16)
    step_avx512<MT, NT, WT>(x, K, q, k, static_cast<__mmask16>(0xFFFF), acc);
  if (kv < K)
    step_avx512<MT, NT, WT>(x, K, q, kv, static_cast<__mmask16>((1u << (K - kv)) - 1), acc);
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) t.acc[m][n] = _mm512_reduce_add_ps(acc[m][n]);
}
#endif

// ---------------------------------------------------------------- driver

template <int MT, int NT, typename WT>
void run_tile(Isa isa, const float* x, int64_t K, const WT* q, Tile<MT, NT>& t) {
  switch (isa) {
#if PDS_I8_AVX512
    case kAvx512:
      return tile_avx512<MT, NT, WT>(x, K, q, t);
#endif
#if PDS_I8_AVX2
    case kAvx2:
      return tile_avx2<MT, NT, WT>(x, K, q, t);
#endif
    default:
      return tile_scalar<MT, NT, WT>(x, K, q, t);
  }
}

// The packed layout's tile: the AVX2 one on either SIMD path (its chunk is 8 floats).
template <int MT, int NT, typename WT>
void run_tile_packed(Isa isa, const float* x, int64_t K, const WT* p, Tile<MT, NT>& t) {
#if PDS_I8_AVX2
  if (isa != kScalar) return tile_avx2_packed<MT, NT, WT>(x, K, p, t);
#endif
  tile_scalar_packed<MT, NT, WT>(x, K, p, t);
}

template <typename WT>
struct Gemv {
  Isa isa;
  const float* x;  // [M, K] float32
  const WT* q;  // [N, K], or in tiles (packed)
  const float* scale;  // [N], or null (float weights: no scale)
  const float* bias;  // [N] float32 or null
  int64_t M, K, N;
  bool packed = false;  // q in gemv_pack's tile layout

  template <typename T, int MT, int NT>
  void block(int64_t m0, int64_t n0, T* y) const {
    Tile<MT, NT> t;
    // A tile starts at n0 * K in either layout (packed tiles are 4 whole rows).
    if (packed) {
      run_tile_packed<MT, NT, WT>(isa, x + m0 * K, K, q + n0 * K, t);
    } else {
      run_tile<MT, NT, WT>(isa, x + m0 * K, K, q + n0 * K, t);
    }
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n) {
        float v = scale ? t.acc[m][n] * scale[n0 + n] : t.acc[m][n];
        if (bias) v += bias[n0 + n];
        y[(m0 + m) * N + n0 + n] = static_cast<T>(v);
      }
  }

  template <typename T, int NT>
  void rows(int64_t n0, T* y) const {
    int64_t m0 = 0;
    for (; m0 + kTileM <= M; m0 += kTileM) block<T, kTileM, NT>(m0, n0, y);
    switch (M - m0) {
      case 3: block<T, 3, NT>(m0, n0, y); break;
      case 2: block<T, 2, NT>(m0, n0, y); break;
      case 1: block<T, 1, NT>(m0, n0, y); break;
      default: break;
    }
  }

  template <typename T>
  void operator()(T* y) const {
    const int64_t tiles = (N + kTileN - 1) / kTileN;
    const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, kTileN * K * M));
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n0 = i * kTileN;
        switch (std::min<int64_t>(kTileN, N - n0)) {
          case 4: rows<T, 4>(n0, y); break;
          case 3: rows<T, 3>(n0, y); break;
          case 2: rows<T, 2>(n0, y); break;
          default: rows<T, 1>(n0, y); break;
        }
      }
    });
  }
};

Isa resolve_isa(int64_t isa) {
  constexpr Isa best = PDS_I8_AVX512 ? kAvx512 : (PDS_I8_AVX2 ? kAvx2 : kScalar);
  if (isa == kAuto) return best;
  TORCH_CHECK(isa == kScalar || (isa == kAvx2 && PDS_I8_AVX2) ||
                  (isa == kAvx512 && PDS_I8_AVX512),
              "int8_linear: code path ", isa,
              " is not compiled in this build (0 scalar, 1 AVX2, 2 AVX-512; best here: ",
              static_cast<int64_t>(best), ")");
  return static_cast<Isa>(isa);
}

// Whether q is in gemv_pack's tile layout (4-D) rather than row-major [N, K].
bool tiled(const at::Tensor& q) { return q.dim() == 4; }

// Whether w has the shape of gemv_pack's tiles of an [n, K] weight, [ceil(n/4), K/8, 4, 8].
bool tiles_of(const at::Tensor& w, int64_t n) {
  return tiled(w) && w.size(0) == (n + kTileN - 1) / kTileN && w.size(2) == kTileN &&
         w.size(3) == kPackW;
}

void check_weight(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.device().is_cpu() && scale.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.is_contiguous(),
              "scale must be a contiguous float32 [N] tensor, got ", scale.scalar_type(), " ",
              scale.sizes());
  const int64_t N = scale.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() &&
                  ((q.dim() == 2 && q.size(0) == N) || tiles_of(q, N)),
              "q must be a contiguous int8 [N, K] tensor (or gemv_pack's [ceil(N/4), K/8, 4, "
              "8] of one) with N = ", N, " (scale's length), got ", q.scalar_type(), " ",
              q.sizes());
}

// A contiguous bfloat16 x as float32 (exact): a plain loop into a vector, where x.to()
// costs a dispatched op and a tensor per call (~1.5 us of a ~5 us decode GEMV call).
std::vector<float> widen_rows(const at::Tensor& x) {
  const int64_t n = x.numel();
  const auto* src = static_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&out[static_cast<size_t>(i)], &bits, sizeof(float));
  }
  return out;
}

// K of a weight in either layout.
int64_t weight_k(const at::Tensor& q) { return tiled(q) ? q.size(1) * kPackW : q.size(1); }

// Row n of a tiled weight (K elements) into dst.
template <typename T>
void gather_row(const T* q, int64_t K, int64_t n, T* dst) {
  const T* tile = q + (n / kTileN) * kTileN * K;
  const int64_t r = n % kTileN;
  for (int64_t c = 0; c < K / kPackW; ++c)
    std::memcpy(dst + c * kPackW, tile + (c * kTileN + r) * kPackW, kPackW * sizeof(T));
}

// v rounded to bfloat16, nearest-even, as c10::BFloat16 does for finite v (q * scale
// is never NaN); integer ops only, so the loop below vectorizes.
inline uint16_t to_bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
inline void dequantize_row(const int8_t* qr, float s, int64_t K, T* o) {
#if PDS_I8_AVX512
  // The same values as the scalar loop below, 16 at a time.
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const __mmask16 mask =
        K - k0 >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << (K - k0)) - 1);
    const __m512 v = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, qr + k0))), sv);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(o + k0, mask, v);
    } else {
      __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
      _mm256_mask_storeu_epi16(o + k0, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    }
  }
  return;
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = 0; k < K; ++k) o[k] = static_cast<float>(qr[k]) * s;
  } else {
    uint16_t* ob = reinterpret_cast<uint16_t*>(o);
    for (int64_t k = 0; k < K; ++k) ob[k] = to_bf16_bits(static_cast<float>(qr[k]) * s);
  }
}

// Rows [n0, n1) of q * scale in dtype T, into out (contiguous [n1 - n0, K]); q row-major
// or, ``packed``, in gemv_pack's tiles.
template <typename T>
void dequantize_rows(const int8_t* q, const float* scale, int64_t K, int64_t n0, int64_t n1,
                     T* out, bool packed) {
  at::parallel_for(n0, n1, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, K)),
                   [&](int64_t begin, int64_t end) {
    std::vector<int8_t> row(packed ? K : 0);
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* qr = q + n * K;
      if (packed) {
        gather_row(q, K, n, row.data());
        qr = row.data();
      }
      dequantize_row<T>(qr, scale[n], K, out + (n - n0) * K);
    }
  });
}

at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale,
                           c10::ScalarType dtype) {
  check_weight(q, scale);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int8_dequantize: dtype must be float32 or bfloat16, got ", dtype);
  at::Tensor out = at::empty({scale.size(0), weight_k(q)}, q.options().dtype(dtype));
  const int64_t N = scale.size(0), K = weight_k(q);
  if (dtype == at::kFloat) {
    dequantize_rows<float>(q.data_ptr<int8_t>(), scale.data_ptr<float>(), K, 0, N,
                           out.data_ptr<float>(), tiled(q));
  } else {
    dequantize_rows<bf16>(q.data_ptr<int8_t>(), scale.data_ptr<float>(), K, 0, N,
                          static_cast<bf16*>(out.data_ptr()), tiled(q));
  }
  return out;
}

// The GEMM path's product x @ wb.T. float32: oneDNN where this torch has it (the
// model's own float GEMMs run there too), its primitive built on the plain [N, K]
// block; at::mm's MKL SGEMM took 6-7% longer at 128-512 rows of SmolLM2's layers and as
// long at 64 and 2048 (2-core Zen 4, alternated in one process). bfloat16: at::mm, which
// reaches oneDNN itself (the same time here) and takes bfloat16 on CPUs whose oneDNN
// refuses it (AVX2 only).
at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& wb) {
  const auto& onednn = pds::onednn_linear_op();
  if (onednn && x.scalar_type() == at::kFloat)
    return pds::onednn_linear(*onednn, x, wb, std::nullopt);
  return at::mm(x, wb.t());
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias_in, int64_t max_gemv_rows,
                       int64_t isa_in) {
  check_weight(q, scale);
  TORCH_CHECK(x_in.device().is_cpu(), "CPU tensor expected");
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16,
              "int8_linear: x must be float32 or bfloat16, got ", dt);
  const int64_t N = scale.size(0), K = weight_k(q);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "int8_linear: x's last dim must be K = ",
              K, ", got ", x_in.sizes());
  const Isa isa = resolve_isa(isa_in);
  at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == N &&
                    (bias_in->scalar_type() == at::kFloat || bias_in->scalar_type() == dt),
                "int8_linear: bias must be [N] in float32 or x's dtype, got ",
                bias_in->scalar_type(), " ", bias_in->sizes());
    bias = bias_in->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(shape);

  if (M > max_gemv_rows) {
    // GEMM path: dequantize a block of weight rows, multiply, copy into y's columns.
    const int64_t block = std::max<int64_t>(
        16, kBlockBytes / (K * static_cast<int64_t>(c10::elementSize(dt))) / 16 * 16);
    at::Tensor w = at::empty({std::min(block, N), K}, x.options());
    for (int64_t n0 = 0; n0 < N; n0 += block) {
      const int64_t n1 = std::min(N, n0 + block);
      at::Tensor wb = w.narrow(0, 0, n1 - n0);
      if (dt == at::kFloat) {
        dequantize_rows<float>(q.data_ptr<int8_t>(), scale.data_ptr<float>(), K, n0, n1,
                               wb.data_ptr<float>(), tiled(q));
      } else {
        dequantize_rows<bf16>(q.data_ptr<int8_t>(), scale.data_ptr<float>(), K, n0, n1,
                              static_cast<bf16*>(wb.data_ptr()), tiled(q));
      }
      at::Tensor part = block_gemm(x, wb);
      if (bias.defined()) part.add_(bias.narrow(0, n0, n1 - n0).to(dt));
      y.narrow(1, n0, n1 - n0).copy_(part);
    }
    return y.view(shape);
  }

  const std::vector<float> xw = dt == at::kFloat ? std::vector<float>() : widen_rows(x);
  Gemv<int8_t> g{isa,     dt == at::kFloat ? x.data_ptr<float>() : xw.data(),
               q.data_ptr<int8_t>(), scale.data_ptr<float>(),
               bias.defined() ? bias.data_ptr<float>() : nullptr,
               M,       K,
               N};
  g.packed = tiled(q);
  if (dt == at::kFloat) {
    g(y.data_ptr<float>());
  } else {
    g(static_cast<bf16*>(y.data_ptr()));
  }
  return y.view(shape);
}

int64_t int8_best_isa() { return resolve_isa(kAuto); }

// The float GEMV of x_in [..., K] on w (an [N, K] weight, row-major or ``packed`` in
// tiles; float32, or bfloat16 with x bfloat16 too), checks named after ``op``.
at::Tensor run_f32_gemv(const char* op, const at::Tensor& x_in, const at::Tensor& w,
                        int64_t N, int64_t K, const std::optional<at::Tensor>& bias_in,
                        int64_t isa_in, bool packed) {
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && w.scalar_type() == dt,
              op, ": x and w must both be float32 or both bfloat16, got ", dt, " and ",
              w.scalar_type());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, op, ": x's last dim must be K = ", K,
              ", got ", x_in.sizes());
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == N &&
                    (bias_in->scalar_type() == at::kFloat || bias_in->scalar_type() == dt),
                op, ": bias must be [N] in float32 or x's dtype, got ",
                bias_in->scalar_type(), " ", bias_in->sizes());
    bias = bias_in->to(at::kFloat).contiguous();
  }
  at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y.view(shape);
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (dt == at::kFloat) {
    Gemv<float> g{resolve_isa(isa_in), x.data_ptr<float>(), w.data_ptr<float>(), nullptr,
                  b, M, K, N};
    g.packed = packed;
    g(y.data_ptr<float>());
  } else {
    const std::vector<float> xf = widen_rows(x);
    Gemv<bf16> g{resolve_isa(isa_in), xf.data(),
                 static_cast<const bf16*>(w.data_ptr()), nullptr, b, M, K, N};
    g.packed = packed;
    g(static_cast<bf16*>(y.data_ptr()));
  }
  return y.view(shape);
}

// y = x · wᵀ (+ bias) for x [..., K] and a contiguous weight [N, K] (both float32 or both
// bfloat16), by the GEMV above (every weight row read once for all rows of x): the decode
// path of float models, where a batch of one or a few tokens makes the GEMM a
// matrix-vector product bound by reading the weight (see workers/models/linear.py).
at::Tensor f32_gemv(const at::Tensor& x_in, const at::Tensor& w,
                    const std::optional<at::Tensor>& bias_in, int64_t isa_in) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "f32_gemv: w must be a contiguous [N, K] "
              "tensor, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  return run_f32_gemv("f32_gemv", x_in, w, N, K, bias_in, isa_in, false);
}

template <typename T>
void pack_tiles(const T* src, int64_t N, int64_t K, T* dst) {
  const int64_t tiles = (N + kTileN - 1) / kTileN, chunks = K / kPackW;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < chunks; ++c)
        for (int r = 0; r < kTileN; ++r) {
          T* o = dst + ((t * chunks + c) * kTileN + r) * kPackW;
          const int64_t n = t * kTileN + r;
          if (n < N) {
            std::memcpy(o, src + n * K + c * kPackW, kPackW * sizeof(T));
          } else {
            std::memset(o, 0, kPackW * sizeof(T));
          }
        }
  });
}

// [N, K] float32, bfloat16 or int8 (K a multiple of 8) -> [ceil(N/4), K/8, 4, 8], zero rows padding
// the last tile: the GEMV's tile layout (f32_gemv_packed; int8_linear takes either).
at::Tensor gemv_pack(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.device().is_cpu(), "CPU tensor expected");
  TORCH_CHECK((w_in.scalar_type() == at::kFloat || w_in.scalar_type() == at::kBFloat16 ||
                  w_in.scalar_type() == at::kChar) &&
                  w_in.dim() == 2,
              "gemv_pack: w must be a float32, bfloat16 or int8 [N, K] tensor, got ",
              w_in.scalar_type(),
              " ", w_in.sizes());
  const int64_t N = w_in.size(0), K = w_in.size(1);
  TORCH_CHECK(K % kPackW == 0, "gemv_pack: K must be a multiple of ", kPackW, ", got ", K);
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty({(N + kTileN - 1) / kTileN, K / kPackW, kTileN, kPackW},
                             w.options());
  if (w.scalar_type() == at::kFloat) {
    pack_tiles(w.data_ptr<float>(), N, K, out.data_ptr<float>());
  } else if (w.scalar_type() == at::kBFloat16) {
    pack_tiles(static_cast<const bf16*>(w.data_ptr()), N, K, static_cast<bf16*>(out.data_ptr()));
  } else {
    pack_tiles(w.data_ptr<int8_t>(), N, K, out.data_ptr<int8_t>());
  }
  return out;
}

// f32_gemv on a weight gemv_pack made of an [n, K] weight.
at::Tensor f32_gemv_packed(const at::Tensor& x_in, const at::Tensor& wp, int64_t n,
                           const std::optional<at::Tensor>& bias_in, int64_t isa_in) {
  TORCH_CHECK(tiles_of(wp, n) && wp.is_contiguous(),
              "f32_gemv_packed: wp must be gemv_pack's [ceil(n/4), K/8, 4, 8] of an [n, "
              "K] weight, got ", wp.sizes(), " for n = ", n);
  const int64_t N = n, K = wp.size(1) * kPackW;
  return run_f32_gemv("f32_gemv_packed", x_in, wp, N, K, bias_in, isa_in, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_kernels, m) {
  m.def(
      "int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias, int max_gemv_rows=16, "
      "int isa=-1) -> Tensor");
  m.def("int8_dequantize(Tensor q, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("int8_best_isa() -> int", &int8_best_isa);
  m.def("f32_gemv(Tensor x, Tensor w, Tensor? bias, int isa=-1) -> Tensor");
  m.def("gemv_pack(Tensor w) -> Tensor");
  m.def("f32_gemv_packed(Tensor x, Tensor wp, int n, Tensor? bias, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_kernels, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_dequantize", &int8_dequantize);
  m.impl("f32_gemv", &f32_gemv);
  m.impl("gemv_pack", &gemv_pack);
  m.impl("f32_gemv_packed", &f32_gemv_packed);
}
