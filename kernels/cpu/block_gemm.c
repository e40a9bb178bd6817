/* The AVX-512 tile of the Q4_0/Q4_1/Q8_0 row products (hr_legacy_rows, block_gemv.c): a
 * register-blocked GEMM of 4 or 8 weight rows times 1 to 4 activation rows, read straight
 * from the GGUF blocks, for CPUs with AVX-512 BW (and VNNI's vpdpwssd where they have it).
 *
 * The arithmetic is block_gemv.c's: per block of 32, the weights' integer codes times the
 * activations' 16-bit codes exactly in int32, the block's sum scaled by dw * dx in float32
 * (Q4_1 adds m * dx * s; Q4_0's -8 is taken into the codes, exact). What differs is the
 * layout in the registers: a 512-bit register holds 8 weights of each of 4 rows (a
 * 128-bit lane a row), and the activation row's matching 8 codes broadcast to the 4
 * lanes, so one vpdpwssd makes 32 products for 4 outputs. A block is 4 such steps into one
 * int32 register, then one conversion and one FMA by the lanes' scales (each lane's row's
 * dw times the row's dx) for the 4 rows; the lanes are summed once, after the last block.
 * Each weight block is widened to 16-bit lanes once and used for every activation row of
 * the tile. The AVX2 tile (block_gemv.c) makes 8 products an instruction and scales each
 * row's block on its own: about twice the instructions a product.
 *
 * Summation order: per lane, the 8 products of a block in int32 (exact), blocks in float32
 * (each block's int32 lane converted: |lane| <= 8 * 128 * 32767 < 2^25, within a rounding
 * of float32's 24 bits for Q8_0), then the 4 lanes of a row.
 */
#include <stdint.h>
#include <stdlib.h>

#include "blocks.h"
#include "tile512.h"

#ifdef HR_AVX512
/* A tile: HR_G groups of 4 weight rows times up to HR_MT activation rows (2 x 6 was the
 * fastest of 2 x 4, 2 x 6, 1 x 8 and 1 x 12 on 2 Zen 4 cores, by 4-8% at 16-512 rows). */
enum { HR_G = 2, HR_MT = 6 };

/* Block b of 4 weight rows (row_bytes apart) as 4 registers: q[c] holds weights 8c to
 * 8c + 7 of row r in 128-bit lane r, int16 (Q4_0's codes less 8). */
static inline __attribute__((always_inline)) void widen4(int type, const uint8_t *blk, int64_t row_bytes,
                                                         __m512i q[4]) {
    if (type == Q8_0) {
        __m256i y[4];
        for (int r = 0; r < 4; r++) y[r] = _mm256_loadu_si256((const __m256i *)(blk + r * row_bytes + 2));
        /* 64-bit pieces: piece c of rows 0-3 gathered into one register, a transpose. */
        const __m256i t0 = _mm256_unpacklo_epi64(y[0], y[1]), t1 = _mm256_unpackhi_epi64(y[0], y[1]);
        const __m256i t2 = _mm256_unpacklo_epi64(y[2], y[3]), t3 = _mm256_unpackhi_epi64(y[2], y[3]);
        q[0] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(t0, t2, 0x20));
        q[1] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(t1, t3, 0x20));
        q[2] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(t0, t2, 0x31));
        q[3] = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(t1, t3, 0x31));
        return;
    }
    /* qs[j]: weight j in the low nibble, j + 16 in the high one; bytes 0-7 of the rows
     * give weights 0-7 and 16-23, bytes 8-15 weights 8-15 and 24-31. */
    const int off = type == Q4_1 ? 4 : 2;
    __m128i x[4];
    for (int r = 0; r < 4; r++) x[r] = _mm_loadu_si128((const __m128i *)(blk + r * row_bytes + off));
    const __m256i lo = _mm256_set_m128i(_mm_unpacklo_epi64(x[2], x[3]), _mm_unpacklo_epi64(x[0], x[1]));
    const __m256i hi = _mm256_set_m128i(_mm_unpackhi_epi64(x[2], x[3]), _mm_unpackhi_epi64(x[0], x[1]));
    const __m512i a = _mm512_cvtepu8_epi16(lo), b = _mm512_cvtepu8_epi16(hi), low4 = _mm512_set1_epi16(15);
    q[0] = _mm512_and_si512(a, low4);
    q[1] = _mm512_and_si512(b, low4);
    q[2] = _mm512_srli_epi16(a, 4);
    q[3] = _mm512_srli_epi16(b, 4);
    if (type == Q4_0) {
        const __m512i eight = _mm512_set1_epi16(8);
        for (int c = 0; c < 4; c++) q[c] = _mm512_sub_epi16(q[c], eight);
    }
}

