/* One request's decode attention over its contiguous KV rows (float32 or float16 K/V, float32 arithmetic): shared by
 * decode_attention.c (a layer's attention for every decoding request) and decode_step.c (whole decoder layers). The
 * why of the loops (prefetch distance, constant group and head_dim) is in decode_attention.c's header. */
#ifndef ODMA_ATTEND_H
#define ODMA_ATTEND_H

#include <math.h>
#include <stdint.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "hints.h"
#define PREFETCH_ROWS 8 /* measured: 4-12 within 3 %, 2 and 16 slower */

/* float16 (IEEE binary16) K/V rows: a cache of half the bytes, the DRAM a decode step streams halved (llama.cpp's
 * default KV type). Converted with the CPU's F16C instructions (round to nearest even, as torch's float -> half), so
 * rows written here and rows torch writes for a prefill hold the same bits. */
ALWAYS_INLINE void halves_to_floats(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) {
        _Float16 h;
        __builtin_memcpy(&h, src + i, 2);
        dst[i] = (float)h;
    }
}

ALWAYS_INLINE void floats_to_halves(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) {
        const _Float16 h = (_Float16)src[i];
        __builtin_memcpy(dst + i, &h, 2);
    }
}

/* Write this step's k or v (fp32, `row` values) as row t of a K or V half. */
ALWAYS_INLINE void kv_put(void *base, int64_t t, int64_t row, const float *src, const int HALF) {
    if (HALF) floats_to_halves(src, (uint16_t *)base + t * row, row);
    else __builtin_memcpy((float *)base + t * row, src, sizeof(float) * row);
}

/* the cache lines of the row PREFETCH_ROWS after row t of K, or, past K's last, of V's first rows */
ALWAYS_INLINE void prefetch_row(const void *K, const void *V, int64_t t, int64_t n, int64_t row, const int HALF) {
    const int64_t bytes = row * (HALF ? 2 : 4);
    const char *ahead = t + PREFETCH_ROWS < n ? (const char *)K + (t + PREFETCH_ROWS) * bytes
                                              : (const char *)V + (t + PREFETCH_ROWS - n) * bytes;
    for (int64_t c = 0; c < bytes; c += 64) PREFETCH(ahead + c); /* a prefetch never faults */
}

/* The steps of `attend` and `attend_pieces`. Row t's scores (all KV heads of K row kr) against every query head:
 * scores[h * n + t]. */
ALWAYS_INLINE void score_row(const float *kr, const float *qb, float *scores, int64_t n, int64_t t, int64_t kv_heads,
                             float scale, const int64_t G, const int64_t D) {
    for (int64_t g = 0; g < kv_heads; g++) {
        const float *kh = kr + g * D;
        for (int64_t j = 0; j < G; j++) {
            const float *qh = qb + (g * G + j) * D;
            float dot = 0.f;
            for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[d];
            scores[(g * G + j) * n + t] = dot * scale;
        }
    }
}

/* Each head's n scores to softmax weights, in place. */
ALWAYS_INLINE void softmax_rows(float *scores, int64_t heads, int64_t n) {
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * n, m = s[0], sum = 0.f;
        for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < n; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; t++) s[t] *= inv;
    }
}

/* V row vr (all KV heads), weighted by row t's weights, added to every query head's output. */
ALWAYS_INLINE void add_row(const float *vr, const float *scores, float *outb, int64_t n, int64_t t, int64_t kv_heads,
                           const int64_t G, const int64_t D) {
    for (int64_t g = 0; g < kv_heads; g++) {
        const float *vh = vr + g * D;
        for (int64_t j = 0; j < G; j++) {
            const float p = scores[(g * G + j) * n + t];
            float *a = outb + (g * G + j) * D;
            for (int64_t d = 0; d < D; d++) a[d] += p * vh[d];
        }
    }
}

/* One request, one layer; scores holds heads * n floats, wide kv_heads * D (an fp16 row widened). G (query heads
 * per KV head), D (head_dim) and HALF (fp16 K/V) are compile-time constants for the common shapes (the dispatch
 * below), so the inner loops unroll fully. */
