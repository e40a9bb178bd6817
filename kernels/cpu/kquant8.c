/* K-quant row products on 8-bit activation codes: y = x . W[n], W in Q4_K, Q5_K or Q6_K
 * blocks; the cpu_kquant_act_bits switch (kernels/switches.py) picks these (HR_ACT8 in
 * the path, blocks.h) or kquant.c's on 16-bit codes.
 *
 * Activations (hr_quantize_row8): per group of 256, D = max|x| / 127; each block b of 32
 * gets dx_b = D / 2^k_b, k_b the largest of 0..6 with 2^k_b max|x_b| <= max|x_group|, and
 * int8 codes c = round(x / dx_b). A block far below its group's largest keeps most of
 * its own resolution (as with a scale per block), yet the scales of a group are powers
 * of two apart, so its products sum in int32 and are scaled once a group, as llama.cpp's
 * q8_K (one scale per 256) is.
 *
 * Sub-block j of 32 weights (kquant.c's layouts) meets activation block b = 8 s + j. Its
 * integers q are bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), so unsigned-by-signed byte
 * products (vpmaddubsw) pair them with the codes into int16 without saturation
 * (2 * 63 * 127 < 2^15; Q6_K's -32 enters as vpmaddubsw(32, c), subtracted), and
 * vpmaddwd (vpdpwssd with VNNI) against the sub-block's scale shifted by u_b = 6 - k_b
 * adds 8 int32 lanes, lane m the sum over weights 4m .. 4m + 3:
 *
 *     P_m += 2^u_b sum_l sc(l) q'_l c_l,  q' = q (Q4_K, Q5_K) or q - 32 (Q6_K, whose scale
 *     sc(l) changes at l = 16)
 *
 * exact: |sc 2^u| <= 128 * 64 fits int16, and 8 sub-blocks of 2 * 8128 * 8192 stay below
 * 2^31. A super-block's lanes enter float32 once, acc_m += P_m * (d * D / 64), after its
 * Q4_K/Q5_K mins, acc_j += (-dmin * m_j) * (dx_b s_b); a row's result is the 8 lanes
 * summed as hr_hsum8 does. Every build does exactly these operations in this order, so
 * the plain C product, the AVX2 one (one weight row, 8 lanes in a 256-bit register) and
 * the AVX-512 BW tile (two weight rows in a 512-bit register, a 256-bit half each) give
 * the same bits.
 *
 * Accuracy: x is within dx_b / 2 of dx_b c, so a product moves by at most
 * sum_b (dx_b / 2) sum_{l in b} |w_l| against the float activations (>= 258 times the
 * 16-bit codes' bound; docs/cpu.md has what that does to a model's logits).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"
#include "tile512.h"

/* Sub-block j of a block: its 32 weights' integers q (bytes) and the scales of its
 * weights 0-15 and 16-31 (equal for Q4_K/Q5_K). */
static void unpack8_scalar(int type, const uint8_t *blk, int j, uint8_t q[32], int sc[2]) {
    if (type == Q6_K) {
        const uint8_t *ql = blk + 64 * (j / 4), *qh = blk + 128 + 32 * (j / 4);
        const int8_t *scs = (const int8_t *)(blk + 192);
        const int g = j % 4;
        for (int l = 0; l < 32; l++)
            q[l] = (uint8_t)(((ql[l + 32 * (g & 1)] >> (4 * (g >> 1))) & 15) | (((qh[l] >> (2 * g)) & 3) << 4));
        sc[0] = scs[2 * j], sc[1] = scs[2 * j + 1];
        return;
    }
    int m;
    hr_scale_min(blk + 4, j, &sc[0], &m);
    sc[1] = sc[0];
    const uint8_t *qs = blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2);
    for (int l = 0; l < 32; l++) {
        int v = (qs[l] >> (4 * (j & 1))) & 15;
        if (type == Q5_K) v |= ((blk[16 + l] >> j) & 1) << 4;
        q[l] = (uint8_t)v;
    }
}

static float block_d(int type, const uint8_t *blk) { return f16_to_f32(type == Q6_K ? blk + 208 : blk); }

