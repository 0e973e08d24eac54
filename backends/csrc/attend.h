/* One request's decode attention over its contiguous KV rows (float32): shared by decode_attention.c (a layer's
 * attention for every decoding request) and decode_step.c (whole decoder layers). The why of the loops (prefetch
 * distance, constant group and head_dim) is in decode_attention.c's header. */
#ifndef ODMA_ATTEND_H
#define ODMA_ATTEND_H

#include <math.h>
#include <stdint.h>

#include "hints.h"
#define PREFETCH_ROWS 8 /* measured: 4-12 within 3 %, 2 and 16 slower */

/* One request, one layer; scores holds heads * n floats. G (query heads per KV head) and D (head_dim) are
 * compile-time constants for the common shapes (the dispatch below), so the inner loops unroll fully. */
ALWAYS_INLINE void attend(float *K, float *V, int64_t n, int64_t kv_heads, const float *qb, float *outb, float *scores,
                          float scale, const int64_t G, const int64_t D) {
    const int64_t row = kv_heads * D, heads = kv_heads * G;
    /* one sequential pass over K: row t (all KV heads) scores every query head */
    for (int64_t t = 0; t < n; t++) {
        const float *kr = K + t * row;
        const float *ahead = t + PREFETCH_ROWS < n ? kr + PREFETCH_ROWS * row : V + (t + PREFETCH_ROWS - n) * row;
        for (int64_t c = 0; c < row; c += LINE_FLOATS) PREFETCH(ahead + c); /* a prefetch never faults */
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
    /* one sequential pass over V */
    for (int64_t i = 0; i < heads * D; i++) outb[i] = 0.f;
    for (int64_t t = 0; t < n; t++) {
        const float *vr = V + t * row;
        if (t + PREFETCH_ROWS < n)
            for (int64_t c = 0; c < row; c += LINE_FLOATS) PREFETCH(vr + PREFETCH_ROWS * row + c);
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *vh = vr + g * D;
            for (int64_t j = 0; j < G; j++) {
                const float p = scores[(g * G + j) * n + t];
                float *a = outb + (g * G + j) * D;
                for (int64_t d = 0; d < D; d++) a[d] += p * vh[d];
            }
        }
    }
}

/* `attend` with the group size and head_dim as constants for the common shapes: SmolLM2-135M/360M (3/64),
 * Llama-3.2-1B (4/64), Llama-3-8B (4/128), Llama-3-70B (8/128); generic loops otherwise. */
static inline void attend_any(float *K, float *V, int64_t n, int64_t kv_heads, const float *qb, float *outb,
                              float *scores, float scale, int64_t group, int64_t head_dim) {
    if (group == 3 && head_dim == 64) attend(K, V, n, kv_heads, qb, outb, scores, scale, 3, 64);
    else if (group == 4 && head_dim == 64) attend(K, V, n, kv_heads, qb, outb, scores, scale, 4, 64);
    else if (group == 4 && head_dim == 128) attend(K, V, n, kv_heads, qb, outb, scores, scale, 4, 128);
    else if (group == 8 && head_dim == 128) attend(K, V, n, kv_heads, qb, outb, scores, scale, 8, 128);
    else attend(K, V, n, kv_heads, qb, outb, scores, scale, group, head_dim);
}

#endif
