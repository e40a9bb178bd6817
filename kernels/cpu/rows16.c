/* Q4_0/Q4_1/Q8_0 blocks of 16 weight rows interleaved, and their AVX-512 product: the
 * layout a projection's blocks take at load on a CPU with AVX-512 BW
 * (kernels/cpu/rows16.py writes it), so that a register's 16 int32 lanes are 16 weight
 * rows and a block's scales are one load.
 *
 * The GGUF layout keeps a row's blocks together; a product of one activation row then
 * spends most of its instructions on layout, not on products: block_gemm.c gathers 4
 * rows' nibbles into a register's 128-bit lanes (about a dozen shuffles and widenings),
 * the 4 rows' float16 scales from 4 places into lanes (another dozen), and sums a row's 4
 * lanes at the end; about 14 instructions a block and row in all, so two cores read the
 * weights at 14-28 GB/s where they stream more. Here a chunk holds block b of 16 rows
 * (rows 16g to 16g + 15), chunks in the order (g, b), so a group of rows streams in order:
 *
 *     Q4_0: d[16] (f16), codes[256]      Q4_1: d[16], m[16] (f16), codes[256]
 *     Q8_0: d[16] (f16), codes[512]
 *
 * the same bytes as the 16 blocks. Q4 codes: byte 32k + 2j + t holds weight 2k + t of row
 * j in its low nibble and weight 2k + 16 + t in its high one (k < 8, t < 2); Q8_0 codes:
 * byte 32k + 2j + t is weight 2k + t of row j (k < 16). Widened to 16-bit lanes, 32 bytes
 * are a register whose int32 lane j holds row j's weights 2k, 2k + 1: one vpdpwssd
 * against the activation row's codes 2k, 2k + 1 (a 32-bit broadcast) adds two products to
 * each of the 16 rows, so a block is 16 (Q8_0) or 16 (Q4: 8 loads, each two registers)
 * vpdpwssd and one row's int32 lane holds the block's whole sum.
 *
 * Q4_K (kquant.c's type of 256 weights a block, 8 sub-blocks of 32 with 6-bit scales
 * and mins): a chunk holds super-block s of 16 rows, chunks in the order (g, s), the same
 * 16 x 144 bytes moved:
 *
 *     d[16] (f16), dmin[16] (f16), planes[12][16], codes[4][16][16][2]
 *
 * plane p holds byte p of each row's packed scales[12], so a sub-block's 16 scales (and
 * mins) are a few byte operations on one or two 16-byte loads; code byte 512 p + 32 k +
 * 2 j + t is the file's qs[32 p + 2 k + t] of row j: its low nibble weight 2 k + t of
 * sub-block 2 p, its high one weight 2 k + t of sub-block 2 p + 1. 32 bytes widened to
 * 16-bit lanes then hold two weights of each row for two sub-blocks (low and high
 * nibbles), each a vpdpwssd against a 32-bit broadcast of the activation codes. A
 * sub-block's sum of q c is exact in int32 and in float32 (32 x 15 x 32767 < 2^24) and
 * is scaled by (d sc_j) dx_b in float32; the mins add (-dmin m_j) dx_b s_b, as kquant.c.
 * Where kquant.c multiplies the codes by sc_j in int16 lanes first, this applies sc_j
 * in float32: the float32 order differs, nothing else. Q5_K's chunk is Q4_K's with its
 * fifth bits after the codes (16 x 176 bytes): byte 2304 + 32 k + 2 j + t is the file's
 * qh[2 k + t] of row j, whose bit i is the fifth bit of that weight of sub-block i; its
 * sums (q <= 31) are exact in int32 and within a rounding of float32.
 *
 * Q6_K (16 sub-blocks of 16 weights, int8 scales, w = d sc (q - 32) with q of 6 bits):
 * a chunk holds super-block s of 16 rows, the same 16 x 210 bytes moved:
 *
 *     d[16] (f16), scales[16][16] (sub-block, row), ql[2][32][16][2], qh[2][16][16][2]
 *
 * For half n (weights 128 n on) and step k < 32, ql byte (n, k, j, t) is the file's
 * ql[64 n + 2 k + t] of row j: its low nibble weight 2 k + t of the half, its high one
 * weight 2 k + t + 64. The top two bits of those weights at steps 2 m and 2 m + 1 are qh
 * byte (n, m, j, t): bits 0-1 and 2-3 step 2 m's (low, high), bits 4-5 and 6-7 step
 * 2 m + 1's. A step is then one 32-byte load of each (a qh load serves two), widened to
 * 16-bit lanes, and two vpdpwssd of q - 32; a sub-block's sum is exact in int32 and
 * float32 (16 x 32 x 32767 < 2^24), scaled by (d sc) dx_b in float32.
 *
 * The arithmetic is block_gemv.c's: 16-bit activation codes per block of 32, the block's
 * integer sum exact in int32 (Q4_0's -8 taken as -8 s from the codes' sum s), scaled by dw
 * dx in float32 (Q4_1 adds m dx s), blocks summed in float32 in order. Q4 sums are below
 * 2^24 (32 * 15 * 32767), so converted exactly; Q8_0's within a rounding of float32.
 * Only the order of the float32 sum differs from the GGUF layout's products (a row's
 * blocks in one lane rather than 4).
 */
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "rows16.h"
#include "tile512.h"