/* -dmin * m_j of the 8 sub-blocks of a Q4_K/Q5_K block (zeros for Q6_K). */
static inline void block_mins(int type, const uint8_t *blk, float mins[8]) {
    const float neg = type == Q6_K ? 0.0f : -f16_to_f32(blk + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m = 0;
        if (type != Q6_K) hr_scale_min(blk + 4, j, &sc, &m);
        mins[j] = neg * (float)m;
    }
}

/* An activation row's shift 6 - k of block b and D / 64 of group s (hr_quantize_row8:
 * after its K codes). */
static inline int act_shift(const int8_t *c, int64_t K, int64_t b) { return ((const uint8_t *)c)[K + b]; }
static inline float act_base(const int8_t *c, int64_t K, int64_t s) {
    float e;
    memcpy(&e, (const uint8_t *)c + K + K / 32 + 4 * s, 4);
    return e;
}

static float row_scalar(int type, const uint8_t *row, int64_t nsb, const int8_t *c, const float *dxs) {
    float acc[8] = {0};
    uint8_t q[32];
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * hr_block_bytes(type);
        const float d = block_d(type, blk);
        if (type != Q6_K) {
            float mins[8];
            block_mins(type, blk, mins);
            for (int j = 0; j < 8; j++) acc[j] = fmaf(mins[j], dxs[s * 8 + j], acc[j]);
        }
        int32_t p[8] = {0};
        for (int j = 0; j < 8; j++) {
            int sc[2];
            unpack8_scalar(type, blk, j, q, sc);
            const int32_t two_u = 1 << act_shift(c, nsb * 256, s * 8 + j);
            for (int l = 0; l < 32; l++)
                p[l / 4 % 8] += sc[l / 16] * two_u * ((int32_t)q[l] - (type == Q6_K ? 32 : 0)) * c[s * 256 + j * 32 + l];
        }
        const float f = d * act_base(c, nsb * 256, s);
        for (int m = 0; m < 8; m++) acc[m] = fmaf((float)p[m], f, acc[m]);
    }
    const float t0 = (acc[0] + acc[4]) + (acc[2] + acc[6]), t1 = (acc[1] + acc[5]) + (acc[3] + acc[7]);
    return t0 + t1;
}

#ifdef HR_AVX2
/* A Q4_K/Q5_K block's first 16 bytes (f16 d, dmin; 12 bytes of 6-bit scales and mins)
 * to 16 bytes sc_0..7, m_0..7 (hr_scale_min's bits, moved a 32-bit word at a time:
 * words (u0, u2, u1, u2 >> 4) masked to 6 bits, the odd ones' top 2 bits from
 * (u0, u1) >> 6); KSCALES over 128-bit lanes of any width. */
#define KSCALES(V, W, shuffle32, srlv32, and, or, srli32, slli32, blend_odd, set1_32, set4_32)                 \
    static inline __attribute__((always_inline)) V W(V v) {                                                    \
        const V a = srlv32(shuffle32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(3, 2, 3, 1)), set4_32(4, 0, 0, 0));         \
        const V b = shuffle32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(2, 2, 1, 1));                                      \
        const V odd = or(and(a, set1_32(0x0f0f0f0f)), slli32(and(srli32(b, 6), set1_32(0x03030303)), 4));     \
        return blend_odd(and(a, set1_32(0x3f3f3f3f)), odd);                                                    \
    }
static inline __m128i set4_128(int a, int b, int c, int d) { return _mm_set_epi32(a, b, c, d); }
static inline __m128i blend_odd128(__m128i even, __m128i odd) { return _mm_blend_epi32(even, odd, 0xA); }
#define SHUF128(v, m) _mm_shuffle_epi32(v, (int)(m))
KSCALES(__m128i, kscales, SHUF128, _mm_srlv_epi32, _mm_and_si128, _mm_or_si128, _mm_srli_epi32, _mm_slli_epi32,
        blend_odd128, _mm_set1_epi32, set4_128)
#undef SHUF128

