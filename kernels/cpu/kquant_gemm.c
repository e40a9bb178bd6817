/* The AVX-512 tile of the K-quant row products (hr_kquant_rows, kquant.c): a
 * register-blocked GEMM of 4 or 8 weight rows of Q4_K, Q5_K or Q6_K blocks times 1 to 6
 * activation rows, read straight from the GGUF blocks, for CPUs with AVX-512 BW (and
 * VNNI's vpdpwssd where they have it): block_gemm.c's technique (tile512.h) on kquant.c's
 * arithmetic.
 *
 * The arithmetic is kquant.c's: a sub-block of 32 weights as the integers u = sc_j q
 * (Q6_K: sc_k (q - 32), a scale a 16), u . c_b exact in int32 against the activation
 * block's 16-bit codes, scaled by d * dx_b in float32; Q4_K/Q5_K add -dmin m_j dx_b s_b.
 * What differs is the layout: a 512-bit register holds 8 of a sub-block's u of each of 4
 * rows (a 128-bit lane a row), so one vpdpwssd makes 32 products for 4 outputs and a
 * sub-block is 4 of them, one conversion and one FMA for the 4 rows. A super-block's
 * header (d, dmin, the 12 bytes of 6-bit scales and mins) is decoded for the 4 rows at
 * once, in their lanes; its mins enter as 2 FMAs a super-block (m_0..3 and m_4..7 against
 * dx_b s_b of the 4 sub-blocks each, a lane each) rather than one a sub-block.
 *
 * Summation order: per lane, the 8 products of a sub-block in int32 (exact: |u| <= 4064,
 * 8 x 4064 x 32767 < 2^31), sub-blocks and mins in float32 per lane, then the 4 lanes of
 * a row.
 */
#include <stdint.h>
#include <stdlib.h>

#include "blocks.h"
#include "tile512.h"

#ifdef HR_AVX512
enum { KQ_G = 2, KQ_MT = 6 };  /* a tile: KQ_G groups of 4 weight rows x up to KQ_MT activation rows */

/* A super-block of 4 weight rows, decoded: d of each row in its 4 lanes; the rows' scales
 * as bytes (Q4_K/Q5_K: sc_0..7 then m_0..7 in each 128-bit lane; Q6_K: the 16 int8
 * scales); Q4_K/Q5_K's -dmin m_t (lo) and -dmin m_4+t (hi) in lane t of the row's 4. */
typedef struct {
    __m512 d, mlo, mhi;
    __m512i sc;
} header4;

/* 16 bytes at off of each of the 4 rows (row_bytes apart), row r in 128-bit lane r. */
static inline __attribute__((always_inline)) __m512i lanes16(const uint8_t *p, int64_t row_bytes) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + row_bytes)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * row_bytes)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * row_bytes)), 3);
}

/* The f16 in the low half of 32-bit lane 4r of v, as float32 in lanes 4r to 4r + 3. */
static inline __attribute__((always_inline)) __m512 spread_f16(__m512i v) {
    const __m512i first = _mm512_set_epi32(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(first, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
}

static inline __attribute__((always_inline)) void header_of(int type, const uint8_t *blk, int64_t row_bytes,
                                                            header4 *h) {
    if (type == Q6_K) {
        h->sc = lanes16(blk + 192, row_bytes);
        const __m512i dq = lanes16(blk + 194, row_bytes);  /* d at bytes 14-15 of each lane */
        h->d = spread_f16(_mm512_srli_epi32(_mm512_shuffle_epi32(dq, _MM_PERM_DDDD), 16));
        h->mlo = h->mhi = _mm512_setzero_ps();
        return;
    }
    /* Bytes 0-3: f16 d and dmin; 4-15: the scales, as ggml's get_scale_min_k4 reads them,
     * rearranged (its utmp steps, a 32-bit word a lane) to sc_0..7, m_0..7. */
    const __m512i v = lanes16(blk, row_bytes);
    h->d = spread_f16(v);
    const __m512 dmin = spread_f16(_mm512_srli_epi32(v, 16));
    const __m512i a = _mm512_srlv_epi32(_mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(3, 2, 3, 1)),
                                        _mm512_set4_epi32(4, 0, 0, 0));
    const __m512i b = _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(2, 2, 1, 1));
    const __m512i k1 = _mm512_set1_epi32(0x3f3f3f3f), k2 = _mm512_set1_epi32(0x0f0f0f0f);
    const __m512i k3 = _mm512_set1_epi32(0x03030303);
    const __m512i odd = _mm512_or_si512(_mm512_and_si512(a, k2),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 6), k3), 4));
    h->sc = _mm512_mask_blend_epi32(0xAAAA, _mm512_and_si512(a, k1), odd);
    const __m512i lo = _mm512_set4_epi32((int)0x8080800b, (int)0x8080800a, (int)0x80808009, (int)0x80808008);
    const __m512i hi = _mm512_set4_epi32((int)0x8080800f, (int)0x8080800e, (int)0x8080800d, (int)0x8080800c);
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), dmin);
    h->mlo = _mm512_mul_ps(neg, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(h->sc, lo)));
    h->mhi = _mm512_mul_ps(neg, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(h->sc, hi)));
}