#ifdef HR_AVX512
/* y[i * ldy + j] = x_i . W[16 g + j] for j < 16 and the MT activation rows i of a pass
 * (codes K apart; dx, sums, dxs nb apart); w: group g's nb chunks. MT is a constant at
 * each call (always inlined), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void group16(int type, const uint8_t *w, int64_t nb,
                                                          const int16_t *codes, int64_t K, const float *dx,
                                                          const int32_t *sums, const float *dxs, const int MT,
                                                          float *y, int64_t ldy) {
    const int64_t chunk = 16 * (int64_t)hr_block_bytes(type);
    const int qoff = type == Q4_1 ? 64 : 32;
    const __m512i low4 = _mm512_set1_epi16(15);
    __m512 acc[HR_R16_MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ch = w + b * chunk, *qs = ch + qoff;
        /* Eight chunks fetched ahead: the hardware prefetcher alone fed one row's pass at 22-27
         * GB/s of the 30 two cores of an Intel Xeon read (the default model's 30 layers). */
        for (int64_t l = 0; l < chunk; l += 64) _mm_prefetch((const char *)ch + 8 * chunk + l, _MM_HINT_T0);
        __m512i s[HR_R16_MT];
        for (int i = 0; i < MT; i++) s[i] = _mm512_setzero_si512();
        if (type == Q8_0) {
            for (int k = 0; k < 16; k++) {
                const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
                for (int i = 0; i < MT; i++) s[i] = dot_acc(s[i], q, pair(codes + i * K + b * 32 + 2 * k));
            }
        } else {
            for (int k = 0; k < 8; k++) {
                const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
                const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
                for (int i = 0; i < MT; i++) {
                    const int16_t *c = codes + i * K + b * 32 + 2 * k;
                    s[i] = dot_acc(s[i], lo, pair(c));
                    s[i] = dot_acc(s[i], hi, pair(c + 16));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ch));
        const __m512 m = type == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 32)))
                                      : _mm512_setzero_ps();
        for (int i = 0; i < MT; i++) {
            if (type == Q4_0) s[i] = _mm512_sub_epi32(s[i], _mm512_set1_epi32(8 * sums[i * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx[i * nb + b])), acc[i]);
            if (type == Q4_1) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(dxs[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* group16 for Q4_K or Q5_K chunks (the layouts above): nsb super-blocks of 16 rows, MT
 * activation rows (dx and dxs = dx s per block of 32, nb apart). */
static inline __attribute__((always_inline)) void group16_q4k(int type, const uint8_t *w, int64_t nsb,
                                                              const int16_t *codes, int64_t K, const float *dx,
                                                              const float *dxs, const int MT, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    __m512 acc[HR_R16_MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *ch = w + s * 16 * hr_block_bytes(type), *pl = ch + 64, *qh = ch + 2304;
        /* Four chunks fetched ahead: Q5_K's two streams a chunk (codes, fifth bits) as Q6_K's; Q4_K's
         * one, which the hardware prefetcher alone fed at 22-27 GB/s of an Intel Xeon's 30 */
        for (int l = 0; l < 16 * hr_block_bytes(type); l += 64)
            _mm_prefetch((const char *)ch + 4 * 16 * hr_block_bytes(type) + l, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ch));
        const __m512 negmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ch + 32))));
        for (int j = 0; j < 8; j++) {  /* the mins: -dmin m_j dx_b s_b */
            const __m512 mj = _mm512_mul_ps(negmin, scale_min16(pl, j, 1));
            for (int i = 0; i < MT; i++) acc[i] = _mm512_fmadd_ps(mj, _mm512_set1_ps(dxs[i * nb + s * 8 + j]), acc[i]);
        }
        for (int p = 0; p < 4; p++) {  /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            const uint8_t *qs = ch + 256 + 512 * p;
            const int64_t b = s * 8 + 2 * p;
            __m512i lo_sum[HR_R16_MT], hi_sum[HR_R16_MT];
            for (int i = 0; i < MT; i++) lo_sum[i] = hi_sum[i] = _mm512_setzero_si512();
            for (int k = 0; k < 16; k++) {
                __m512i lo, hi;
                widen_q4k_step(type, qs, qh, p, k, &lo, &hi);
                for (int i = 0; i < MT; i++) {
                    const int16_t *c = codes + i * K + b * 32 + 2 * k;
                    lo_sum[i] = dot_acc(lo_sum[i], lo, pair(c));
                    hi_sum[i] = dot_acc(hi_sum[i], hi, pair(c + 32));
                }
            }
            const __m512 slo = _mm512_mul_ps(d, scale_min16(pl, 2 * p, 0));
            const __m512 shi = _mm512_mul_ps(d, scale_min16(pl, 2 * p + 1, 0));
            add_sums(acc, lo_sum, hi_sum, slo, shi, dx, nb, b, b + 1, MT);
        }
    }
    for (int i = 0; i < MT; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* group16 for Q6_K chunks (the layout above). */
static inline __attribute__((always_inline)) void group16_q6k(const uint8_t *w, int64_t nsb, const int16_t *codes,
                                                              int64_t K, const float *dx, const int MT, float *y,
                                                              int64_t ldy) {
    const int64_t nb = K / 32;
    __m512 acc[HR_R16_MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *ch = w + s * 16 * 210, *sc = ch + 32;
        /* Four chunks ahead (the next group's follow on): the hardware prefetcher fell behind
         * on a chunk's two streams (ql, qh), 9 against 24 Gweights/s out of memory. */
        for (int l = 0; l < 16 * 210; l += 64) _mm_prefetch((const char *)ch + 4 * 16 * 210 + l, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ch));
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = ch + 288 + 1024 * n, *qh = ch + 2336 + 512 * n;
            for (int q = 0; q < 4; q++) {  /* steps 8q to 8q + 7: sub-blocks 8n + q (low) and 8n + 4 + q */
                __m512i lo_sum[HR_R16_MT], hi_sum[HR_R16_MT];
                for (int i = 0; i < MT; i++) lo_sum[i] = hi_sum[i] = _mm512_setzero_si512();
                for (int m = 4 * q; m < 4 * q + 4; m++) {
                    const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * m)));
                    for (int kk = 0; kk < 2; kk++) {
                        const int k = 2 * m + kk;
                        __m512i lo, hi;
                        widen_q6k_step(ql, h, k, kk, &lo, &hi);
                        for (int i = 0; i < MT; i++) {
                            const int16_t *c = codes + i * K + s * 256 + 128 * n + 2 * k;
                            lo_sum[i] = dot_acc(lo_sum[i], lo, pair(c));
                            hi_sum[i] = dot_acc(hi_sum[i], hi, pair(c + 64));
                        }
                    }
                }
                const __m512 slo = _mm512_mul_ps(d, scales16(sc, 8 * n + q));
                const __m512 shi = _mm512_mul_ps(d, scales16(sc, 8 * n + 4 + q));
                const int64_t b = s * 8 + 4 * n + q / 2;  /* the activation blocks of 32: b (low), b + 2 (high) */
                add_sums(acc, lo_sum, hi_sum, slo, shi, dx, nb, b, b + 2, MT);
            }
        }
    }
    for (int i = 0; i < MT; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* One pass of MT activation rows over one group, by type (both constants at each call:
 * the other kernels and their branches fold away). */
static inline __attribute__((always_inline)) void pass16(int type, const uint8_t *w, int64_t nb, const int16_t *c,
                                                         int64_t K, const float *x, const int32_t *s, const float *xs,
                                                         const int MT, float *y, int64_t ldy) {
    if (type == Q4_K || type == Q5_K)
        group16_q4k(type, w, nb / 8, c, K, x, xs, MT, y, ldy);
    else if (type == Q6_K)
        group16_q6k(w, nb / 8, c, K, x, MT, y, ldy);
    else
        group16(type, w, nb, c, K, x, s, xs, MT, y, ldy);
}

/* Every pass of up to HR_R16_MT activation rows over one group, at a constant type. */
static inline __attribute__((always_inline)) void group_of(int type, const uint8_t *w, int64_t nb,
                                                           const int16_t *codes, int64_t K, const float *dx,
                                                           const int32_t *sums, const float *dxs, int64_t M,
                                                           float *y, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += HR_R16_MT) {
        const int mt = M - m0 < HR_R16_MT ? (int)(M - m0) : HR_R16_MT;
        const int16_t *c = codes + m0 * K;
        const float *x = dx + m0 * nb, *xs = dxs + m0 * nb;
        const int32_t *s = sums + m0 * nb;
        float *yt = y + m0 * ldy;
        switch (mt) {  /* a constant MT a call: the accumulators stay in registers */
            case 8: pass16(type, w, nb, c, K, x, s, xs, 8, yt, ldy); break;
            case 7: pass16(type, w, nb, c, K, x, s, xs, 7, yt, ldy); break;
            case 6: pass16(type, w, nb, c, K, x, s, xs, 6, yt, ldy); break;
            case 5: pass16(type, w, nb, c, K, x, s, xs, 5, yt, ldy); break;
            case 4: pass16(type, w, nb, c, K, x, s, xs, 4, yt, ldy); break;
            case 3: pass16(type, w, nb, c, K, x, s, xs, 3, yt, ldy); break;
            case 2: pass16(type, w, nb, c, K, x, s, xs, 2, yt, ldy); break;
            default: pass16(type, w, nb, c, K, x, s, xs, 1, yt, ldy); break;
        }
    }
}
#endif

