/* y = x W^T + b with W kept in GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), x, y and b in float32.
 *
 * Why: a decode step streams every weight once; a Q4_1 model dequantized to fp32 streams 6.4x the bytes its file
 * holds. Here the weights stay quantized in memory and each panel is dequantized on the way to the FMAs, in the
 * thread that uses it, into a buffer that stays in cache, so DRAM sees only the quantized bytes.
 *
 * Every block type is w = s * q (+ o): q a small integer, s and o per output column and per sub-block of B depths
 * (B = 32; 16 for Q6_K). The packing (backends/cpu_quant.py) regroups a GGUF tensor's blocks into the column panels
 * of linear.c (PANEL columns, panel.h) and per sub-block of a panel writes
 *   s[PANEL] (fp16 as in the file for Q4_0, Q4_1, Q8_0; fp32 for the K-quants, whose s = d * sc is a product),
 *   o[PANEL] (Q4_1: m; Q4_K: -dmin * m; none for the others),
 *   q: unsigned, the centre c of the type subtracted on use (w = s * (q - c) (+ o): Q4_0 c = 8, Q8_0 128 (the
 *      file's signed byte + 128), Q6_K 32 (its 6-bit q widened to a byte), 0 for Q4_1 and Q4_K), in 32-bit lanes of
 *      4 consecutive depths of one column, what vpdpbusd multiplies: byte types as B/4 groups of [PANEL][4] bytes
 *      (group g, column j, byte b: depth 4g + b); 4-bit types as B/8 groups of [PANEL][4] bytes, byte b of column j
 *      in group g holding depth 8g + b in its low nibble and depth 8g + 4 + b in its high one.
 * Dequantization rounds as the reference (gguf-py's, what transformers and odma's fp32 cache use) does: s * q
 * rounded, then + o rounded (the library is built with -ffp-contract=off), so a panel holds the very floats of the
 * dequantized fp32 model, and the FMAs after it (panel.h's, in k order) give the fp32 kernel's bits.
 *
 * Three ways through a panel, the same sums in the same order each way:
 * - up to ROWS rows (a decode step of a few requests): dequantized in registers, sub-block by sub-block, each vector
 *   of weights multiplied at once by every row; the weights never touch memory as floats;
 * - up to TILE_ROWS_MAX rows (a decode step of many requests): TILE_K depths of the panel at a time are
 *   dequantized into the thread's tile (12 KB of fp32 for AVX-512, in L1), and every row, ROWS at a time, runs over
 *   the tile, its accumulators kept in y between tiles (exact: a float stored and loaded back is the same float),
 *   so the weights are dequantized once per step and read from L1 by every row pass;
 * - more rows (a prefill): the whole panel is dequantized once into the thread's buffer (K x PANEL floats, in L2)
 *   and panel.h's fp32 passes run over it as over an fp32 panel: moving every row's accumulators through y at each
 *   tile cost more than it saved there (SmolLM2's layers, one thread, Xeon: at 2,048 rows 4.1 s tiled, 3.1 s from
 *   the buffer, 2.9 s for the fp32 kernel; at 128 rows 189, 204 and 203 ms; level at 256).
 * Threads: OpenMP splits the panels; each thread has its own buffer.
 */
#include "panel.h"

#define TILE_K 64 /* depths dequantized at a time for more than ROWS rows: a multiple of every sub-block */
#define TILE_ROWS_MAX 128 /* more rows: the whole panel dequantized into a buffer */

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml's type ids */

/* each type's qformat fields in order, the constant arguments of the specialised kernels below */
#define F_Q4_0 32, 1, 0, 1, 8
#define F_Q4_1 32, 1, 1, 1, 0
#define F_Q8_0 32, 1, 0, 0, 128
#define F_Q4_K 32, 0, 1, 1, 0
#define F_Q6_K 16, 0, 0, 0, 32

typedef struct {
    int sub;      /* depths per sub-block */
    int scale16;  /* s and o in fp16 (else fp32) */
    int offset;   /* o present */
    int nibbles;  /* 4-bit q (else one byte each) */
    int centre;   /* subtracted from q before scaling */
} qformat;

static int format_of(int type, qformat *f) {
    switch (type) {
    case Q4_0: *f = (qformat){F_Q4_0}; return 0;
    case Q4_1: *f = (qformat){F_Q4_1}; return 0;
    case Q8_0: *f = (qformat){F_Q8_0}; return 0;
    case Q4_K: *f = (qformat){F_Q4_K}; return 0;
    case Q6_K: *f = (qformat){F_Q6_K}; return 0;
    default: return -1;
    }
}

static int64_t sub_block_bytes(const qformat *f, int64_t panel) {
    const int64_t scale_bytes = panel * (f->scale16 ? 2 : 4) * (f->offset ? 2 : 1);
    return scale_bytes + (f->nibbles ? f->sub / 2 : f->sub) * panel;
}

