/* What the AVX-512 tiles share (block_gemm.c: Q4_0/Q4_1/Q8_0; kquant_gemm.c: Q4_K/Q5_K/
 * Q6_K): the layout is 4 weight rows in one 512-bit register, a 128-bit lane a row, 8
 * int16 weights a lane, against an activation row's 8 matching codes broadcast to the 4
 * lanes; each lane's int32 sums are converted and scaled into float32 accumulators whose
 * 4 lanes of a row are summed once, at the end.
 */
#ifndef HR_TILE512_H
#define HR_TILE512_H

#include "blocks.h"

#ifdef HR_AVX512
/* acc + the pairwise products of a and b (int16 lanes), in int32 lanes. */
static inline __m512i dot_acc(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* 4 int32 lanes of row r (128-bit lane r of q) times the 32 codes c, as 4 x 8 products:
 * q[k] holds the row's weights 8k to 8k + 7. */
static inline __attribute__((always_inline)) __m512i dot32(const __m512i q[4], const __m512i a[4]) {
    __m512i p = _mm512_madd_epi16(q[0], a[0]);
    p = dot_acc(p, q[1], a[1]);
    p = dot_acc(p, q[2], a[2]);
    return dot_acc(p, q[3], a[3]);
}

/* 32 activation codes as dot32 takes them: codes 8k to 8k + 7 broadcast to the 4 lanes. */
static inline __attribute__((always_inline)) void broadcast32(const int16_t *c, __m512i a[4]) {
    for (int k = 0; k < 4; k++) a[k] = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(c + 8 * k)));
}

/* The next tile's bytes fetched ahead by hand, a few lines a block: the tile reads its
 * rows block by block, an order the hardware prefetcher does not follow. */
static inline __attribute__((always_inline)) void prefetch_next(const uint8_t *next, int64_t bytes, int64_t nb,
                                                                int64_t b) {
    const int64_t lines = (bytes + 63) / 64, per_block = (lines + nb - 1) / nb;
    for (int64_t l = b * per_block; l < (b + 1) * per_block && l < lines; l++)
        _mm_prefetch((const char *)next + l * 64, _MM_HINT_T0);
}

/* Each row's 4 lanes of acc summed and stored: y[r] for the register's rows r < 4. */
static inline __attribute__((always_inline)) void store_rows4(__m512 acc, float *y) {
    const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    __m512 s = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
    _mm_storeu_ps(y, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, s)));
}
#endif

#endif