/* The 4 rows' block scales spread over their lanes: d (each row's dw in its 4 lanes) and,
 * for Q4_1, m (the row's m in the first lane of its 4, zero in the others). */
static inline __attribute__((always_inline)) void scales4(int type, const uint8_t *blk, int64_t row_bytes,
                                                          __m512 *d, __m512 *m) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    if (type == Q4_1) {
        int32_t h[4];  /* each row's {f16 d, f16 m}, put in a register (not through memory:
                        * a 16-byte load of four 4-byte stores stalls store forwarding) */
        for (int r = 0; r < 4; r++) memcpy(h + r, blk + r * row_bytes, 4);
        const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi32(h[0], h[1], h[2], h[3]));
        const __m512 wide = _mm512_castps256_ps512(dm);
        const __m512i two = _mm512_add_epi32(spread, spread);
        *d = _mm512_permutexvar_ps(two, wide);
        *m = _mm512_maskz_permutexvar_ps(0x1111, _mm512_add_epi32(two, _mm512_set1_epi32(1)), wide);
        return;
    }
    int16_t h[4];
    for (int r = 0; r < 4; r++) memcpy(h + r, blk + r * row_bytes, 2);
    const __m128i hv = _mm_setr_epi16(h[0], h[1], h[2], h[3], 0, 0, 0, 0);
    *d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(hv)));
    *m = _mm512_setzero_ps();
}

/* A block of 4 weight rows as the tile reads it: widen4's registers and scales4's. */
typedef struct {
    __m512i q[4];
    __m512 d, m;
} widened;

/* y[i * ldy + r] for G * 4 weight rows r (w, row_bytes apart) and MT activation rows i
 * (codes K apart; dx, dxs nb apart). G and MT are constants at each call (always
 * inlined), so the G * MT accumulators stay in registers. pre: the rows' blocks already
 * widened ([nb][G]), else NULL (they are widened here, for these MT rows alone). */
static inline __attribute__((always_inline)) void tile512(int type, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                          const int16_t *codes, int64_t K, const float *dx,
                                                          const float *dxs, const int G, const int MT, float *y,
                                                          int64_t ldy, const widened *pre) {
    const int bb = hr_block_bytes(type);
    __m512 acc[2][HR_MT];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < MT; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i q[2][4];
        __m512 d[2], m[2];
        for (int g = 0; g < G; g++) {
            if (pre) {
                const widened *p = pre + b * G + g;
                for (int k = 0; k < 4; k++) q[g][k] = p->q[k];
                d[g] = p->d, m[g] = p->m;
            } else {
                const uint8_t *blk = w + 4 * g * row_bytes + b * bb;
                widen4(type, blk, row_bytes, q[g]);
                scales4(type, blk, row_bytes, &d[g], &m[g]);
            }
        }
        if (!pre) prefetch_next(w + 4 * G * row_bytes, 4 * G * row_bytes, nb, b);
        for (int i = 0; i < MT; i++) {
            __m512i a[4];
            broadcast32(codes + i * K + b * 32, a);
            const __m512 sx = _mm512_set1_ps(dx[i * nb + b]);
            for (int g = 0; g < G; g++) {
                const __m512i p = dot32(q[g], a);
                acc[g][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d[g], sx), acc[g][i]);
                if (type == Q4_1) acc[g][i] = _mm512_fmadd_ps(m[g], _mm512_set1_ps(dxs[i * nb + b]), acc[g][i]);
            }
        }
    }
    /* Each row's 4 lanes summed: lane 4r then holds row r's output. */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < MT; i++) store_rows4(acc[g][i], y + i * ldy + 4 * g);
}

