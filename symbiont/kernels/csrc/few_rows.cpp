// y = x Wᵀ + b for a few rows of x (float32): the base products of a decode step with one
// to a few sequences, on a CPU. PyTorch runs these through MKL's sgemv/sgemm, which on
// AMD EPYC takes a generic code path (`mkl_blas_def_xsgemv`); on the layers of 4.0M- and
// 97.5M-parameter Llamas this kernel ran 1.2-4.0x faster (BENCHMARKS.md, issue 17,
// session 18). Built with the other kernels into one library by symbiont/kernels/library.py.
//
// W is [out, in] with rows `ws` apart (a checkpoint's own layout, or rows of a block of
// siblings); each row of x and y is contiguous. A tile of O rows of W is read once for N
// rows of x, with N*O accumulators in registers, so W, the bytes that bound the product,
// streams from memory once per 4 rows of x. Each output is summed by one thread in one
// order (lanes by one tree, whichever tile computes it), so results depend neither on the
// thread count nor on the other rows of the call.
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

#ifdef __AVX512F__
typedef float vw __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int W_LANES = 16;
// [a0+a8, ..., a7+a15]
static inline v8 fold(vw a) {
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
// rows of W per tile for 4, 2 and 1 rows of x: accumulators + W + x within 32 registers
constexpr int TILE4 = 4, TILE2 = 8, TILE1 = 8;
#else
typedef v8 vw;
constexpr int W_LANES = 8;
static inline v8 fold(vw a) { return a; }
constexpr int TILE4 = 2, TILE2 = 4, TILE1 = 4;  // within 16 registers
#endif

static inline vw ldw(const float* p) { return *reinterpret_cast<const vw*>(p); }

// y[r, j] = x[r] · w[j] + b[j] for r < N, j < O; w points at the tile's first row
template <int N, int O>
static inline void tile(const float* x, int64_t xs, const float* w, int64_t ws, int64_t in,
                        const float* b, float* y, int64_t ys) {
    vw acc[N * O];
    for (int a = 0; a < N * O; a++) acc[a] = vw{};
    int64_t i = 0;
    for (; i + W_LANES <= in; i += W_LANES) {
        vw wv[O];
        for (int j = 0; j < O; j++) wv[j] = ldw(w + j * ws + i);
        for (int r = 0; r < N; r++) {
            const vw xv = ldw(x + r * xs + i);
            for (int j = 0; j < O; j++) acc[r * O + j] += xv * wv[j];
        }
    }
    constexpr int EIGHTS = N * O / 8 * 8;
    float sums[N * O];
    for (int a = 0; a < EIGHTS; a += 8) {  // eight accumulators' lanes summed at once
        v8 f[8];
        for (int k = 0; k < 8; k++) f[k] = fold(acc[a + k]);
        st(sums + a, sum8(f));
    }
    for (int a = EIGHTS; a < N * O; a++) {
        const v8 f = fold(acc[a]);
        sums[a] = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));  // sum8's tree
    }
    for (int r = 0; r < N; r++)
        for (int j = 0; j < O; j++) {
            float t = sums[r * O + j];
            for (int64_t k = i; k < in; k++) t += x[r * xs + k] * w[j * ws + k];  // tail
            y[r * ys + j] = b ? t + b[j] : t;
        }
}

// rows [0, N) of x against rows [o0, o1) of W
template <int N, int O>
static void tiles(const float* x, int64_t xs, const float* w, int64_t ws, int64_t in,
                  int64_t o0, int64_t o1, const float* b, float* y, int64_t ys) {
    int64_t o = o0;
    for (; o + O <= o1; o += O) tile<N, O>(x, xs, w + o * ws, ws, in, b ? b + o : nullptr, y + o, ys);
    for (; o < o1; o++) tile<N, 1>(x, xs, w + o * ws, ws, in, b ? b + o : nullptr, y + o, ys);
}

// x [n, in] (row stride xs), w [out, in] (row stride ws), b [out] or null -> y [n, out]
// (row stride ys). The outputs are split across `threads` threads in runs of 8 rows of W
// where W is big enough to pay for waking them.
extern "C" void few_rows_linear(const float* x, int64_t xs, int64_t n, const float* w, int64_t ws,
                                int64_t in, int64_t out, const float* b, float* y, int64_t ys,
                                int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1 && out * in >= (int64_t(1) << 18))
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int64_t per = ((out + nt - 1) / nt + 7) / 8 * 8;
        const int64_t o0 = t * per, o1 = o0 + per < out ? o0 + per : out;
        for (int64_t r = 0; o0 < o1 && r < n;) {
            const float* xr = x + r * xs;
            float* yr = y + r * ys;
            if (n - r >= 4) {
                tiles<4, TILE4>(xr, xs, w, ws, in, o0, o1, b, yr, ys);
                r += 4;
            } else if (n - r >= 2) {
                tiles<2, TILE2>(xr, xs, w, ws, in, o0, o1, b, yr, ys);
                r += 2;
            } else {
                tiles<1, TILE1>(xr, xs, w, ws, in, o0, o1, b, yr, ys);
                r += 1;
            }
        }
    }
}
