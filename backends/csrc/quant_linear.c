/* y = x W^T + b with W kept in GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), x, y and b in float32.
 *
 * Why: a decode step streams every weight once; a Q4_1 model dequantized to fp32 streams 6.4x the bytes its file
 * holds. Here the weights stay quantized in memory and each panel is dequantized on the way to the FMAs, in the
 * thread that uses it, into a buffer that stays in cache, so DRAM sees only the quantized bytes.
 *
 * Every block type is w = s * q (+ o): q a small integer, s and o per output column and per sub-block of SUB depths
 * (32; 16 for Q6_K). The packing (backends/cpu_quant.py) regroups a GGUF tensor's blocks into the column panels
 * of linear.c (PANEL columns, panel.h), keeping each type's bytes as its file keeps them, per block of SUPER
 * depths (a panel is K / SUPER such blocks):
 * - Q4_0, Q4_1, Q8_0 (SUPER = SUB = 32): s[PANEL] fp16 (Q4_1: then o = m [PANEL] fp16), then q;
 * - the K-quants (SUPER = 256): d[PANEL] fp16 (Q4_K: then dmin [PANEL] fp16), the sub-blocks' scales
 *   [SUPER / SUB][PANEL] (Q4_K: sc, 6 bits in a byte, then m; Q6_K: a signed byte), then the sub-blocks' q;
 *   s = d * sc and o = -(dmin * m) are formed in registers (exact in fp32: an 11-bit times a 6- or 8-bit integer).
 *   Per column 4.625 bits a weight for Q4_K (the file: 4.5), 6.5625 for Q6_K (as the file).
 * q: unsigned, the centre c of the type subtracted on use (w = s * (q - c) (+ o): Q4_0 c = 8, Q8_0 128 (the file's
 * signed byte + 128), Q6_K 32, 0 for Q4_1 and Q4_K), in 32-bit lanes of 4 depths of one column, what vpdpbusd
 * multiplies: byte types (Q8_0) as SUB/4 groups of [PANEL][4] bytes (group g, column j, byte b: depth 4g + b);
 * 4-bit types as SUB/8 groups of [PANEL][4] bytes, byte b of column j in group g holding depth 8g + b in its low
 * nibble and depth 8g + 4 + b in its high one; Q6_K's 6 bits as its low 4 in that nibble layout, then one more
 * [PANEL][4] bytes per sub-block with the high 2 (byte b: bits 4g + 2h for depth 8g + 4h + b, g and h 0 or 1).
 * Dequantization rounds as the reference (gguf-py's, what transformers and odma's fp32 cache use) does: s * q
 * rounded, then + o rounded (the library is built with -ffp-contract=off), so a panel holds the very floats of the
 * dequantized fp32 model, and the FMAs after it (panel.h's, in k order) give the fp32 kernel's bits.
 *
 * With fp32 activations, three ways through a panel, the same sums in the same order each way:
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
 * With int8 activations (the caller's choice, int8_rows): integer dot products per 16 depths, below.
 * Threads: OpenMP splits the panels; each thread has its own buffer.
 */
#include <math.h>

#include "panel.h"

#define TILE_K 64 /* depths dequantized at a time for more than ROWS rows: a multiple of every sub-block */
#define TILE_ROWS_MAX 128 /* more rows: the whole panel dequantized into a buffer */

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml's type ids */
/* Q6_K's wide form, a panel's copy for passes over many rows (widen_panel): never packed, not a ggml type */
enum { Q6_K_WIDE = 1014 };

/* each type's qformat fields in order, the constant arguments of the specialised kernels below */
#define F_Q4_0 32, 32, 0, 1, 0, 8, 0
#define F_Q4_1 32, 32, 1, 1, 0, 0, 0
#define F_Q8_0 32, 32, 0, 0, 0, 128, 0
#define F_Q4_K 32, 256, 1, 1, 0, 0, 0
#define F_Q6_K 16, 256, 0, 1, 1, 32, 0
#define F_Q6_K_WIDE 16, 16, 0, 0, 0, 32, 1
/* the same fields as the constant parameters of those kernels, and passed on */
#define QF_PARAMS                                                                                  \
    const int SUB, const int SUPER, const int OFFSET, const int NIBBLES, const int HIGH2, const int CENTRE, const int WIDE
