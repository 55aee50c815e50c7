// y = x Wᵀ + b for a few rows of x (float32): the base products of a decode step with one
// to a few sequences, on a CPU. PyTorch runs these through MKL's sgemv/sgemm, which on
// AMD EPYC takes a generic code path (`mkl_blas_def_xsgemv`); on the layers of 4.0M- and
// 97.5M-parameter Llamas this kernel ran 1.2-3.9x faster (BENCHMARKS.md, issue 17,
// session 18). Built with the other kernels into one library by symbiont/kernels/library.py.
//
// W is [out, in] with rows `ws` apart (a checkpoint's own layout, or rows of a block of
// siblings); each row of x and y is contiguous. A tile of 8 rows of W (4 without AVX-512)
// is read once for the call's rows of x: with 1 or 2 rows in one pass, sums in registers;
// with more, 512 columns at a time, which stay in L1 while each pair of rows passes over
// them, so W, the bytes that bound the product, streams from memory once per call. Each
// lane sums its columns in order and lanes are summed by one tree, by one thread, so
// results depend neither on the thread count nor on the other rows of the call.
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
// rows of W per tile: 2 rows of x x 8 accumulators + 8 of W + x within 32 registers
constexpr int TILE = 8;
#else
typedef v8 vw;
constexpr int W_LANES = 8;
static inline v8 fold(vw a) { return a; }
constexpr int TILE = 4;  // within 16 registers
#endif

static inline vw ldw(const float* p) { return *reinterpret_cast<const vw*>(p); }

constexpr int MAX_ROWS = 8;  // rows of x per call of `tile` (callers send up to 7)
// Columns of a tile of W that stay in L1 while each pair of rows of x passes over them:
// W streams from memory once per call however many rows x has (8 rows x 512 floats: 16 KiB)
constexpr int64_t CHUNK = 512;

// part[r * O + j] += lanes of x[r] · w[j] over columns [i0, i1) (whole vectors)
template <int N, int O>
static inline void pass(const float* x, int64_t xs, const float* w, int64_t ws, int64_t i0,
                        int64_t i1, vw* part) {
    vw acc[N * O];
    for (int a = 0; a < N * O; a++) acc[a] = part[a];
    for (int64_t i = i0; i < i1; i += W_LANES) {
        vw wv[O];
        for (int j = 0; j < O; j++) wv[j] = ldw(w + j * ws + i);
        for (int r = 0; r < N; r++) {
            const vw xv = ldw(x + r * xs + i);
            for (int j = 0; j < O; j++) acc[r * O + j] += xv * wv[j];
        }
    }
    for (int a = 0; a < N * O; a++) part[a] = acc[a];
}

// the sum of a's lanes, by sum8's tree (the same bits whichever way it is reached)
static inline float lanes(vw a) {
    const v8 f = fold(a);
    return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}

// y[j] = the lanes of acc[j], plus the columns past the whole vectors, plus b[j], for one
// row x of the tile's j < O rows of W
template <int O>
static inline void finish(const vw* acc, const float* x, const float* w, int64_t ws,
                          int64_t whole, int64_t in, const float* b, float* y) {
    float sums[O];
    if constexpr (O == 8) {  // eight accumulators' lanes summed at once
        v8 f[8];
        for (int k = 0; k < 8; k++) f[k] = fold(acc[k]);
        st(sums, sum8(f));
    } else {
        for (int j = 0; j < O; j++) sums[j] = lanes(acc[j]);
    }
    for (int j = 0; j < O; j++) {
        float t = sums[j];
        for (int64_t k = whole; k < in; k++) t += x[k] * w[j * ws + k];  // the tail
        y[j] = b ? t + b[j] : t;
    }
}

