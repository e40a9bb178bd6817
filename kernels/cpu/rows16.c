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
#include "tile512.h"

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
            case 8: group16(type, w, nb, c, K, x, s, xs, 8, yt, ldy); break;
            case 7: group16(type, w, nb, c, K, x, s, xs, 7, yt, ldy); break;
            case 6: group16(type, w, nb, c, K, x, s, xs, 6, yt, ldy); break;
            case 5: group16(type, w, nb, c, K, x, s, xs, 5, yt, ldy); break;
            case 4: group16(type, w, nb, c, K, x, s, xs, 4, yt, ldy); break;
            case 3: group16(type, w, nb, c, K, x, s, xs, 3, yt, ldy); break;
            case 2: group16(type, w, nb, c, K, x, s, xs, 2, yt, ldy); break;
            default: group16(type, w, nb, c, K, x, s, xs, 1, yt, ldy); break;
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
    const int64_t nb = K / 32, group_bytes = 16 * nb * hr_block_bytes(type);
    if (K % 32 || n0 % 16 || n1 % 16 || (type != Q4_0 && type != Q4_1 && type != Q8_0)) return -1;
    for (int64_t g = n0 / 16; g < n1 / 16; g++) {
        const uint8_t *wg = w + g * group_bytes;
        switch (type) {  /* one copy a type: its branches fold away */
            case Q4_0: group_of(Q4_0, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
            case Q4_1: group_of(Q4_1, wg, nb, codes, K, dx, sums, dxs, M, y + 16 * g, ldy); break;
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
