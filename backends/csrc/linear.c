/* y = x W^T + b on weights packed once into column panels (CPU, AVX-512): float32, and bfloat16 with AVX512_BF16.
 *
 * Why not oneDNN: a decode step multiplies a few rows (one per request) by every weight of the model, so each
 * weight is read from DRAM once per step and used a few times. oneDNN's fp32 kernel on SmolLM2's shapes at 16
 * rows took the weight stream's time plus the FMAs' time, one after the other (30 ms per step on a Zen 5 core:
 * 13.4 ms of stream at 40 GB/s, 16.8 ms of FMAs; docs/BENCHMARKS.md, "CPU linear layers"). This kernel streams each
 * panel once, prefetching ahead, while it computes on the lines already there, so the two overlap.
 *
 * Layout: W [N, K] is packed as panels of PANEL output columns, panel p = [K][PANEL] (row k holds W[p*PANEL + j, k]
 * for j < PANEL; the last panel is zero-padded), panels one after another. A pass over a panel for up to ROWS rows
 * of x keeps ROWS x 3 accumulators in registers (24 of the 32 zmm registers), reads one 192-byte row of the panel
 * per k and broadcasts x[r, k]: 24 FMAs per 3 loads. The first pass over a panel streams it from memory and
 * prefetches PREFETCH_AHEAD floats ahead; the passes for further rows find it in L2 (110-295 KB per panel here).
 * Each output element sums its K products in order (as a plain loop would), so results differ from other GEMMs
 * only in the last bits.
 *
 * bfloat16 (x, W, b and y in bf16, sums in fp32): the panel holds k in pairs, [K/2][PANEL][2], so that one
 * vdpbf16ps multiplies a broadcast pair of x by the pair of every column in a register: the same 192 bytes and
 * 24 instructions per step as fp32, for twice the k. K must be even (the caller keeps oneDNN otherwise).
 *
 * Threads: OpenMP splits the panels (disjoint output columns); built with -fopenmp, the library uses the OpenMP
 * runtime torch already loaded (the same libgomp.so.1), not a second pool.
 */
#include <stdint.h>

#define PANEL 48 /* output columns per panel: 3 zmm registers */
#define ROWS 8   /* rows of x per pass: 8 x 3 accumulators */
#define STEP_BYTES (PANEL * 4) /* one k (fp32) or k pair (bf16) of a panel: 192 bytes, 3 zmm */
#define PREFETCH_AHEAD 8192 /* bytes (~43 steps of a panel) ahead; 4-32 KB measured within 3 % */

int odma_linear_panel(void) { return PANEL; }

int odma_linear_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
#include <immintrin.h>
#include <string.h>
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static __mmask16 first_n(int64_t n) { return n <= 0 ? 0 : n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

/* x[r, k] broadcast: fp32, or the bf16 pair x[r, 2k..2k+1] as one 32-bit lane */
ALWAYS_INLINE __m512 broadcast(const void *x, int64_t ldx, int64_t r, int64_t k, const int BF16) {
    if (BF16) {
        int32_t pair;
        memcpy(&pair, (const uint16_t *)x + r * ldx + 2 * k, sizeof pair);
        return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
    }
    return _mm512_set1_ps(((const float *)x)[r * ldx + k]);
}

#ifdef __AVX512BF16__
ALWAYS_INLINE __m512 mac_bf16(__m512 acc, __m512 x, __m512 w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
ALWAYS_INLINE __m512 load_bias_bf16(const uint16_t *b, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b)), 16));
}
ALWAYS_INLINE void store_bf16(uint16_t *y, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(v));
}
#else /* never reached: odma_linear_bf16 refuses to run without AVX512_BF16 */
ALWAYS_INLINE __m512 mac_bf16(__m512 acc, __m512 x, __m512 w) { (void)x; (void)w; return acc; }
ALWAYS_INLINE __m512 load_bias_bf16(const uint16_t *b, __mmask16 m) { (void)b; (void)m; return _mm512_setzero_ps(); }
ALWAYS_INLINE void store_bf16(uint16_t *y, __mmask16 m, __m512 v) { (void)y; (void)m; (void)v; }
#endif

ALWAYS_INLINE __m512 mac(__m512 acc, __m512 x, __m512 w, const int BF16) {
    return BF16 ? mac_bf16(acc, x, w) : _mm512_fmadd_ps(x, w, acc);
}
ALWAYS_INLINE __m512 load_bias(const void *bias, int64_t col, __mmask16 m, const int BF16) {
    if (!bias) return _mm512_setzero_ps();
    return BF16 ? load_bias_bf16((const uint16_t *)bias + col, m) : _mm512_maskz_loadu_ps(m, (const float *)bias + col);
}
ALWAYS_INLINE void store(void *y, int64_t ldy, int64_t r, int64_t col, __mmask16 m, __m512 v, const int BF16) {
    if (BF16) store_bf16((uint16_t *)y + r * ldy + col, m, v);
    else _mm512_mask_storeu_ps((float *)y + r * ldy + col, m, v);
}

