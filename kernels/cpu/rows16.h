/* What rows16.c (a pass of up to HR_R16_MT activation rows over a group of 16
 * interleaved weight rows) and rows16_many.c (many rows: a group's Q5_K/Q6_K weights
 * widened once for all passes) share: the broadcast of a pair of activation codes, the K-quant
 * scales of 16 rows as float32 lanes, and a sub-block pair's sums into the accumulators.
 * rows16.c's head comment gives the layouts.
 */
#ifndef HR_ROWS16_H
#define HR_ROWS16_H

#include <stdint.h>
#include <string.h>

#include "blocks.h"

#ifdef HR_AVX512
/* Activation rows a pass: 8 float32 and 8 int32 accumulators, with the widened weights
 * and the scales, in 32 registers. */
enum { HR_R16_MT = 8 };

/* 32 bits of activation codes (codes j, j + 1) broadcast to every lane. */
static inline __attribute__((always_inline)) __m512i pair(const int16_t *c) {
    int32_t v;
    memcpy(&v, c, 4);
    return _mm512_set1_epi32(v);
}

/* The 6-bit scale (min: the 6-bit min) of sub-block j of the 16 rows whose scale planes
 * are at pl, as float32 lanes (ggml's get_scale_min_k4 on each row's bytes). */
static inline __attribute__((always_inline)) __m512 scale_min16(const uint8_t *pl, int j, int min) {
    const __m128i low6 = _mm_set1_epi8(63), low4 = _mm_set1_epi8(15), two = _mm_set1_epi8(3);
    __m128i v;
    if (j < 4) {
        v = _mm_and_si128(_mm_loadu_si128((const __m128i *)(pl + 16 * (j + 4 * min))), low6);
    } else {
        const __m128i c = _mm_loadu_si128((const __m128i *)(pl + 16 * (j + 4)));
        const __m128i a = _mm_loadu_si128((const __m128i *)(pl + 16 * (j - 4 + 4 * min)));
        const __m128i bottom = min ? _mm_and_si128(_mm_srli_epi16(c, 4), low4) : _mm_and_si128(c, low4);
        const __m128i top = _mm_and_si128(_mm_srli_epi16(a, 6), two);  /* bits 6-7 of a */
        v = _mm_or_si128(bottom, _mm_slli_epi16(top, 4));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

/* Two sub-blocks' int32 sums of MT activation rows into their float32 accumulators:
 * acc += sum_lo (scale_lo dx[b_lo]) + sum_hi (scale_hi dx[b_hi]), scale_* (d sc) of the
 * 16 rows, dx the rows' block scales nb apart. */
static inline __attribute__((always_inline)) void add_sums(__m512 *acc, const __m512i *lo_sum, const __m512i *hi_sum,
                                                           __m512 scale_lo, __m512 scale_hi, const float *dx,
                                                           int64_t nb, int64_t b_lo, int64_t b_hi, const int MT) {
    for (int i = 0; i < MT; i++) {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_sum[i]), _mm512_mul_ps(scale_lo, _mm512_set1_ps(dx[i * nb + b_lo])),
                                 acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_sum[i]), _mm512_mul_ps(scale_hi, _mm512_set1_ps(dx[i * nb + b_hi])),
                                 acc[i]);
    }
}

/* The int8 scales of sub-block i of 16 rows (16 bytes at sc), as float32 lanes. */
static inline __attribute__((always_inline)) __m512 scales16(const uint8_t *sc, int i) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * i))));
}

/* Step k of Q4_K/Q5_K sub-blocks 2p (lo) and 2p + 1 (hi) of 16 rows widened to 16-bit
 * lanes, two weights of each row a register: qs the pair's codes, qh Q5_K's fifth bits
 * (bit 2p, 2p + 1 of qh[2k + t]). */
static inline __attribute__((always_inline)) void widen_q4k_step(int type, const uint8_t *qs, const uint8_t *qh,
                                                                 int p, int k, __m512i *lo, __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi16(15), bit4 = _mm512_set1_epi16(16);
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * k)));
    *lo = _mm512_and_si512(v, low4);
    *hi = _mm512_srli_epi16(v, 4);
    if (type == Q5_K) {
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * k)));
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(h, 2 * p), 4), bit4));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(h, 2 * p + 1), 4), bit4));
    }
}

/* Step k of a Q6_K half widened to 16-bit lanes as q - 32: lo (weights 2k + t), hi (2k + t
 * + 64); ql the half's low bits, h the widened top-bit bytes of steps 2m, 2m + 1 (k = 2m +
 * kk). */
static inline __attribute__((always_inline)) void widen_q6k_step(const uint8_t *ql, __m512i h, int k, int kk,
                                                                 __m512i *lo, __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi16(15), two = _mm512_set1_epi16(3 << 4), bias = _mm512_set1_epi16(32);
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 32 * k)));
    const __m512i hb = kk ? _mm512_srli_epi16(h, 4) : h;
    *lo = _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), two)),
                           bias);
    *hi = _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(v, 4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), two)),
                           bias);
}

/* Every pass of up to HR_R16_MT activation rows over one group of 16 interleaved Q5_K or
 * Q6_K rows (w the group's K / 256 chunks), the weights widened to
 * 16-bit lanes once a chunk of super-blocks for all the passes (rows16_many.c): the same
 * float32 operations in the same order as rows16.c's passes, so the same bits. */
void hr_rows16_kquant_many(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                           const float *dxs, int64_t M, float *y, int64_t ldy);
#endif

#endif
