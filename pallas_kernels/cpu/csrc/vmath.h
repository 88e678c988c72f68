// The 16-float vector types of the C++ CPU kernels (gemv.h's products use them too) and their
// elementwise math: exp of non-positive arguments (attention's softmax) and the SwiGLU activation
// silu(g) * u (the expert FFN). Each has a vector form and a one-lane form that compute the same
// bits, so a value never depends on where it sits in an array (a plain step and a verification
// pass agree bit for bit).

#ifndef MOESPEC_CSRC_VMATH_H_
#define MOESPEC_CSRC_VMATH_H_

#include <cstdint>
#include <cstring>

namespace moespec {

// 16 floats / ints: one AVX-512 register (two AVX2 ones), loaded from any float-aligned address.
typedef float F16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t I16 __attribute__((vector_size(64), aligned(4)));
typedef float F1 __attribute__((vector_size(4)));
typedef int32_t I1 __attribute__((vector_size(4)));
constexpr int kLanes = 16;

// exp(x) for x <= 0: Cody-Waite reduction to |r| <= ln2 / 2 and Cephes' degree-6 polynomial,
// ~1 ulp; x below `lowest` (~ -87, where exp leaves the normal floats) counts as `lowest`.
template <typename F, typename I>
inline F ExpNonPositiveOf(F x, F lowest) {
  x = x < lowest ? lowest : x;
  const I n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);  // rounds (x <= 0)
  const F nf = __builtin_convertvector(n, F);
  const F r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<const F&>(static_cast<const I&>((n + 127) << 23));
}

// silu(g) * u = g * sigmoid(g) * u, with sigmoid from e = exp(-|g|) <= 1 on both sides of 0:
// 1 / (1 + e) for g >= 0, e / (1 + e) below (no overflow for any g).
template <typename F, typename I>
inline F SwigluOf(F g, F u) {
  const F zero = g - g;
  const F neg_abs = g < zero ? g : zero - g;
  const F e = ExpNonPositiveOf<F, I>(neg_abs, zero - 87.0f);
  const F num = g < zero ? e : zero + 1.0f;
  return g * (num / (e + 1.0f)) * u;
}

// g[i] = silu(g[i]) * u[i] for i < n.
inline void SwigluInPlace(float* g, const float* u, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    F16 gv, uv;
    std::memcpy(&gv, g + i, sizeof(gv));
    std::memcpy(&uv, u + i, sizeof(uv));
    gv = SwigluOf<F16, I16>(gv, uv);
    std::memcpy(g + i, &gv, sizeof(gv));
  }
  for (; i < n; ++i) g[i] = SwigluOf<F1, I1>(F1{g[i]}, F1{u[i]})[0];
}

}  // namespace moespec

#endif  // MOESPEC_CSRC_VMATH_H_