// y[r, j] = x[r] · w[j] + b[j] for r < n (3 to MAX_ROWS), j < O; w points at the tile's
// first row. Each lane sums its columns in order, chunk after chunk, as one pass would.
template <int O>
static void chunked_tile(const float* x, int64_t xs, int64_t n, const float* w, int64_t ws,
                         int64_t in, const float* b, float* y, int64_t ys) {
    vw part[MAX_ROWS * O];
    for (int64_t a = 0; a < n * O; a++) part[a] = vw{};
    const int64_t whole = in / W_LANES * W_LANES;
    for (int64_t c = 0; c < whole; c += CHUNK) {
        const int64_t end = c + CHUNK < whole ? c + CHUNK : whole;
        int64_t r = 0;
        for (; r + 2 <= n; r += 2) pass<2, O>(x + r * xs, xs, w, ws, c, end, part + r * O);
        if (r < n) pass<1, O>(x + r * xs, xs, w, ws, c, end, part + r * O);
    }
    for (int64_t r = 0; r < n; r++)
        finish<O>(part + r * O, x + r * xs, w, ws, whole, in, b, y + r * ys);
}

// y[r, j] = x[r] · w[j] + b[j] for r < N (1 or 2), j < O, in one pass with every sum in
// registers: the same bits as `chunked_tile` (each lane sums its columns in order)
template <int N, int O>
static inline void tile(const float* x, int64_t xs, const float* w, int64_t ws, int64_t in,
                        const float* b, float* y, int64_t ys) {
    vw acc[N * O];
    for (int a = 0; a < N * O; a++) acc[a] = vw{};
    const int64_t whole = in / W_LANES * W_LANES;
    for (int64_t i = 0; i < whole; i += W_LANES) {
        vw wv[O];
        for (int j = 0; j < O; j++) wv[j] = ldw(w + j * ws + i);
        for (int r = 0; r < N; r++) {
            const vw xv = ldw(x + r * xs + i);
            for (int j = 0; j < O; j++) acc[r * O + j] += xv * wv[j];
        }
    }
    for (int r = 0; r < N; r++) finish<O>(acc + r * O, x + r * xs, w, ws, whole, in, b, y + r * ys);
}

// rows [0, N) of x (N: 1 or 2) against rows [o0, o1) of W
template <int N>
static void tiles(const float* x, int64_t xs, const float* w, int64_t ws, int64_t in,
                  int64_t o0, int64_t o1, const float* b, float* y, int64_t ys) {
    int64_t o = o0;
    for (; o + TILE <= o1; o += TILE)
        tile<N, TILE>(x, xs, w + o * ws, ws, in, b ? b + o : nullptr, y + o, ys);
    for (; o < o1; o++) tile<N, 1>(x, xs, w + o * ws, ws, in, b ? b + o : nullptr, y + o, ys);
}

// rows [0, n) of x (3 <= n <= MAX_ROWS) against rows [o0, o1) of W
static void chunked_tiles(const float* x, int64_t xs, int64_t n, const float* w, int64_t ws,
                          int64_t in, int64_t o0, int64_t o1, const float* b, float* y,
                          int64_t ys) {
    int64_t o = o0;
    for (; o + TILE <= o1; o += TILE)
        chunked_tile<TILE>(x, xs, n, w + o * ws, ws, in, b ? b + o : nullptr, y + o, ys);
    for (; o < o1; o++)
        chunked_tile<1>(x, xs, n, w + o * ws, ws, in, b ? b + o : nullptr, y + o, ys);
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
        for (int64_t r = 0; o0 < o1 && r < n; r += MAX_ROWS) {
            const int64_t rows = n - r < MAX_ROWS ? n - r : MAX_ROWS;
            const float* xr = x + r * xs;
            float* yr = y + r * ys;
            if (rows == 1)
                tiles<1>(xr, xs, w, ws, in, o0, o1, b, yr, ys);
            else if (rows == 2)
                tiles<2>(xr, xs, w, ws, in, o0, o1, b, yr, ys);
            else
                chunked_tiles(xr, xs, rows, w, ws, in, o0, o1, b, yr, ys);
        }
    }
}