#define QF_ARGS SUB, SUPER, OFFSET, NIBBLES, HIGH2, CENTRE, WIDE

typedef struct {
    int sub;      /* depths per sub-block (one s, o) */
    int super;    /* depths per block of the layout: sub, or 256 for the K-quants' d (and dmin) */
    int offset;   /* o present */
    int nibbles;  /* 4-bit q (else one byte each) */
    int high2;    /* Q6_K: 2 more bits of q per depth, after the nibbles */
    int centre;   /* subtracted from q before scaling */
    int wide;     /* s and o in fp32 (the wide form), else fp16 */
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

/* bytes of a layout block's head (d or s, dmin or o, the K-quants' sub-block scales), of one sub-block's q, and of
 * the whole block, for one panel of PANEL columns */
static inline int64_t head_bytes(QF_PARAMS) {
    (void)NIBBLES; (void)HIGH2; (void)CENTRE;
    return PANEL * (WIDE ? 4 : 2) * (OFFSET ? 2 : 1) + (SUPER > SUB ? SUPER / SUB * PANEL * (OFFSET ? 2 : 1) : 0);
}
static inline int64_t q_sub_bytes(QF_PARAMS) {
    (void)SUPER; (void)OFFSET; (void)CENTRE; (void)WIDE;
    return ((NIBBLES ? SUB / 2 : SUB) + (HIGH2 ? SUB / 4 : 0)) * PANEL;
}
static inline int64_t layout_block_bytes(QF_PARAMS) {
    return head_bytes(QF_ARGS) + SUPER / SUB * q_sub_bytes(QF_ARGS);
}
static int64_t format_block_bytes(const qformat *f) {
    return layout_block_bytes(f->sub, f->super, f->offset, f->nibbles, f->high2, f->centre, f->wide);
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
    if (format_of(type, &f) || K < 1 || K % f.super || !PANEL) return -1;
    return K / f.super * format_block_bytes(&f);
}

#ifdef ODMA_HAVE_PANEL
/* Where sub-block k0 / SUB of a panel lies: its layout block (blk), its index there (j) and its q. Prefetches the
 * bytes PREFETCH_AHEAD past this sub-block's own (with its block's head at the block's first). */
#define LOCATE_SUB(src, k0)                                                                        \
    const char *blk = (src) + (k0) / SUPER * block_bytes;                                          \
    const int j = (int)((k0) % SUPER / SUB);                                                       \
    const char *q = blk + head + j * q_bytes;                                                      \
    {                                                                                              \
        const char *from = j ? q : blk;                                                            \
        for (int64_t line = 0; line < q_bytes + (j ? 0 : head); line += 64)                       \
            _mm_prefetch(from + PREFETCH_AHEAD + line, _MM_HINT_T0);                               \
    }
/* the byte counts LOCATE_SUB reads, for the format in scope */
#define LAYOUT_SIZES                                                                               \
    const int64_t head = head_bytes(QF_ARGS), q_bytes = q_sub_bytes(QF_ARGS);                      \
    const int64_t block_bytes = head + SUPER / SUB * q_bytes;

/* Sub-block j's scale and offset for column vector c, from its layout block's head: plain types keep them in fp16,
 * the K-quants form them from d (dmin) and the sub-block's integer scale (min), each product exact in fp32. */
ALWAYS_INLINE void sub_scales(const char *blk, int j, int c, vec *sc, vec *oc, QF_PARAMS) {
    (void)NIBBLES; (void)HIGH2; (void)CENTRE;
    *oc = vzero();
    if (WIDE) {
        *sc = vload(blk + c * VW * 4);
        if (OFFSET) *oc = vload(blk + PANEL * 4 + c * VW * 4);
        return;
    }
    const vec d = load_half(blk + c * VW * 2);
    if (SUPER == SUB) {
        *sc = d;
        if (OFFSET) *oc = load_half(blk + PANEL * 2 + c * VW * 2);
        return;
    }
    const char *k = blk + PANEL * 2 * (OFFSET ? 2 : 1); /* the sub-blocks' scales, then (Q4_K) their mins */
    if (OFFSET) { /* Q4_K: s = d * sc, o = -(dmin * m) */
        *sc = vmul(d, vcvt_i32(widen_u8(k + j * PANEL + c * VW)));
        const vec neg_dmin = vmul(load_half(blk + PANEL * 2 + c * VW * 2), vset1(-1.0f));
        *oc = vmul(neg_dmin, vcvt_i32(widen_u8(k + (SUPER / SUB + j) * PANEL + c * VW)));
    } else { /* Q6_K: s = d * scale, a signed byte */
        *sc = vmul(d, vcvt_i32(widen_i8(k + j * PANEL + c * VW)));
    }
}

/* depths per group of lanes: 8 for 4-bit (and Q6_K's) q, 4 for bytes (NIBBLES is in scope at every use) */
#define GROUP (NIBBLES ? 8 : 4)

/* Q6_K's high-bit lanes of column vector c of a sub-block (q its first group); zero for other types */
#define HIGH_LANES(q, c) (HIGH2 ? iload((q) + SUB / 8 * PANEL * 4 + (c) * VW * 4) : iset1(0))

/* Q6_K's q of group g as bytes: lo holds depths 8g + b, hi 8g + 4 + b (b = 0..3), the low 4 bits from the nibble
 * lanes v, bits 4 and 5 from the sub-block's high lanes vh */
ALWAYS_INLINE void six_bit_lanes(ivec v, ivec vh, int g, ivec *lo, ivec *hi) {
    *lo = ivor(ivand(v, iset1(0x0F0F0F0F)), ivshl(ivand(ivshr(vh, 4 * g), iset1(0x03030303)), 4));
    *hi = ivor(ivand(ivshr(v, 4), iset1(0x0F0F0F0F)), ivshl(ivand(ivshr(vh, 4 * g + 2), iset1(0x03030303)), 4));
}

/* q of depth b (< GROUP) of a group, from the group's lanes v (Q6_K: from its bytes lo and hi), as int32 */
ALWAYS_INLINE ivec lane_q(ivec v, ivec lo, ivec hi, int b, const int NIBBLES, const int HIGH2) {
    if (HIGH2) return ivand(ivshr(b < 4 ? lo : hi, 8 * (b & 3)), iset1(255));
    if (NIBBLES) return ivand(ivshr(v, b < 4 ? 8 * b : 8 * (b - 4) + 4), iset1(15));
    return ivand(ivshr(v, 8 * b), iset1(255));
}

/* a group's lanes v at q, and for Q6_K its bytes lo and hi */
#define GROUP_LANES(g, c)                                                                          \
    const ivec v = iload(q + (g) * PANEL * 4 + (c) * VW * 4);                                      \
    ivec lo = v, hi = v;                                                                           \
    if (HIGH2) six_bit_lanes(v, vh, g, &lo, &hi);

/* depths [k_begin, k_begin + depth) of one panel into dst [depth][PANEL] fp32. The format's fields are constants at
 * each call site below. */
ALWAYS_INLINE void dequant_panel(const char *src, int64_t k_begin, int64_t depth, float *dst, QF_PARAMS) {
    LAYOUT_SIZES
    for (int64_t k0 = k_begin; k0 < k_begin + depth; k0 += SUB) {
        LOCATE_SUB(src, k0)
        for (int c = 0; c < 3; c++) {
            vec sc, oc;
            sub_scales(blk, j, c, &sc, &oc, QF_ARGS);
            const ivec vh = HIGH_LANES(q, c);
            float *d = dst + (k0 - k_begin) * PANEL + c * VW;
            for (int g = 0; g < SUB / GROUP; g++) {
                GROUP_LANES(g, c)
                for (int b = 0; b < GROUP; b++) {
                    vec w = vmul(vcvt_i32(ivadd(lane_q(v, lo, hi, b, NIBBLES, HIGH2), iset1(-CENTRE))), sc);
                    if (OFFSET) w = vadd(w, oc);
                    vstore(d + (g * GROUP + b) * PANEL, w);
                }
            }
        }
    }
}

/* A Q6_K panel (F_Q6_K at src) in its wide form (F_Q6_K_WIDE) at dst: per sub-block s in fp32, then q a byte a
 * depth. Passes over many rows read it instead of the file's form, so that each sub-block's scale and high bits are
 * put together once per panel rather than once per pass. */
ALWAYS_INLINE void widen_panel(const char *src, int64_t K, char *dst, QF_PARAMS) {
    LAYOUT_SIZES
    for (int64_t k0 = 0; k0 < K; k0 += SUB) {
        LOCATE_SUB(src, k0)
        char *wq = dst + PANEL * 4;
        for (int c = 0; c < 3; c++) {
            vec sc, oc;
            sub_scales(blk, j, c, &sc, &oc, QF_ARGS);
            vstore((float *)dst + c * VW, sc);
            const ivec vh = HIGH_LANES(q, c);
            for (int g = 0; g < SUB / 8; g++) { /* groups 2g and 2g + 1 of four depths: nibble group g's lo and hi */
                GROUP_LANES(g, c)
                istore(wq + 2 * g * PANEL * 4 + c * VW * 4, lo);
                istore(wq + (2 * g + 1) * PANEL * 4 + c * VW * 4, hi);
            }
        }
        dst = wq + SUB * PANEL;
    }
}

/* In registers: R (<= ROWS) rows of x times one packed panel, y = acc + bias. Per column vector c of a sub-block, its
 * scale and offset are loaded once and each dequantized depth goes straight to the R rows' FMAs (panel.h's MAC_ALL),
 * so each accumulator still sums its depths in order. */
#define FUSED_COL(c)                                                                               \
    {                                                                                              \
        vec sc, oc;                                                                                \
        sub_scales(blk, j, c, &sc, &oc, QF_ARGS);                                                  \
        const ivec vh = HIGH_LANES(q, c);                                                          \
        for (int g = 0; g < SUB / GROUP; g++) {                                                    \
            GROUP_LANES(g, c)                                                                      \
            for (int b = 0; b < GROUP; b++) {                                                      \
                vec w = vmul(vcvt_i32(ivadd(lane_q(v, lo, hi, b, NIBBLES, HIGH2), iset1(-CENTRE))), sc); \
                if (OFFSET) w = vadd(w, oc);                                                       \
                MAC_ALL(c, k0 + g * GROUP + b, w)                                                  \
            }                                                                                      \
        }                                                                                          \
    }

ALWAYS_INLINE void fused_rows(const float *x, int64_t ldx, const char *src, int64_t K, const float *bias,
                              int64_t cols, float *y, int64_t ldy, const int R, QF_PARAMS) {
    const int MODE = W_F32;
    LAYOUT_SIZES
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6) DECLARE(7)
    for (int64_t k0 = 0; k0 < K; k0 += SUB) {
        LOCATE_SUB(src, k0)
        FUSED_COL(0) FUSED_COL(1) FUSED_COL(2)
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

static void dequant_any(int type, const char *src, int64_t k_begin, int64_t depth, float *dst) {
    switch (type) {
    case Q4_0: dequant_panel(src, k_begin, depth, dst, F_Q4_0); break;
    case Q4_1: dequant_panel(src, k_begin, depth, dst, F_Q4_1); break;
    case Q8_0: dequant_panel(src, k_begin, depth, dst, F_Q8_0); break;
    case Q4_K: dequant_panel(src, k_begin, depth, dst, F_Q4_K); break;
    case Q6_K: dequant_panel(src, k_begin, depth, dst, F_Q6_K); break;
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


/* Integer dot products: each row's activations quantized per block of XB depths as llama.cpp's quantize_row_q8_0
 * does per 32 (d = max|x| / 127 in fp32, q = x * (1 / d) rounded to nearest even, in [-127, 127]), and per XB
 * depths and column an int32 sum of q_w * q_x, then in fp32 y += (s * d) * (isum - centre * xsum) (+ o * d * xsum),
 * xsum the row's sum of q_x over those depths. Not the fp32 model's bits: the caller picks this path (int8_rows).
 * Rows go INT_ROWS at a time, the panel read from cache after the first pass.
 * The unsigned weight bytes (0..255) times the signed activations are what vpdpbusd multiplies. Without VNNI,
 * vpmaddubsw + vpmaddwd: a pair of products must fit int16, so the 4-bit q (<= 15) and Q6_K's (<= 63) go as they
 * are, and Q8_0's (q - 128 up to 128 in size) as |q - 128| times q_x carrying q - 128's sign, the centre already
 * out (llama.cpp's trick). */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_ISA 3
#define dot4(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#elif !defined(__AVX512F__) && defined(__AVX2__) && defined(__AVXVNNI__)
#define INT8_ISA 2
#define dot4(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif !defined(__AVX512F__) && defined(ODMA_HAVE_PANEL)
#define INT8_ISA 1
ALWAYS_INLINE ivec dot4(ivec acc, ivec u, ivec s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
ALWAYS_INLINE ivec sign8(ivec x, ivec s) { return _mm256_sign_epi8(x, s); }
ALWAYS_INLINE ivec abs8(ivec v) { return _mm256_abs_epi8(v); }
#else
#define INT8_ISA 0 /* AVX-512 without VNNI: the fp32 path only */
#endif

/* 0: no integer path in this build; 1: vpmaddubsw (AVX2), 2: AVX-VNNI, 3: AVX512-VNNI */
int odma_quant_int8_isa(void) { return INT8_ISA; }

#if INT8_ISA
#if INT8_ISA > 1 /* never reached: the sign trick is for vpmaddubsw only */
ALWAYS_INLINE ivec sign8(ivec x, ivec s) { (void)s; return x; }
ALWAYS_INLINE ivec abs8(ivec v) { return v; }
#endif
#define INT_ROWS (ROWS / 2) /* rows per pass: 3 * INT_ROWS fp32 and INT_ROWS int32 accumulators fit the registers */
#define SIGNED_Q8 (INT8_ISA == 1 && CENTRE == 128) /* Q8_0 by the sign trick: no centre to take out */

#define XB 16 /* depths per activation scale: SmolLM2's perplexity moved +0.66 % with 32, -0.07 % with 16 */

/* Quantized activations of M rows: per row, K int8, and per XB depths a scale and the sum of the int8. */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sum;
} qrows;

ALWAYS_INLINE void store_i8(int8_t *p, ivec v) { /* VW int32 in [-127, 127] → VW bytes */
#if defined(__AVX512F__)
    _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(v));
#else
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
#endif
}

/* the largest lane of v, NaN if a lane is (then d is NaN, and so is y, as on the fp32 path) */
ALWAYS_INLINE float lanes_max(vec v) {
#if defined(__AVX512F__)
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return NAN;
    return _mm512_reduce_max_ps(v);
#else
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) return NAN;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
}

ALWAYS_INLINE int32_t lanes_sum(ivec v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_epi32(v);
#else
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
#endif
}

/* per row and XB depths: d = max|x| / 127, q = x / d rounded to nearest even, and the sum of the q (in registers:
 * XB is one or two vectors) */
static void quantize_rows(const float *x, int64_t M, int64_t ldx, int64_t K, qrows a) {
    for (int64_t r = 0; r < M; r++) {
        for (int64_t k0 = 0; k0 < K; k0 += XB) {
            const float *xb = x + r * ldx + k0;
            vec v[XB / VW];
            float m = 0;
            for (int i = 0; i < XB / VW; i++) {
                v[i] = vload(xb + i * VW);
                const float mi = lanes_max(vabs(v[i]));
                m = mi > m || mi != mi ? mi : m;
            }
            const float d = m / 127.0f, id = d ? 1.0f / d : 0.0f;
            int8_t *q = a.q + r * K + k0;
            ivec sum = iset1(0);
            for (int i = 0; i < XB / VW; i++) {
                const ivec t = vcvt_round(vmul(v[i], vset1(id)));
                store_i8(q + i * VW, t);
                sum = ivadd(sum, t);
            }
            a.d[r * (K / XB) + k0 / XB] = d;
            a.sum[r * (K / XB) + k0 / XB] = lanes_sum(sum);
        }
    }
}

/* named per row, as the fp32 accumulators (panel.h's DECLARE) */
#define INT_DECLARE(r) ivec i##r = iset1(0);
/* every row r < R: i_r += the 4 products of lane bytes w with the row's x at depths k..k+3 (sign trick: each x takes
 * the sign of sw's byte) */
#define INT_DOT(r, w, sw, k)                                                                       \
    if (R > r) {                                                                                   \
        int32_t xk;                                                                                \
        memcpy(&xk, a.q + r * K + (k), 4);                                                         \
        i##r = dot4(i##r, w, SIGNED_Q8 ? sign8(iset1(xk), sw) : iset1(xk));                        \
    }
#define INT_DOT_ALL(w, sw, k) INT_DOT(0, w, sw, k) INT_DOT(1, w, sw, k) INT_DOT(2, w, sw, k) INT_DOT(3, w, sw, k)
/* a row's sums over XB depths (part h of the sub-block) into its fp32 accumulator of column vector c */
#define INT_FOLD(r, c, h)                                                                          \
    if (R > r) {                                                                                   \
        const ivec t = SIGNED_Q8 || !CENTRE ? i##r : ivadd(i##r, iset1(-CENTRE * xs##r[h]));       \
        a##r##c = vfma(vmul(sc, vset1(d##r[h])), vcvt_i32(t), a##r##c);                           \
        if (OFFSET) a##r##c = vfma(oc, vset1(d##r[h] * (float)xs##r[h]), a##r##c);                \
        i##r = iset1(0);                                                                           \
    }
/* row r's activation scales and sums over the sub-block's SUB / XB parts */
#define INT_ROW_SCALARS(r)                                                                         \
    float d##r[SUB / XB];                                                                          \
    int32_t xs##r[SUB / XB];                                                                       \
    for (int h = 0; h < SUB / XB; h++) {                                                           \
        d##r[h] = R > r ? a.d[r * (K / XB) + k0 / XB + h] : 0;                                     \
        xs##r[h] = R > r ? a.sum[r * (K / XB) + k0 / XB + h] : 0;                                  \
    }
#define INT_COL(c)                                                                                 \
    {                                                                                              \
        vec sc, oc;                                                                                \
        sub_scales(blk, j, c, &sc, &oc, QF_ARGS);                                                  \
        const ivec vh = HIGH_LANES(q, c);                                                          \
        for (int g = 0; g < SUB / GROUP; g++) {                                                    \
            GROUP_LANES(g, c)                                                                      \
            if (NIBBLES) {                                                                         \
                if (!HIGH2) {                                                                      \
                    lo = ivand(v, iset1(0x0F0F0F0F));                                              \
                    hi = ivand(ivshr(v, 4), iset1(0x0F0F0F0F));                                    \
                }                                                                                  \
                INT_DOT_ALL(lo, v, k0 + 8 * g)                                                     \
                INT_DOT_ALL(hi, v, k0 + 8 * g + 4)                                                 \
            } else if (SIGNED_Q8) {                                                                \
                const ivec sw = ivxor(v, iset1((int)0x80808080u)); /* q - 128, signed */           \
                INT_DOT_ALL(abs8(sw), sw, k0 + 4 * g)                                              \
            } else {                                                                               \
                INT_DOT_ALL(v, v, k0 + 4 * g)                                                      \
            }                                                                                      \
            if ((g + 1) * GROUP % XB == 0) { /* the end of an activation block */                  \
                const int h = g * GROUP / XB;                                                      \
                INT_FOLD(0, c, h) INT_FOLD(1, c, h) INT_FOLD(2, c, h) INT_FOLD(3, c, h)            \
            }                                                                                      \
        }                                                                                          \
    }

/* R (<= INT_ROWS) quantized rows times one packed panel, y = acc + bias */
ALWAYS_INLINE void int8_rows(qrows a, int64_t K, const char *src, const float *bias, int64_t cols, float *y,
                             int64_t ldy, const int R, QF_PARAMS) {
    const int MODE = W_F32;
    LAYOUT_SIZES
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3)
    INT_DECLARE(0) INT_DECLARE(1) INT_DECLARE(2) INT_DECLARE(3)
    for (int64_t k0 = 0; k0 < K; k0 += SUB) {
        LOCATE_SUB(src, k0)
        INT_ROW_SCALARS(0) INT_ROW_SCALARS(1) INT_ROW_SCALARS(2) INT_ROW_SCALARS(3)
        INT_COL(0) INT_COL(1) INT_COL(2)
    }
    const vmask m0 = first_n(cols), m1 = first_n(cols - VW), m2 = first_n(cols - 2 * VW);
    const vec b0 = load_bias(bias, 0, m0, MODE), b1 = load_bias(bias, VW, m1, MODE), b2 = load_bias(bias, 2 * VW, m2, MODE);
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3)
}