int odma_quant_panel(void) { return PANEL; }
int odma_quant_isa(void) { return ODMA_ISA; }

int odma_quant_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Bytes of one packed panel of depth K (a multiple of the type's block), or -1 for an unknown type or depth. */
int64_t odma_quant_panel_bytes(int type, int64_t K) {
    qformat f;
    if (format_of(type, &f) || K < 1 || K % f.sub || !PANEL) return -1;
    return K / f.sub * sub_block_bytes(&f, PANEL);
}

#ifdef ODMA_HAVE_PANEL
ALWAYS_INLINE vec load_scale(const char *p, const int SCALE16) { return SCALE16 ? load_half(p) : vload(p); }

/* depths per group of lanes: 8 for 4-bit q, 4 for bytes (NIBBLES is in scope at every use) */
#define GROUP (NIBBLES ? 8 : 4)

/* q of depth b (< GROUP) of a group, from the group's lanes, as int32 */
ALWAYS_INLINE ivec lane_q(ivec v, int b, const int NIBBLES) {
    if (NIBBLES) return ivand(ivshr(v, b < 4 ? 8 * b : 8 * (b - 4) + 4), iset1(15));
    return ivand(ivshr(v, 8 * b), iset1(255));
}

/* One panel's K depths into dst [K][PANEL] fp32. The format's fields are constants at each call site below. */
ALWAYS_INLINE void dequant_panel(const char *src, int64_t K, float *dst, const int SUB, const int SCALE16,
                                 const int OFFSET, const int NIBBLES, const int CENTRE) {
    const int ss = SCALE16 ? 2 : 4;
    const int64_t sub_bytes = PANEL * ss * (OFFSET ? 2 : 1) + (NIBBLES ? SUB / 2 : SUB) * PANEL;
    for (int64_t k0 = 0; k0 < K; k0 += SUB) {
        const char *s = src, *o = src + PANEL * ss, *q = src + PANEL * ss * (OFFSET ? 2 : 1);
        for (int64_t line = 0; line < sub_bytes; line += 64) _mm_prefetch(src + PREFETCH_AHEAD + line, _MM_HINT_T0);
        for (int c = 0; c < 3; c++) {
            const vec sc = load_scale(s + c * VW * ss, SCALE16);
            const vec oc = OFFSET ? load_scale(o + c * VW * ss, SCALE16) : vzero();
            float *d = dst + k0 * PANEL + c * VW;
            for (int g = 0; g < SUB / GROUP; g++) {
                const ivec v = iload(q + g * PANEL * 4 + c * VW * 4);
                for (int b = 0; b < GROUP; b++) {
                    vec w = vmul(vcvt_i32(ivadd(lane_q(v, b, NIBBLES), iset1(-CENTRE))), sc);
                    if (OFFSET) w = vadd(w, oc);
                    vstore(d + (g * GROUP + b) * PANEL, w);
                }
            }
        }
        src += sub_bytes;
    }
}

/* In registers: R (<= ROWS) rows of x times one packed panel, y = acc + bias. Per column vector c of a sub-block, its
 * scale and offset are loaded once and each dequantized depth goes straight to the R rows' FMAs (panel.h's MAC_ALL),
 * so each accumulator still sums its depths in order. */
#define FUSED_COL(c)                                                                               \
    {                                                                                              \
        const vec sc = load_scale(s + c * VW * ss, SCALE16);                                       \
        const vec oc = OFFSET ? load_scale(o + c * VW * ss, SCALE16) : vzero();                    \
        for (int g = 0; g < SUB / GROUP; g++) {                                                    \
            const ivec v = iload(q + g * PANEL * 4 + c * VW * 4);                                  \
            for (int b = 0; b < GROUP; b++) {                                                      \
                vec w = vmul(vcvt_i32(ivadd(lane_q(v, b, NIBBLES), iset1(-CENTRE))), sc);          \
                if (OFFSET) w = vadd(w, oc);                                                       \
                MAC_ALL(c, k0 + g * GROUP + b, w)                                                  \
            }                                                                                      \
        }                                                                                          \
    }

ALWAYS_INLINE void fused_rows(const float *x, int64_t ldx, const char *src, int64_t K, const float *bias,
                              int64_t cols, float *y, int64_t ldy, const int R, const int SUB, const int SCALE16,
                              const int OFFSET, const int NIBBLES, const int CENTRE) {
    const int MODE = W_F32, ss = SCALE16 ? 2 : 4;
    const int64_t sub_bytes = PANEL * ss * (OFFSET ? 2 : 1) + (NIBBLES ? SUB / 2 : SUB) * PANEL;
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6) DECLARE(7)
    for (int64_t k0 = 0; k0 < K; k0 += SUB) {
        const char *s = src, *o = src + PANEL * ss, *q = src + PANEL * ss * (OFFSET ? 2 : 1);
        for (int64_t line = 0; line < sub_bytes; line += 64) _mm_prefetch(src + PREFETCH_AHEAD + line, _MM_HINT_T0);
        FUSED_COL(0) FUSED_COL(1) FUSED_COL(2)
        src += sub_bytes;
    }
    const vmask m0 = first_n(cols), m1 = first_n(cols - VW), m2 = first_n(cols - 2 * VW);
    const vec b0 = load_bias(bias, 0, m0, MODE), b1 = load_bias(bias, VW, m1, MODE), b2 = load_bias(bias, 2 * VW, m2, MODE);
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
}