/* Sub-blocks j and j + 1 (j even) of one block as bytes q (unpack8_scalar's). */
static inline __attribute__((always_inline)) void unpack8_avx2(int type, const uint8_t *blk, int j, __m256i q[2]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (type == Q6_K) {
        const int g = j % 4;  /* 0 or 2: ql's low nibbles, or its high ones */
        const __m128i lo_shift = _mm_cvtsi32_si128(4 * (g >> 1));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * (j / 4)));
        for (int h = 0; h < 2; h++) {
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * (j / 4) + 32 * h));
            const __m256i top = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * (g + h))),
                                                 _mm256_set1_epi8(3));
            q[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(lo, lo_shift), low4), _mm256_slli_epi16(top, 4));
        }
        return;
    }
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2)));
    q[0] = _mm256_and_si256(qs, low4);
    q[1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), low4);
    if (type == Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int h = 0; h < 2; h++) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << (j + h)));
            q[h] = _mm256_or_si256(q[h], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                           _mm256_set1_epi8(16)));
        }
    }
}

/* The int16 scales of sub-block j of one block: weights 0-15's in the low 128 bits
 * (vpmaddubsw's lanes 0-7), 16-31's in the high; sm: kscales of a Q4_K/Q5_K block. */
static inline __attribute__((always_inline)) __m256i scales8_avx2(int type, const uint8_t *blk, int j, __m128i sm) {
    if (type == Q6_K) {
        const int8_t *scs = (const int8_t *)(blk + 192);
        return _mm256_set_m128i(_mm_set1_epi16(scs[2 * j + 1]), _mm_set1_epi16(scs[2 * j]));
    }
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(sm), _mm256_set1_epi16((short)(0x8000 | j)));
}

/* -dmin * m_j of a Q4_K/Q5_K block's 8 sub-blocks (block_mins), from its kscales. */
static inline __attribute__((always_inline)) __m256 mins_avx2(const uint8_t *blk, __m128i sm) {
    return _mm256_mul_ps(_mm256_set1_ps(-f16_to_f32(blk + 2)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
}

/* acc + the pairwise products of a and b (int16 lanes), in int32 lanes. */
static inline __attribute__((always_inline)) __m256i dot16_avx2(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* One weight row times MT activation rows (codes ldc bytes apart). */
static inline __attribute__((always_inline)) void row_avx2(int type, const uint8_t *row, int64_t nsb, int64_t nb,
                                                           const int8_t *codes, int64_t ldc,
                                                           const float *dxs, const int MT, float *y, int64_t ldy) {
    __m256 acc[4];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * hr_block_bytes(type);
        const float d = block_d(type, blk);
        __m128i sm = _mm_setzero_si128();
        if (type != Q6_K) {
            sm = kscales(_mm_loadu_si128((const __m128i *)blk));
            const __m256 mv = mins_avx2(blk, sm);
            for (int i = 0; i < MT; i++) acc[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(dxs + i * nb + s * 8), acc[i]);
        }
        __m256i p[4];
        for (int i = 0; i < MT; i++) p[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
            __m256i q[2];
            unpack8_avx2(type, blk, j, q);
            for (int h = 0; h < 2; h++) {
                const __m256i s16 = scales8_avx2(type, blk, j + h, sm);
                for (int i = 0; i < MT; i++) {
                    const int8_t *ci = codes + i * ldc;
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(ci + s * 256 + (j + h) * 32));
                    __m256i v = _mm256_maddubs_epi16(q[h], a);
                    if (type == Q6_K) v = _mm256_sub_epi16(v, _mm256_maddubs_epi16(_mm256_set1_epi8(32), a));
                    const __m128i u = _mm_cvtsi32_si128(act_shift(ci, nsb * 256, s * 8 + j + h));
                    p[i] = dot16_avx2(p[i], v, _mm256_sll_epi16(s16, u));
                }
            }
        }
        for (int i = 0; i < MT; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[i]), _mm256_set1_ps(d * act_base(codes + i * ldc, nsb * 256, s)),
                                     acc[i]);
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hr_hsum8(acc[i]);
}
#endif

#ifdef HR_AVX512
enum { PAIRS = 2, TILE_M = 4 };  /* a tile: PAIRS pairs of weight rows x up to TILE_M activation rows */

/* 32 bytes at p of two rows, row_bytes apart, a 256-bit half each. */
static inline __attribute__((always_inline)) __m512i two_rows(const uint8_t *p, int64_t row_bytes) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + row_bytes)), 1);
}

