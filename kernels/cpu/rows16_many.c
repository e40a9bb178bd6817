/* Many activation rows (a prefill chunk, a batch's decode past HR_R16_MT) against a group
 * of 16 interleaved Q5_K or Q6_K weight rows (rows16.c's layouts): rows16.c widens each
 * 32-byte load of codes to 16-bit lanes in every pass of HR_R16_MT activation rows (Q5_K
 * six vector operations for two registers, Q6_K about ten), so at 128 rows a group's
 * weights are widened 16 times. Here a chunk of HR_R16_SB super-blocks is widened once,
 * with its sub-blocks' scales (d sc) and Q5_K's mins (-dmin m) as float32 lanes, into a
 * buffer on the thread's stack (38 KiB, in L1 or L2), and every pass loads it: the inner
 * loop is a load and HR_R16_MT vpdpwssd. A pass's float32 accumulators go to y between
 * chunks and come back (a float32 store and load change nothing), and each operation is
 * rows16.c's in its order, so the output has the same bits. Q4_K stays in rows16.c: its
 * widening is three operations for two registers, and loading them instead measured
 * 0.95-0.99x (2 cores, 128 and 512 rows).
 *
 * A chunk's registers are in the order the passes read them: pair P (two sub-blocks whose
 * codes one 32-byte load holds, low and high nibbles) has its steps t, each two registers
 * (low, high): q[P][2 t], q[P][2 t + 1].
 *   Q5_K: 4 pairs of 16 steps; pair p is sub-blocks 2p (low) and 2p + 1 (high), step
 *     k reads codes 64 p + 2 k (low) and + 32 (high) of the super-block.
 *   Q6_K: 8 pairs of 8 steps; pair P = 4 n + q is sub-blocks 8 n + q (low) and 8 n + 4 + q
 *     (high), step t reads codes 128 n + 16 q + 2 t (low) and + 64 (high).
 */
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "rows16.h"
#include "tile512.h"

#ifdef HR_AVX512
/* Super-blocks widened at a time: 4 x 8 KiB of weights, the scales and mins. */
enum { HR_R16_SB = 4 };

typedef struct {
    __m512i q[HR_R16_SB][128];    /* 256 weights of 16 rows a super-block, in pairs' order */
    __m512 scale[HR_R16_SB][16];  /* d sc of the pairs' sub-blocks: scale[2P] low, [2P + 1] high */
    __m512 min[HR_R16_SB][8];     /* Q5_K: -dmin m_j */
} widened16;

/* Super-block ch (a Q5_K chunk of 16 rows) widened into slot s of wb. */
static inline __attribute__((always_inline)) void widen_q5k(const uint8_t *ch, widened16 *wb, int s) {
    const uint8_t *pl = ch + 64, *qh = ch + 2304;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ch));
    const __m512 negmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 32))));
    for (int j = 0; j < 8; j++) wb->min[s][j] = _mm512_mul_ps(negmin, scale_min16(pl, j, 1));
    for (int p = 0; p < 4; p++) {
        const uint8_t *qs = ch + 256 + 512 * p;
        wb->scale[s][2 * p] = _mm512_mul_ps(d, scale_min16(pl, 2 * p, 0));
        wb->scale[s][2 * p + 1] = _mm512_mul_ps(d, scale_min16(pl, 2 * p + 1, 0));
        for (int k = 0; k < 16; k++) {
            __m512i lo, hi;
            widen_q4k_step(Q5_K, qs, qh, p, k, &lo, &hi);
            wb->q[s][32 * p + 2 * k] = lo;
            wb->q[s][32 * p + 2 * k + 1] = hi;
        }
    }
}

/* Super-block ch (a Q6_K chunk of 16 rows) widened into slot s of wb. */
static inline __attribute__((always_inline)) void widen_q6k(const uint8_t *ch, widened16 *wb, int s) {
    const uint8_t *sc = ch + 32;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ch));
    for (int n = 0; n < 2; n++) {
        const uint8_t *ql = ch + 288 + 1024 * n, *qh = ch + 2336 + 512 * n;
        for (int q = 0; q < 4; q++) {
            const int P = 4 * n + q;
            wb->scale[s][2 * P] = _mm512_mul_ps(d, scales16(sc, 8 * n + q));
            wb->scale[s][2 * P + 1] = _mm512_mul_ps(d, scales16(sc, 8 * n + 4 + q));
            for (int m = 4 * q; m < 4 * q + 4; m++) {
                const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * m)));
                for (int kk = 0; kk < 2; kk++) {
                    const int k = 2 * m + kk, t = k - 8 * q;
                    widen_q6k_step(ql, h, k, kk, &wb->q[s][16 * P + 2 * t], &wb->q[s][16 * P + 2 * t + 1]);
                }
            }
        }
    }
}

/* One pass of MT activation rows (codes K apart; dx, dxs nb apart) over the ns widened
 * super-blocks of wb, the first being super-block s0 of the rows: acc carried in and out. */