ALWAYS_INLINE void attend(const void *Kc, const void *Vc, int64_t n, int64_t kv_heads, const float *qb, float *outb,
                          float *scores, float *wide, float scale, const int64_t G, const int64_t D, const int HALF) {
    const int64_t row = kv_heads * D, heads = kv_heads * G;
    const float *K = Kc, *V = Vc; /* fp32 rows; fp16 ones are read through K16, V16 */
    const uint16_t *K16 = Kc, *V16 = Vc;
    /* one sequential pass over K: row t (all KV heads) scores every query head */
    for (int64_t t = 0; t < n; t++) {
        prefetch_row(Kc, Vc, t, n, row, HALF);
        const float *kr = K + t * row;
        if (HALF) halves_to_floats(K16 + t * row, wide, row), kr = wide;
        score_row(kr, qb, scores, n, t, kv_heads, scale, G, D);
    }
    softmax_rows(scores, heads, n);
    /* one sequential pass over V */
    for (int64_t i = 0; i < heads * D; i++) outb[i] = 0.f;
    for (int64_t t = 0; t < n; t++) {
        if (t + PREFETCH_ROWS < n) prefetch_row(Vc, Vc, t, n, row, HALF);
        const float *vr = V + t * row;
        if (HALF) halves_to_floats(V16 + t * row, wide, row), vr = wide;
        add_row(vr, scores, outb, n, t, kv_heads, G, D);
    }
}

/* `attend` over rows that lie in several blocks (a shared prefix read in place, a block continued elsewhere):
 * piece s holds positions [ends[s - 1], ends[s]) (from 0), position t at row t - firsts[s] of its K (Ks[s]) and V
 * (Vs[s]); the last piece ends at n. The same products, softmax and sums in the same order as `attend` over one block
 * holding those rows; each piece streams K, then V, sequentially. */
ALWAYS_INLINE void attend_pieces(const void *const *Ks, const void *const *Vs, const int64_t *firsts,
                                 const int64_t *ends, int64_t pieces, int64_t n, int64_t kv_heads, const float *qb,
                                 float *outb, float *scores, float *wide, float scale, const int64_t G,
                                 const int64_t D, const int HALF) {
    const int64_t row = kv_heads * D, heads = kv_heads * G;
    for (int64_t s = 0, lo = 0; s < pieces; lo = ends[s++]) {
        const int64_t first = firsts[s], rows = ends[s] - first;
        for (int64_t t = lo; t < ends[s]; t++) {
            prefetch_row(Ks[s], Vs[s], t - first, rows, row, HALF);
            const float *kr = (const float *)Ks[s] + (t - first) * row;
            if (HALF) halves_to_floats((const uint16_t *)Ks[s] + (t - first) * row, wide, row), kr = wide;
            score_row(kr, qb, scores, n, t, kv_heads, scale, G, D);
        }
    }
    softmax_rows(scores, heads, n);
    for (int64_t i = 0; i < heads * D; i++) outb[i] = 0.f;
    for (int64_t s = 0, lo = 0; s < pieces; lo = ends[s++]) {
        const int64_t first = firsts[s], rows = ends[s] - first;
        for (int64_t t = lo; t < ends[s]; t++) {
            if (t - first + PREFETCH_ROWS < rows) prefetch_row(Vs[s], Vs[s], t - first, rows, row, HALF);
            const float *vr = (const float *)Vs[s] + (t - first) * row;
            if (HALF) halves_to_floats((const uint16_t *)Vs[s] + (t - first) * row, wide, row), vr = wide;
            add_row(vr, scores, outb, n, t, kv_heads, G, D);
        }
    }
}

/* the shapes with constants (SmolLM2-135M/360M 3/64, Llama-3.2-1B 4/64, Llama-3-8B 4/128, Llama-3-70B 8/128), generic
 * loops otherwise: CALL(G, D) for the shape of `group` and `head_dim` */
#define ATTEND_SHAPES(CALL)                                                 \
    if (group == 3 && head_dim == 64) CALL(3, 64);                          \
    else if (group == 4 && head_dim == 64) CALL(4, 64);                     \
    else if (group == 4 && head_dim == 128) CALL(4, 128);                   \
    else if (group == 8 && head_dim == 128) CALL(8, 128);                   \
    else CALL(group, head_dim);

#define ATTEND_ONE(G, D) attend(K, V, n, kv_heads, qb, outb, scores, wide, scale, G, D, half)
#define ATTEND_PIECES(G, D) attend_pieces(Ks, Vs, firsts, ends, pieces, n, kv_heads, qb, outb, scores, wide, scale, G, D, half)

/* one function per cache dtype: each optimized (unrolled) as if it were the only one */
#define ATTEND_DTYPE(NAME, PIECES_NAME, HALF)                                                                       \
    static __attribute__((noinline)) void NAME(const void *K, const void *V, int64_t n, int64_t kv_heads,           \
                                               const float *qb, float *outb, float *scores, float *wide, float scale, \
                                               int64_t group, int64_t head_dim) {                                   \
        const int half = HALF;                                                                                      \
        ATTEND_SHAPES(ATTEND_ONE)                                                                                   \
    }                                                                                                               \
    static __attribute__((noinline)) void PIECES_NAME(const void *const *Ks, const void *const *Vs,                 \
                                                      const int64_t *firsts, const int64_t *ends, int64_t pieces,   \
                                                      int64_t n, int64_t kv_heads, const float *qb, float *outb,    \
                                                      float *scores, float *wide, float scale, int64_t group,      \
                                                      int64_t head_dim) {                                           \
        const int half = HALF;                                                                                      \
        ATTEND_SHAPES(ATTEND_PIECES)                                                                                \
    }
