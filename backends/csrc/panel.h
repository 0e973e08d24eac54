/* The column-panel GEMM's inner loop, shared by linear.c (fp32 and bf16 weights) and quant_linear.c (GGUF blocks):
 * R rows of x times one panel of packed weights, accumulators in registers, y = acc + bias.
 *
 * One source, two instruction sets, picked by the compiler flags of the build (ckernels.py builds for this CPU, or
 * for x86-64-v3 when ODMA_CPU_ISA=avx2 asks for the AVX2 path):
 * - AVX-512: 16-lane vectors, PANEL 48 columns (3 zmm), ROWS 8 rows per pass: 24 accumulators of 32 registers;
 * - AVX2 + FMA (and F16C, which every such CPU has): 8-lane vectors, PANEL 24 columns (3 ymm), ROWS 4 rows per
 *   pass: 12 accumulators of 16 registers, the same 3 weight loads per k, 12 FMAs per 3 loads instead of 24.
 * Each output element sums its K products in k order with one FMA each, whatever the ISA, the row pass or the
 * thread: the two builds give the same bits for fp32 (and so does quant_linear.c's dequantized panel).
 *
 * Weight modes (a constant at each call site, so the others compile away):
 * - W_F32: panel [K][PANEL] fp32, x fp32;
 * - W_DPBF16: panel [K/2][PANEL][2] bf16 (k in pairs), x bf16 pairs broadcast as one 32-bit lane, vdpbf16ps
 *   (AVX512_BF16 only);
 * - W_WIDEN: the same bf16 pair panel, widened to fp32 in registers (a shift for even k, a mask for odd k: both
 *   exact) and multiplied by x in fp32, for CPUs without AVX512_BF16 (AVX2, AVX-512 before Cooper Lake / Zen 4).
 * The first pass over a panel streams it from memory and prefetches PREFETCH_AHEAD bytes ahead; further passes
 * (more rows) find it in L2.
 */
#ifndef ODMA_PANEL_H
#define ODMA_PANEL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "hints.h"

#define PREFETCH_AHEAD 8192 /* bytes (~43 steps of an AVX-512 panel) ahead; 4-32 KB measured within 3 % */
#define W_F32 0
#define W_DPBF16 1
#define W_WIDEN 2

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define ODMA_HAVE_PANEL 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define ODMA_ISA 512
#define VW 16
#define ROWS 8
typedef __m512 vec;
typedef __m512i ivec;
typedef __mmask16 vmask;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps((const float *)(p))
#define vset1(f) _mm512_set1_ps(f)
#define vfma(a, b, acc) _mm512_fmadd_ps(a, b, acc)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vabs(v) _mm512_abs_ps(v)
#define vcvt_round(v) _mm512_cvtps_epi32(v) /* to int32, rounding to nearest even */
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define iload(p) _mm512_loadu_si512((const void *)(p))
#define istore(p, v) _mm512_storeu_si512((void *)(p), v)
#define as_vec(i) _mm512_castsi512_ps(i)
#define ishl16(i) _mm512_slli_epi32(i, 16)
#define ihigh16(i) _mm512_and_si512(i, _mm512_set1_epi32((int)0xFFFF0000u))
#define vcvt_i32(i) _mm512_cvtepi32_ps(i)
#define ivadd(a, b) _mm512_add_epi32(a, b)
#define iset1(v) _mm512_set1_epi32(v)
#define ivand(a, b) _mm512_and_si512(a, b)
#define ivxor(a, b) _mm512_xor_si512(a, b)
#define ivor(a, b) _mm512_or_si512(a, b)
#define ivshr(a, n) _mm512_srli_epi32(a, n)
#define ivshl(a, n) _mm512_slli_epi32(a, n)
#define widen_u8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))    /* VW bytes → VW int32 */
#define widen_i8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define load_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))      /* VW fp16 → fp32, exact */
ALWAYS_INLINE vmask first_n(int64_t n) { return n <= 0 ? 0 : n >= 16 ? 0xFFFF : (vmask)((1u << n) - 1); }
#define vload_mask(p, m) _mm512_maskz_loadu_ps(m, p)
#define vstore_mask(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ODMA_ISA 2
#define VW 8
#define ROWS 4
typedef __m256 vec;
typedef __m256i ivec;
typedef __m256i vmask;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps((const float *)(p))
#define vset1(f) _mm256_set1_ps(f)
#define vfma(a, b, acc) _mm256_fmadd_ps(a, b, acc)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vabs(v) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)
#define vcvt_round(v) _mm256_cvtps_epi32(v)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define iload(p) _mm256_loadu_si256((const __m256i *)(p))
#define istore(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define as_vec(i) _mm256_castsi256_ps(i)
#define ishl16(i) _mm256_slli_epi32(i, 16)
#define ihigh16(i) _mm256_and_si256(i, _mm256_set1_epi32((int)0xFFFF0000u))
#define vcvt_i32(i) _mm256_cvtepi32_ps(i)
#define ivadd(a, b) _mm256_add_epi32(a, b)
#define iset1(v) _mm256_set1_epi32(v)
#define ivand(a, b) _mm256_and_si256(a, b)
#define ivxor(a, b) _mm256_xor_si256(a, b)
#define ivor(a, b) _mm256_or_si256(a, b)
#define ivshr(a, n) _mm256_srli_epi32(a, n)
#define ivshl(a, n) _mm256_slli_epi32(a, n)
#define widen_u8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define widen_i8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define load_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
ALWAYS_INLINE vmask first_n(int64_t n) {
    const int c = n <= 0 ? 0 : n >= 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define vload_mask(p, m) _mm256_maskload_ps(p, m)
#define vstore_mask(p, m, v) _mm256_maskstore_ps(p, m, v)
#else
#define ODMA_ISA 0
#define VW 0
#endif

#define PANEL (3 * VW) /* output columns per panel: 3 vector registers */

/* A float buffer grown on demand and kept: each file holds its own per thread (`static __thread`). */
typedef struct {
    float *data;
    int64_t floats;
} grow_buffer;

static inline float *grown(grow_buffer *b, int64_t floats) {
    if (floats > b->floats) {
        float *bigger = realloc(b->data, (size_t)floats * sizeof(float));
        if (!bigger) return 0;
        b->data = bigger;
        b->floats = floats;
    }
    return b->data;
}

#ifdef ODMA_HAVE_PANEL

#if defined(__AVX512F__) && defined(__AVX512BF16__)
ALWAYS_INLINE vec mac_dpbf16(vec acc, vec x, vec w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
ALWAYS_INLINE void store_dpbf16(uint16_t *y, vmask m, vec v) {
    _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(v));
}
ALWAYS_INLINE vec load_bias_dpbf16(const uint16_t *b, vmask m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b)), 16));
}
#else /* never reached: W_DPBF16 is used only where the build has AVX512_BF16 */
ALWAYS_INLINE vec mac_dpbf16(vec acc, vec x, vec w) { (void)x; (void)w; return acc; }
ALWAYS_INLINE void store_dpbf16(uint16_t *y, vmask m, vec v) { (void)y; (void)m; (void)v; }
ALWAYS_INLINE vec load_bias_dpbf16(const uint16_t *b, vmask m) { (void)b; (void)m; return vzero(); }
#endif

