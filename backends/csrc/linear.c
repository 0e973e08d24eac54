/* y = x W^T + b on weights packed once into column panels (CPU): float32, and bfloat16 (with AVX512_BF16's
 * vdpbf16ps, or widened to fp32 in registers on AVX2 and older AVX-512). The inner loop and the two instruction
 * sets (AVX-512, AVX2 + FMA) are in panel.h.
 *
 * Why not oneDNN: a decode step multiplies a few rows (one per request) by every weight of the model, so each
 * weight is read from DRAM once per step and used a few times. oneDNN's fp32 kernel on SmolLM2's shapes at 16
 * rows took the weight stream's time plus the FMAs' time, one after the other (30 ms per step on a Zen 5 core:
 * 13.4 ms of stream at 40 GB/s, 16.8 ms of FMAs; docs/BENCHMARKS.md, "CPU linear layers"). This kernel streams each
 * panel once, prefetching ahead, while it computes on the lines already there, so the two overlap.
 *
 * Layout: W [N, K] is packed as panels of PANEL output columns, panel p = [K][PANEL] (row k holds W[p*PANEL + j, k]
 * for j < PANEL; the last panel is zero-padded), panels one after another. bfloat16 panels hold k in pairs,
 * [K/2][PANEL][2], so that one vdpbf16ps multiplies a broadcast pair of x by the pair of every column in a register
 * (K must be even; the caller keeps oneDNN otherwise). PANEL is 48 in the AVX-512 build, 24 in the AVX2 one: the
 * caller packs with odma_linear_panel().
 *
 * Threads: OpenMP splits the panels (disjoint output columns); built with -fopenmp, the library uses the OpenMP
 * runtime torch already loaded (the same libgomp.so.1), not a second pool.
 */
#include "panel.h"

int odma_linear_panel(void) { return PANEL; }

/* 512: the AVX-512 build, 2: the AVX2 + FMA build, 0: neither (every entry point answers -1) */
int odma_linear_isa(void) { return ODMA_ISA; }

/* how bf16 is multiplied: 1 vdpbf16ps (AVX512_BF16), 2 widened to fp32 in registers, 0 not at all */
int odma_linear_bf16_mode(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#elif defined(ODMA_HAVE_PANEL)
    return 2;
#else
    return 0;
#endif
}

int odma_linear_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#ifdef ODMA_HAVE_PANEL
static void panel_f32(const void *x, int64_t M, int64_t ldx, const char *w, int64_t steps, const void *bias,
                      int64_t cols, void *y, int64_t ldy) {
    panel_all_rows(x, M, ldx, w, steps, bias, cols, y, ldy, 1, W_F32);
}
static void panel_dpbf16(const void *x, int64_t M, int64_t ldx, const char *w, int64_t steps, const void *bias,
                         int64_t cols, void *y, int64_t ldy) {
    panel_all_rows(x, M, ldx, w, steps, bias, cols, y, ldy, 1, W_DPBF16);
}
static void panel_widen(const void *x, int64_t M, int64_t ldx, const char *w, int64_t steps, const void *bias,
                        int64_t cols, void *y, int64_t ldy) {
    panel_all_rows(x, M, ldx, w, steps, bias, cols, y, ldy, 1, W_WIDEN);
}
typedef void (*panel_fn)(const void *, int64_t, int64_t, const char *, int64_t, const void *, int64_t, void *, int64_t);

/* every panel, split over threads; `size`: bytes per element of x, y and bias as `fn` reads them */
static void run(panel_fn fn, const void *x, int64_t M, int64_t ldx, const void *packed, int64_t N, int64_t steps,
                const void *bias, void *y, int64_t ldy, int64_t threads, int size) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t col = p * PANEL, cols = N - col < PANEL ? N - col : PANEL;
        fn(x, M, ldx, (const char *)packed + p * steps * PANEL * 4, steps, bias ? (const char *)bias + col * size : 0,
           cols, (char *)y + col * size, ldy);
    }
}

/* scratch of the calling thread for the widened bf16 path (x, bias and y in fp32) */
static __thread grow_buffer scratch;

/* bf16 without vdpbf16ps: x and bias widened to fp32 once, y computed in fp32 and rounded to bf16 at the end */
static int run_widened(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *packed, int64_t K, int64_t N,
                       const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t threads) {
    float *xf = grown(&scratch, M * K + N + M * N);
    if (!xf) return -3;
    float *bf = xf + M * K, *yf = bf + N;
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k < K; k++) xf[r * K + k] = from_bf16(x[r * ldx + k]);
    for (int64_t n = 0; n < N && bias; n++) bf[n] = from_bf16(bias[n]);
    run(panel_widen, xf, M, K, packed, N, K / 2, bias ? bf : 0, yf, N, threads, 4);
    for (int64_t r = 0; r < M; r++)
        for (int64_t n = 0; n < N; n++) y[r * ldy + n] = to_bf16(yf[r * N + n]);
    return 0;
}
#endif

/* x [M, K] (row stride ldx), packed W (N columns in ceil(N / PANEL) panels), bias [N] or NULL, y [M, N] (row
 * stride ldy), all float32. Returns 0, or -1 where this build has neither AVX-512 nor AVX2 + FMA (the caller then
 * keeps its other GEMM), -2 on bad sizes. */
int odma_linear_f32(const float *x, int64_t M, int64_t ldx, const float *packed, int64_t K, int64_t N,
                    const float *bias, float *y, int64_t ldy, int64_t threads) {
#ifdef ODMA_HAVE_PANEL
    if (M < 0 || K < 1 || N < 1 || ldx < K || ldy < N) return -2;
    run(panel_f32, x, M, ldx, packed, N, K, bias, y, ldy, threads, 4);
    return 0;
#else
    (void)x; (void)M; (void)ldx; (void)packed; (void)K; (void)N; (void)bias; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}

/* The same in bfloat16 (uint16 bit patterns; K even; sums in fp32, one rounding to bf16 at the end). -1 where the
 * build has no panel kernel, -3 when the widened path's scratch cannot be allocated. */
int odma_linear_bf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *packed, int64_t K, int64_t N,
                     const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t threads) {
#ifdef ODMA_HAVE_PANEL
    if (M < 0 || K < 1 || N < 1 || ldx < K || ldy < N || K % 2) return -2;
    if (odma_linear_bf16_mode() == 2) return M ? run_widened(x, M, ldx, packed, K, N, bias, y, ldy, threads) : 0;
    run(panel_dpbf16, x, M, ldx, packed, N, K / 2, bias, y, ldy, threads, 2);
    return 0;
#else
    (void)x; (void)M; (void)ldx; (void)packed; (void)K; (void)N; (void)bias; (void)y; (void)ldy; (void)threads;
    return -1;
#endif
}