#define FUSED_TYPE(R)                                                                                   \
    switch (type) {                                                                                     \
    case Q4_0: fused_rows(x, ldx, src, K, bias, cols, y, ldy, R, F_Q4_0); break;                           \
    case Q4_1: fused_rows(x, ldx, src, K, bias, cols, y, ldy, R, F_Q4_1); break;                           \
    case Q8_0: fused_rows(x, ldx, src, K, bias, cols, y, ldy, R, F_Q8_0); break;                           \
    case Q4_K: fused_rows(x, ldx, src, K, bias, cols, y, ldy, R, F_Q4_K); break;                           \
    case Q6_K: fused_rows(x, ldx, src, K, bias, cols, y, ldy, R, F_Q6_K); break;                           \
    }
#define FUSED_CASE(n) case n: FUSED_TYPE(n < ROWS ? n : ROWS) break;

/* M (<= ROWS) rows times one packed panel, dequantized in registers */
static void fused_panel(int type, const float *x, int64_t M, int64_t ldx, const char *src, int64_t K,
                        const float *bias, int64_t cols, float *y, int64_t ldy) {
    switch (M) {
        FUSED_CASE(1) FUSED_CASE(2) FUSED_CASE(3) FUSED_CASE(4) FUSED_CASE(5) FUSED_CASE(6) FUSED_CASE(7)
        default: FUSED_TYPE(ROWS)
    }
}

static void panel_f32(const float *x, int64_t M, int64_t ldx, const float *w, int64_t K, const float *bias,
                      int64_t cols, float *y, int64_t ldy) {
    panel_all_rows(x, M, ldx, (const char *)w, K, bias, cols, y, ldy, 0, W_F32); /* w is in cache: no prefetch */
}

static void dequant_any(int type, const char *src, int64_t K, float *dst) {
    switch (type) {
    case Q4_0: dequant_panel(src, K, dst, F_Q4_0); break;
    case Q4_1: dequant_panel(src, K, dst, F_Q4_1); break;
    case Q8_0: dequant_panel(src, K, dst, F_Q8_0); break;
    case Q4_K: dequant_panel(src, K, dst, F_Q4_K); break;
    case Q6_K: dequant_panel(src, K, dst, F_Q6_K); break;
    }
}

/* the calling thread's tile or panel buffer (one per OpenMP thread) */
static __thread grow_buffer tile_buf;

/* R rows of x (x: their columns from this tile's first depth) times one fp32 tile [steps][PANEL] of a panel, the
 * accumulators starting from y (first tile: from zero) and going back to y (last tile: plus the bias). */
#define LOAD_ROW(r)                                                                                \
    if (R > r) {                                                                                   \
        a##r##0 = vload_mask(y + r * ldy, m0);                                                     \
        a##r##1 = vload_mask(y + r * ldy + VW, m1);                                                \
        a##r##2 = vload_mask(y + r * ldy + 2 * VW, m2);                                            \
    }
