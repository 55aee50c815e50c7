// LoRA for tokens one by one, each reading its own adapter's rows in place: the
// serving engine's decoding sequences, each on another adapter (symbiont/serve/adapters.py,
// `LoraRows`). y[t] += (x[t] · A[s]ᵀ) · (B[s]ᵀ·scale) for each row (t, s, r) of the call.
// Built with the other kernels into one library by symbiont/kernels/library.py.
//
// A step of 32 sequences on 32 adapters must read every one's A and B in every adapted
// layer: the bytes bound it. PyTorch's embedding_bag, which did this before, streamed B at
// about 11 GB/s and Aᵀ at 21 on one core of a machine whose core streams 30; here each
// adapter's weights are read front to back, in one stream each, as the stacks hold them:
//   Aᵀ  [slots, chunks, in, 16]: chunk c of slot s holds ranks 16c..16c+15 of each input
//       feature (zero beyond the slot's rank), one 64-byte line per feature;
//   B   [slots, r_max / 8, out / 8, 8, 8]: block (k, o) of slot s holds rows 8k..8k+7 of
//       B[s]·scale (zero beyond the rank), columns 8o..8o+7 of each, row after row. One
//       pass over eight rows thus reads one stream, not eight of one row each (in
//       bfloat16 that took the expand from 8 to 5 ms for a step's rows: short streams
//       are mostly the hardware prefetcher's start-up; BENCHMARKS.md, session 20).
// While a row runs, the first lines of the next row's streams are prefetched.
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

constexpr int64_t B_BLOCK = 8;  // rows and columns of a block of B

// d[0:out] = Σ_k h[k] · b[k][0:out] over k < r (rounded up to whole blocks: B and h are
// zero beyond the rank), b one slot's blocks [r_max / 8, out / 8, 8, 8]. A block's eight
// products stay in one sum per column, in row order; d is read once a pass, from L1.
template <typename W>
static inline void expand(const float* h, const W* b, int64_t r, int64_t out, float* d) {
    for (int64_t o = 0; o < out; o++) d[o] = 0.f;
    const int64_t blocks = out / B_BLOCK;
    for (int64_t k = 0; k < r; k += B_BLOCK) {
        const W* pass = b + k * out;  // rows k..k+7: blocks * 64 values in a row
        v8 hv[B_BLOCK];
        for (int j = 0; j < B_BLOCK; j++) hv[j] = splat(h[k + j]);
        for (int64_t ob = 0; ob < blocks; ob++) {
            const W* block = pass + ob * B_BLOCK * B_BLOCK;
            v8 acc = hv[0] * ldw(block);
            for (int j = 1; j < B_BLOCK; j++) acc += hv[j] * ldw(block + j * B_BLOCK);
            st(d + ob * B_BLOCK, ld(d + ob * B_BLOCK) + acc);
        }
    }
}

// The first lines of each stream row `j` reads (its Aᵀ chunks and B), towards L1 while
// the previous row runs: a stream the prefetcher has not seen yet otherwise starts with
// misses it waits for one by one.
constexpr int PREFETCH_LINES = 8;  // 7% of a step's time in bfloat16, 5% in float32
template <typename W>
static inline void prefetch_next(const W* a_t, int64_t chunks, int64_t in, const W* b,
                                int64_t r_max, int64_t out, int64_t s, int64_t r) {
    const int64_t used = (r + RANK_CHUNK - 1) / RANK_CHUNK;
    for (int64_t c = 0; c < used; c++) {
        const char* p = reinterpret_cast<const char*>(a_t + (s * chunks + c) * in * RANK_CHUNK);
        for (int q = 0; q < PREFETCH_LINES; q++) __builtin_prefetch(p + 64 * q, 0, 3);
    }
    const char* p = reinterpret_cast<const char*>(b + s * r_max * out);
    for (int q = 0; q < PREFETCH_LINES; q++) __builtin_prefetch(p + 64 * q, 0, 3);
}

// For each row j < n_rows: token t = tokens[j] (rows of x and y `xs` and `ys` apart),
// slot s = slots[j], rank r = ranks[j] (at most 16·chunks and r_max; the caller checks
// every index, and that r_max and out are multiples of 8): y[t] += expand(shrink(x[t])).
// Ranks are read in whole chunks of A and whole blocks of B, so the stacks must hold
// zeros beyond each slot's rank (AdapterLayer.put writes them so). Tokens are distinct,
// so threads split rows.
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
            if (j + 1 < n_rows) prefetch_next(a_t, chunks, in, b, r_max, out, slots[j + 1], ranks[j + 1]);
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
