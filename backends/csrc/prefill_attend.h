/* A prefill chunk's causal attention, tiled (flash-attention's loops on a CPU core): a block of the chunk's query rows
 * of one KV head group against a tile of keys at a time, with an online softmax (running max and sum per query).
 *
 * Why: attending each chunk row on its own (attend.h) reads the whole prefix once per row and query head, as a row of
 * dot products; past ~512 tokens of context that lost to torch's SDPA. Here a tile of K and V rows (widened to fp32
 * once, fp16 or not) serves every query vector of the block: its rows times the group's query heads (GQA), so the
 * scores and the output are two small GEMMs in registers.
 *
 * Layout: everything runs transposed, one vector across query vectors (m = row * G + head in the group): Qt [D][MP]
 * (q * scale), the scores and probabilities S [BK][MP], the output Ot [D][MP], the running max and sum [MP]. So the
 * online softmax is a vector's max, exp and sum down a tile's keys, and a K or V element is one broadcast. MP is the
 * block's query vectors rounded up to the register block; the padding queries are zeros and their outputs unread.
 * Causality: row i (at position first + i) sees key k iff k <= first + i, so in a key's row of S the masked queries
 * are a prefix (m < (k - first) * G), filled with -1e30 (compiled with -ffast-math: finite values only).
 * Arithmetic: fp32 throughout, the exponent a Cephes polynomial (within 2 ulp of expf).
 */
#ifndef ODMA_PREFILL_ATTEND_H
#define ODMA_PREFILL_ATTEND_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attend.h"
#include "hints.h"

#if defined(__AVX512F__)
#define PF_VL 16
#define PF_MR 4 /* vectors of queries per register block: 4 keys x 4 vectors of accumulators, of 32 registers */
typedef __m512 pf_vec;
#define PF_LOAD _mm512_loadu_ps
#define PF_STORE _mm512_storeu_ps
#define PF_SET1 _mm512_set1_ps
#define PF_FMA _mm512_fmadd_ps /* a * b + c */
#define PF_MUL _mm512_mul_ps
#define PF_ADD _mm512_add_ps
#define PF_SUB _mm512_sub_ps
#define PF_MAX _mm512_max_ps
#define PF_ZERO _mm512_setzero_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define PF_VL 8
#define PF_MR 2 /* 4 x 2 accumulators of 16 registers */
typedef __m256 pf_vec;
#define PF_LOAD _mm256_loadu_ps
#define PF_STORE _mm256_storeu_ps
#define PF_SET1 _mm256_set1_ps
#define PF_FMA _mm256_fmadd_ps
#define PF_MUL _mm256_mul_ps
#define PF_ADD _mm256_add_ps
#define PF_SUB _mm256_sub_ps
#define PF_MAX _mm256_max_ps
#define PF_ZERO _mm256_setzero_ps
#else /* a build without AVX2: the same loops on scalars */
#define PF_VL 1
#define PF_MR 4
typedef float pf_vec;
#define PF_LOAD(p) (*(p))
#define PF_STORE(p, v) (*(p) = (v))
#define PF_SET1(x) (x)
#define PF_FMA(a, b, c) ((a) * (b) + (c))
#define PF_MUL(a, b) ((a) * (b))
#define PF_ADD(a, b) ((a) + (b))
#define PF_SUB(a, b) ((a) - (b))
#define PF_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PF_ZERO() 0.f
#endif

#define PF_BK 64     /* keys per tile: the K tile (16 KB at head_dim 64) and a slice of Qt share L1 */
#define PF_QVECS 192 /* query vectors (rows x group) per block: measured, 128 and 256 10-20 % slower, 384 as fast */
#define PF_KR 4                  /* keys per register block of the scores */
#define PF_DR 4                  /* head dims per register block of the output */
#define PF_MB (PF_MR * PF_VL)    /* query vectors per register block */
#define PF_MASKED (-1e30f)
#define PF_MIN_ROWS 6 /* a chunk of fewer rows attends row by row (attend.h): measured even at 4-6 rows */

/* exp(x) for x <= 0, exactly 0 below -87.3 (masked scores); Cephes' expf: x = n ln2 + r, exp(r) by a polynomial */
ALWAYS_INLINE pf_vec pf_exp(pf_vec x) {
#if PF_VL == 1
    return x < -87.3f ? 0.f : expf(x);
#else
#define PF_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    const pf_vec lo = PF_SET1(-87.3f);
    const pf_vec xc = PF_MAX(x, lo);
#if PF_VL == 16
    const pf_vec n = _mm512_roundscale_ps(PF_MUL(xc, PF_SET1(1.44269504088896341f)), PF_NEAREST);
    pf_vec r = _mm512_fnmadd_ps(n, PF_SET1(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, PF_SET1(-2.12194440e-4f), r);
#else
    const pf_vec n = _mm256_round_ps(PF_MUL(xc, PF_SET1(1.44269504088896341f)), PF_NEAREST);
    pf_vec r = _mm256_fnmadd_ps(n, PF_SET1(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, PF_SET1(-2.12194440e-4f), r);
#endif
    pf_vec p = PF_SET1(1.9875691500e-4f);
    p = PF_FMA(p, r, PF_SET1(1.3981999507e-3f));
    p = PF_FMA(p, r, PF_SET1(8.3334519073e-3f));
    p = PF_FMA(p, r, PF_SET1(4.1665795894e-2f));
    p = PF_FMA(p, r, PF_SET1(1.6666665459e-1f));
    p = PF_FMA(p, r, PF_SET1(5.0000001201e-1f));
    p = PF_FMA(p, PF_MUL(r, r), PF_ADD(r, PF_SET1(1.f)));
#if PF_VL == 16
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), _mm512_scalef_ps(p, n));
#else
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
#endif
#endif
}