ATTEND_DTYPE(attend_kv32, attend_pieces_kv32, 0)
ATTEND_DTYPE(attend_kv16, attend_pieces_kv16, 1)

/* `attend` with the group size and head_dim as constants for the common shapes; half: K/V in fp16. */
static inline void attend_any(const void *K, const void *V, int64_t n, int64_t kv_heads, const float *qb, float *outb,
                              float *scores, float *wide, float scale, int64_t group, int64_t head_dim, int half) {
    if (half) attend_kv16(K, V, n, kv_heads, qb, outb, scores, wide, scale, group, head_dim);
    else attend_kv32(K, V, n, kv_heads, qb, outb, scores, wide, scale, group, head_dim);
}

/* `attend_pieces` likewise. */
static inline void attend_pieces_any(const void *const *Ks, const void *const *Vs, const int64_t *firsts,
                                     const int64_t *ends, int64_t pieces, int64_t n, int64_t kv_heads, const float *qb,
                                     float *outb, float *scores, float *wide, float scale, int64_t group,
                                     int64_t head_dim, int half) {
    if (half) attend_pieces_kv16(Ks, Vs, firsts, ends, pieces, n, kv_heads, qb, outb, scores, wide, scale, group, head_dim);
    else attend_pieces_kv32(Ks, Vs, firsts, ends, pieces, n, kv_heads, qb, outb, scores, wide, scale, group, head_dim);
}

/* The pieces requests read before their own blocks (a shared prefix read in place, a block continued elsewhere), as
 * backends/cpu_attention.py's PieceTables lays them out: request b's are entries [start[b], start[b + 1]) in row
 * order (each a block's address, layer and K-to-V strides in elements, the first row it holds and the row after the
 * piece); its own block holds rows from own_first[b] on. start NULL: no request reads pieces. */
typedef struct {
    const int64_t *start, *block, *layer_stride, *half_stride, *first, *end, *own_first;
} odma_pieces;

#define MAX_PIECES 16 /* pieces a request may read (the engine's tables hold fewer) */

/* The first row request b's own block holds. */
static inline int64_t pieces_own_first(const odma_pieces *P, int64_t b) { return P->start ? P->own_first[b] : 0; }

static inline int64_t pieces_of(const odma_pieces *P, int64_t b) { return P->start ? P->start[b + 1] - P->start[b] : 0; }

/* Whether request b's pieces (at most MAX_PIECES) end where its own block begins, before its new row at len - 1. */
static inline int pieces_fit(const odma_pieces *P, int64_t b, int64_t len) {
    const int64_t p = pieces_of(P, b), own = pieces_own_first(P, b);
    return p >= 0 && p <= MAX_PIECES && own >= 0 && own < len && (p ? P->end[P->start[b + 1] - 1] : 0) == own;
}

/* Request b's attention over its pieces of `layer`, then its own block (K, V: that layer's, n rows in all). */
static inline void attend_through_pieces(const odma_pieces *P, int64_t b, int64_t layer, const void *K, const void *V,
                                         int64_t n, int64_t kv_heads, const float *qb, float *outb, float *scores,
                                         float *wide, float scale, int64_t group, int64_t head_dim, int half) {
    const void *Ks[MAX_PIECES + 1], *Vs[MAX_PIECES + 1];
    int64_t firsts[MAX_PIECES + 1], ends[MAX_PIECES + 1];
    const int64_t p0 = P->start[b], pieces = pieces_of(P, b), elem = half ? 2 : 4;
    for (int64_t i = 0; i < pieces; i++) {
        const int64_t e = p0 + i;
        Ks[i] = (const char *)(intptr_t)P->block[e] + layer * P->layer_stride[e] * elem;
        Vs[i] = (const char *)Ks[i] + P->half_stride[e] * elem;
        firsts[i] = P->first[e], ends[i] = P->end[e];
    }
    Ks[pieces] = K, Vs[pieces] = V, firsts[pieces] = pieces_own_first(P, b), ends[pieces] = n;
    attend_pieces_any(Ks, Vs, firsts, ends, pieces + 1, n, kv_heads, qb, outb, scores, wide, scale, group, head_dim,
                      half);
}

#endif