/* x[r, k] broadcast: fp32 (W_F32, W_WIDEN: `k` counts floats), or the bf16 pair x[r, 2k..2k+1] as one lane */
ALWAYS_INLINE vec broadcast(const void *x, int64_t ldx, int64_t r, int64_t k, const int MODE) {
    if (MODE == W_DPBF16) {
        int32_t pair;
        memcpy(&pair, (const uint16_t *)x + r * ldx + 2 * k, sizeof pair);
        return as_vec(iset1(pair));
    }
    return vset1(((const float *)x)[r * ldx + k]);
}

/* Named accumulators, not an array: gcc spilled a [ROWS][3] array of vectors to the stack (1.5x slower). */
#define DECLARE(r) vec a##r##0 = vzero(), a##r##1 = a##r##0, a##r##2 = a##r##0;
/* every row r < R: a[r][c] += x[r, k] * w (k: a float index of x, or the k pair with W_DPBF16) */
#define MAC_COL(r, c, k, w)                                                                        \
    if (R > r) a##r##c = MODE == W_DPBF16 ? mac_dpbf16(a##r##c, broadcast(x, ldx, r, k, MODE), w)   \
                                          : vfma(broadcast(x, ldx, r, k, MODE), w, a##r##c);
#define MAC_ALL(c, k, w) MAC_COL(0, c, k, w) MAC_COL(1, c, k, w) MAC_COL(2, c, k, w) MAC_COL(3, c, k, w) \
                         MAC_COL(4, c, k, w) MAC_COL(5, c, k, w) MAC_COL(6, c, k, w) MAC_COL(7, c, k, w)
#define MAC_ROW(r)                                                                                 \
    if (R > r) {                                                                                   \
        const vec xr = broadcast(x, ldx, r, k, MODE);                                              \
        a##r##0 = MODE == W_DPBF16 ? mac_dpbf16(a##r##0, xr, w0) : vfma(xr, w0, a##r##0);          \
        a##r##1 = MODE == W_DPBF16 ? mac_dpbf16(a##r##1, xr, w1) : vfma(xr, w1, a##r##1);          \
        a##r##2 = MODE == W_DPBF16 ? mac_dpbf16(a##r##2, xr, w2) : vfma(xr, w2, a##r##2);          \
    }
/* widened bf16: per column vector, the even k's products then the odd k's, so k stays in order per output */
#define MAC_WIDEN(c)                                                                               \
    {                                                                                              \
        const ivec wi = iload(wk + c * VW * 4);                                                    \
        const vec we = as_vec(ishl16(wi)), wo = as_vec(ihigh16(wi));                               \
        MAC_ALL(c, 2 * k, we)                                                                      \
        MAC_ALL(c, 2 * k + 1, wo)                                                                  \
    }
#define STORE_ROW(r)                                                                               \
    if (R > r) {                                                                                   \
        store_out(y, ldy, r, 0, m0, vadd(a##r##0, b0), MODE);                                      \
        store_out(y, ldy, r, VW, m1, vadd(a##r##1, b1), MODE);                                     \
        store_out(y, ldy, r, 2 * VW, m2, vadd(a##r##2, b2), MODE);                                 \
    }

/* y and bias: bf16 with W_DPBF16, fp32 otherwise (the bf16 entry point widens and narrows around W_WIDEN) */
ALWAYS_INLINE vec load_bias(const void *bias, int64_t col, vmask m, const int MODE) {
    if (!bias) return vzero();
    if (MODE == W_DPBF16) return load_bias_dpbf16((const uint16_t *)bias + col, m);
    return vload_mask((const float *)bias + col, m);
}
ALWAYS_INLINE void store_out(void *y, int64_t ldy, int64_t r, int64_t col, vmask m, vec v, const int MODE) {
    if (MODE == W_DPBF16) store_dpbf16((uint16_t *)y + r * ldy + col, m, v);
    else vstore_mask((float *)y + r * ldy + col, m, v);
}

/* R (<= ROWS) rows of x times one panel of `steps` k (W_F32) or k pairs (bf16 modes); R and MODE are constants at
 * each call site, so the unused rows and the other modes' code compile away. */
ALWAYS_INLINE void panel_rows(const void *x, int64_t ldx, const char *w, int64_t steps, const void *bias,
                              int64_t cols, void *y, int64_t ldy, int prefetch, const int R, const int MODE) {
    const int64_t step_bytes = PANEL * 4; /* one k (fp32) or one k pair (bf16) of the panel */
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6) DECLARE(7)
    for (int64_t k = 0; k < steps; k++) {
        const char *wk = w + k * step_bytes;
        if (prefetch) { /* a prefetch never faults, so running past the panels' end is harmless */
            for (int64_t line = 0; line < step_bytes; line += 64) _mm_prefetch(wk + PREFETCH_AHEAD + line, _MM_HINT_T0);
        }
        if (MODE == W_WIDEN) {
            MAC_WIDEN(0) MAC_WIDEN(1) MAC_WIDEN(2)
        } else {
            const vec w0 = vload(wk), w1 = vload(wk + VW * 4), w2 = vload(wk + 2 * VW * 4);
            MAC_ROW(0) MAC_ROW(1) MAC_ROW(2) MAC_ROW(3) MAC_ROW(4) MAC_ROW(5) MAC_ROW(6) MAC_ROW(7)
        }
    }
    const vmask m0 = first_n(cols), m1 = first_n(cols - VW), m2 = first_n(cols - 2 * VW);
    const vec b0 = load_bias(bias, 0, m0, MODE), b1 = load_bias(bias, VW, m1, MODE), b2 = load_bias(bias, 2 * VW, m2, MODE);
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
}

#define PANEL_ROWS_CASE(n, MODE) \
    case n: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, n < ROWS ? n : ROWS, MODE); break;

/* Every row of x times one panel, ROWS at a time; `xsize`/`ysize`: bytes per element of x and of y and bias. */
ALWAYS_INLINE void panel_all_rows(const void *x, int64_t M, int64_t ldx, const char *w, int64_t steps,
                                  const void *bias, int64_t cols, void *y, int64_t ldy, int first_prefetch,
                                  const int MODE) {
    const int xsize = MODE == W_DPBF16 ? 2 : 4, ysize = MODE == W_DPBF16 ? 2 : 4;
    for (int64_t m = 0; m < M; m += ROWS) {
        const void *xm = (const char *)x + m * ldx * xsize;
        void *ym = (char *)y + m * ldy * ysize;
        const int prefetch = first_prefetch && m == 0;
        switch (M - m < ROWS ? M - m : ROWS) {
            PANEL_ROWS_CASE(1, MODE) PANEL_ROWS_CASE(2, MODE) PANEL_ROWS_CASE(3, MODE)
            PANEL_ROWS_CASE(4, MODE) PANEL_ROWS_CASE(5, MODE) PANEL_ROWS_CASE(6, MODE)
            PANEL_ROWS_CASE(7, MODE) default: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, ROWS, MODE);
        }
    }
}

#endif /* ODMA_HAVE_PANEL */
#endif /* ODMA_PANEL_H */
