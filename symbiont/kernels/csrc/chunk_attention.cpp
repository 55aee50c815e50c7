// Causal attention of one prefill chunk over its context, for the serving engine on a CPU
// (float32). Built with decode_attention.cpp into one library by
// symbiont/serve/decode_kernel.py.
//
// PyTorch's CPU flash kernel computes a chunk's scores a 512-key block at a time as small
// matrix products through BLAS and its softmax row by row; on one core it ran at about a
// third of the core's multiply-add peak on a 512-token chunk (BENCHMARKS.md, issue 17,
// session 17). Here a tile of R queries of one head works through its keys 64 at a time
// with the scores transposed, keys by queries, so that every vector holds R queries:
// - scores: for 8 keys at a time, 8 x R/VW accumulators, each key's element broadcast
//   against the tile's queries (packed once per tile, dims by queries, already scaled);
// - the online softmax (running max and sum per query, rescaling the output) is then
//   element-wise across vectors, with no reduction inside a vector;
// - the output, also transposed (dims by queries), takes each value element broadcast
//   against a row of probabilities, for 8 dims at a time.
// Only keys a query may see are read: up to the tile's last query (causal), from the
// window's start for its first query; scores beyond a query's own limits are set to
// -inf. Results agree with SDPA within float32 rounding (another summation order, and the
// polynomial exp of vec.h).
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

#ifdef __AVX512F__
constexpr int VW = 16;  // floats per vector: one 512-bit register
#else
constexpr int VW = 8;  // two 256-bit registers would not leave room for the accumulators
#endif
// may_alias and aligned(4): loads and stores straight from float rows (through memcpy,
// GCC at -march=haswell split each load in two halves and went through the stack)
typedef float vf __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));

constexpr int NV = 2;         // vectors per tile row: R queries
constexpr int R = NV * VW;    // queries per tile
constexpr int KB = 64;        // keys per softmax block
constexpr int G = VW == 16 ? 8 : 4;  // keys (scores) or dims (output) per register block

