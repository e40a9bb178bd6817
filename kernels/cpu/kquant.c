/* K-quant row products on the CPU: y = x . W[n] with W in Q4_K, Q5_K or Q6_K blocks.
 *
 * Called by hr_block_gemv (block_gemv.c) and hr_moe_experts (moe_experts.c) through
 * hr_rows (blocks.h), on activation rows quantized as for the other types: per block of
 * 32, int16 codes c = round(x / dx), dx = max|x| / 32767 (hr_quantize_row). 16-bit codes
 * rather than llama.cpp's 8-bit q8_K: a quantized activation is within dx / 2 of x, so a
 * block's product moves by at most (max|x| / 65534) * sum|w| (8-bit codes: 258 times
 * that, which moved a small model's projections by about 1%, block_gemv.c). The price is
 * 16-bit multiplies (vpmaddwd: 16 products an instruction on AVX2, 32 on AVX-512) and
 * widening each sub-block to int16: on 2 Zen 4 cores a 6-layer Qwen3-30B-A3B-shape
 * Q4_K_M file decoded at 17.4 tokens/s (batch 1), its experts at 9.7 GB/s a core.
 * kquant8.c is the 8-bit alternative (the cpu_kquant_act_bits switch, 16 by default):
 * byte products summed in int32 over a super-block, 28.9 tokens/s and 14.6 GB/s a core
 * on the same file, logits moved by 1-9% of the largest on random test models
 * (docs/benchmarks.md, issue 34's CPU subsection; docs/cpu.md).
 *
 * Block layouts (ggml-common.h; gguf.quants decodes the same), 256 weights a block:
 *   Q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}        144 bytes
 *   Q5_K {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]} 176 bytes
 *   Q6_K {u8 ql[128]; u8 qh[64]; s8 scales[16]; f16 d}         210 bytes
 * Q4_K/Q5_K: 8 sub-blocks of 32, w = d * sc_j * q - dmin * m_j with 6-bit sc_j, m_j
 * packed in scales[12]; sub-block j takes the low (j even) or high (j odd) nibbles of
 * qs[32 (j / 2) ...], and Q5_K adds bit j of qh[l] as 16. Q6_K: 16 sub-blocks of 16,
 * w = d * sc_k * (q - 32), q's low 4 bits from ql and high 2 from qh.
 *
 * A sub-block of 32 (Q6_K: two of 16) meets one activation block b, so its product is
 *
 *     dx_b * d * (u . c_b) - dmin * m_j * dx_b * s_b,   u = sc_j q  (Q6_K: sc_k (q - 32))
 *
 * with u . c_b exact in int32 (|u| <= 4096, |c| <= 32767, 32 terms: below 2**31), and the
 * sum over sub-blocks accumulated in float32. Three builds of the same arithmetic, chosen
 * by the compiler's target: AVX-512 BW (the register-blocked tile of kquant_gemm.c over
 * whole groups of 4 weight rows; the AVX2 loop below takes the rest), AVX2 (one weight
 * row at a time, vpdpwssd on 256-bit lanes where AVX512-VNNI has it; an AVX-512 build
 * keeps it for HR_PATH_AVX2) and plain C, also called on any machine (scalar = HR_PATH_C)
 * so the tests check the vector ones against it.
 */
#include <stdint.h>
#include <string.h>

#include "blocks.h"

/* Sub-block j (weights 32 j ... 32 j + 31) of a block as u (above): the integers, the
 * float factor d and the offset per unit of dx * s (-dmin * m_j, or 0). */
static void unpack_scalar(int type, const uint8_t *blk, int j, int16_t *u, float *d, float *off) {
    if (type == Q6_K) {
        const uint8_t *ql = blk + 64 * (j / 4), *qh = blk + 128 + 32 * (j / 4);
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * (j / 4);
        const int g = j % 4;
        for (int l = 0; l < 32; l++) {
            const int q = ((ql[l + 32 * (g & 1)] >> (4 * (g >> 1))) & 15) | (((qh[l] >> (2 * g)) & 3) << 4);
            u[l] = (int16_t)((q - 32) * sc[2 * g + l / 16]);
        }
        *d = f16_to_f32(blk + 208);
        *off = 0.0f;
        return;
    }
    int sc, m;
    hr_scale_min(blk + 4, j, &sc, &m);
    const uint8_t *qs = blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2);
    for (int l = 0; l < 32; l++) {
        int q = (qs[l] >> (4 * (j & 1))) & 15;
        if (type == Q5_K) q |= ((blk[16 + l] >> j) & 1) << 4;
        u[l] = (int16_t)(q * sc);
    }
    *d = f16_to_f32(blk);
    *off = -f16_to_f32(blk + 2) * (float)m;
}

