// Vector helpers shared by symbiont's CPU kernels (GCC vector extensions, 8 floats).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

// may_alias and aligned(4): loaded and stored straight from float rows. (Through memcpy,
// GCC at -march=haswell split each load into two 16-byte halves put together on the stack.)
typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i8 __attribute__((vector_size(32), aligned(4)));

static inline v8 ld(const float* p) { return *reinterpret_cast<const v8*>(p); }
static inline void st(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }
static inline v8 splat(float a) { return v8{a, a, a, a, a, a, a, a}; }

static inline void prefetch_row(const float* p, int64_t hd) {
    for (int64_t i = 0; i < hd; i += 16) __builtin_prefetch(p + i);  // 16 floats: a cache line
}

// [a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, ..., b6+b7]
static inline v8 pairsum(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
// [sum of a[0]'s lanes, ..., sum of a[7]'s lanes]
static inline v8 sum8(const v8* a) {
    v8 s01 = pairsum(a[0], a[1]), s23 = pairsum(a[2], a[3]);
    v8 s45 = pairsum(a[4], a[5]), s67 = pairsum(a[6], a[7]);
    return pairsum(pairsum(s01, s23), pairsum(s45, s67));
}

// exp of each lane: Cephes' expf (range reduction by ln 2, degree-5 polynomial), about 1 ulp
static inline v8 vexp(v8 x) {
    // clamped so that a NaN stays NaN (and reaches the output, as with SDPA)
    x = x > splat(88.3762626647949f) ? splat(88.3762626647949f) : x;
    x = x < splat(-88.3762626647949f) ? splat(-88.3762626647949f) : x;
    v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
    // floor as a truncation corrected for negatives (|fx| <= 128 here): a per-lane
    // floorf compiled to one scalar instruction per lane
    v8 fl = __builtin_convertvector(__builtin_convertvector(fx, i8), v8);
    fl = fl > fx ? fl - 1.0f : fl;
    x = x - fl * splat(0.693359375f) - fl * splat(-2.12194440e-4f);
    v8 z = x * x;
    v8 y = splat(1.9875691500E-4f);
    y = y * x + splat(1.3981999507E-3f);
    y = y * x + splat(8.3334519073E-3f);
    y = y * x + splat(4.1665795894E-2f);
    y = y * x + splat(1.6666665459E-1f);
    y = y * x + splat(5.0000001201E-1f);
    y = y * z + x + splat(1.0f);
    i8 e = (__builtin_convertvector(fl, i8) + 127) << 23;
    return y * (v8)e;  // a cast between vector types of one size keeps the bits
}
