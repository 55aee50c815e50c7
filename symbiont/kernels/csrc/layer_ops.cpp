// RMSNorm (with the residual add before it) and rotary embedding of a Llama-shaped decoder
// layer, one pass over memory each, for the serving engine on a CPU (float32). PyTorch
// runs each as several operations (its CPU RMSNorm alone is six: square, mean, add,
// rsqrt, two multiplies; rotary embedding of queries and keys seven), and in a decode
// step of a small model each operation's dispatch costs more than its arithmetic. Built
// with decode_attention.cpp into one library by symbiont/serve/decode_kernel.py.
//
// Rows are tokens; every kernel takes a row stride and needs each row contiguous. Rows
// are split across OpenMP threads only where there is enough work to pay for waking them.
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

// fn(r) for every row r, on `threads` threads where the rows hold enough work to pay for
// waking them (a decode step's few rows stay on the caller's thread)
template <class F>
static inline void for_rows(int64_t rows, int64_t elements, int threads, F fn) {
#ifdef _OPENMP
    if (threads > 1 && elements >= (int64_t(1) << 16)) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = 0; r < rows; r++) fn(r);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) fn(r);
}

// Rotary embedding is bitwise transformers' only if a * c - b * s is not contracted into
// one fused multiply-add, which -O3 otherwise does
#if defined(__clang__)
#define NO_FMA_CONTRACTION _Pragma("clang fp contract(off)")
#define NO_FMA_CONTRACTION_FN
#else
#define NO_FMA_CONTRACTION
#define NO_FMA_CONTRACTION_FN __attribute__((optimize("fp-contract=off")))
#endif

// [v] -> sum of its lanes, pairwise (the order is fixed, so results do not depend on
// the thread count)
static inline float hsum(v8 v) {
    const float a = (v[0] + v[4]) + (v[2] + v[6]);
    const float b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}

// h = x + res (if res), out = h / sqrt(mean(h^2) + eps) * w, row by row. x, res, h and out
// are [rows, dim] with row strides; res and h are null for the RMSNorm of x alone.
extern "C" void rms_norm(
    const float* x, int64_t xs, const float* res, int64_t rs, float* h, int64_t hs,
    const float* w, float* out, int64_t os, int64_t rows, int64_t dim, float eps, int threads)
{
    for_rows(rows, rows * dim, threads, [&](int64_t r) {
        const float* xr = x + r * xs;
        if (res != nullptr) {  // the residual sum, kept for the next residual add
            const float* rr = res + r * rs;
            float* hr = h + r * hs;
            int64_t i = 0;
            for (; i + 8 <= dim; i += 8) st(hr + i, ld(xr + i) + ld(rr + i));
            for (; i < dim; i++) hr[i] = xr[i] + rr[i];
            xr = hr;
        }
        v8 acc = splat(0.0f);
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const v8 a = ld(xr + i);
            acc += a * a;
        }
        float tail = 0.0f;
        for (; i < dim; i++) tail += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt((hsum(acc) + tail) / float(dim) + eps);
        const v8 vinv = splat(inv);
        float* o = out + r * os;
        for (i = 0; i + 8 <= dim; i += 8) st(o + i, ld(w + i) * (ld(xr + i) * vinv));
        for (; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    });
}

// One token's rotary embedding of one head: y = x * cos + rotate_half(x) * sin, where
// rotate_half(x) = [-x[half:], x[:half]]. Never inlined: inside its caller the caller's
// contraction setting would apply.
static NO_FMA_CONTRACTION_FN __attribute__((noinline)) void rotate_row(
    const float* x, const float* c, const float* s, float* y, int64_t half)
{
    NO_FMA_CONTRACTION
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {  // both halves of the rotation at once
        const v8 a = ld(x + i), b = ld(x + half + i);
        st(y + i, a * ld(c + i) - b * ld(s + i));
        st(y + half + i, b * ld(c + half + i) + a * ld(s + half + i));
    }
    for (; i < half; i++) {
        y[i] = x[i] * c[i] - x[half + i] * s[i];
        y[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
    }
}

// Rotary position embedding of queries and keys, as transformers' Llama applies it.
// q [n, qh, hd] and k [n, kh, hd] (token and head strides; hd contiguous), cos and sin
// [n, hd] (row stride cs) -> out [qh + kh, n, hd] contiguous: heads first, as the
// attention reads them.
extern "C" void rotary(
    const float* q, int64_t qs0, int64_t qs1, int64_t qh,
    const float* k, int64_t ks0, int64_t ks1, int64_t kh,
    const float* cos, const float* sin, int64_t cs,
    float* out, int64_t n, int64_t hd, int threads)
{
    const int64_t heads = qh + kh;
    for_rows(n, n * heads * hd, threads, [&](int64_t t) {
        for (int64_t h = 0; h < heads; h++) {
            const float* x = h < qh ? q + t * qs0 + h * qs1 : k + t * ks0 + (h - qh) * ks1;
            rotate_row(x, cos + t * cs, sin + t * cs, out + (h * n + t) * hd, hd / 2);
        }
    });
}