#define INT8_TYPE(R)                                                                               \
    switch (type) {                                                                                \
    case Q4_0: int8_rows(am, K, src, bias, cols, ym, ldy, R, F_Q4_0); break;                       \
    case Q4_1: int8_rows(am, K, src, bias, cols, ym, ldy, R, F_Q4_1); break;                       \
    case Q8_0: int8_rows(am, K, src, bias, cols, ym, ldy, R, F_Q8_0); break;                       \
    case Q4_K: int8_rows(am, K, src, bias, cols, ym, ldy, R, F_Q4_K); break;                       \
    case Q6_K: int8_rows(am, K, src, bias, cols, ym, ldy, R, F_Q6_K); break;                       \
    case Q6_K_WIDE: int8_rows(am, K, src, bias, cols, ym, ldy, R, F_Q6_K_WIDE); break;             \
    }

/* From this many rows a Q6_K panel is widened once (its high bits put back, its scales formed) and the passes read
 * the copy: scripts/gemm_int8_rows.py, Zen 5, one thread: 1.08x at 64 rows, 1.1-1.2x at 128-256, slower at 8-32.
 * Q4_K's copy was slower at every row count tried (8-256): forming its scales in each pass costs less. */
#define WIDE_ROWS 64

/* the calling thread's wide copy of a Q6_K panel */
static __thread grow_buffer wide_buf;