static void rows_scalar(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                        const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t nsb = K / 256, nb = K / 32, row_bytes = nsb * hr_block_bytes(type);
    int16_t u[32];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t i = 0; i < M; i++) y[i * ldy + n] = 0.0f;
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *blk = w + n * row_bytes + s * hr_block_bytes(type);
            for (int j = 0; j < 8; j++) {
                float d, off;
                unpack_scalar(type, blk, j, u, &d, &off);
                const int64_t b = s * 8 + j;
                for (int64_t i = 0; i < M; i++) {
                    const int16_t *c = codes + i * K + b * 32;
                    int32_t dot = 0;
                    for (int l = 0; l < 32; l++) dot += u[l] * c[l];
                    y[i * ldy + n] += d * dx[i * nb + b] * (float)dot + off * dxs[i * nb + b];
                }
            }
        }
    }
}

/* One row of K / 256 blocks as float32, in gguf's order of operations (its dequantizers:
 * Q4_K/Q5_K (d sc_j) q - (dmin m_j), Q6_K (d sc_k) (q - 32)). */
void hr_kquant_dequantize_row(int type, const uint8_t *row, int64_t K, float *out) {
    for (int64_t s = 0; s < K / 256; s++) {
        const uint8_t *blk = row + s * hr_block_bytes(type);
        for (int j = 0; j < 8; j++) {
            float *o = out + s * 256 + 32 * j;
            if (type == Q6_K) {
                const uint8_t *ql = blk + 64 * (j / 4), *qh = blk + 128 + 32 * (j / 4);
                const int8_t *sc = (const int8_t *)(blk + 192) + 8 * (j / 4);
                const float d = f16_to_f32(blk + 208);
                const int g = j % 4;
                for (int l = 0; l < 32; l++) {
                    const int q = ((ql[l + 32 * (g & 1)] >> (4 * (g >> 1))) & 15) | (((qh[l] >> (2 * g)) & 3) << 4);
                    o[l] = (d * (float)sc[2 * g + l / 16]) * (float)(q - 32);
                }
                continue;
            }
            int sc, m;
            hr_scale_min(blk + 4, j, &sc, &m);
            const float d = f16_to_f32(blk) * (float)sc, dm = f16_to_f32(blk + 2) * (float)m;
            const uint8_t *qs = blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2);
            for (int l = 0; l < 32; l++) {
                int q = (qs[l] >> (4 * (j & 1))) & 15;
                if (type == Q5_K) q |= ((blk[16 + l] >> j) & 1) << 4;
                o[l] = d * (float)q - dm;
            }
        }
    }
}

#ifdef HR_AVX2
/* Sub-block j as u in two vectors of 16 int16 lanes (weights 0-15, 16-31); sc: its
 * scale (Q4_K/Q5_K, decoded once a block by the caller). */
static inline __attribute__((always_inline)) void unpack_avx2(int type, const uint8_t *blk, int j, int sc,
                                                              __m256i *u0, __m256i *u1) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i q;
    if (type == Q6_K) {
        const uint8_t *ql = blk + 64 * (j / 4), *qh = blk + 128 + 32 * (j / 4);
        const int8_t *scs = (const int8_t *)(blk + 192) + 8 * (j / 4);
        const int g = j % 4;
        (void)sc;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(ql + 32 * (g & 1)));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)qh);
        q = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(lo, 4) : lo, low4);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
        q = _mm256_or_si256(q, _mm256_slli_epi16(top, 4));
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));  /* q - 32 in [-32, 31] */
        *u0 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(scs[2 * g]));
        *u1 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)),
                                 _mm256_set1_epi16(scs[2 * g + 1]));
        return;
    }
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (type == Q5_K ? 48 : 16) + 32 * (j / 2)));
    q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(qs, 4) : qs, low4);
    if (type == Q5_K) {
        const __m256i bit = _mm256_set1_epi8((char)(1 << j));
        const __m256i qh = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(blk + 16)), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(qh, bit), _mm256_set1_epi8(16)));
    }
    const __m256i s16 = _mm256_set1_epi16((short)sc);
    *u0 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), s16);
    *u1 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), s16);
}

