/* Decoder layers of a step in one call (CPU): decode rows, and a prefill chunk's rows each as a row of its own.
 *
 * Why: a decode step of a small model at one stream is mostly not arithmetic. SmolLM2-135M's step at batch 1
 * took 10.6 ms on a Zen 5 core, of which ~4.8 ms were Python and small torch ops around 30 layers (norms, the
 * rotation, slicing, residual adds, ~150 ctypes calls); llama.cpp's whole step took 5.2 ms. Here the layers run
 * in C (the same step: 6.1 ms), and the Python engine keeps the embedding, the final norm, the LM head, sampling
 * and the KV bookkeeping.
 *
 * Per layer, for the B requests at once:
 *   h = rmsnorm(x) * attn_norm;  qkv = h Wqkv^T (+ b);  q, k rotated at each request's position (the rotary table:
 *   per position the cos of every frequency, then the sin, as the Python model's `Rotary.table`);  k, v written to
 *   row len-1 of the request's block and q attended over rows [0, len) (a decode row: attend.h, the decode-attention
 *   kernel's loops; a prefill chunk's rows: prefill_attend.h, tiled);  x += attn Wo^T (+ b);  h = rmsnorm(x) * mlp_norm;  g, u = h Wgu^T;  x += (silu(g) * u) Wdown^T.
 * The GEMMs are the backend's own kernels (linear.c for fp32 and bf16 panels, quant_linear.c for GGUF blocks),
 * called through the function pointers the caller passes in `odma_part`: they split their panels over OpenMP threads themselves;
 * the attention here splits the requests.
 *
 * Arithmetic is the Python model's, not its bits: the norms' sums of squares run in another order than torch's
 * reduction (tests compare within float tolerance and greedy tokens). A bf16 model's activations are rounded to bf16
 * wherever its torch ops round them (`as_model`), and its GEMMs are linear.c's bf16 ones; fp32 and GGUF-block models
 * keep fp32 activations throughout, as theirs do.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attend.h"
#include "bf16.h"
#include "prefill_attend.h"

#define MAX_PARTS 4 /* a fused layer of parts in different block types (Q4_K_M: Q4_K q, k beside a Q6_K v) */
/* odma_part.type: linear.c's fp32 or bf16 panels, else the GGUF block type of quant_linear.c */
#define KIND_F32 -1
#define KIND_BF16 -2

typedef int (*f32_gemm)(const float *x, int64_t M, int64_t ldx, const void *packed, int64_t K, int64_t N,
                        const float *bias, float *y, int64_t ldy, int64_t threads);
typedef int (*bf16_gemm)(const uint16_t *x, int64_t M, int64_t ldx, const void *packed, int64_t K, int64_t N,
                         const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t threads);
typedef int (*quant_gemm)(const float *x, int64_t M, int64_t ldx, const void *packed, int type, int64_t K,
                          int64_t N, const float *bias, float *y, int64_t ldy, int64_t threads, int64_t int8_rows);

/* One GEMM writing `rows` output columns from column `col` of the layer's output. */
typedef struct {
    void *fn;           /* f32_gemm, bf16_gemm or quant_gemm, by type */
    const void *packed; /* its packed weights */
    int64_t type;
    int64_t rows;
    int64_t col;
    const void *bias; /* this part's first column of the bias (fp32; bf16 for KIND_BF16), or NULL */
    const int64_t *int8_rows; /* GGUF blocks: the GEMM's int8_rows argument, read at each call (it may change) */
} odma_part;

typedef struct {
    int64_t in, out, parts;
    odma_part part[MAX_PARTS];
} odma_linear;

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    odma_linear qkv, o, gate_up, down;
} odma_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    int64_t bf16; /* a bf16 model: activations rounded to bf16 where its torch ops round them */
} odma_shape;

/* The step: row b's block at address blocks[b], its layer l's K at l * layer_stride[b] elements, V half_stride[b]
 * further (decode_attention.c's layout); lens[b] its context including its token (at position lens[b]-1). Rows of
 * one request's prefill chunk share its block, lens one apart. Decode rows may read their first rows from other
 * blocks (`pieces`, attend.h; its start NULL: none does). */
typedef struct {
    int64_t batch, threads;
    const int64_t *blocks, *layer_stride, *half_stride, *lens;
    const float *rotary; /* [positions, head_dim] */
    int64_t half; /* K/V blocks in float16 (else float32) */
    odma_pieces pieces;
} odma_step;

int odma_decode_step_max_parts(void) { return MAX_PARTS; }

/* y [M, out] = x [M, in] W^T (+ b), fp32 in and out; bf16 panels read x narrowed into xs and write ys (both
 * [M, widest]), widened back into y: exact, x holding bf16 values. */