/* 32 bytes at p of each of 4 rows, transposed: t[k] holds bytes 8k to 8k + 7 of row r at
 * its 64-bit piece r. */
static inline __attribute__((always_inline)) void pieces(const uint8_t *p, int64_t row_bytes, __m256i t[4]) {
    __m256i y[4];
    for (int r = 0; r < 4; r++) y[r] = _mm256_loadu_si256((const __m256i *)(p + r * row_bytes));
    const __m256i t0 = _mm256_unpacklo_epi64(y[0], y[1]), t1 = _mm256_unpackhi_epi64(y[0], y[1]);
    const __m256i t2 = _mm256_unpacklo_epi64(y[2], y[3]), t3 = _mm256_unpackhi_epi64(y[2], y[3]);
    t[0] = _mm256_permute2x128_si256(t0, t2, 0x20);
    t[1] = _mm256_permute2x128_si256(t1, t3, 0x20);
    t[2] = _mm256_permute2x128_si256(t0, t2, 0x31);
    t[3] = _mm256_permute2x128_si256(t1, t3, 0x31);
}

/* Byte j of each 128-bit lane of v as int16 lanes: zero-extended, or sign-extended. */
static inline __attribute__((always_inline)) __m512i byte_u16(__m512i v, int j) {
    return _mm512_shuffle_epi8(v, _mm512_set1_epi16((short)(0x8000 | j)));
}
static inline __attribute__((always_inline)) __m512i byte_s16(__m512i v, int j) {
    return _mm512_srai_epi16(_mm512_shuffle_epi8(v, _mm512_set1_epi16((short)(j << 8 | 0x80))), 8);
}

/* Sub-block j (weights 32 j to 32 j + 31) of 4 rows' super-block as u: q[k] holds u of
 * weights 8k to 8k + 7 of row r in 128-bit lane r. */
static inline __attribute__((always_inline)) void widen_sub(int type, const uint8_t *blk, int64_t row_bytes, int j,
                                                            const header4 *h, __m512i q[4]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i t[4];
    if (type == Q6_K) {
        const int g = j % 4;
        __m256i hb[4];
        pieces(blk + 64 * (j / 4) + 32 * (g & 1), row_bytes, t);
        pieces(blk + 128 + 32 * (j / 4), row_bytes, hb);
        const __m128i lo_shift = _mm_cvtsi32_si128(4 * (g >> 1)), hi_shift = _mm_cvtsi32_si128(2 * g);
        const __m512i s0 = byte_s16(h->sc, 2 * j), s1 = byte_s16(h->sc, 2 * j + 1);
        for (int k = 0; k < 4; k++) {
            const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(t[k], lo_shift), low4);
            const __m256i top = _mm256_and_si256(_mm256_srl_epi16(hb[k], hi_shift), _mm256_set1_epi8(3));
            const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(top, 4)), _mm256_set1_epi8(32));
            q[k] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(v), k < 2 ? s0 : s1);
        }
        return;
    }
    pieces(blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2), row_bytes, t);
    __m256i hb[4];
    if (type == Q5_K) pieces(blk + 16, row_bytes, hb);
    const __m512i s = byte_u16(h->sc, j);
    for (int k = 0; k < 4; k++) {
        __m256i v = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(t[k], 4) : t[k], low4);
        if (type == Q5_K) {
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hb[k], j), _mm256_set1_epi8(1));
            v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
        }
        q[k] = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(v), s);
    }
}

