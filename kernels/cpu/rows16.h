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

/* Every pass of up to HR_R16_MT activation rows over one group of 16 interleaved Q5_K or
 * Q6_K rows (w the group's K / 256 chunks), the weights widened to
 * 16-bit lanes once a chunk of super-blocks for all the passes (rows16_many.c): the same
 * float32 operations in the same order as rows16.c's passes, so the same bits. */
void hr_rows16_kquant_many(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                           const float *dxs, int64_t M, float *y, int64_t ldy);
#endif

#endif
