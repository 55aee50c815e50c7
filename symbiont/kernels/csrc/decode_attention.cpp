// Decode attention over a strided KV view, for the serving engine on a CPU (float32).
//
// One query per sequence; the query heads that share a KV head are attended together, so
// each K and V row is read from memory once. Per (sequence, KV head): scores against
// every key (8 keys at a time, their dot products summed in one shuffle tree), softmax
// (vectorised exp), then the values weighted by it, with the accumulators in registers.
// Masked keys (additive mask -inf) are skipped, so whatever the pool holds there (stale
// or uninitialised values) never reaches the output. Built by symbiont/serve/
// decode_kernel.py with the machine's compiler (-O3 -march=native); GCC >= 12 or clang.
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

// One query head's dot products with 8 keys (the first nk real) -> [8]
template <int HD>
static inline v8 scores8(const float* qa, const float* kb, int64_t ks2, int64_t nk, int64_t hd) {
    constexpr int NV = HD / 8;
    v8 d[8];
    if constexpr (HD > 0) {
        v8 qv[NV];
        for (int i = 0; i < NV; i++) qv[i] = ld(qa + 8 * i);
        for (int t = 0; t < 8; t++) {
            v8 a = splat(0.0f);
            if (t < nk) {
                const float* kj = kb + t * ks2;
                for (int i = 0; i < NV; i++) a += qv[i] * ld(kj + 8 * i);
            }
            d[t] = a;
        }
    } else {
        for (int t = 0; t < 8; t++) {
            v8 a = splat(0.0f);
            if (t < nk) {
                const float* kj = kb + t * ks2;
                int64_t i = 0;
                for (; i + 8 <= hd; i += 8) a += ld(qa + i) * ld(kj + i);
                float tail = 0.0f;
                for (; i < hd; i++) tail += qa[i] * kj[i];
                a[0] += tail;
            }
            d[t] = a;
        }
    }
    return sum8(d);
}

// acc[a] += p[a][j] v_j over the keys, G heads at a time with accumulators in registers.
template <int HD>
static inline void weighted_values(const float* vh, int64_t vs2, const float* m, const float* s,
                                   int64_t Lp, int64_t L, int64_t share, int64_t hd, float* o,
                                   const float* vn) {
    if constexpr (HD > 0) {
        constexpr int NV = HD / 8;
        constexpr int G = NV >= 16 ? 1 : 16 / NV;
        for (int64_t a0 = 0; a0 < share; a0 += G) {
            const int64_t g = share - a0 < G ? share - a0 : G;
            v8 acc[G][NV];
            for (int a = 0; a < G; a++)
                for (int i = 0; i < NV; i++) acc[a][i] = splat(0.0f);
            for (int64_t j = 0; j < L; j++) {
                if (a0 == 0) prefetch_row(vn + j * vs2, HD);  // the next item's values
                if (m[j] == -INFINITY) continue;
                const float* vj = vh + j * vs2;
                v8 vv[NV];
                for (int i = 0; i < NV; i++) vv[i] = ld(vj + 8 * i);
                for (int a = 0; a < G; a++) {
                    if (a < g) {
                        const v8 p = splat(s[(a0 + a) * Lp + j]);
                        for (int i = 0; i < NV; i++) acc[a][i] += p * vv[i];
                    }
                }
            }
            for (int a = 0; a < g; a++)
                for (int i = 0; i < NV; i++) st(o + (a0 + a) * HD + 8 * i, acc[a][i]);
        }
    } else {
        std::memset(o, 0, sizeof(float) * share * hd);
        for (int64_t j = 0; j < L; j++) {
            if (m[j] == -INFINITY) continue;
            const float* vj = vh + j * vs2;
            for (int64_t a = 0; a < share; a++) {
                const float p = s[a * Lp + j];
                for (int64_t i = 0; i < hd; i++) o[a * hd + i] += p * vj[i];
            }
        }
    }
}