/* A sub-block of 4 rows widened (widen_sub's q), kept for the passes of a tile of many
 * activation rows. */
typedef struct {
    __m512i q[4];
} kwide;

/* y[i * ldy + r] for G * 4 weight rows r (w, row_bytes apart) and MT activation rows i
 * (codes K apart; dx, dxs K / 32 apart). G, MT and type are constants at each call. pre,
 * hpre: the rows' sub-blocks ([nsb][8][G]) and headers ([nsb][G]) already widened and
 * decoded, else NULL (done here, for these MT rows alone). */
static inline __attribute__((always_inline)) void ktile(int type, const uint8_t *w, int64_t row_bytes, int64_t nsb,
                                                        const int16_t *codes, int64_t K, const float *dx,
                                                        const float *dxs, const int G, const int MT, float *y,
                                                        int64_t ldy, const kwide *pre, const header4 *hpre) {
    const int bb = hr_block_bytes(type);
    const int64_t nb = K / 32;
    __m512 acc[KQ_G][KQ_MT];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < MT; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        header4 h[KQ_G];
        for (int g = 0; g < G; g++) {
            if (hpre) h[g] = hpre[s * G + g];
            else header_of(type, w + 4 * g * row_bytes + s * bb, row_bytes, &h[g]);
        }
        if (!pre) prefetch_next(w + 4 * G * row_bytes, 4 * G * row_bytes, nsb, s);
        if (type != Q6_K)
            for (int i = 0; i < MT; i++) {
                const __m512 lo = _mm512_broadcast_f32x4(_mm_loadu_ps(dxs + i * nb + s * 8));
                const __m512 hi = _mm512_broadcast_f32x4(_mm_loadu_ps(dxs + i * nb + s * 8 + 4));
                for (int g = 0; g < G; g++)
                    acc[g][i] = _mm512_fmadd_ps(h[g].mhi, hi, _mm512_fmadd_ps(h[g].mlo, lo, acc[g][i]));
            }
        for (int j = 0; j < 8; j++) {
            __m512i q[KQ_G][4];
            for (int g = 0; g < G; g++) {
                if (pre) {
                    for (int k = 0; k < 4; k++) q[g][k] = pre[(s * 8 + j) * G + g].q[k];
                } else {
                    widen_sub(type, w + 4 * g * row_bytes + s * bb, row_bytes, j, &h[g], q[g]);
                }
            }
            const int64_t b = s * 8 + j;
            for (int i = 0; i < MT; i++) {
                __m512i a[4];
                broadcast32(codes + i * K + b * 32, a);
                const __m512 sx = _mm512_set1_ps(dx[i * nb + b]);
                for (int g = 0; g < G; g++)
                    acc[g][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot32(q[g], a)), _mm512_mul_ps(h[g].d, sx),
                                                acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < MT; i++) store_rows4(acc[g][i], y + i * ldy + 4 * g);
}

static inline __attribute__((always_inline)) void ktiles_mt(int type, const uint8_t *w, int64_t row_bytes,
                                                            int64_t nsb, const int16_t *c, int64_t K, const float *dx,
                                                            const float *dxs, const int G, int mt, float *y,
                                                            int64_t ldy, const kwide *pre, const header4 *hpre) {
    switch (mt) {
        case 6: ktile(type, w, row_bytes, nsb, c, K, dx, dxs, G, 6, y, ldy, pre, hpre); break;
        case 5: ktile(type, w, row_bytes, nsb, c, K, dx, dxs, G, 5, y, ldy, pre, hpre); break;
        case 4: ktile(type, w, row_bytes, nsb, c, K, dx, dxs, G, 4, y, ldy, pre, hpre); break;
        case 3: ktile(type, w, row_bytes, nsb, c, K, dx, dxs, G, 3, y, ldy, pre, hpre); break;
        case 2: ktile(type, w, row_bytes, nsb, c, K, dx, dxs, G, 2, y, ldy, pre, hpre); break;
        default: ktile(type, w, row_bytes, nsb, c, K, dx, dxs, G, 1, y, ldy, pre, hpre); break;
    }
}

/* G groups of 4 rows' super-blocks decoded and widened once into hpre ([nsb][G]) and pre
 * ([nsb][8][G]), for a tile of more activation rows than one pass takes (block_gemm.c's
 * widen_tile): each pass then loads them instead of widening again. */
static inline __attribute__((always_inline)) void widen_ktile(int type, const uint8_t *w, int64_t row_bytes,
                                                              int64_t nsb, int G, kwide *pre, header4 *hpre) {
    const int bb = hr_block_bytes(type);
    for (int64_t s = 0; s < nsb; s++) {
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + 4 * g * row_bytes + s * bb;
            header_of(type, blk, row_bytes, &hpre[s * G + g]);
            for (int j = 0; j < 8; j++) widen_sub(type, blk, row_bytes, j, &hpre[s * G + g], pre[(s * 8 + j) * G + g].q);
        }
        prefetch_next(w + 4 * G * row_bytes, 4 * G * row_bytes, nsb, s);
    }
}