static inline int64_t pf_round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* rows of one block for a group of G query heads per KV head */
static inline int64_t pf_block_rows(int64_t G) { return G < PF_QVECS ? PF_QVECS / G : 1; }

/* floats of scratch one thread needs for blocks of head_dim D and group G */
static inline int64_t pf_scratch_floats(int64_t G, int64_t D) {
    const int64_t MP = pf_round_up(pf_block_rows(G) * G, PF_MB);
    return MP * (2 * D + PF_BK + 2) + 2 * PF_BK * D;
}

/* Rows [0, bq) of a block, row i at position first + i (its context first + i + 1 rows of K and V), of KV head g:
 * row i's query heads g * G .. g * G + G - 1 at q + i * q_stride (head h at h * D), their outputs at out +
 * i * out_stride alike. K/V as attend(): rows of kv_heads * D, fp16 where HALF. */
ALWAYS_INLINE void pf_block(const void *Kc, const void *Vc, int64_t kv_heads, int64_t g, int64_t G, int64_t first,
                            int64_t bq, const float *q, int64_t q_stride, float *out, int64_t out_stride, float scale,
                            float *scratch, const int64_t D, const int HALF) {
    const int64_t M = bq * G, MP = pf_round_up(M, PF_MB), row = kv_heads * D, keys = first + bq;
    float *Qt = scratch, *Ot = Qt + D * MP, *S = Ot + D * MP, *mx = S + PF_BK * MP, *l = mx + MP;
    float *Kw = l + MP, *Vw = Kw + PF_BK * D;
    memset(Qt, 0, sizeof(float) * D * MP);
    for (int64_t i = 0; i < bq; i++)
        for (int64_t j = 0; j < G; j++) {
            const float *qh = q + i * q_stride + (g * G + j) * D;
            for (int64_t d = 0; d < D; d++) Qt[d * MP + i * G + j] = qh[d] * scale;
        }
    memset(Ot, 0, sizeof(float) * D * MP);
    for (int64_t m = 0; m < MP; m++) mx[m] = PF_MASKED, l[m] = 0.f;
    for (int64_t k0 = 0; k0 < keys; k0 += PF_BK) {
        const int64_t kn = keys - k0 < PF_BK ? keys - k0 : PF_BK, kp = pf_round_up(kn, PF_KR);
        /* the tile's rows of head g, widened: every query vector of the block reads them from here */
        for (int64_t t = 0; t < kn; t++) {
            const int64_t at = (k0 + t) * row + g * D;
            if (HALF) {
                halves_to_floats((const uint16_t *)Kc + at, Kw + t * D, D);
                halves_to_floats((const uint16_t *)Vc + at, Vw + t * D, D);
            } else {
                memcpy(Kw + t * D, (const float *)Kc + at, sizeof(float) * D);
                memcpy(Vw + t * D, (const float *)Vc + at, sizeof(float) * D);
            }
        }
        memset(Kw + kn * D, 0, sizeof(float) * (kp - kn) * D); /* the last register block's missing keys */
        /* S = K Qt: KR keys x MR vectors of queries in registers over head_dim */
        for (int64_t mb = 0; mb < MP; mb += PF_MB)
            for (int64_t t = 0; t < kp; t += PF_KR) {
                pf_vec acc[PF_KR][PF_MR];
                for (int kk = 0; kk < PF_KR; kk++)
                    for (int r = 0; r < PF_MR; r++) acc[kk][r] = PF_ZERO();
                for (int64_t d = 0; d < D; d++) {
                    pf_vec qv[PF_MR];
                    for (int r = 0; r < PF_MR; r++) qv[r] = PF_LOAD(Qt + d * MP + mb + r * PF_VL);
                    for (int kk = 0; kk < PF_KR; kk++) {
                        const pf_vec b = PF_SET1(Kw[(t + kk) * D + d]);
                        for (int r = 0; r < PF_MR; r++) acc[kk][r] = PF_FMA(b, qv[r], acc[kk][r]);
                    }
                }
                for (int kk = 0; kk < PF_KR; kk++)
                    for (int r = 0; r < PF_MR; r++) PF_STORE(S + (t + kk) * MP + mb + r * PF_VL, acc[kk][r]);
            }
        /* causality: key k0 + t is hidden from the queries of rows before k0 + t - first (all of them past kn) */
        for (int64_t t = 0; t < kp; t++) {
            const int64_t cut = t < kn ? (k0 + t - first) * G : MP;
            for (int64_t m = 0; m < (cut < MP ? cut : MP); m++) S[t * MP + m] = PF_MASKED;
        }
        /* the online softmax, a vector of queries at a time: new max, the old state rescaled, S turned into p */
        for (int64_t mv = 0; mv < MP; mv += PF_VL) {
            const pf_vec old = PF_LOAD(mx + mv);
            pf_vec top = old;
            for (int64_t t = 0; t < kp; t++) top = PF_MAX(top, PF_LOAD(S + t * MP + mv));
            const pf_vec alpha = pf_exp(PF_SUB(old, top)); /* 0 on the first tile */
            pf_vec sum = PF_ZERO();
            for (int64_t t = 0; t < kp; t++) {
                const pf_vec p = pf_exp(PF_SUB(PF_LOAD(S + t * MP + mv), top));
                PF_STORE(S + t * MP + mv, p);
                sum = PF_ADD(sum, p);
            }
            PF_STORE(l + mv, PF_FMA(PF_LOAD(l + mv), alpha, sum));
            PF_STORE(mx + mv, top);
            for (int64_t d = 0; d < D; d++) PF_STORE(Ot + d * MP + mv, PF_MUL(PF_LOAD(Ot + d * MP + mv), alpha));
        }
        /* Ot += V^T P: DR head dims x MR vectors of queries in registers over the tile's keys */
        for (int64_t mb = 0; mb < MP; mb += PF_MB)
            for (int64_t d = 0; d < D; d += PF_DR) {
                pf_vec acc[PF_DR][PF_MR];
                for (int dd = 0; dd < PF_DR; dd++)
                    for (int r = 0; r < PF_MR; r++) acc[dd][r] = PF_LOAD(Ot + (d + dd) * MP + mb + r * PF_VL);
                for (int64_t t = 0; t < kn; t++) {
                    pf_vec p[PF_MR];
                    for (int r = 0; r < PF_MR; r++) p[r] = PF_LOAD(S + t * MP + mb + r * PF_VL);
                    for (int dd = 0; dd < PF_DR; dd++) {
                        const pf_vec b = PF_SET1(Vw[t * D + d + dd]);
                        for (int r = 0; r < PF_MR; r++) acc[dd][r] = PF_FMA(b, p[r], acc[dd][r]);
                    }
                }
                for (int dd = 0; dd < PF_DR; dd++)
                    for (int r = 0; r < PF_MR; r++) PF_STORE(Ot + (d + dd) * MP + mb + r * PF_VL, acc[dd][r]);
            }
    }
    for (int64_t i = 0; i < bq; i++)
        for (int64_t j = 0; j < G; j++) {
            const int64_t m = i * G + j;
            const float inv = 1.f / l[m];
            float *oh = out + i * out_stride + (g * G + j) * D;
            for (int64_t d = 0; d < D; d++) oh[d] = Ot[d * MP + m] * inv;
        }
}

