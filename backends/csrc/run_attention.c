/* Decode attention over a paged KV cache laid out in per-head planes, where a run of consecutive block ids is one
 * range of rows (CPU, float32).
 *
 * Layout (one layer): plane g of the cache holds KV head g's rows for every block in block-id order,
 * [blocks, block_size] rows of 2 * head_dim floats each, a token's K then its V; plane g starts head_stride floats
 * after plane g - 1. So row r of plane g is token r % block_size of block r / block_size, and the blocks of a run
 * b, b + 1, ... are one range of rows: vLLM's LHBNC layout ([L, H, B, N, 2 * D]), which an attention backend may ask
 * vLLM for.
 *
 * A request's block table is walked run by run: ids that follow each other are one range of rows, read as one
 * stream (a request whose blocks are one run is one stream per head, K and V together); with coalesce off every
 * block is its own range, the paged reading of the same data. Each range is read once, in tiles of TILE rows: the
 * tile's scores, an online softmax over everything read so far (flash-decoding's rescaling), then the tile's V rows,
 * still in L1. Query head h reads KV head h / (heads / kv_heads) (grouped-query attention).
 *
 * odma_run_write_f32 stores a step's new K/V rows at their slots (row = slot within each plane; slot < 0: padding,
 * skipped), what vLLM's reshape-and-cache op does for its own layout.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hints.h"
#define TILE 32           /* rows scored before their V rows are summed: 32 x 512 B of SmolLM2 stays in L1 */
#define PREFETCH_ROWS 4   /* rows ahead of the one being scored */
#define MAX_GROUP 16      /* query heads per KV head this kernel takes */
#define MAX_DIM 256

/* One (request, KV head): fold rows [0, n) of one range into the running state of its G query heads. */
ALWAYS_INLINE void fold(const float *rows, int64_t n, const float *q, float *m, float *l, float *acc, float scale,
                        const int64_t G, const int64_t D) {
    const int64_t stride = 2 * D;
    float s[MAX_GROUP][TILE];
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int64_t tn = n - t0 < TILE ? n - t0 : TILE;
        const float *tile = rows + t0 * stride;
        for (int64_t t = 0; t < tn; t++) {
            const float *k = tile + t * stride;
            const float *ahead = k + PREFETCH_ROWS * stride;  /* may run past the range: a prefetch never faults */
            for (int64_t c = 0; c < stride; c += LINE_FLOATS) PREFETCH(ahead + c);
            for (int64_t j = 0; j < G; j++) {
                const float *qh = q + j * D;
                float dot = 0.f;
                for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];
                s[j][t] = dot * scale;
            }
        }
        for (int64_t j = 0; j < G; j++) {
            float mt = m[j];
            for (int64_t t = 0; t < tn; t++) mt = s[j][t] > mt ? s[j][t] : mt;
            const float alpha = expf(m[j] - mt); /* 0 on the first tile (m = -1e30) */
            float sum = 0.f;
            for (int64_t t = 0; t < tn; t++) {
                s[j][t] = expf(s[j][t] - mt);
                sum += s[j][t];
            }
            float *a = acc + j * D;
            if (alpha != 1.f)
                for (int64_t d = 0; d < D; d++) a[d] *= alpha;
            l[j] = l[j] * alpha + sum;
            m[j] = mt;
        }
        for (int64_t t = 0; t < tn; t++) {
            const float *v = tile + t * stride + D;
            for (int64_t j = 0; j < G; j++) {
                const float p = s[j][t];
                float *a = acc + j * D;
                for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
            }
        }
    }
}

/* One (request, KV head) over the request's block table: every run (or block), then the normalized output. */
ALWAYS_INLINE void attend(const float *plane, int64_t block_size, const int32_t *table, int64_t n, int coalesce,
                          const float *q, float *out, float scale, const int64_t G, const int64_t D) {
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP * MAX_DIM];
    for (int64_t j = 0; j < G; j++) {
        m[j] = -1e30f; /* not -INFINITY: compiled with -ffast-math, which assumes finite values */
        l[j] = 0.f;
    }
    memset(acc, 0, sizeof(float) * G * D);
    const int64_t blocks = (n + block_size - 1) / block_size;
    for (int64_t i = 0; i < blocks;) {
        int64_t run = 1;
        if (coalesce)
            while (i + run < blocks && table[i + run] == table[i] + run) run++;
        int64_t rows = run * block_size;
        if (i * block_size + rows > n) rows = n - i * block_size;
        fold(plane + (int64_t)table[i] * block_size * 2 * D, rows, q, m, l, acc, scale, G, D);
        i += run;
    }
    for (int64_t j = 0; j < G; j++) {
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t d = 0; d < D; d++) out[j * D + d] = acc[j * D + d] * inv;
    }
}

/* Requests [lo, hi) of the step. Request b reads its query (heads x head_dim floats) at q + q_rows[b] * q_stride,
 * attends over its first seq_lens[b] tokens through block_table + b * table_stride, and writes its output at
 * out + q_rows[b] * out_stride. Returns 0, or 1 on a shape the kernel does not take. */
int odma_run_decode_f32(const float *cache, int64_t head_stride, int64_t block_size, const int32_t *block_table,
                        int64_t table_stride, const int32_t *seq_lens, const int64_t *q_rows, const float *q,
                        int64_t q_stride, float *out, int64_t out_stride, int64_t lo, int64_t hi, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, float scale, int coalesce) {
    const int64_t G = heads / kv_heads, D = head_dim;
    if (G < 1 || G > MAX_GROUP || D < 1 || D > MAX_DIM || heads % kv_heads) return 1;
    for (int64_t b = lo; b < hi; b++) {
        const int32_t *table = block_table + b * table_stride;
        const int64_t n = seq_lens[b];
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *plane = cache + g * head_stride, *qh = q + q_rows[b] * q_stride + g * G * D;
            float *oh = out + q_rows[b] * out_stride + g * G * D;
            /* SmolLM2-135M/360M (3/64), Llama-3.2-1B (4/64), Llama-3-8B (4/128), Qwen2-7B (7/128); else generic */
            if (G == 3 && D == 64) attend(plane, block_size, table, n, coalesce, qh, oh, scale, 3, 64);
            else if (G == 4 && D == 64) attend(plane, block_size, table, n, coalesce, qh, oh, scale, 4, 64);
            else if (G == 4 && D == 128) attend(plane, block_size, table, n, coalesce, qh, oh, scale, 4, 128);
            else if (G == 7 && D == 128) attend(plane, block_size, table, n, coalesce, qh, oh, scale, 7, 128);
            else attend(plane, block_size, table, n, coalesce, qh, oh, scale, G, D);
        }
    }
    return 0;
}

/* Store tokens' K and V ([tokens, kv_heads, head_dim] each, rows key_stride / value_stride floats apart) at their
 * slots: row slots[t] of every plane. */
void odma_run_write_f32(float *cache, int64_t head_stride, const float *key, int64_t key_stride, const float *value,
                        int64_t value_stride, const int64_t *slots, int64_t tokens, int64_t kv_heads,
                        int64_t head_dim) {
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        for (int64_t g = 0; g < kv_heads; g++) {
            float *row = cache + g * head_stride + slots[t] * 2 * head_dim;
            memcpy(row, key + t * key_stride + g * head_dim, sizeof(float) * head_dim);
            memcpy(row + head_dim, value + t * value_stride + g * head_dim, sizeof(float) * head_dim);
        }
    }
}