static inline __attribute__((always_inline)) int64_t krows_of(int type, const uint8_t *w, int64_t K,
                                                              const int16_t *codes, const float *dx, const float *dxs,
                                                              int64_t M, int64_t n0, int64_t n1, float *y,
                                                              int64_t ldy) {
    const int64_t nsb = K / 256, nb = K / 32, row_bytes = nsb * hr_block_bytes(type);
    /* Several passes over the activation rows: the tile's sub-blocks widened once (K =
     * 1536 takes 24 KiB for 8 rows); NULL where that memory is not to be had. */
    kwide *pre = M > KQ_MT ? aligned_alloc(64, (size_t)nsb * 8 * KQ_G * sizeof(kwide)) : NULL;
    header4 *hpre = pre ? aligned_alloc(64, (size_t)nsb * KQ_G * sizeof(header4)) : NULL;
    if (!hpre) {
        free(pre);
        pre = NULL;
    }
    int64_t t0 = n0;
    while (t0 + 4 <= n1) {
        const int G = t0 + 4 * KQ_G <= n1 ? KQ_G : 1;
        const uint8_t *wt = w + t0 * row_bytes;
        if (pre) {
            if (G == KQ_G) widen_ktile(type, wt, row_bytes, nsb, KQ_G, pre, hpre);
            else widen_ktile(type, wt, row_bytes, nsb, 1, pre, hpre);
        }
        for (int64_t m0 = 0; m0 < M; m0 += KQ_MT) {
            const int mt = M - m0 < KQ_MT ? (int)(M - m0) : KQ_MT;
            const int16_t *c = codes + m0 * K;
            const float *x = dx + m0 * nb, *xs = dxs + m0 * nb;
            float *yt = y + m0 * ldy + t0;
            if (G == KQ_G && pre)
                ktiles_mt(type, wt, row_bytes, nsb, c, K, x, xs, KQ_G, mt, yt, ldy, pre, hpre);
            else if (G == KQ_G)
                ktiles_mt(type, wt, row_bytes, nsb, c, K, x, xs, KQ_G, mt, yt, ldy, NULL, NULL);
            else if (pre)
                ktiles_mt(type, wt, row_bytes, nsb, c, K, x, xs, 1, mt, yt, ldy, pre, hpre);
            else
                ktiles_mt(type, wt, row_bytes, nsb, c, K, x, xs, 1, mt, yt, ldy, NULL, NULL);
        }
        t0 += 4 * G;
    }
    free(pre);
    free(hpre);
    return t0;
}

int64_t hr_kquant_rows512(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                          const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    switch (type) {
        case Q4_K: return krows_of(Q4_K, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
        case Q5_K: return krows_of(Q5_K, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
        case Q6_K: return krows_of(Q6_K, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
        default: return n0;
    }
}
#endif