template <int HD>
static void attend(
    const float* q, int64_t qs0, int64_t qs1, int64_t qs2,
    const float* k, int64_t ks0, int64_t ks1, int64_t ks2,
    const float* v, int64_t vs0, int64_t vs1, int64_t vs2,
    const float* mask, int64_t ms0,
    float* out, int64_t n, int64_t kvh, int64_t share, int64_t L, int64_t hd,
    float scale, float* scratch, int threads)
{
    const int64_t Lp = (L + 7) & ~int64_t(7);
    const v8 ninf = splat(-INFINITY);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (int64_t item = 0; item < n * kvh; item++) {
        const int64_t r = item / kvh, h = item % kvh;
#ifdef _OPENMP
        float* s = scratch + omp_get_thread_num() * share * Lp;  // [share, Lp] of this thread
#else
        float* s = scratch;
#endif
        // Only the keys from the row's first unmasked one to its last are read: rows of
        // short contexts in a wide view, and the view's filler rows, skip the rest.
        const float* mrow = mask + r * ms0;
        int64_t lo = 0, hi = L;
        while (lo < hi && mrow[lo] == -INFINITY) lo++;
        while (hi > lo && mrow[hi - 1] == -INFINITY) hi--;
        const int64_t Lr = hi - lo;
        const float* m = mrow + lo;
        const float* qh = q + r * qs0 + h * qs1;
        const float* kh = k + r * ks0 + h * ks1 + lo * ks2;
        const float* vh = v + r * vs0 + h * vs1 + lo * vs2;
        float* o = out + ((r * kvh + h) * share) * hd;
        // The next item's keys and values, over this row's range (the last item
        // prefetches its own again: harmless)
        const int64_t next = item + 1 < n * kvh ? item + 1 : item;
        const float* kn = k + (next / kvh) * ks0 + (next % kvh) * ks1 + lo * ks2;
        const float* vn = v + (next / kvh) * vs0 + (next % kvh) * vs1 + lo * vs2;
        for (int64_t j0 = 0; j0 < Lr; j0 += 8) {
            const int64_t nk = Lr - j0 < 8 ? Lr - j0 : 8;
            v8 mv;
            for (int t = 0; t < 8; t++) mv[t] = t < nk ? m[j0 + t] : -INFINITY;
            // Start reading this block's values, which the value pass reads after the
            // softmax, and the next item's keys: a context is a few 4 KiB pages, and
            // the hardware prefetchers stop at each page's end, so without this each
            // page would begin with a wait for memory.
            for (int64_t t = 0; t < nk; t++) {
                prefetch_row(vh + (j0 + t) * vs2, hd);
                prefetch_row(kn + (j0 + t) * ks2, hd);
            }
            for (int64_t a = 0; a < share; a++) {
                v8 sc = scores8<HD>(qh + a * qs2, kh + j0 * ks2, ks2, nk, hd);
                st(s + a * Lp + j0, mv == ninf ? ninf : sc * splat(scale) + mv);
            }
        }
        const int64_t Lrp = (Lr + 7) & ~int64_t(7);
        for (int64_t a = 0; a < share; a++) {
            float* sa = s + a * Lp;
            v8 mx = ninf;
            for (int64_t j0 = 0; j0 < Lrp; j0 += 8) { v8 x = ld(sa + j0); mx = x > mx ? x : mx; }
            float mxs = -INFINITY;
            for (int t = 0; t < 8; t++) mxs = mx[t] > mxs ? mx[t] : mxs;
            v8 sum = splat(0.0f);
            for (int64_t j0 = 0; j0 < Lrp; j0 += 8) {
                v8 x = ld(sa + j0);
                v8 e = x == ninf ? splat(0.0f) : vexp(x - splat(mxs));
                st(sa + j0, e);
                sum += e;
            }
            float t = 0.0f;
            for (int i = 0; i < 8; i++) t += sum[i];
            const v8 inv = splat(t == 0.0f ? 0.0f : 1.0f / t);  // NaN stays NaN
            for (int64_t j0 = 0; j0 < Lrp; j0 += 8) st(sa + j0, ld(sa + j0) * inv);
        }
        weighted_values<HD>(vh, vs2, m, s, Lp, Lr, share, hd, o, vn);
    }
}

// q [n, kvh, share, hd], k and v [n, kvh, L, hd] (strides in elements; hd contiguous),
// mask [n, L] additive (row stride ms0, keys contiguous) -> out [n, kvh, share, hd]
// contiguous. scratch: threads * share * round_up(L, 8) floats.
extern "C" void decode_attention(
    const float* q, int64_t qs0, int64_t qs1, int64_t qs2,
    const float* k, int64_t ks0, int64_t ks1, int64_t ks2,
    const float* v, int64_t vs0, int64_t vs1, int64_t vs2,
    const float* mask, int64_t ms0,
    float* out, int64_t n, int64_t kvh, int64_t share, int64_t L, int64_t hd,
    float scale, float* scratch, int threads)
{
#define CALL(H) attend<H>(q, qs0, qs1, qs2, k, ks0, ks1, ks2, v, vs0, vs1, vs2, mask, ms0, out, n, kvh, share, L, hd, scale, scratch, threads)
    switch (hd) {
        case 16: CALL(16); break;
        case 32: CALL(32); break;
        case 64: CALL(64); break;
        case 128: CALL(128); break;
        default: CALL(0); break;
    }
#undef CALL
}