#define SAVE_ROW(r)                                                                                \
    if (R > r) {                                                                                   \
        vstore_mask(y + r * ldy, m0, a##r##0);                                                     \
        vstore_mask(y + r * ldy + VW, m1, a##r##1);                                                \
        vstore_mask(y + r * ldy + 2 * VW, m2, a##r##2);                                            \
    }

ALWAYS_INLINE void tile_rows(const float *x, int64_t ldx, const float *w, int64_t steps, const float *bias,
                             int64_t cols, float *y, int64_t ldy, int first, int last, const int R) {
    const int MODE = W_F32;
    const vmask m0 = first_n(cols), m1 = first_n(cols - VW), m2 = first_n(cols - 2 * VW);
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6) DECLARE(7)
    if (!first) {
        LOAD_ROW(0) LOAD_ROW(1) LOAD_ROW(2) LOAD_ROW(3) LOAD_ROW(4) LOAD_ROW(5) LOAD_ROW(6) LOAD_ROW(7)
    }
    for (int64_t k = 0; k < steps; k++) {
        const float *wk = w + k * PANEL;
        const vec w0 = vload(wk), w1 = vload(wk + VW), w2 = vload(wk + 2 * VW);
        MAC_ROW(0) MAC_ROW(1) MAC_ROW(2) MAC_ROW(3) MAC_ROW(4) MAC_ROW(5) MAC_ROW(6) MAC_ROW(7)
    }
    if (last) {
        const vec b0 = load_bias(bias, 0, m0, MODE), b1 = load_bias(bias, VW, m1, MODE);
        const vec b2 = load_bias(bias, 2 * VW, m2, MODE);
        STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
    } else {
        SAVE_ROW(0) SAVE_ROW(1) SAVE_ROW(2) SAVE_ROW(3) SAVE_ROW(4) SAVE_ROW(5) SAVE_ROW(6) SAVE_ROW(7)
    }
}

#define TILE_CASE(n) \
    case n: tile_rows(xm, ldx, w, steps, bias, cols, ym, ldy, first, last, n < ROWS ? n : ROWS); break;

static void tile_all_rows(const float *x, int64_t M, int64_t ldx, const float *w, int64_t steps, const float *bias,
                          int64_t cols, float *y, int64_t ldy, int first, int last) {
    for (int64_t m = 0; m < M; m += ROWS) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (M - m < ROWS ? M - m : ROWS) {
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
            default: tile_rows(xm, ldx, w, steps, bias, cols, ym, ldy, first, last, ROWS);
        }
    }
}
#endif

/* x [M, K] (row stride ldx), packed W of `type` (N columns in ceil(N / PANEL) panels), bias [N] or NULL, y [M, N]
 * (row stride ldy). Returns 0; -1 where this build has no panel kernel, -2 on bad sizes or an unknown type, -3 when
 * a thread's buffer cannot be allocated. */
int odma_quant_linear(const float *x, int64_t M, int64_t ldx, const uint8_t *packed, int type, int64_t K, int64_t N,
                      const float *bias, float *y, int64_t ldy, int64_t threads) {
#ifdef ODMA_HAVE_PANEL
    const int64_t panel_bytes = odma_quant_panel_bytes(type, K);
    if (panel_bytes < 0 || M < 0 || N < 1 || ldx < K || ldy < N) return -2;
    if (!M) return 0;
    qformat f;
    format_of(type, &f);
    const int64_t sub_bytes = sub_block_bytes(&f, PANEL);
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1) reduction(| : failed)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t col = p * PANEL, cols = N - col < PANEL ? N - col : PANEL;
        const char *src = (const char *)packed + p * panel_bytes;
        if (M <= ROWS) {
            fused_panel(type, x, M, ldx, src, K, bias ? bias + col : 0, cols, y + col, ldy);
            continue;
        }
        float *buf = grown(&tile_buf, M > TILE_ROWS_MAX ? K * PANEL : TILE_K * PANEL);
        if (!buf) {
            failed = 1;
            continue;
        }
        if (M > TILE_ROWS_MAX) {
            dequant_any(type, src, K, buf);
            panel_f32(x, M, ldx, buf, K, bias ? bias + col : 0, cols, y + col, ldy);
            continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += TILE_K) {
            const int64_t depth = K - k0 < TILE_K ? K - k0 : TILE_K;
            dequant_any(type, src + k0 / f.sub * sub_bytes, depth, buf);
            tile_all_rows(x + k0, M, ldx, buf, depth, bias ? bias + col : 0, cols, y + col, ldy, k0 == 0,
                          k0 + depth >= K);
        }
    }
    return failed ? -3 : 0;
#else
    (void)x; (void)M; (void)ldx; (void)packed; (void)type; (void)K; (void)N; (void)bias; (void)y; (void)ldy;
    (void)threads;
    return -1;
#endif
}

/* The packed W back to fp32 rows, out [N, K]: what the GEMM multiplies by (the tests compare it with gguf-py's
 * dequantization). Same return codes. */
int odma_quant_dequantize(const uint8_t *packed, int type, int64_t K, int64_t N, float *out) {
#ifdef ODMA_HAVE_PANEL
    const int64_t panel_bytes = odma_quant_panel_bytes(type, K);
    if (panel_bytes < 0 || N < 1) return -2;
    float *buf = grown(&tile_buf, K * PANEL);
    if (!buf) return -3;
    for (int64_t p = 0; p * PANEL < N; p++) {
        dequant_any(type, (const char *)packed + p * panel_bytes, K, buf);
        for (int64_t j = 0; j < PANEL && p * PANEL + j < N; j++)
            for (int64_t k = 0; k < K; k++) out[(p * PANEL + j) * K + k] = buf[k * PANEL + j];
    }
    return 0;
#else
    (void)packed; (void)type; (void)K; (void)N; (void)out;
    return -1;
#endif
}