#define PF_DTYPE(NAME, HALF)                                                                                          \
    static __attribute__((noinline)) void NAME(const void *K, const void *V, int64_t kv_heads, int64_t g, int64_t G, \
                                               int64_t first, int64_t bq, const float *q, int64_t q_stride,          \
                                               float *out, int64_t out_stride, float scale, float *scratch,          \
                                               int64_t D) {                                                          \
        if (D == 64)                                                                                                 \
            pf_block(K, V, kv_heads, g, G, first, bq, q, q_stride, out, out_stride, scale, scratch, 64, HALF);       \
        else if (D == 128)                                                                                           \
            pf_block(K, V, kv_heads, g, G, first, bq, q, q_stride, out, out_stride, scale, scratch, 128, HALF);      \
        else pf_block(K, V, kv_heads, g, G, first, bq, q, q_stride, out, out_stride, scale, scratch, D, HALF);       \
    }
PF_DTYPE(prefill_block_kv32, 0)
PF_DTYPE(prefill_block_kv16, 1)

/* One block of a chunk's rows (pf_block), head_dim 64 and 128 unrolled; half: K/V in fp16. D must be a multiple of
 * PF_DR (head dims are even multiples of 8 in every model the step runs). */
static inline void prefill_block(const void *K, const void *V, int64_t kv_heads, int64_t g, int64_t G, int64_t first,
                                 int64_t bq, const float *q, int64_t q_stride, float *out, int64_t out_stride,
                                 float scale, float *scratch, int64_t D, int half) {
    if (half) prefill_block_kv16(K, V, kv_heads, g, G, first, bq, q, q_stride, out, out_stride, scale, scratch, D);
    else prefill_block_kv32(K, V, kv_heads, g, G, first, bq, q, q_stride, out, out_stride, scale, scratch, D);
}

#endif
