// What every source of the native layer shares: the XLA FFI API and the eight-float vectors the
// kernels compute with (Load, Splat, Sum). Everything here is static inline: these run in the
// innermost loops of every source file.

#ifndef JAXDECODE_CSRC_COMMON_H_
#define JAXDECODE_CSRC_COMMON_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdecode {

// Eight-float vectors (AVX with -march=native, two SSE registers otherwise).
typedef float v8 __attribute__((vector_size(32)));

static inline v8 Load(const float* p) {
  v8 r;
  __builtin_memcpy(&r, p, sizeof r);
  return r;
}

// All eight lanes equal to a (one broadcast; `v8{} + a` would first add a to zero).
static inline v8 Splat(float a) { return v8{a, a, a, a, a, a, a, a}; }

// The sum of the eight lanes, always in this order (attend.h's Sum4 repeats it bit for bit).
static inline float Sum(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

}  // namespace jaxdecode

#endif  // JAXDECODE_CSRC_COMMON_H_
