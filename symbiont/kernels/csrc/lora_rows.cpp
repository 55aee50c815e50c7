// LoRA for tokens one by one, each reading its own adapter's rows in place: the
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
// x and y are float32; the stacks are float32 (`lora_rows`) or bfloat16 (`lora_rows_bf16`:
// half the bytes, each value widened exactly to float32 before it is used). Each row's sums
// run in float32 in a fixed order on one thread, so results depend neither on the thread
// count nor on the other rows of the call.
#include <cstdint>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "vec.h"

constexpr int RANK_CHUNK = 16;
constexpr int64_t MAX_CHUNKS = 64;  // ranks up to 1024 (lora_rows.py checks)

typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
// 8 weights as float32: loaded as they are, or bfloat16 widened (its bits are a float32's
// upper half, so the widening is exact)
static inline v8 ldw(const float* p) { return ld(p); }
#ifdef __AVX2__
// one vpmovzxwd from memory (through the vector types GCC split the load in 8-byte parts,
// and the bfloat16 kernel ran slower than the float32 one on half the bytes)
static inline v8 ldw(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return (v8)_mm256_slli_epi32(wide, 16);  // a cast between vector types of one size keeps the bits
}
#else
static inline v8 ldw(const uint16_t* p) {
    const u32x8 wide = __builtin_convertvector(*reinterpret_cast<const u16x8*>(p), u32x8) << 16;
    return (v8)wide;
}
#endif
static inline float w1(float w) { return w; }
static inline float w1(uint16_t w) {
    const uint32_t bits = uint32_t(w) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// h[0:16] = Σ_i x[i] · at[i][0:16] over i < n: one chunk of Aᵀ ([n, 16]). Four partial sums
// (features i mod 4) keep four FMA chains in flight.
template <typename W>
static inline void shrink_chunk(const float* x, const W* at, int64_t n, float* h) {
    v8 lo[4] = {splat(0.f), splat(0.f), splat(0.f), splat(0.f)};
    v8 hi[4] = {splat(0.f), splat(0.f), splat(0.f), splat(0.f)};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const W* p = at + i * RANK_CHUNK;
        for (int u = 0; u < 4; u++) {
            const v8 xv = splat(x[i + u]);
            lo[u] += xv * ldw(p + u * RANK_CHUNK);
            hi[u] += xv * ldw(p + u * RANK_CHUNK + 8);
        }
    }
    for (; i < n; i++) {
        const W* p = at + i * RANK_CHUNK;
        const v8 xv = splat(x[i]);
        lo[0] += xv * ldw(p);
        hi[0] += xv * ldw(p + 8);
    }
    st(h, (lo[0] + lo[1]) + (lo[2] + lo[3]));
    st(h + 8, (hi[0] + hi[1]) + (hi[2] + hi[3]));
}

// d[0:out] += Σ_k h[k] · b[k][0:out] over k in [k, r) in passes of ROWS rows of b (`out`
// apart), each pass reading d once from L1 while ROWS streams of B come from memory.
// Returns the first row not done (fewer than ROWS left). Eight rows a pass streamed B
// 1.25x faster than two (BENCHMARKS.md, session 19).
template <int ROWS, typename W>
static inline int64_t expand_pass(const float* h, const W* b, int64_t k, int64_t r,
                                  int64_t out, float* d) {
    const int64_t whole = out & ~int64_t(7);
    for (; k + ROWS <= r; k += ROWS) {
        const W* bk = b + k * out;
        v8 hv[ROWS];
        for (int j = 0; j < ROWS; j++) hv[j] = splat(h[k + j]);
        int64_t o = 0;
        for (; o < whole; o += 8) {
            v8 acc = hv[0] * ldw(bk + o);
            for (int j = 1; j < ROWS; j++) acc += hv[j] * ldw(bk + j * out + o);
            st(d + o, ld(d + o) + acc);
        }
        for (; o < out; o++) {
            float acc = h[k] * w1(bk[o]);
            for (int j = 1; j < ROWS; j++) acc += h[k + j] * w1(bk[j * out + o]);
            d[o] += acc;
        }
    }
    return k;
}

// d[0:out] = Σ_k h[k] · b[k][0:out] over k < r
template <typename W>
static inline void expand(const float* h, const W* b, int64_t r, int64_t out, float* d) {
    for (int64_t o = 0; o < out; o++) d[o] = 0.f;
    const int64_t k = expand_pass<8>(h, b, 0, r, out, d);
    expand_pass<1>(h, b, k, r, out, d);
}

// For each row j < n_rows: token t = tokens[j] (rows of x and y `xs` and `ys` apart),
// slot s = slots[j], rank r = ranks[j] (at most 16·chunks and r_max; the caller checks
// every index): y[t] += expand(shrink(x[t])). Tokens are distinct, so threads split rows.
template <typename W>
static void rows(const float* x, int64_t xs, const int64_t* tokens, const int64_t* slots,
                 const int64_t* ranks, int64_t n_rows, const W* a_t, int64_t chunks, int64_t in,
                 const W* b, int64_t r_max, int64_t out, float* y, int64_t ys, int threads) {
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

extern "C" {

void lora_rows(const float* x, int64_t xs, const int64_t* tokens, const int64_t* slots,
               const int64_t* ranks, int64_t n_rows, const float* a_t, int64_t chunks,
               int64_t in, const float* b, int64_t r_max, int64_t out, float* y, int64_t ys,
               int threads) {
    rows(x, xs, tokens, slots, ranks, n_rows, a_t, chunks, in, b, r_max, out, y, ys, threads);
}

// the stacks in bfloat16 (their raw 16-bit patterns)
void lora_rows_bf16(const float* x, int64_t xs, const int64_t* tokens, const int64_t* slots,
                    const int64_t* ranks, int64_t n_rows, const uint16_t* a_t, int64_t chunks,
                    int64_t in, const uint16_t* b, int64_t r_max, int64_t out, float* y,
                    int64_t ys, int threads) {
    rows(x, xs, tokens, slots, ranks, n_rows, a_t, chunks, in, b, r_max, out, y, ys, threads);
}

}  // extern "C"