/* every quantized row times one packed panel, INT_ROWS at a time (the panel stays in cache after the first pass) */
static void int8_panel(int type, qrows a, int64_t M, int64_t K, const char *src, const float *bias, int64_t cols,
                       float *y, int64_t ldy) {
    if (type == Q6_K && M >= WIDE_ROWS) { /* the wide form (the file's if there is no room for it) */
        const qformat f = {F_Q6_K_WIDE};
        char *wide = (char *)grown(&wide_buf, (K / f.sub * format_block_bytes(&f) + 3) / 4);
        if (wide) {
            widen_panel(src, K, wide, F_Q6_K);
            src = wide;
            type = Q6_K_WIDE;
        }
    }
    for (int64_t m = 0; m < M; m += INT_ROWS) {
        const qrows am = {a.q + m * K, a.d + m * (K / XB), a.sum + m * (K / XB)};
        float *ym = y + m * ldy;
        switch (M - m < INT_ROWS ? M - m : INT_ROWS) {
        case 1: INT8_TYPE(1) break;
#if INT_ROWS > 2
        case 2: INT8_TYPE(2) break;
        case 3: INT8_TYPE(3) break;
#endif
        default: INT8_TYPE(INT_ROWS)
        }
    }
}

/* the calling thread's quantized activations */
static __thread grow_buffer act_buf;
#endif /* INT8_ISA */

