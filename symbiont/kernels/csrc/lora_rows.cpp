// LoRA for tokens one by one, each reading its own adapter's rows in place (float32): the
// serving engine's decoding sequences, each on another adapter (symbiont/serve/adapters.py,
// `LoraRows`). y[t] += (x[t] · A[s]ᵀ) · (B[s]ᵀ·scale) for each row (t, s, r) of the call.
// Built with the other kernels into one library by symbiont/kernels/library.py.
//
// A step of 32 sequences on 32 adapters must read every one's A and B in every adapted
// layer: the bytes bound it. PyTorch's embedding_bag, which did this before, streamed B at
// about 11 GB/s and Aᵀ at 21 on one core of a machine whose core streams 30; here each
// adapter's rows are read front to back, as the stacks hold them:
//   Aᵀ  [slots, chunks, in, 16]: chunk c of slot s holds ranks 16c..16c+15 of each input
//       feature (zero beyond the slot's rank), one 64-byte line per feature;
//   B   [slots, r_max, out]: row k of slot s is B[s][:, k]·scale (zero beyond the rank).
// Each row's sums run in a fixed order on one thread, so results depend neither on the
// thread count nor on the other rows of the call.
#include <cstdint>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

constexpr int RANK_CHUNK = 16;
constexpr int64_t MAX_CHUNKS = 64;  // ranks up to 1024 (lora_rows.py checks)

// h[0:16] = Σ_i x[i] · at[i][0:16] over i < n: one chunk of Aᵀ ([n, 16]). Four partial sums
// (features i mod 4) keep four FMA chains in flight.
static inline void shrink_chunk(const float* x, const float* at, int64_t n, float* h) {
    v8 lo[4] = {splat(0.f), splat(0.f), splat(0.f), splat(0.f)};
    v8 hi[4] = {splat(0.f), splat(0.f), splat(0.f), splat(0.f)};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float* p = at + i * RANK_CHUNK;
        for (int u = 0; u < 4; u++) {
            const v8 xv = splat(x[i + u]);
            lo[u] += xv * ld(p + u * RANK_CHUNK);
            hi[u] += xv * ld(p + u * RANK_CHUNK + 8);
        }
    }
    for (; i < n; i++) {
        const float* p = at + i * RANK_CHUNK;
        const v8 xv = splat(x[i]);
        lo[0] += xv * ld(p);
        hi[0] += xv * ld(p + 8);
    }
    st(h, (lo[0] + lo[1]) + (lo[2] + lo[3]));
    st(h + 8, (hi[0] + hi[1]) + (hi[2] + hi[3]));
}

// d[0:out] += Σ_k h[k] · b[k][0:out] over k in [k, r) in passes of ROWS rows of b (`out`
// apart), each pass reading d once from L1 while ROWS streams of B come from memory.
// Returns the first row not done (fewer than ROWS left). Eight rows a pass streamed B
// 1.25x faster than two (BENCHMARKS.md, session 19).
template <int ROWS>
static inline int64_t expand_pass(const float* h, const float* b, int64_t k, int64_t r,
                                  int64_t out, float* d) {
    const int64_t whole = out & ~int64_t(7);
    for (; k + ROWS <= r; k += ROWS) {
        const float* bk = b + k * out;
        v8 hv[ROWS];
        for (int j = 0; j < ROWS; j++) hv[j] = splat(h[k + j]);
        int64_t o = 0;
        for (; o < whole; o += 8) {
            v8 acc = hv[0] * ld(bk + o);
            for (int j = 1; j < ROWS; j++) acc += hv[j] * ld(bk + j * out + o);
            st(d + o, ld(d + o) + acc);
        }
        for (; o < out; o++) {
            float acc = h[k] * bk[o];
            for (int j = 1; j < ROWS; j++) acc += h[k + j] * bk[j * out + o];
            d[o] += acc;
        }
    }
    return k;
}

// d[0:out] = Σ_k h[k] · b[k][0:out] over k < r
static inline void expand(const float* h, const float* b, int64_t r, int64_t out, float* d) {
    for (int64_t o = 0; o < out; o++) d[o] = 0.f;
    const int64_t k = expand_pass<8>(h, b, 0, r, out, d);
    expand_pass<1>(h, b, k, r, out, d);
}

extern "C" {

// For each row j < n_rows: token t = tokens[j] (rows of x and y `xs` and `ys` apart),
// slot s = slots[j], rank r = ranks[j] (at most 16·chunks and r_max; the caller checks
// every index): y[t] += expand(shrink(x[t])). Tokens are distinct, so threads split rows.
void lora_rows(const float* x, int64_t xs, const int64_t* tokens, const int64_t* slots,
               const int64_t* ranks, int64_t n_rows, const float* a_t, int64_t chunks,
               int64_t in, const float* b, int64_t r_max, int64_t out, float* y, int64_t ys,
               int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && n_rows > 1)
    {
        std::vector<float> d(out);
        float h[RANK_CHUNK * MAX_CHUNKS];
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n_rows; j++) {
            const int64_t t = tokens[j], s = slots[j], r = ranks[j];
            const float* xt = x + t * xs;
            const int64_t used = (r + RANK_CHUNK - 1) / RANK_CHUNK;
            for (int64_t c = 0; c < used; c++) {
                shrink_chunk(xt, a_t + (s * chunks + c) * in * RANK_CHUNK, in, h + c * RANK_CHUNK);
            }
            expand(h, b + s * r_max * out, r, out, d.data());
            float* yt = y + t * ys;
            for (int64_t o = 0; o < out; o++) yt[o] += d[o];
        }
    }
}

}  // extern "C"
