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

/* A request may also read its first rows from other blocks: the piece arguments are attend.h's `odma_pieces`, field
 * by field (piece_start NULL: no request reads pieces). Returns 0; 1 for a request without a position, 2 without
 * memory, 3 for pieces that do not end where a request's own block begins. */
int odma_decode_attention(const int64_t *blocks, const int64_t *layer_stride, const int64_t *half_stride,
                          int64_t layer, const int64_t *lens,
                          const float *q, const float *k_new, const float *v_new, float *out,
                          int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t half,
                          const int64_t *piece_start, const int64_t *piece_block, const int64_t *piece_layer_stride,
                          const int64_t *piece_half_stride, const int64_t *piece_first, const int64_t *piece_end,
                          const int64_t *own_first) {
    const odma_pieces P = {piece_start, piece_block, piece_layer_stride, piece_half_stride, piece_first, piece_end,
                           own_first};
    const int64_t group = heads / kv_heads, row = kv_heads * head_dim, elem = half ? 2 : 4;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (lens[b] < 1) return 1;
        if (lens[b] > max_len) max_len = lens[b];
        if (!pieces_fit(&P, b, lens[b])) return 3;
    }
    float *scores = malloc(sizeof(float) * (heads * max_len + row));
    if (!scores) return 2;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = lens[b], first = pieces_own_first(&P, b);
        char *K = (char *)(intptr_t)blocks[b] + layer * layer_stride[b] * elem, *V = K + half_stride[b] * elem;
        kv_put(K, n - 1 - first, row, k_new + b * row, half);
        kv_put(V, n - 1 - first, row, v_new + b * row, half);
        const float *qb = q + b * heads * head_dim;
        float *ob = out + b * heads * head_dim, *wide = scores + heads * max_len;
        if (pieces_of(&P, b))
            attend_through_pieces(&P, b, layer, K, V, n, kv_heads, qb, ob, scores, wide, scale, group, head_dim, half);
        else
            attend_any(K, V, n, kv_heads, qb, ob, scores, wide, scale, group, head_dim, half);
    }
    free(scores);
    return 0;
}