static int linear(const odma_linear *L, const float *x, int64_t M, float *y, int64_t threads, uint16_t *xs,
                  uint16_t *ys) {
    int narrowed = 0;
    for (int64_t i = 0; i < L->parts; i++) {
        const odma_part *p = &L->part[i];
        int code;
        if (p->type == KIND_F32) {
            code = ((f32_gemm)p->fn)(x, M, L->in, p->packed, L->in, p->rows, p->bias, y + p->col, L->out, threads);
        } else if (p->type == KIND_BF16) {
            if (!narrowed) {
                for (int64_t j = 0; j < M * L->in; j++) xs[j] = to_bf16(x[j]);
                narrowed = 1;
            }
            code = ((bf16_gemm)p->fn)(xs, M, L->in, p->packed, L->in, p->rows, p->bias, ys, p->rows, threads);
            for (int64_t m = 0; !code && m < M; m++)
                for (int64_t j = 0; j < p->rows; j++) y[m * L->out + p->col + j] = from_bf16(ys[m * p->rows + j]);
        } else {
            code = ((quant_gemm)p->fn)(x, M, L->in, p->packed, (int)p->type, L->in, p->rows, p->bias, y + p->col,
                                       L->out, threads, *p->int8_rows);
        }
        if (code) return 100 - code; /* the GEMMs answer -1, -2, -3 */
    }
    return 0;
}

/* v as the model holds it: rounded to bf16 by every torch op of a bf16 model */
static inline float as_model(float v, int64_t bf16) { return bf16 ? from_bf16(to_bf16(v)) : v; }

/* out [M, H] = rmsnorm(x) * w: float32 statistics, as the Python model's RMSNorm (its normalized x rounded to the
 * model's dtype, then the product) */
static void rmsnorm(const float *x, const float *w, int64_t M, int64_t H, float eps, int64_t bf16, float *out) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * H;
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += xm[i] * xm[i];
        const float r = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) out[m * H + i] = as_model(w[i] * as_model(xm[i] * r, bf16), bf16);
    }
}

/* heads vectors of head_dim at v, rotated by the table row (cos | sin of head_dim / 2 frequencies); a bf16 model
 * rounds cos and sin, each product and the sum, as `x * cos + rotate_half(x) * sin` does in bf16 */
static void rotate(float *v, int64_t heads, int64_t head_dim, const float *table, int64_t bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = v + h * head_dim, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float c = as_model(table[i], bf16), s = as_model(table[half + i], bf16), x0 = a[i], x1 = b[i];
            a[i] = as_model(as_model(x0 * c, bf16) - as_model(x1 * s, bf16), bf16);
            b[i] = as_model(as_model(x1 * c, bf16) + as_model(x0 * s, bf16), bf16);
        }
    }
}

/* One piece of a layer's attention: a row over its prefix on its own (rows == 0: row b, attend.h), or a block of a
 * prefill chunk (prefill_attend.h): rows [b, b + rows) of one request, KV head g. */
typedef struct {
    int64_t b, rows, g, cost;
} attn_job;

static int costlier(const void *a, const void *b) {
    const int64_t x = ((const attn_job *)a)->cost, y = ((const attn_job *)b)->cost;
    return (x < y) - (x > y);
}

/* The step's attention as jobs, costliest first (threads take them in turn). A chunk is a run of rows that share a
 * block and strides, lens one apart (cpu_attention.plan_tokens lays a chunk's rows out so); one of at least min_rows
 * rows runs in blocks of pf_block_rows(G) rows per KV head. jobs: room for batch * (kv_heads + 1). */
static int64_t plan_jobs(const odma_step *step, int64_t kvh, int64_t G, int64_t D, int64_t min_rows, attn_job *jobs) {
    const int64_t B = step->batch, bq = pf_block_rows(G);
    int64_t n = 0;
    for (int64_t b = 0; b < B;) {
        int64_t r = 1;
        while (b + r < B && step->blocks[b + r] == step->blocks[b] && step->layer_stride[b + r] == step->layer_stride[b]
               && step->half_stride[b + r] == step->half_stride[b] && step->lens[b + r] == step->lens[b] + r)
            r++;
        if (r >= min_rows && D % PF_DR == 0) {
            for (int64_t i = 0; i < r; i += bq)
                for (int64_t g = 0; g < kvh; g++) {
                    const int64_t rows = r - i < bq ? r - i : bq;
                    jobs[n++] = (attn_job){b + i, rows, g, rows * G * (step->lens[b + i] + rows)};
                }
        } else {
            for (int64_t i = 0; i < r; i++) jobs[n++] = (attn_job){b + i, 0, 0, kvh * G * step->lens[b + i]};
        }
        b += r;
    }
    qsort(jobs, n, sizeof(attn_job), costlier);
    return n;
}