/* Named accumulators, not an array: gcc spilled a [ROWS][3] array of __m512 to the stack (1.5x slower). */
#define DECLARE(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0;
#define MAC_ROW(r)                                                              \
    if (R > r) {                                                                \
        const __m512 xr = broadcast(x, ldx, r, k, BF16);                        \
        a##r##0 = mac(a##r##0, xr, w0, BF16);                                   \
        a##r##1 = mac(a##r##1, xr, w1, BF16);                                   \
        a##r##2 = mac(a##r##2, xr, w2, BF16);                                   \
    }
#define STORE_ROW(r)                                                            \
    if (R > r) {                                                                \
        store(y, ldy, r, 0, m0, _mm512_add_ps(a##r##0, b0), BF16);              \
        store(y, ldy, r, 16, m1, _mm512_add_ps(a##r##1, b1), BF16);             \
        store(y, ldy, r, 32, m2, _mm512_add_ps(a##r##2, b2), BF16);             \
    }

/* R (<= ROWS) rows of x times one panel of `steps` k (fp32) or k pairs (bf16); R and BF16 are constants at each
 * call site, so the unused rows and the other type's code compile away. */
ALWAYS_INLINE void panel_rows(const void *x, int64_t ldx, const char *w, int64_t steps, const void *bias,
                              int64_t cols, void *y, int64_t ldy, int prefetch, const int R, const int BF16) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6) DECLARE(7)
    for (int64_t k = 0; k < steps; k++) {
        const char *wk = w + k * STEP_BYTES;
        if (prefetch) { /* a prefetch never faults, so running past the panels' end is harmless */
            _mm_prefetch(wk + PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch(wk + PREFETCH_AHEAD + 64, _MM_HINT_T0);
            _mm_prefetch(wk + PREFETCH_AHEAD + 128, _MM_HINT_T0);
        }
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 64), w2 = _mm512_loadu_ps(wk + 128);
        MAC_ROW(0) MAC_ROW(1) MAC_ROW(2) MAC_ROW(3) MAC_ROW(4) MAC_ROW(5) MAC_ROW(6) MAC_ROW(7)
    }
    const __mmask16 m0 = first_n(cols), m1 = first_n(cols - 16), m2 = first_n(cols - 32);
    const __m512 b0 = load_bias(bias, 0, m0, BF16), b1 = load_bias(bias, 16, m1, BF16), b2 = load_bias(bias, 32, m2, BF16);
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
}

#define PANEL_ROWS_CASES(BF16)                                                                               \
    switch (M - m < ROWS ? M - m : ROWS) {                                                                   \
    case 1: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 1, BF16); break;                    \
    case 2: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 2, BF16); break;                    \
    case 3: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 3, BF16); break;                    \
    case 4: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 4, BF16); break;                    \
    case 5: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 5, BF16); break;                    \
    case 6: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 6, BF16); break;                    \
    case 7: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 7, BF16); break;                    \
    default: panel_rows(xm, ldx, w, steps, bias, cols, ym, ldy, prefetch, 8, BF16); break;                   \
    }

/* Every row of x times one panel, ROWS at a time; `size` is the element size (4: fp32, 2: bf16). */
static void panel(const void *x, int64_t M, int64_t ldx, const char *w, int64_t steps, const void *bias,
                  int64_t cols, void *y, int64_t ldy, int size) {
    for (int64_t m = 0; m < M; m += ROWS) {
        const void *xm = (const char *)x + m * ldx * size;
        void *ym = (char *)y + m * ldy * size;
        const int prefetch = m == 0;
        if (size == 2) {
            PANEL_ROWS_CASES(1)
        } else {
            PANEL_ROWS_CASES(0)
        }
    }
}

static int run(const void *x, int64_t M, int64_t ldx, const void *packed, int64_t K, int64_t N, const void *bias,
               void *y, int64_t ldy, int64_t threads, int size) {
    if (M < 0 || K < 1 || N < 1 || ldx < K || ldy < N || (size == 2 && K % 2)) return -2;
    const int64_t panels = (N + PANEL - 1) / PANEL, steps = size == 2 ? K / 2 : K;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t col = p * PANEL, cols = N - col < PANEL ? N - col : PANEL;
        panel(x, M, ldx, (const char *)packed + p * steps * STEP_BYTES, steps,
              bias ? (const char *)bias + col * size : 0, cols, (char *)y + col * size, ldy, size);
    }
    return 0;
}
#endif

/* x [M, K] (row stride ldx), packed W (N columns in ceil(N / PANEL) panels), bias [N] or NULL, y [M, N] (row
 * stride ldy), all float32. Returns 0, or -1 where this build has no AVX-512 (the caller then keeps its other
 * GEMM), -2 on bad sizes. */
int odma_linear_f32(const float *x, int64_t M, int64_t ldx, const float *packed, int64_t K, int64_t N,
                    const float *bias, float *y, int64_t ldy, int64_t threads) {
#ifdef __AVX512F__
    return run(x, M, ldx, packed, K, N, bias, y, ldy, threads, 4);
#else
    (void)x; (void)M; (void)ldx; (void)packed; (void)K; (void)N; (void)bias; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}

/* The same in bfloat16 (uint16 bit patterns; K even). -1 where this build has no AVX512_BF16. */
int odma_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *packed, int64_t K, int64_t N,
                     const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return run(x, M, ldx, packed, K, N, bias, y, ldy, threads, 2);
#else
    (void)x; (void)M; (void)ldx; (void)packed; (void)K; (void)N; (void)bias; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}