/* x [M, K] (row stride ldx), packed W of `type` (N columns in ceil(N / PANEL) panels), bias [N] or NULL, y [M, N]
 * (row stride ldy); up to int8_rows rows (in a build with the integer path) by integer dot products on int8
 * activations, more rows in fp32. Returns 0; -1 where this build has no panel kernel, -2 on bad
 * sizes or an unknown type, -3 when a buffer cannot be allocated. */
int odma_quant_linear(const float *x, int64_t M, int64_t ldx, const uint8_t *packed, int type, int64_t K, int64_t N,
                      const float *bias, float *y, int64_t ldy, int64_t threads, int64_t int8_rows) {
#ifdef ODMA_HAVE_PANEL
    const int64_t panel_bytes = odma_quant_panel_bytes(type, K);
    if (panel_bytes < 0 || M < 0 || N < 1 || ldx < K || ldy < N) return -2;
    if (!M) return 0;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
    (void)threads;
#if INT8_ISA
    if (M <= int8_rows) { /* K is a multiple of the sub-block, so of XB */
        /* a row's scales (K / XB floats), sums (K / XB int32) and int8 (K / 4 floats' bytes) */
        float *buf = grown(&act_buf, M * (2 * K / XB + K / 4));
        if (!buf) return -3;
        const qrows a = {(int8_t *)(buf + M * 2 * K / XB), buf, (int32_t *)(buf + M * K / XB)};
        quantize_rows(x, M, ldx, K, a);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t col = p * PANEL, cols = N - col < PANEL ? N - col : PANEL;
            int8_panel(type, a, M, K, (const char *)packed + p * panel_bytes, bias ? bias + col : 0, cols, y + col,
                       ldy);
        }
        return 0;
    }
#else
    (void)int8_rows;
#endif
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
            dequant_any(type, src, 0, K, buf);
            panel_f32(x, M, ldx, buf, K, bias ? bias + col : 0, cols, y + col, ldy);
            continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += TILE_K) {
            const int64_t depth = K - k0 < TILE_K ? K - k0 : TILE_K;
            dequant_any(type, src, k0, depth, buf);
            tile_all_rows(x + k0, M, ldx, buf, depth, bias ? bias + col : 0, cols, y + col, ldy, k0 == 0,
                          k0 + depth >= K);
        }
    }
    return failed ? -3 : 0;
#else
    (void)x; (void)M; (void)ldx; (void)packed; (void)type; (void)K; (void)N; (void)bias; (void)y; (void)ldy;
    (void)threads; (void)int8_rows;
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
        dequant_any(type, (const char *)packed + p * panel_bytes, 0, K, buf);
        for (int64_t j = 0; j < PANEL && p * PANEL + j < N; j++)
            for (int64_t k = 0; k < K; k++) out[(p * PANEL + j) * K + k] = buf[k * PANEL + j];
    }
    return 0;
#else
    (void)packed; (void)type; (void)K; (void)N; (void)out;
    return -1;
#endif
}