/* One weight row times MT activation rows (a constant at each call, so the accumulators
 * stay in registers): each sub-block is unpacked once for the MT rows. */
static inline __attribute__((always_inline)) void row_avx2(int type, const uint8_t *row, int64_t nsb, int64_t K,
                                                           const int16_t *codes, const float *dx, const float *dxs,
                                                           const int MT, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    __m256 acc[4];
    float offs[4];
    for (int i = 0; i < MT; i++) { acc[i] = _mm256_setzero_ps(); offs[i] = 0.0f; }
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * hr_block_bytes(type);
        int sc[8] = {0}, mn[8] = {0};
        float d, dmin = 0.0f;
        if (type == Q6_K) {
            d = f16_to_f32(blk + 208);
        } else {
            d = f16_to_f32(blk);
            dmin = -f16_to_f32(blk + 2);
            for (int j = 0; j < 8; j++) hr_scale_min(blk + 4, j, &sc[j], &mn[j]);
        }
        for (int j = 0; j < 8; j++) {
            __m256i u0, u1;
            unpack_avx2(type, blk, j, sc[j], &u0, &u1);
            const float off = dmin * (float)mn[j];
            const int64_t b = s * 8 + j;
            for (int i = 0; i < MT; i++) {
                const int16_t *c = codes + i * K + b * 32;
                __m256i p;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                p = _mm256_dpwssd_epi32(_mm256_madd_epi16(u0, _mm256_loadu_si256((const __m256i *)c)), u1,
                                        _mm256_loadu_si256((const __m256i *)(c + 16)));
#else
                p = _mm256_add_epi32(_mm256_madd_epi16(u0, _mm256_loadu_si256((const __m256i *)c)),
                                     _mm256_madd_epi16(u1, _mm256_loadu_si256((const __m256i *)(c + 16))));
#endif
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[i * nb + b]), acc[i]);
                offs[i] += off * dxs[i * nb + b];
            }
        }
    }
    for (int i = 0; i < MT; i++) y[i * ldy] = hr_hsum8(acc[i]) + offs[i];
}

static inline __attribute__((always_inline)) void row_avx2_types(int type, const uint8_t *row, int64_t nsb,
                                                                 int64_t K, const int16_t *c, const float *d,
                                                                 const float *ds, int mt, float *y, int64_t ldy) {
    switch (mt) {
        case 4: row_avx2(type, row, nsb, K, c, d, ds, 4, y, ldy); break;
        case 3: row_avx2(type, row, nsb, K, c, d, ds, 3, y, ldy); break;
        case 2: row_avx2(type, row, nsb, K, c, d, ds, 2, y, ldy); break;
        default: row_avx2(type, row, nsb, K, c, d, ds, 1, y, ldy); break;
    }
}
#endif

void hr_kquant_rows(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                    const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy, int scalar) {
#ifdef HR_AVX512
    if (scalar == HR_PATH_BEST) n0 = hr_kquant_rows512(type, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
#endif
#ifdef HR_AVX2
    if (scalar != HR_PATH_C) {
        const int64_t nsb = K / 256, nb = K / 32, row_bytes = nsb * hr_block_bytes(type);
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = w + n * row_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int16_t *c = codes + m0 * K;
                const float *d = dx + m0 * nb, *ds = dxs + m0 * nb;
                float *yt = y + m0 * ldy + n;
                const int mt = M - m0 < 4 ? (int)(M - m0) : 4;
                /* constant type and MT per call: branches and accumulators compiled away */
                if (type == Q4_K) row_avx2_types(Q4_K, row, nsb, K, c, d, ds, mt, yt, ldy);
                else if (type == Q5_K) row_avx2_types(Q5_K, row, nsb, K, c, d, ds, mt, yt, ldy);
                else row_avx2_types(Q6_K, row, nsb, K, c, d, ds, mt, yt, ldy);
            }
        }
        return;
    }
#endif
    (void)scalar;
    rows_scalar(type, w, K, codes, dx, dxs, M, n0, n1, y, ldy);
}
