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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    float *acc = malloc(sizeof(float) * heads * head_dim);
    if (!scores || !acc) {
        free(scores);
        free(acc);
        return 2;
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = lens[b];
        float *K = (float *)(intptr_t)blocks[b] + layer * layer_stride[b], *V = K + half_stride[b];
        const float *qb = q + b * heads * head_dim;
        memcpy(K + (n - 1) * row, k_new + b * row, sizeof(float) * row);
        memcpy(V + (n - 1) * row, v_new + b * row, sizeof(float) * row);
        /* one sequential pass over K: row t (all KV heads) scores every query head */
        for (int64_t t = 0; t < n; t++) {
            const float *kr = K + t * row;
            for (int64_t h = 0; h < heads; h++) {
                const float *qh = qb + h * head_dim, *kh = kr + (h / group) * head_dim;
                float dot = 0.f;
                for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
                scores[h * n + t] = dot * scale;
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
        memset(acc, 0, sizeof(float) * heads * head_dim);
        for (int64_t t = 0; t < n; t++) {
            const float *vr = V + t * row;
            for (int64_t h = 0; h < heads; h++) {
                const float p = scores[h * n + t], *vh = vr + (h / group) * head_dim;
                float *a = acc + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
            }
        }
        memcpy(out + b * heads * head_dim, acc, sizeof(float) * heads * head_dim);
    }
    free(scores);
    free(acc);
    return 0;
}