static inline __attribute__((always_inline)) void pass_many(int type, const widened16 *wb, int ns, int64_t s0,
                                                            const int16_t *codes, int64_t K, const float *dx,
                                                            const float *dxs, const int MT, __m512 *acc) {
    const int64_t nb = K / 32;
    const int q6 = type == Q6_K, pairs = q6 ? 8 : 4, steps = q6 ? 8 : 16;
    for (int s = 0; s < ns; s++) {
        const int64_t sb = s0 + s;
        if (!q6)
            for (int j = 0; j < 8; j++)  /* the mins: -dmin m_j dx_b s_b */
                for (int i = 0; i < MT; i++)
                    acc[i] = _mm512_fmadd_ps(wb->min[s][j], _mm512_set1_ps(dxs[i * nb + sb * 8 + j]), acc[i]);
        for (int P = 0; P < pairs; P++) {
            /* the pair's codes (low; high at +32 or +64) and activation blocks of 32 */
            const int64_t at = sb * 256 + (q6 ? 128 * (P / 4) + 16 * (P % 4) : 64 * P);
            const int64_t b = q6 ? sb * 8 + 4 * (P / 4) + (P % 4) / 2 : sb * 8 + 2 * P;
            const int hi_at = q6 ? 64 : 32, hi_b = q6 ? 2 : 1;
            const __m512i *q = wb->q[s] + 2 * steps * P;
            __m512i lo_sum[HR_R16_MT], hi_sum[HR_R16_MT];
            for (int i = 0; i < MT; i++) lo_sum[i] = hi_sum[i] = _mm512_setzero_si512();
            for (int t = 0; t < steps; t++) {
                const __m512i lo = q[2 * t], hi = q[2 * t + 1];
                for (int i = 0; i < MT; i++) {
                    const int16_t *c = codes + i * K + at + 2 * t;
                    lo_sum[i] = dot_acc(lo_sum[i], lo, pair(c));
                    hi_sum[i] = dot_acc(hi_sum[i], hi, pair(c + hi_at));
                }
            }
            add_sums(acc, lo_sum, hi_sum, wb->scale[s][2 * P], wb->scale[s][2 * P + 1], dx, nb, b, b + hi_b, MT);
        }
    }
}

/* pass_many with the accumulators from y (zero at the first chunk) and back to it. */
static inline __attribute__((always_inline)) void pass_rows(int type, const widened16 *wb, int ns, int64_t s0,
                                                            const int16_t *codes, int64_t K, const float *dx,
                                                            const float *dxs, const int MT, float *y, int64_t ldy) {
    __m512 acc[HR_R16_MT];
    for (int i = 0; i < MT; i++) acc[i] = s0 ? _mm512_loadu_ps(y + i * ldy) : _mm512_setzero_ps();
    pass_many(type, wb, ns, s0, codes, K, dx, dxs, MT, acc);
    for (int i = 0; i < MT; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* Every chunk of the group, every pass of up to HR_R16_MT rows over it, at a constant type. */
static inline __attribute__((always_inline)) void many_of(int type, const uint8_t *w, int64_t K, const int16_t *codes,
                                                          const float *dx, const float *dxs, int64_t M, float *y,
                                                          int64_t ldy) {
    widened16 wb;
    const int64_t nsb = K / 256, nb = K / 32, chunk = 16 * (int64_t)hr_block_bytes(type);
    for (int64_t s0 = 0; s0 < nsb; s0 += HR_R16_SB) {
        const int ns = nsb - s0 < HR_R16_SB ? (int)(nsb - s0) : HR_R16_SB;
        for (int s = 0; s < ns; s++) {
            if (type == Q6_K)
                widen_q6k(w + (s0 + s) * chunk, &wb, s);
            else
                widen_q5k(w + (s0 + s) * chunk, &wb, s);
        }
        for (int64_t m0 = 0; m0 < M; m0 += HR_R16_MT) {
            const int mt = M - m0 < HR_R16_MT ? (int)(M - m0) : HR_R16_MT;
            const int16_t *c = codes + m0 * K;
            const float *x = dx + m0 * nb, *xs = dxs + m0 * nb;
            float *yt = y + m0 * ldy;
            switch (mt) {  /* a constant MT a call: the accumulators stay in registers */
                case 8: pass_rows(type, &wb, ns, s0, c, K, x, xs, 8, yt, ldy); break;
                case 7: pass_rows(type, &wb, ns, s0, c, K, x, xs, 7, yt, ldy); break;
                case 6: pass_rows(type, &wb, ns, s0, c, K, x, xs, 6, yt, ldy); break;
                case 5: pass_rows(type, &wb, ns, s0, c, K, x, xs, 5, yt, ldy); break;
                case 4: pass_rows(type, &wb, ns, s0, c, K, x, xs, 4, yt, ldy); break;
                case 3: pass_rows(type, &wb, ns, s0, c, K, x, xs, 3, yt, ldy); break;
                case 2: pass_rows(type, &wb, ns, s0, c, K, x, xs, 2, yt, ldy); break;
                default: pass_rows(type, &wb, ns, s0, c, K, x, xs, 1, yt, ldy); break;
            }
        }
    }
}

void hr_rows16_kquant_many(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                           const float *dxs, int64_t M, float *y, int64_t ldy) {
    if (type == Q5_K)  /* one copy a type: its branches fold away */
        many_of(Q5_K, w, K, codes, dx, dxs, M, y, ldy);
    else
        many_of(Q6_K, w, K, codes, dx, dxs, M, y, ldy);
}
#endif