/* floats of attention scratch per thread: a row's scores and one widened K or V row, or a tiled block's buffers */
static int64_t attn_scratch(int64_t heads, int64_t kvh, int64_t D, int64_t max_len) {
    const int64_t row = heads * max_len + kvh * D, tiled = pf_scratch_floats(heads / kvh, D);
    return row > tiled ? row : tiled;
}

/* Layer l's attention for every job: row b's query at q + b * q_stride, its output at out + b * heads * D. */
static void attend_jobs(const odma_step *step, int64_t l, const attn_job *jobs, int64_t n_jobs, int64_t heads,
                        int64_t kvh, int64_t D, const float *q, int64_t q_stride, float *out, float *scratch,
                        int64_t per_thread, int64_t threads) {
    const int64_t G = heads / kvh, qd = heads * D, elem = step->half ? 2 : 4;
    const float scale = 1.f / sqrtf((float)D);
    int64_t max_len = 0;
    for (int64_t b = 0; b < step->batch; b++) max_len = step->lens[b] > max_len ? step->lens[b] : max_len;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && n_jobs > 1)
    for (int64_t j = 0; j < n_jobs; j++) {
        const attn_job *job = &jobs[j];
        const int64_t b = job->b;
        const char *K = (const char *)(intptr_t)step->blocks[b] + l * step->layer_stride[b] * elem;
        const char *V = K + step->half_stride[b] * elem;
#ifdef _OPENMP
        float *mine = scratch + (int64_t)omp_get_thread_num() * per_thread;
#else
        float *mine = scratch;
#endif
        if (job->rows)
            prefill_block(K, V, kvh, job->g, G, step->lens[b] - 1, job->rows, q + b * q_stride, q_stride, out + b * qd,
                          qd, scale, mine, D, (int)step->half);
        else if (pieces_of(&step->pieces, b))
            attend_through_pieces(&step->pieces, b, l, K, V, step->lens[b], kvh, q + b * q_stride, out + b * qd, mine,
                                  mine + heads * max_len, scale, G, D, (int)step->half);
        else
            attend_any(K, V, step->lens[b], kvh, q + b * q_stride, out + b * qd, mine, mine + heads * max_len, scale,
                       G, D, step->half);
    }
}

/* A prefill chunk's attention alone, for tests and measurements: rows [0, rows) at positions start .. start + rows - 1
 * of one layer's K then V (kv; V half_stride elements after K; rows of kv_heads * head_dim, fp16 where half; rows
 * [0, start + rows) written), queries q [rows, heads * head_dim], outputs out alike. A chunk of at least min_rows rows
 * runs tiled, else row by row (the step takes PF_MIN_ROWS). Returns 0; 1 for a shape it does not take; 2 without
 * memory. */
int odma_chunk_attention(const void *kv, int64_t half_stride, int64_t start, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, const float *q, float *out, int64_t half, int64_t min_rows,
                         int64_t threads) {
    if (start < 0 || rows < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 1) return 1;
    threads = threads > 0 ? threads : 1;
    int64_t *arrays = malloc(sizeof(int64_t) * 4 * rows);
    attn_job *jobs = malloc(sizeof(attn_job) * rows * (kv_heads + 1));
    const int64_t per_thread = attn_scratch(heads, kv_heads, head_dim, start + rows);
    float *scratch = malloc(sizeof(float) * threads * per_thread);
    int code = 2;
    if (arrays && jobs && scratch) {
        int64_t *blocks = arrays, *layer_stride = arrays + rows, *halves = arrays + 2 * rows, *lens = arrays + 3 * rows;
        for (int64_t i = 0; i < rows; i++)
            blocks[i] = (int64_t)(intptr_t)kv, layer_stride[i] = 0, halves[i] = half_stride, lens[i] = start + 1 + i;
        const odma_step step = {rows, threads, blocks, layer_stride, halves, lens, NULL, half};
        const int64_t n = plan_jobs(&step, kv_heads, heads / kv_heads, head_dim, min_rows, jobs);
        attend_jobs(&step, 0, jobs, n, heads, kv_heads, head_dim, q, heads * head_dim, out, scratch, per_thread,
                    threads);
        code = 0;
    }
    free(arrays), free(jobs), free(scratch);
    return code;
}

/* Layers [first, first + count) of `layers` over x [batch, hidden] in place. Returns 0; 1 for a request without a
 * position (len < 1), 2 when memory for the step cannot be had, 3 for pieces that do not end where a row's own block
 * begins (or more than MAX_PIECES), 100 - a GEMM's (negative) code when one fails. */