static inline vf vld(const float* p) { return *reinterpret_cast<const vf*>(p); }
static inline void vst(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
// Every lane spelled out: GCC then emits one broadcast (a loop over the lanes compiled to
// one masked load per lane, and vf{} + a, at 256 bits, to a store and a reload)
static inline vi vsplati(int32_t a) {
#ifdef __AVX512F__
    return vi{a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
#else
    return vi{a, a, a, a, a, a, a, a};
#endif
}

// int64 -> int32, saturated (relative positions beyond 2^31 tokens stay ordered)
static inline int64_t clamp32(int64_t v) {
    return v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : v;
}

static inline vf vsplat(float a) {
#ifdef __AVX512F__
    return vf{a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a};
#else
    return vf{a, a, a, a, a, a, a, a};
#endif
}

// exp of each lane, as vexp in vec.h (Cephes' expf), at this file's vector width
static inline vf vexpw(vf x) {
    x = x > vsplat(88.3762626647949f) ? vsplat(88.3762626647949f) : x;
    x = x < vsplat(-88.3762626647949f) ? vsplat(-88.3762626647949f) : x;
    vf fx = x * vsplat(1.44269504088896341f) + vsplat(0.5f);
    vf fl = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
    fl = fl > fx ? fl - 1.0f : fl;
    x = x - fl * vsplat(0.693359375f) - fl * vsplat(-2.12194440e-4f);
    vf z = x * x;
    vf y = vsplat(1.9875691500E-4f);
    y = y * x + vsplat(1.3981999507E-3f);
    y = y * x + vsplat(8.3334519073E-3f);
    y = y * x + vsplat(4.1665795894E-2f);
    y = y * x + vsplat(1.6666665459E-1f);
    y = y * x + vsplat(5.0000001201E-1f);
    y = y * z + x + vsplat(1.0f);
    vi e = (__builtin_convertvector(fl, vi) + 127) << 23;
    return y * (vf)e;  // a cast between vector types of one size keeps the bits
}

// s[j][:] = scores of keys j0 + j (j < nk) against the tile's queries: s [KB][R]
template <int HD>
static inline void tile_scores(const float* qt, const float* kh, int64_t ks1, int64_t j0,
                               int64_t nk, float* s, int64_t hd_rt) {
    const int64_t hd = HD > 0 ? HD : hd_rt;
    for (int64_t g0 = 0; g0 < nk; g0 += G) {
        const int64_t ng = nk - g0 < G ? nk - g0 : G;
        const float* kr[G];
        for (int t = 0; t < G; t++) kr[t] = kh + (j0 + g0 + (t < ng ? t : 0)) * ks1;
        vf acc[G][NV];
        for (int t = 0; t < G; t++)
            for (int x = 0; x < NV; x++) acc[t][x] = vsplat(0.0f);
        for (int64_t d = 0; d < hd; d++) {
            vf qv[NV];
            for (int x = 0; x < NV; x++) qv[x] = vld(qt + d * R + x * VW);
            for (int t = 0; t < G; t++) {
                const vf kb = vsplat(kr[t][d]);
                for (int x = 0; x < NV; x++) acc[t][x] += kb * qv[x];
            }
        }
        for (int t = 0; t < G; t++)
            if (t < ng)
                for (int x = 0; x < NV; x++) vst(s + (g0 + t) * R + x * VW, acc[t][x]);
    }
}

// ot[d][:] += sum_j p[j][:] v[j0 + j][d], over nk keys: ot [hd][R], p [KB][R]
template <int HD>
static inline void tile_values(float* ot, const float* p, const float* vh, int64_t vs1,
                               int64_t j0, int64_t nk, int64_t hd_rt) {
    const int64_t hd = HD > 0 ? HD : hd_rt;
    for (int64_t d0 = 0; d0 < hd; d0 += G) {
        vf acc[G][NV];
        for (int t = 0; t < G; t++)
            for (int x = 0; x < NV; x++) acc[t][x] = vld(ot + (d0 + t) * R + x * VW);
        for (int64_t j = 0; j < nk; j++) {
            const float* vj = vh + (j0 + j) * vs1 + d0;
            vf pv[NV];
            for (int x = 0; x < NV; x++) pv[x] = vld(p + j * R + x * VW);
            for (int t = 0; t < G; t++) {
                const vf vb = vsplat(vj[t]);
                for (int x = 0; x < NV; x++) acc[t][x] += vb * pv[x];
            }
        }
        for (int t = 0; t < G; t++)
            for (int x = 0; x < NV; x++) vst(ot + (d0 + t) * R + x * VW, acc[t][x]);
    }
}

// One tile: queries p0 .. p0 + rows - 1 of query head a.
template <int HD>
static void tile(const float* q, int64_t qs0, int64_t qs1, const float* k, int64_t ks0,
                 int64_t ks1, const float* v, int64_t vs0, int64_t vs1, float* out, int64_t os0,
                 int64_t os1, int64_t a, int64_t share, int64_t p0, int64_t rows, int64_t start,
                 int64_t window, float scale, float* scratch, int64_t hd_rt) {
    const int64_t hd = HD > 0 ? HD : hd_rt;
    float* qt = scratch;           // [hd][R] the tile's queries, dims by queries, scaled
    float* ot = qt + hd * R;       // [hd][R] its output so far, dims by queries
    float* s = ot + hd * R;        // [KB][R] a block's scores, then probabilities
    const float* qa = q + a * qs0;
    for (int64_t r = 0; r < R; r++) {
        const float* qr = qa + (p0 + (r < rows ? r : 0)) * qs1;
        for (int64_t d = 0; d < hd; d++) qt[d * R + r] = r < rows ? qr[d] * scale : 0.0f;
    }
    std::memset(ot, 0, sizeof(float) * hd * R);
    const int64_t h = a / share;
    const float* kh = k + h * ks0;
    const float* vh = v + h * vs0;
    // Positions relative to the tile's first query (start + p0), as int32 lanes: query r
    // sees keys k with r - window < k <= r (no lower limit without a window)
    const int64_t base = start + p0;
    vi pos[NV], lo[NV];
    for (int x = 0; x < NV; x++)
        for (int i = 0; i < VW; i++) {
            const int64_t r = x * VW + i < rows ? x * VW + i : rows - 1;
            pos[x][i] = int32_t(r);
            lo[x][i] = window > 0 ? int32_t(clamp32(r - window)) : INT32_MIN;
        }
    const int64_t first = window > 0 && base - window + 1 > 0 ? base - window + 1 : 0;
    const int64_t last = base + rows - 1;  // the tile's last query sees up to here
    const vf ninf = vsplat(-INFINITY);
    vf mx[NV], sum[NV];
    for (int x = 0; x < NV; x++) { mx[x] = ninf; sum[x] = vsplat(0.0f); }
    for (int64_t j0 = first; j0 <= last; j0 += KB) {
        const int64_t nk = last + 1 - j0 < KB ? last + 1 - j0 : KB;
        tile_scores<HD>(qt, kh, ks1, j0, nk, s, hd);
        // keys beyond a query's limits: only in blocks that reach past the tile's first
        // query (causal) or start before its last query's window
        const bool edge =
            j0 + nk - 1 > base || (window > 0 && j0 - base <= int64_t(lo[NV - 1][VW - 1]));
        vf bmax[NV];
        for (int x = 0; x < NV; x++) bmax[x] = ninf;
        for (int64_t j = 0; j < nk; j++) {
            const vi key = vsplati(int32_t(clamp32(j0 + j - base)));
            for (int x = 0; x < NV; x++) {
                vf sc = vld(s + j * R + x * VW);
                if (edge) sc = (key > pos[x]) | (key <= lo[x]) ? ninf : sc;
                vst(s + j * R + x * VW, sc);
                bmax[x] = sc > bmax[x] ? sc : bmax[x];
            }
        }
        vf alpha[NV];
        for (int x = 0; x < NV; x++) {
            const vf nmx = bmax[x] > mx[x] ? bmax[x] : mx[x];
            // nothing seen yet (-inf): nothing to rescale
            alpha[x] = mx[x] == ninf ? vsplat(0.0f) : vexpw(mx[x] - nmx);
            mx[x] = nmx;
            sum[x] *= alpha[x];
        }
        for (int64_t d = 0; d < hd; d++)
            for (int x = 0; x < NV; x++) vst(ot + d * R + x * VW, vld(ot + d * R + x * VW) * alpha[x]);
        for (int64_t j = 0; j < nk; j++)
            for (int x = 0; x < NV; x++) {
                const vf sc = vld(s + j * R + x * VW);
                const vf e = sc == ninf ? vsplat(0.0f) : vexpw(sc - mx[x]);
                vst(s + j * R + x * VW, e);
                sum[x] += e;
            }
        tile_values<HD>(ot, s, vh, vs1, j0, nk, hd);
    }
    for (int x = 0; x < NV; x++) {
        const vf inv = sum[x] == vsplat(0.0f) ? vsplat(0.0f) : vsplat(1.0f) / sum[x];
        for (int64_t d = 0; d < hd; d++) vst(ot + d * R + x * VW, vld(ot + d * R + x * VW) * inv);
    }
    for (int64_t r = 0; r < rows; r++) {
        float* o = out + (p0 + r) * os0 + a * os1;
        for (int64_t d = 0; d < hd; d++) o[d] = ot[d * R + r];
    }
}

template <int HD>
static void attend_chunk(const float* q, int64_t qs0, int64_t qs1, const float* k, int64_t ks0,
                         int64_t ks1, const float* v, int64_t vs0, int64_t vs1, float* out,
                         int64_t os0, int64_t os1, int64_t heads, int64_t kv_heads, int64_t m,
                         int64_t start, int64_t window, float scale, float* scratch,
                         int threads, int64_t hd) {
    const int64_t share = heads / kv_heads;
    const int64_t tiles = (m + R - 1) / R;
    const int64_t per_thread = 2 * hd * R + KB * R;
    // Tiles late in the chunk see more keys: with several threads, hand them out in
    // small pieces from the longest down
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
#endif
    for (int64_t item = 0; item < heads * tiles; item++) {
        const int64_t t = tiles - 1 - item / heads, a = item % heads;
#ifdef _OPENMP
        float* mine = scratch + omp_get_thread_num() * per_thread;
#else
        float* mine = scratch;
#endif
        const int64_t p0 = t * R;
        const int64_t rows = m - p0 < R ? m - p0 : R;
        tile<HD>(q, qs0, qs1, k, ks0, ks1, v, vs0, vs1, out, os0, os1, a, share, p0, rows, start,
                 window, scale, mine, hd);
    }
}

// Floats of scratch each thread needs (the caller allocates threads times this).
// The output's register blocks are G dims wide, so hd must be a multiple of 8.
extern "C" int64_t chunk_attention_scratch(int64_t hd) { return 2 * hd * R + KB * R; }

// q [heads, m, hd] (strides qs0, qs1), k and v [kv_heads, >= start + m, hd] (strides
// ks0, ks1 and vs0, vs1), head dims contiguous -> out [m, heads, hd] (strides os0, os1).
// Query i, at position start + i, attends keys j with j <= start + i and, when window > 0,
// j > start + i - window. Returns 0, or -1 for a head_dim that is no multiple of 8.
extern "C" int chunk_attention(
    const float* q, int64_t qs0, int64_t qs1,
    const float* k, int64_t ks0, int64_t ks1,
    const float* v, int64_t vs0, int64_t vs1,
    float* out, int64_t os0, int64_t os1,
    int64_t heads, int64_t kv_heads, int64_t m, int64_t hd, int64_t start, int64_t window,
    float scale, float* scratch, int threads)
{
#define CALL(H) attend_chunk<H>(q, qs0, qs1, k, ks0, ks1, v, vs0, vs1, out, os0, os1, heads, kv_heads, m, start, window, scale, scratch, threads, hd)
    if (hd <= 0 || hd % 8 != 0) return -1;
    switch (hd) {  // the common head dims with their loops unrolled; others at run time
        case 64: CALL(64); return 0;
        case 128: CALL(128); return 0;
        case 16: CALL(16); return 0;
        case 32: CALL(32); return 0;
        default: CALL(0); return 0;
    }
#undef CALL
}
