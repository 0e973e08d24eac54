/* Decode attention straight from each request's contiguous KV block (CPU; K/V in float32 or float16, arithmetic in
 * float32).
 *
 * One call handles every decoding request of one layer: it appends the step's new K/V row to each block
 * and attends the request's single query token over rows [0, len) of its block. A block's K (and V) rows
 * for a layer are one contiguous range of the pool's arena, so the loops below stream memory sequentially
 * (what contiguous blocks are for) and there is no per-request dispatch from Python.
 *
 * Layout: request b's block starts at address blocks[b] (a [layers, 2, capacity, kv_heads, head_dim] tensor of
 * float32, or float16 where `half`, rows contiguous); its K for `layer` starts layer * layer_stride[b] elements in,
 * V half_stride[b] further, and row t of either is t * kv_heads * head_dim further. Blocks may sit in different arenas or
 * segments: only addresses are shared with the caller.
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention, as transformers' repeat_kv).
 * A request may read its first rows from other blocks (below, `piece_start`): the same sums, piece by piece.
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

#include "attend.h"

/* A request may also read its first rows from other blocks (pieces: a shared prefix read in place, a block
 * continued elsewhere): with `piece_start`, request b's pieces are entries [piece_start[b], piece_start[b + 1]) of the
 * piece arrays, in row order (each a block's address, layer and K-to-V strides, the first row it holds and the row
 * after the piece), and its own block holds rows from own_first[b] on; piece_start NULL: none has any. */
int odma_decode_attention(const int64_t *blocks, const int64_t *layer_stride, const int64_t *half_stride,
                          int64_t layer, const int64_t *lens,
                          const float *q, const float *k_new, const float *v_new, float *out,
                          int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t half,
                          const int64_t *piece_start, const int64_t *piece_block, const int64_t *piece_layer_stride,
                          const int64_t *piece_half_stride, const int64_t *piece_first, const int64_t *piece_end,
                          const int64_t *own_first) {
    const int64_t group = heads / kv_heads, row = kv_heads * head_dim, elem = half ? 2 : 4;
    int64_t max_len = 0, max_pieces = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (lens[b] < 1) return 1;
        if (lens[b] > max_len) max_len = lens[b];
        if (piece_start) {
            const int64_t first = own_first[b], p = piece_start[b + 1] - piece_start[b];
            if (p < 0 || first < 0 || first >= lens[b] || (p ? piece_end[piece_start[b + 1] - 1] : 0) != first) return 3;
            if (p > max_pieces) max_pieces = p;
        }
    }
    float *scores = malloc(sizeof(float) * (heads * max_len + row));
    const void **parts = malloc(sizeof(void *) * 2 * (max_pieces + 1));
    int64_t *bounds = malloc(sizeof(int64_t) * 2 * (max_pieces + 1));
    if (!scores || !parts || !bounds) {
        free(scores), free(parts), free(bounds);
        return 2;
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = lens[b], first = piece_start ? own_first[b] : 0;
        char *K = (char *)(intptr_t)blocks[b] + layer * layer_stride[b] * elem, *V = K + half_stride[b] * elem;
        kv_put(K, n - 1 - first, row, k_new + b * row, half);
        kv_put(V, n - 1 - first, row, v_new + b * row, half);
        const float *qb = q + b * heads * head_dim;
        float *ob = out + b * heads * head_dim;
        const int64_t p0 = piece_start ? piece_start[b] : 0, pieces = piece_start ? piece_start[b + 1] - p0 : 0;
        if (!pieces) {
            attend_any(K, V, n, kv_heads, qb, ob, scores, scores + heads * max_len, scale, group, head_dim, half);
            continue;
        }
        const void **Ks = parts, **Vs = parts + pieces + 1;
        int64_t *firsts = bounds, *ends = bounds + pieces + 1;
        for (int64_t i = 0; i < pieces; i++) {
            const int64_t e = p0 + i;
            Ks[i] = (char *)(intptr_t)piece_block[e] + layer * piece_layer_stride[e] * elem;
            Vs[i] = (const char *)Ks[i] + piece_half_stride[e] * elem;
            firsts[i] = piece_first[e], ends[i] = piece_end[e];
        }
        Ks[pieces] = K, Vs[pieces] = V, firsts[pieces] = first, ends[pieces] = n;
        attend_pieces_any(Ks, Vs, firsts, ends, pieces + 1, n, kv_heads, qb, ob, scores, scores + heads * max_len,
                          scale, group, head_dim, half);
    }
    free(scores), free(parts), free(bounds);
    return 0;
}