int odma_decode_layers(const odma_shape *S, const odma_layer *layers, int64_t first, int64_t count,
                       const odma_step *step, float *x) {
    const int64_t B = step->batch, H = S->hidden, D = S->head_dim, heads = S->heads, kvh = S->kv_heads;
    const int64_t qd = heads * D, kvd = kvh * D, I = S->intermediate, group = heads / kvh;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        if (step->lens[b] < 1) return 1;
        if (step->lens[b] > max_len) max_len = step->lens[b];
        if (!pieces_fit(&step->pieces, b, step->lens[b])) return 3;
    }
    const int64_t widest = qd + 2 * kvd > 2 * I ? qd + 2 * kvd : 2 * I;
    /* h: a norm's output (then the MLP's product), wide: qkv or gate_up, att: attention's output, y: a projection */
    float *h = malloc(sizeof(float) * B * (H > I ? H : I)), *wide = malloc(sizeof(float) * B * widest);
    float *att = malloc(sizeof(float) * B * qd), *y = malloc(sizeof(float) * B * H);
    const int64_t threads = step->threads > 0 ? step->threads : 1;
    const int64_t per_thread = attn_scratch(heads, kvh, D, max_len), elem = step->half ? 2 : 4;
    float *scores = malloc(sizeof(float) * threads * per_thread);
    attn_job *jobs = malloc(sizeof(attn_job) * B * (kvh + 1));
    const int64_t ins = H > I ? (H > qd ? H : qd) : (I > qd ? I : qd); /* the widest GEMM input */
    const int64_t bf16 = S->bf16, narrow = bf16 ? B * (widest > ins ? widest : ins) : 1;
    uint16_t *xs = malloc(sizeof(uint16_t) * narrow), *ys = malloc(sizeof(uint16_t) * narrow);
    int code = 0;
    if (!h || !wide || !att || !y || !scores || !jobs || !xs || !ys) code = 2;
    const int64_t n_jobs = code ? 0 : plan_jobs(step, kvh, group, D, PF_MIN_ROWS, jobs);
    for (int64_t l = first; !code && l < first + count; l++) {
        const odma_layer *L = &layers[l];
        rmsnorm(x, L->attn_norm, B, H, S->eps, bf16, h);
        if ((code = linear(&L->qkv, h, B, wide, threads, xs, ys))) break;
        const int64_t row = qd + 2 * kvd;
        /* every row's k and v into its block first: a prefill chunk's rows are rows of one request, each attending
         * over the ones before it */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && B > 1)
        for (int64_t b = 0; b < B; b++) {
            const int64_t n = step->lens[b];
            float *qb = wide + b * row, *kb = qb + qd, *vb = kb + kvd;
            const float *table = step->rotary + (n - 1) * D;
            rotate(qb, heads, D, table, bf16);
            rotate(kb, kvh, D, table, bf16);
            char *K = (char *)(intptr_t)step->blocks[b] + l * step->layer_stride[b] * elem;
            kv_put(K, n - 1 - pieces_own_first(&step->pieces, b), kvd, kb, step->half);
            kv_put(K + step->half_stride[b] * elem, n - 1 - pieces_own_first(&step->pieces, b), kvd, vb, step->half);
        }
        attend_jobs(step, l, jobs, n_jobs, heads, kvh, D, wide, row, att, scores, per_thread, threads);
        if (bf16)
            for (int64_t i = 0; i < B * qd; i++) att[i] = as_model(att[i], bf16);
        if ((code = linear(&L->o, att, B, y, threads, xs, ys))) break;
        for (int64_t i = 0; i < B * H; i++) x[i] = as_model(x[i] + y[i], bf16);
        rmsnorm(x, L->mlp_norm, B, H, S->eps, bf16, h);
        if ((code = linear(&L->gate_up, h, B, wide, threads, xs, ys))) break;
        for (int64_t b = 0; b < B; b++) {
            const float *g = wide + b * 2 * I, *u = g + I;
            for (int64_t i = 0; i < I; i++)
                h[b * I + i] = as_model(as_model(g[i] / (1.f + expf(-g[i])), bf16) * u[i], bf16);
        }
        if ((code = linear(&L->down, h, B, y, threads, xs, ys))) break;
        for (int64_t i = 0; i < B * H; i++) x[i] = as_model(x[i] + y[i], bf16);
    }
    free(h), free(wide), free(att), free(y), free(scores), free(jobs), free(xs), free(ys);
    return code;
}

int odma_prefill_min_rows(void) { return PF_MIN_ROWS; }
