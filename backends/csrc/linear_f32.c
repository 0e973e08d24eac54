/* y = x W^T + b in float32 on weights packed once into column panels (CPU, AVX-512).
 *
 * Why not oneDNN: a decode step multiplies a few rows (one per request) by every weight of the model, so each
 * weight is read from DRAM once per step and used a few times. oneDNN's fp32 kernel on SmolLM2's shapes at 16
 * rows took the weight stream's time plus the FMAs' time, one after the other (30 ms per step on a Zen 5 core:
 * 13.4 ms of stream at 40 GB/s, 16.8 ms of FMAs; docs/BENCHMARKS.md, "Session 17"). This kernel streams each
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
 * Threads: OpenMP splits the panels (disjoint output columns); built with -fopenmp, the library uses the OpenMP
 * runtime torch already loaded (the same libgomp.so.1), not a second pool.
 */
#include <stdint.h>

#define PANEL 48 /* output columns per panel: 3 zmm registers */
#define ROWS 8   /* rows of x per pass: 8 x 3 accumulators */
#define PREFETCH_AHEAD 2048 /* floats (8 KB, ~43 rows of a panel) ahead; 1024 and 4096-8192 measured within 3 % */

int odma_linear_f32_panel(void) { return PANEL; }

int odma_linear_f32_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
#include <immintrin.h>
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static __mmask16 first_n(int64_t n) { return n <= 0 ? 0 : n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

/* Named accumulators, not an array: gcc spilled a [ROWS][3] array of __m512 to the stack (1.5x slower). */
#define DECLARE(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0;
#define FMA_ROW(r)                                                              \
    if (R > r) {                                                                \
        const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);                       \
        a##r##0 = _mm512_fmadd_ps(xr, w0, a##r##0);                             \
        a##r##1 = _mm512_fmadd_ps(xr, w1, a##r##1);                             \
        a##r##2 = _mm512_fmadd_ps(xr, w2, a##r##2);                             \
    }
#define STORE_ROW(r)                                                            \
    if (R > r) {                                                                \
        float *yr = y + r * ldy;                                                \
        _mm512_mask_storeu_ps(yr, m0, _mm512_add_ps(a##r##0, b0));              \
        _mm512_mask_storeu_ps(yr + 16, m1, _mm512_add_ps(a##r##1, b1));         \
        _mm512_mask_storeu_ps(yr + 32, m2, _mm512_add_ps(a##r##2, b2));         \
    }

/* R (<= ROWS) rows of x times one panel; R is a constant at each call site, so the unused rows compile away. */
ALWAYS_INLINE void panel_rows(const float *x, int64_t ldx, const float *w, int64_t K, const float *bias,
                              int64_t cols, float *y, int64_t ldy, int prefetch, const int R) {
    DECLARE(0) DECLARE(1) DECLARE(2) DECLARE(3) DECLARE(4) DECLARE(5) DECLARE(6) DECLARE(7)
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * PANEL;
        if (prefetch) { /* a prefetch never faults, so running past the panels' end is harmless */
            _mm_prefetch((const char *)(wk + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(wk + PREFETCH_AHEAD + 16), _MM_HINT_T0);
            _mm_prefetch((const char *)(wk + PREFETCH_AHEAD + 32), _MM_HINT_T0);
        }
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32);
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5) FMA_ROW(6) FMA_ROW(7)
    }
    const __mmask16 m0 = first_n(cols), m1 = first_n(cols - 16), m2 = first_n(cols - 32);
    const __m512 zero = _mm512_setzero_ps();
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : zero;
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : zero;
    const __m512 b2 = bias ? _mm512_maskz_loadu_ps(m2, bias + 32) : zero;
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5) STORE_ROW(6) STORE_ROW(7)
}

static void panel(const float *x, int64_t M, int64_t ldx, const float *w, int64_t K, const float *bias,
                  int64_t cols, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m += ROWS) {
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        const int prefetch = m == 0;
        switch (M - m < ROWS ? M - m : ROWS) {
        case 1: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 1); break;
        case 2: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 2); break;
        case 3: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 3); break;
        case 4: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 4); break;
        case 5: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 5); break;
        case 6: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 6); break;
        case 7: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 7); break;
        default: panel_rows(xm, ldx, w, K, bias, cols, ym, ldy, prefetch, 8); break;
        }
    }
}
#endif

/* x [M, K] (row stride ldx), packed W (N columns in ceil(N / PANEL) panels), bias [N] or NULL, y [M, N] (row
 * stride ldy). Returns 0, or -1 where this build has no AVX-512 (the caller then keeps its other GEMM), -2 on
 * bad sizes. */
int odma_linear_f32(const float *x, int64_t M, int64_t ldx, const float *packed, int64_t K, int64_t N,
                    const float *bias, float *y, int64_t ldy, int64_t threads) {
#ifdef __AVX512F__
    if (M < 0 || K < 1 || N < 1 || ldx < K || ldy < N) return -2;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t col = p * PANEL, cols = N - col < PANEL ? N - col : PANEL;
        panel(x, M, ldx, packed + p * K * PANEL, K, bias ? bias + col : 0, cols, y + col, ldy);
    }
    return 0;
#else
    (void)x; (void)M; (void)ldx; (void)packed; (void)K; (void)N; (void)bias; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}