int hr_rows16_available(void) {
#ifdef HR_AVX512
    return 1;
#else
    return 0;
#endif
}

int hr_rows16(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx, const int32_t *sums,
              const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy) {
#ifdef HR_AVX512
    if (!hr_rows16_takes(type) || K % hr_block_elements(type) || n0 % 16 || n1 % 16) return -1;
    const int64_t nb = K / 32, group_bytes = 16 * (K / hr_block_elements(type)) * hr_block_bytes(type);
    for (int64_t g = n0 / 16; g < n1 / 16; g++) {
        const uint8_t *wg = w + g * group_bytes;
        if ((type == Q5_K || type == Q6_K) && M > HR_R16_MT) {  /* more than one pass: widen once (rows16_many.c) */
            hr_rows16_kquant_many(type, wg, K, codes, dx, dxs, M, y + 16 * g, ldy);
            continue;
        }
        switch (type) {  /* one copy a type: its branches fold away */
            case Q4_0: group_of(Q4_0, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
            case Q4_1: group_of(Q4_1, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
            case Q4_K: group_of(Q4_K, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
            case Q5_K: group_of(Q5_K, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
            case Q6_K: group_of(Q6_K, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
            default: group_of(Q8_0, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
        }
    }
    return 0;
#else
    (void)type, (void)w, (void)K, (void)codes, (void)dx, (void)sums, (void)dxs, (void)M, (void)n0, (void)n1;
    (void)y, (void)ldy;
    return -1;
#endif
}

/* Row j (of 16) of an interleaved K-quant chunk (the layouts above) as the file's block:
 * 144 (Q4_K), 176 (Q5_K) or 210 (Q6_K) bytes into blk. Plain C: a lookup of a few rows. */
static void unpack_row(int type, const uint8_t *ch, int j, uint8_t *blk) {
    if (type == Q4_K || type == Q5_K) {
        const int at = type == Q5_K ? 48 : 16;  /* the file's qs */
        memcpy(blk, ch + 2 * j, 2);
        memcpy(blk + 2, ch + 32 + 2 * j, 2);
        for (int p = 0; p < 12; p++) blk[4 + p] = ch[64 + 16 * p + j];
        for (int p = 0; p < 4; p++)
            for (int k = 0; k < 16; k++)
                for (int t = 0; t < 2; t++) blk[at + 32 * p + 2 * k + t] = ch[256 + 512 * p + 32 * k + 2 * j + t];
        if (type == Q5_K)
            for (int k = 0; k < 16; k++)
                for (int t = 0; t < 2; t++) blk[16 + 2 * k + t] = ch[2304 + 32 * k + 2 * j + t];
        return;
    }
    memcpy(blk + 208, ch + 2 * j, 2);
    for (int i = 0; i < 16; i++) blk[192 + i] = ch[32 + 16 * i + j];
    for (int n = 0; n < 2; n++) {
        for (int k = 0; k < 32; k++)
            for (int t = 0; t < 2; t++) blk[64 * n + 2 * k + t] = ch[288 + 1024 * n + 32 * k + 2 * j + t];
        for (int l = 0; l < 32; l++) {  /* qh[l]: the top bits of weights l, l + 32, l + 64, l + 96 of the half */
            uint8_t qh = 0;
            for (int p = 0; p < 4; p++) {
                const int i = l + 32 * (p & 1), k = i / 2, t = i % 2;  /* low weight i, or i + 64 (p >= 2) */
                const uint8_t packed = ch[2336 + 512 * n + 32 * (k / 2) + 2 * j + t];
                qh |= (uint8_t)(((packed >> (4 * (k % 2) + 2 * (p >> 1))) & 3) << (2 * p));
            }
            blk[128 + 32 * n + l] = qh;
        }
    }
}

/* Rows ids[0..n) of N rows of K weights in interleaved Q4_K, Q5_K or Q6_K blocks as float32,
 * out[i * K ...]: gguf's values (hr_kquant_dequantize_row on each row's blocks put back).
 * A lookup of a tied head's embeddings. Returns 0, or -1 for a type, K or an id it does
 * not take. Built on any machine: the layout is bytes, only its product needs AVX-512. */
int hr_rows16_dequantize(int type, const uint8_t *w, int64_t K, int64_t N, const int64_t *ids, int64_t n,
                         float *out) {
    if (!hr_is_kquant(type) || K % 256 || N % 16) return -1;
    const int bb = hr_block_bytes(type);
    const int64_t nsb = K / 256;
    uint8_t blk[210];
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= N) return -1;
        const uint8_t *group = w + (ids[i] / 16) * nsb * 16 * bb;
        for (int64_t s = 0; s < nsb; s++) {
            unpack_row(type, group + s * 16 * bb, (int)(ids[i] % 16), blk);
            hr_kquant_dequantize_row(type, blk, 256, out + i * K + s * 256);
        }
    }
    return 0;
}
