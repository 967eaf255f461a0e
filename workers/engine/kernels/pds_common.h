// Helpers the bit-exact kernels (fused_ops.cpp, kv_encode.cpp) share, in one place.
//
// keep(v) / keepv(v): an opaque copy of a float (or a 16-float AVX-512 vector). It stops
// the compiler contracting the multiply that produced v into a following add: torch
// rounds the product first, and GCC contracts a * b + c into an FMA by default in C++.
// to_f(v): any element type as float.
//
// Part of the kernel build's cache key (workers/engine/kernels/__init__.py HEADERS).

#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pds {

inline float keep(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  asm volatile("" : "+m"(v));
#endif
  return v;
}

#if defined(__AVX512F__)
inline __m512 keepv(__m512 v) {
  asm("" : "+v"(v));
  return v;
}
#endif

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

}  // namespace pds