static inline __attribute__((always_inline)) __m512 two_floats(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

static inline __m512i blend_odd512(__m512i even, __m512i odd) { return _mm512_mask_blend_epi32(0xAAAA, even, odd); }
KSCALES(__m512i, kscales512, _mm512_shuffle_epi32, _mm512_srlv_epi32, _mm512_and_si512, _mm512_or_si512,
        _mm512_srli_epi32, _mm512_slli_epi32, blend_odd512, _mm512_set1_epi32, _mm512_set4_epi32)

/* Two 16-byte rows of scales, each in both 128-bit lanes of its half. */
static inline __attribute__((always_inline)) __m512i two_scales(__m128i a, __m128i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(a)), _mm256_broadcastsi128_si256(b), 1);
}

/* unpack8_avx2 of two blocks row_bytes apart, a 256-bit half each. */
static inline __attribute__((always_inline)) void unpack8_pair(int type, const uint8_t *blk, int64_t row_bytes, int j,
                                                               __m512i q[2]) {
    const __m512i low4 = _mm512_set1_epi8(15);
    if (type == Q6_K) {
        const int g = j % 4;
        const __m128i lo_shift = _mm_cvtsi32_si128(4 * (g >> 1));
        const __m512i hi = two_rows(blk + 128 + 32 * (j / 4), row_bytes);
        for (int h = 0; h < 2; h++) {
            const __m512i lo = two_rows(blk + 64 * (j / 4) + 32 * h, row_bytes);
            const __m512i top = _mm512_and_si512(_mm512_srl_epi16(hi, _mm_cvtsi32_si128(2 * (g + h))),
                                                 _mm512_set1_epi8(3));
            q[h] = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi16(lo, lo_shift), low4), _mm512_slli_epi16(top, 4));
        }
        return;
    }
    const __m512i qs = two_rows(blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2), row_bytes);
    q[0] = _mm512_and_si512(qs, low4);
    q[1] = _mm512_and_si512(_mm512_srli_epi16(qs, 4), low4);
    if (type == Q5_K) {
        const __m512i qh = two_rows(blk + 16, row_bytes);
        for (int h = 0; h < 2; h++) {
            const __mmask64 set = _mm512_test_epi8_mask(qh, _mm512_set1_epi8((char)(1 << (j + h))));
            q[h] = _mm512_or_si512(q[h], _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(16)));
        }
    }
}

/* scales8_avx2 of two blocks from their two_scales (kscales, or Q6_K's 16 int8 scales). */
static inline __attribute__((always_inline)) __m512i scales8_pair(int type, __m512i z, int j) {
    if (type == Q6_K) {  /* byte 2j sign-extended in 128-bit lanes 0 and 2, byte 2j + 1 in 1 and 3 */
        const __m512i pick = _mm512_mask_blend_epi64(0xCC, _mm512_set1_epi16((short)(2 * j << 8 | 0x80)),
                                                     _mm512_set1_epi16((short)((2 * j + 1) << 8 | 0x80)));
        return _mm512_srai_epi16(_mm512_shuffle_epi8(z, pick), 8);
    }
    return _mm512_shuffle_epi8(z, _mm512_set1_epi16((short)(0x8000 | j)));
}

