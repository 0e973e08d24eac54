/* Decode attention straight from each request's contiguous KV block (CPU, float32).
 *
 * One call handles every decoding request of one layer: it appends the step's new K/V row to each block
 * and attends the request's single query token over rows [0, len) of its block. A block's K (and V) rows
 * for a layer are one contiguous range of the pool's arena, so the loops below stream memory sequentially
 * (what contiguous blocks are for) and there is no per-request dispatch from Python.
 *
 * Layout: request b's block starts at address blocks[b] (a [layers, 2, capacity, kv_heads, head_dim] float32
 * tensor, rows contiguous); its K for `layer` starts layer * layer_stride[b] elements in, V half_stride[b]
 * further, and row t of either is t * kv_heads * head_dim further. Blocks may sit in different arenas or
 * segments: only addresses are shared with the caller.
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention, as transformers' repeat_kv).
 *
 * Speed (Zen 5, 2026-11-24; docs/BENCHMARKS.md, "Decode attention"): a decode step reads every cached row once, mostly from DRAM, in
 * short streams (one request's K, then its V: ~166 KB each at SmolLM2's 217 rows). Prefetching PREFETCH_ROWS
 * rows ahead, and the first V rows while K's last rows are scored, keeps DRAM busy across those stream starts;
 * with the group size and head_dim as constants the compiler keeps the loops free of divisions. Together
 * 30-35 % less time than the plain loops in `odma-bench attention` (batch 8, 1K-16K rows) and 28-32 % less
 * attention time per decode step of 16-64 requests in the engine.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define PREFETCH(p) ((void)(p))
#define ALWAYS_INLINE static inline
#endif
#define PREFETCH_ROWS 8 /* measured: 4-12 within 3 %, 2 and 16 slower */
#define LINE_FLOATS 16  /* one 64-byte cache line */

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

int odma_decode_attention_f32(const int64_t *blocks, const int64_t *layer_stride, const int64_t *half_stride,
                              int64_t layer, const int64_t *lens,
                              const float *q, const float *k_new, const float *v_new, float *out,
                              int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale) {
    const int64_t group = heads / kv_heads, row = kv_heads * head_dim;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (lens[b] < 1) return 1;
        if (lens[b] > max_len) max_len = lens[b];
    }
    float *scores = malloc(sizeof(float) * heads * max_len);
    if (!scores) return 2;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = lens[b];
        float *K = (float *)(intptr_t)blocks[b] + layer * layer_stride[b], *V = K + half_stride[b];
        memcpy(K + (n - 1) * row, k_new + b * row, sizeof(float) * row);
        memcpy(V + (n - 1) * row, v_new + b * row, sizeof(float) * row);
        const float *qb = q + b * heads * head_dim;
        float *ob = out + b * heads * head_dim;
        /* SmolLM2-135M/360M (3/64), Llama-3.2-1B (4/64), Llama-3-8B (4/128), Llama-3-70B (8/128); else generic */
        if (group == 3 && head_dim == 64) attend(K, V, n, kv_heads, qb, ob, scores, scale, 3, 64);
        else if (group == 4 && head_dim == 64) attend(K, V, n, kv_heads, qb, ob, scores, scale, 4, 64);
        else if (group == 4 && head_dim == 128) attend(K, V, n, kv_heads, qb, ob, scores, scale, 4, 128);
        else if (group == 8 && head_dim == 128) attend(K, V, n, kv_heads, qb, ob, scores, scale, 8, 128);
        else attend(K, V, n, kv_heads, qb, ob, scores, scale, group, head_dim);
    }
    free(scores);
    return 0;
}