/* MT = 1 to HR_MT activation rows at a constant G. */
static inline __attribute__((always_inline)) void tiles_mt(int type, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                           const int16_t *c, int64_t K, const float *dx,
                                                           const float *dxs, const int G, int mt, float *y,
                                                           int64_t ldy, const widened *pre) {
    switch (mt) {
        case 6: tile512(type, w, row_bytes, nb, c, K, dx, dxs, G, 6, y, ldy, pre); break;
        case 5: tile512(type, w, row_bytes, nb, c, K, dx, dxs, G, 5, y, ldy, pre); break;
        case 4: tile512(type, w, row_bytes, nb, c, K, dx, dxs, G, 4, y, ldy, pre); break;
        case 3: tile512(type, w, row_bytes, nb, c, K, dx, dxs, G, 3, y, ldy, pre); break;
        case 2: tile512(type, w, row_bytes, nb, c, K, dx, dxs, G, 2, y, ldy, pre); break;
        default: tile512(type, w, row_bytes, nb, c, K, dx, dxs, G, 1, y, ldy, pre); break;
    }
}

/* G groups of 4 rows' blocks widened once into pre ([nb][G]), for a tile of more
 * activation rows than one pass takes: each pass then loads them. */
static inline __attribute__((always_inline)) void widen_tile(int type, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                             int G, widened *pre) {
    const int bb = hr_block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + 4 * g * row_bytes + b * bb;
            widen4(type, blk, row_bytes, pre[b * G + g].q);
            scales4(type, blk, row_bytes, &pre[b * G + g].d, &pre[b * G + g].m);
        }
        prefetch_next(w + 4 * G * row_bytes, 4 * G * row_bytes, nb, b);
    }
}

/* One type at a constant (the type's branches fold away in each copy). */
static inline __attribute__((always_inline)) int64_t rows512_of(int type, const uint8_t *w, int64_t K,
                                                                const int16_t *codes, const float *dx,
                                                                const float *dxs, int64_t M, int64_t n0, int64_t n1,
                                                                float *y, int64_t ldy) {
    const int64_t nb = K / 32, row_bytes = nb * hr_block_bytes(type);
    /* Several passes over the activation rows: the tile's blocks widened once (a tile of
     * K = 1536 takes 36 KiB); NULL where that memory is not to be had. */
    widened *pre = M > HR_MT ? aligned_alloc(64, (size_t)nb * HR_G * sizeof(widened)) : NULL;
    int64_t t0 = n0;
    for (; t0 + 4 <= n1; t0 += 4 * HR_G) {
        const int G = t0 + 4 * HR_G <= n1 ? HR_G : 1;
        const uint8_t *wt = w + t0 * row_bytes;
        if (pre) {
            if (G == 2)
                widen_tile(type, wt, row_bytes, nb, 2, pre);
            else
                widen_tile(type, wt, row_bytes, nb, 1, pre);
        }
        for (int64_t m0 = 0; m0 < M; m0 += HR_MT) {
            const int mt = M - m0 < HR_MT ? (int)(M - m0) : HR_MT;
            const int16_t *c = codes + m0 * K;
            const float *x = dx + m0 * nb, *xs = dxs + m0 * nb;
            float *yt = y + m0 * ldy + t0;
            if (G == 2 && pre)
                tiles_mt(type, wt, row_bytes, nb, c, K, x, xs, 2, mt, yt, ldy, pre);
            else if (G == 2)
                tiles_mt(type, wt, row_bytes, nb, c, K, x, xs, 2, mt, yt, ldy, NULL);
            else if (pre)
                tiles_mt(type, wt, row_bytes, nb, c, K, x, xs, 1, mt, yt, ldy, pre);
            else
                tiles_mt(type, wt, row_bytes, nb, c, K, x, xs, 1, mt, yt, ldy, NULL);
        }
        if (G == 1) {
            t0 += 4;
            break;
        }
    }
    free(pre);
    return t0;
}

int64_t hr_legacy_rows512(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                          const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    switch (type) {
        case Q4_0: return rows512_of(Q4_0, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
        case Q4_1: return rows512_of(Q4_1, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
        case Q8_0: return rows512_of(Q8_0, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
        default: return n0;
    }
}

#endif