/* y[i * ldy + r] for 2 * NP weight rows r (w, row_bytes apart) and MT activation rows i. */
static inline __attribute__((always_inline)) void tile(int type, const uint8_t *w, int64_t row_bytes, int64_t nsb,
                                                       int64_t nb, const int8_t *codes, int64_t ldc,
                                                       const float *dxs, const int NP, const int MT, float *y,
                                                       int64_t ldy) {
    const int bb = hr_block_bytes(type);
    __m512 acc[PAIRS][TILE_M];
    for (int p = 0; p < NP; p++)
        for (int i = 0; i < MT; i++) acc[p][i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        __m512 d[PAIRS];
        __m512i z[PAIRS];
        prefetch_next(w + 2 * NP * row_bytes, 2 * NP * row_bytes, nsb, s);
        for (int p = 0; p < NP; p++) {
            const uint8_t *b0 = w + 2 * p * row_bytes + s * bb, *b1 = b0 + row_bytes;
            d[p] = two_floats(_mm256_set1_ps(block_d(type, b0)), _mm256_set1_ps(block_d(type, b1)));
            if (type == Q6_K) {
                z[p] = two_scales(_mm_loadu_si128((const __m128i *)(b0 + 192)),
                                  _mm_loadu_si128((const __m128i *)(b1 + 192)));
                continue;
            }
            z[p] = kscales512(two_scales(_mm_loadu_si128((const __m128i *)b0), _mm_loadu_si128((const __m128i *)b1)));
            /* m_0..7 of the two rows: bytes 8-15 of 128-bit lanes 0 and 2 */
            const __m128i m16 = _mm512_castsi512_si128(_mm512_permutexvar_epi64(_mm512_set_epi64(0, 0, 0, 0, 0, 0, 5, 1), z[p]));
            const __m512 dmin = two_floats(_mm256_set1_ps(-f16_to_f32(b0 + 2)), _mm256_set1_ps(-f16_to_f32(b1 + 2)));
            const __m512 mv = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m16)));
            for (int i = 0; i < MT; i++) {
                const __m256 x8 = _mm256_loadu_ps(dxs + i * nb + s * 8);
                acc[p][i] = _mm512_fmadd_ps(mv, two_floats(x8, x8), acc[p][i]);
            }
        }
        __m512i ip[PAIRS][TILE_M];
        for (int p = 0; p < NP; p++)
            for (int i = 0; i < MT; i++) ip[p][i] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
            __m512i q[PAIRS][2];
            for (int p = 0; p < NP; p++) unpack8_pair(type, w + 2 * p * row_bytes + s * bb, row_bytes, j, q[p]);
            for (int h = 0; h < 2; h++) {
                __m512i s16[PAIRS];
                for (int p = 0; p < NP; p++) s16[p] = scales8_pair(type, z[p], j + h);
                for (int i = 0; i < MT; i++) {
                    const int8_t *ci = codes + i * ldc;
                    const __m512i a = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(ci + s * 256 + (j + h) * 32)));
                    const __m512i a32 = type == Q6_K ? _mm512_maddubs_epi16(_mm512_set1_epi8(32), a) : a;
                    const __m128i u = _mm_cvtsi32_si128(act_shift(ci, nsb * 256, s * 8 + j + h));
                    for (int p = 0; p < NP; p++) {
                        __m512i v = _mm512_maddubs_epi16(q[p][h], a);
                        if (type == Q6_K) v = _mm512_sub_epi16(v, a32);
                        ip[p][i] = dot_acc(ip[p][i], v, _mm512_sll_epi16(s16[p], u));
                    }
                }
            }
        }
        for (int i = 0; i < MT; i++) {
            const __m512 f = _mm512_set1_ps(act_base(codes + i * ldc, nsb * 256, s));
            for (int p = 0; p < NP; p++)
                acc[p][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ip[p][i]), _mm512_mul_ps(d[p], f), acc[p][i]);
        }
    }
    for (int p = 0; p < NP; p++)
        for (int i = 0; i < MT; i++) {
            y[i * ldy + 2 * p] = hr_hsum8(_mm512_castps512_ps256(acc[p][i]));
            y[i * ldy + 2 * p + 1] = hr_hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p][i]), 1)));
        }
}

