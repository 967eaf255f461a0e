#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// plain read bandwidth
double readsum(torch::Tensor w) {
  const float* p = w.data_ptr<float>();
  int64_t n = w.numel();
  std::vector<double> parts(64, 0.0);
  at::parallel_for(0, n / 64, 1024, [&](int64_t b, int64_t e) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4=a0,a5=a0,a6=a0,a7=a0;
    for (int64_t i = b; i < e; ++i) {
      const float* q = p + i * 64;
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(q));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(q + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(q + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(q + 24));
      a4 = _mm256_add_ps(a4, _mm256_loadu_ps(q + 32));
      a5 = _mm256_add_ps(a5, _mm256_loadu_ps(q + 40));
      a6 = _mm256_add_ps(a6, _mm256_loadu_ps(q + 48));
      a7 = _mm256_add_ps(a7, _mm256_loadu_ps(q + 56));
    }
    parts[at::get_thread_num()] += hsum(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)),_mm256_add_ps(_mm256_add_ps(a4,a5),_mm256_add_ps(a6,a7))));
  });
  double s = 0; for (double v : parts) s += v; return s;
}

// pack [N, K] -> [N/4][K/8][4][8]  (N % 4 == 0, K % 8 == 0)
torch::Tensor pack4(torch::Tensor w) {
  int64_t N = w.size(0), K = w.size(1);
  auto out = torch::empty({N * K}, w.options());
  const float* s = w.data_ptr<float>(); float* d = out.data_ptr<float>();
  for (int64_t t = 0; t < N / 4; ++t)
    for (int64_t k = 0; k < K / 8; ++k)
      for (int r = 0; r < 4; ++r)
        for (int j = 0; j < 8; ++j)
          d[((t * (K / 8) + k) * 4 + r) * 8 + j] = s[(t * 4 + r) * K + k * 8 + j];
  return out;
}

template <int PF>
void packed_gemv_impl(const float* x, const float* w, float* y, int64_t N, int64_t K) {
  const int64_t tiles = N / 4;
  at::parallel_for(0, tiles, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* p = w + t * 4 * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < K; k += 8, p += 32) {
        if (PF) { _mm_prefetch((const char*)(p + PF), _MM_HINT_T0); _mm_prefetch((const char*)(p + PF + 16), _MM_HINT_T0); }
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p + 8), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p + 16), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(p + 24), a3);
      }
      y[t * 4] = hsum(a0); y[t * 4 + 1] = hsum(a1); y[t * 4 + 2] = hsum(a2); y[t * 4 + 3] = hsum(a3);
    }
  });
}

torch::Tensor packed_gemv(torch::Tensor x, torch::Tensor wp, int64_t N, int64_t K, int64_t pf) {
  auto y = torch::empty({N}, x.options());
  switch (pf) {
    case 0: packed_gemv_impl<0>(x.data_ptr<float>(), wp.data_ptr<float>(), y.data_ptr<float>(), N, K); break;
    case 1: packed_gemv_impl<128>(x.data_ptr<float>(), wp.data_ptr<float>(), y.data_ptr<float>(), N, K); break;
    case 2: packed_gemv_impl<256>(x.data_ptr<float>(), wp.data_ptr<float>(), y.data_ptr<float>(), N, K); break;
    default: packed_gemv_impl<512>(x.data_ptr<float>(), wp.data_ptr<float>(), y.data_ptr<float>(), N, K); break;
  }
  return y;
}

// row-major, one row at a time with 4 accumulators (pure sequential stream)
torch::Tensor row_gemv(torch::Tensor x, torch::Tensor w) {
  int64_t N = w.size(0), K = w.size(1);
  auto y = torch::empty({N}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const float* p = wp + n * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + k), _mm256_loadu_ps(p + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + k + 8), _mm256_loadu_ps(p + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + k + 16), _mm256_loadu_ps(p + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + k + 24), _mm256_loadu_ps(p + k + 24), a3);
      }
      for (; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + k), _mm256_loadu_ps(p + k), a0);
      yp[n] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("readsum", &readsum); m.def("pack4", &pack4); m.def("packed_gemv", &packed_gemv); m.def("row_gemv", &row_gemv);
}