static inline __attribute__((always_inline)) void tiles_mt(int type, const uint8_t *w, int64_t row_bytes,
                                                           int64_t nsb, int64_t nb, const int8_t *c, int64_t ldc,
                                                           const float *dxs, const int NP, int mt,
                                                           float *y, int64_t ldy) {
    switch (mt) {
        case 4: tile(type, w, row_bytes, nsb, nb, c, ldc, dxs, NP, 4, y, ldy); break;
        case 3: tile(type, w, row_bytes, nsb, nb, c, ldc, dxs, NP, 3, y, ldy); break;
        case 2: tile(type, w, row_bytes, nsb, nb, c, ldc, dxs, NP, 2, y, ldy); break;
        default: tile(type, w, row_bytes, nsb, nb, c, ldc, dxs, NP, 1, y, ldy); break;
    }
}

/* The tile over rows n0 up to the returned row (whole pairs), the rest left to the caller. */
static inline __attribute__((always_inline)) int64_t rows512(int type, const uint8_t *w, int64_t K,
                                                             const int8_t *codes, int64_t ldc,
                                                             const float *dxs, int64_t M, int64_t n0, int64_t n1,
                                                             float *y, int64_t ldy) {
    const int64_t nsb = K / 256, nb = K / 32, row_bytes = nsb * hr_block_bytes(type);
    while (n0 + 2 <= n1) {
        const int np = n0 + 2 * PAIRS <= n1 ? PAIRS : 1;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
            const int mt = M - m0 < TILE_M ? (int)(M - m0) : TILE_M;
            const uint8_t *wt = w + n0 * row_bytes;
            if (np == PAIRS)
                tiles_mt(type, wt, row_bytes, nsb, nb, codes + m0 * ldc, ldc, dxs + m0 * nb, PAIRS, mt,
                         y + m0 * ldy + n0, ldy);
            else
                tiles_mt(type, wt, row_bytes, nsb, nb, codes + m0 * ldc, ldc, dxs + m0 * nb, 1, mt,
                         y + m0 * ldy + n0, ldy);
        }
        n0 += 2 * np;
    }
    return n0;
}
#endif

/* hr_kquant_rows on 8-bit codes (blocks.h): path HR_PATH_BEST (the AVX-512 tile where
 * the build has it, AVX2 for the rest), HR_PATH_AVX2 or HR_PATH_C; all give the same bits. */
void hr_kquant_rows8(int type, const uint8_t *w, int64_t K, const int8_t *codes, int64_t ldc,
                     const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy, int path) {
    const int64_t nsb = K / 256, nb = K / 32, row_bytes = nsb * hr_block_bytes(type);
#ifdef HR_AVX512
    if (path == HR_PATH_BEST) {
        if (type == Q4_K) n0 = rows512(Q4_K, w, K, codes, ldc, dxs, M, n0, n1, y, ldy);
        else if (type == Q5_K) n0 = rows512(Q5_K, w, K, codes, ldc, dxs, M, n0, n1, y, ldy);
        else n0 = rows512(Q6_K, w, K, codes, ldc, dxs, M, n0, n1, y, ldy);
    }
#endif
#ifdef HR_AVX2
    if (path != HR_PATH_C) {
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const uint8_t *row = w + n * row_bytes;
                const int8_t *c = codes + m0 * ldc;
                const float *ds = dxs + m0 * nb;
                float *yt = y + m0 * ldy + n;
                const int mt = M - m0 < 4 ? (int)(M - m0) : 4;
#define HR_ROW8(T)                                                                  \
    switch (mt) {                                                                   \
        case 4: row_avx2(T, row, nsb, nb, c, ldc, ds, 4, yt, ldy); break;       \
        case 3: row_avx2(T, row, nsb, nb, c, ldc, ds, 3, yt, ldy); break;       \
        case 2: row_avx2(T, row, nsb, nb, c, ldc, ds, 2, yt, ldy); break;       \
        default: row_avx2(T, row, nsb, nb, c, ldc, ds, 1, yt, ldy); break;      \
    }
                if (type == Q4_K) { HR_ROW8(Q4_K) }
                else if (type == Q5_K) { HR_ROW8(Q5_K) }
                else { HR_ROW8(Q6_K) }
#undef HR_ROW8
            }
        return;
    }
#endif
    (void)path;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t i = 0; i < M; i++)
            y[i * ldy + n] = row_scalar(type, w + n * row_bytes, nsb, codes + i * ldc, dxs + i * nb);
}
