/* GGUF-block GEMV on the CPU: y = x @ W.T with W kept in its file's blocks.
 *
 * Built at first use by kernels/cpu/build.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; kernels/cpu/block_gemv.py holds the torch reference of the same
 * arithmetic and the Python entry point.
 *
 * Each activation row is quantized per block of 32 to int16 codes c with a float32 scale
 * dx = max|x| / 32767 and the codes' sum s; a weight block is w = dw * u + mw (Q4_1),
 * dw * (u - 8) (Q4_0) or dw * q (Q8_0), so one block's product is exact integer
 * arithmetic,
 *
 *     Q4_1: dw dx (u . c) + mw dx s      Q4_0: dw dx (u . c - 8 s)      Q8_0: dw dx (q . c)
 *
 * and the row's sum of those over blocks is accumulated in float32. This is llama.cpp's
 * scheme for these types (ggml-cpu's vec_dot_q4_1_q8_1 and kin) with 16-bit codes where
 * it takes 8: a small model's activations have blocks whose largest value is 30 times
 * their mean, and 8-bit codes moved each projection by about 1% (the default model's
 * greedy answers then left the float32 reference's on its first token); 16-bit codes
 * move it by about 2**-15 of a block's largest value.
 *
 * Block layouts (ggml-common.h): Q4_0 {f16 d; u8 qs[16]} 18 bytes, Q4_1 {f16 d; f16 m;
 * u8 qs[16]} 20 bytes, Q8_0 {f16 d; s8 qs[32]} 34 bytes; qs[j] holds weight j in its low
 * nibble and weight j + 16 in its high one.
 *
 * Three builds of the inner product, chosen by the compiler's target: AVX-512 BW (the
 * register-blocked tile of block_gemm.c, vpdpwssd where AVX512-VNNI has it), AVX2
 * (vpmaddwd on 16-bit lanes, vpdpwssd where AVX-VNNI or AVX512-VNNI has it; an AVX-512
 * build keeps it for HR_PATH_AVX2) and plain C, which the tests also call on any machine
 * (scalar = HR_PATH_C) to check the vector ones against it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "blocks.h"

static int block_bytes(int type) { return hr_block_bytes(type); }

int hr_simd_level(void) {
#if defined(HR_AVX512)
    return 2;
#elif defined(HR_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Largest |x| of a block of 32 and whether all 32 are finite (maxps keeps its second
 * operand for a NaN first, as fmaxf keeps the number). */
static inline float block_max(const float *xb, int *finite) {
#ifdef HR_AVX512
    const __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xb)), a1 = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
    const __m512 inf = _mm512_set1_ps(INFINITY);
    *finite &= (_mm512_cmp_ps_mask(a0, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a1, inf, _CMP_LT_OQ)) == 0xffff;
    return _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(xb[j]);
        *finite &= isfinite(a) != 0;
        amax = fmaxf(amax, a);
    }
    return amax;
#endif
}

/* Codes round(x * id) of a block of 32 (round half to even; |x * id| <= limit up to
 * rounding, clamped so the conversion is always defined), their sum returned. */
static inline __attribute__((always_inline)) int32_t block_codes(const float *xb, float id, float limit, int bits,
                                                                 void *out) {
#ifdef HR_AVX512
    /* 16 lanes at a time: a block's scalar loop took about 90 ns */
    const __m512 lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit), vi = _mm512_set1_ps(id);
    const int rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb), vi), rne), nlim), lim);
    const __m512 r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), vi), rne), nlim), lim);
    const __m512i i0 = _mm512_cvttps_epi32(r0), i1 = _mm512_cvttps_epi32(r1);
    if (bits == 8) {
        _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)out + 1, _mm512_cvtepi32_epi8(i1));
    } else {
        _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(i0));
        _mm256_storeu_si256((__m256i *)out + 1, _mm512_cvtepi32_epi16(i1));
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
    int32_t s = 0;
    for (int j = 0; j < 32; j++) {
        const float c = fminf(fmaxf(nearbyintf(xb[j] * id), -limit), limit);
        if (bits == 8)
            ((int8_t *)out)[j] = (int8_t)c;
        else
            ((int16_t *)out)[j] = (int16_t)c;
        s += (int32_t)c;
    }
    return s;
#endif
}

/* Quantize one row of K floats into codes of `bits` bits (blocks.h: hr_quantize_row,
 * hr_quantize_row8). 16: dx = max|x| / 32767 per block of 32. 8: per group of 256,
 * D = max|x| / 127 and each block's dx = D / 2^k, k the largest of 0..6 with
 * 2^k max|x_block| <= max|x_group|; the shifts 6 - k and D / 64 follow the codes. A block
 * (group) holding a NaN or an infinity gets a NaN scale (and zero codes), so the
 * products it enters are NaN, as in float arithmetic; one too small for its scale's
 * reciprocal (below about 1e-34) gets zero codes. */
static inline __attribute__((always_inline)) void quantize_row_as(const float *x, int64_t K, void *codes,
                                                                  float *scales, int32_t *sums, const int bits) {
    const float limit = bits == 8 ? 127.0f : 32767.0f;
    const int per = bits == 8 ? 8 : 1;  /* blocks of 32 a group */
    for (int64_t g = 0; g < K / (32 * per); g++) {
        float bmax[8], gmax = 0.0f;
        int finite = 1;
        for (int i = 0; i < per; i++) {
            bmax[i] = block_max(x + (g * per + i) * 32, &finite);
            gmax = fmaxf(gmax, bmax[i]);
        }
        float d = gmax / limit, id = d != 0.0f ? 1.0f / d : 0.0f;
        if (!isfinite(id)) id = 0.0f;
        if (!finite) d = NAN, id = 0.0f;
        for (int i = 0; i < per; i++) {
            const int64_t b = g * per + i;
            int k = bits == 8 ? 6 : 0;
            while (k > 0 && bmax[i] * (float)(1 << k) > gmax) k--;
            float idb = id * (float)(1 << k);
            if (!isfinite(idb)) idb = 0.0f;
            void *out = bits == 8 ? (void *)((int8_t *)codes + b * 32) : (void *)((int16_t *)codes + b * 32);
            sums[b] = block_codes(x + b * 32, idb, limit, bits, out);
            scales[b] = d * (1.0f / (float)(1 << k));
            if (bits == 8) ((uint8_t *)codes)[K + b] = (uint8_t)(6 - k);
        }
        if (bits == 8) {
            const float e = d * (1.0f / 64.0f);
            memcpy((uint8_t *)codes + K + K / 32 + 4 * g, &e, 4);
        }
    }
}

void hr_quantize_row(const float *x, int64_t K, int16_t *codes, float *scales, int32_t *sums) {
    quantize_row_as(x, K, codes, scales, sums, 16);
}

void hr_quantize_row8(const float *x, int64_t K, int8_t *codes, float *scales, int32_t *sums) {
    quantize_row_as(x, K, codes, scales, sums, 8);
}

/* One output: row w (nb blocks of type) times one quantized activation row. */
static float dot_scalar(int type, const uint8_t *w, const int16_t *c, const float *dx, const int32_t *sx, int64_t nb) {
    const int bb = block_bytes(type);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const int16_t *cb = c + b * 32;
        const float dw = f16_to_f32(blk);
        int32_t dot = 0;
        if (type == Q8_0) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; j++) dot += q[j] * cb[j];
            acc += dw * dx[b] * (float)dot;
        } else {
            const uint8_t *qs = blk + (type == Q4_1 ? 4 : 2);
            for (int j = 0; j < 16; j++) dot += (qs[j] & 15) * cb[j] + (qs[j] >> 4) * cb[j + 16];
            if (type == Q4_1) {
                acc += dw * dx[b] * (float)dot + f16_to_f32(blk + 2) * dx[b] * (float)sx[b];
            } else {
                acc += dw * dx[b] * (float)(dot - 8 * sx[b]);
            }
        }
    }
    return acc;
}

#ifdef HR_AVX2
/* 8 int32 lanes of a . b + c . d over 16-bit lanes (pairs of products summed). */
static inline __m256i dot_i16(__m256i a, __m256i b, __m256i c, __m256i d) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(a, b), c, d);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(a, b), c, d);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(a, b), _mm256_madd_epi16(c, d));
#endif
}

/* A tile of outputs: 4 weight rows (w, w + row_bytes, ...) times MT quantized activation
 * rows (codes K apart). A block of each weight row is widened to 16-bit lanes once for
 * the MT rows, and the 4 x MT accumulators are independent, so one FMA's latency hides
 * behind the others. MT is a constant at each call (always inlined), so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_avx2(
    int type, const uint8_t *w, int64_t row_bytes, int64_t nb, const int16_t *codes, int64_t K, const float *dx,
    const float *dxs, const int MT, float *y, int64_t ldy) {
    const int bb = block_bytes(type);
    const __m256i low4 = _mm256_set1_epi16(15);
    __m256 acc[4][4];
    float off[4][4];  /* the offset terms (Q4_0's -8, Q4_1's m) */
    for (int i = 0; i < MT; i++)
        for (int r = 0; r < 4; r++) { acc[i][r] = _mm256_setzero_ps(); off[i][r] = 0.0f; }
    /* The tile reads its four rows block by block, an order the hardware prefetcher
     * does not follow; the next tile's bytes are fetched ahead by hand, a few lines per
     * block (past the last tile this only touches addresses: prefetches never fault). */
    const char *next = (const char *)(w + 4 * row_bytes);
    const int64_t lines = (4 * row_bytes + 63) / 64, per_block = (lines + nb - 1) / nb;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t l = b * per_block; l < (b + 1) * per_block && l < lines; l++)
            _mm_prefetch(next + l * 64, _MM_HINT_T0);
        __m256i lo[4], hi[4];  /* weights 0-15 and 16-31 of the block, 16-bit lanes */
        float dw[4], ow[4];
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = w + r * row_bytes + b * bb;
            dw[r] = f16_to_f32(blk);
            if (type == Q8_0) {
                lo[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
                hi[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
                ow[r] = 0.0f;
            } else {
                /* Each byte widened to a 16-bit lane: its low nibble is weight j, the
                 * rest (shifted down) weight j + 16. */
                const __m256i qs = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2))));
                lo[r] = _mm256_and_si256(qs, low4);
                hi[r] = _mm256_srli_epi16(qs, 4);
                ow[r] = type == Q4_1 ? f16_to_f32(blk + 2) : -8.0f * dw[r];
            }
        }
        for (int i = 0; i < MT; i++) {
            const __m256i c0 = _mm256_loadu_si256((const __m256i *)(codes + i * K + b * 32));
            const __m256i c1 = _mm256_loadu_si256((const __m256i *)(codes + i * K + b * 32 + 16));
            const float d = dx[i * nb + b], ds = dxs[i * nb + b];
            for (int r = 0; r < 4; r++) {
                /* 8 int32 lanes: pairs of 16-bit products, |sum| below 2**31 (Q8_0: 64 x 128 x 32767). */
                const __m256i p = dot_i16(lo[r], c0, hi[r], c1);
                acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[r] * d), acc[i][r]);
                off[i][r] += ow[r] * ds;
            }
        }
    }
    for (int i = 0; i < MT; i++)
        for (int r = 0; r < 4; r++) y[i * ldy + r] = hr_hsum8(acc[i][r]) + off[i][r];
}
#endif

/* Serial row products of Q4_0/Q4_1/Q8_0 (blocks.h): with AVX-512, block_gemm.c's tiles
 * over whole groups of 4 weight rows; else tiles of 4 weight rows times up to 4
 * activation rows, the AVX2 tile where it fits; plain C for the rest. */
void hr_legacy_rows(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *scales,
                    const int32_t *sums, const float *scaled_sums, int64_t M, int64_t n0, int64_t n1, float *y,
                    int64_t ldy, int scalar) {
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(type);
#ifdef HR_AVX512
    if (scalar == HR_PATH_BEST) n0 = hr_legacy_rows512(type, w, K, codes, scales, scaled_sums, M, n0, n1, y, ldy);
#endif
    for (int64_t t0 = n0; t0 < n1; t0 += 4) {
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mt = M - m0 < 4 ? (int)(M - m0) : 4;
            const int16_t *c = codes + m0 * K;
            const float *dx = scales + m0 * nb, *dxs = scaled_sums + m0 * nb;
            float *yt = y + m0 * ldy + t0;
#ifdef HR_AVX2
            if (scalar != HR_PATH_C && t0 + 4 <= n1) {
                const uint8_t *wt = w + t0 * row_bytes;
                switch (mt) {  /* constant MT per call: the accumulators stay in registers */
                    case 4: tile_avx2(type, wt, row_bytes, nb, c, K, dx, dxs, 4, yt, ldy); break;
                    case 3: tile_avx2(type, wt, row_bytes, nb, c, K, dx, dxs, 3, yt, ldy); break;
                    case 2: tile_avx2(type, wt, row_bytes, nb, c, K, dx, dxs, 2, yt, ldy); break;
                    default: tile_avx2(type, wt, row_bytes, nb, c, K, dx, dxs, 1, yt, ldy); break;
                }
                continue;
            }
#endif
            (void)scalar, (void)yt, (void)dxs;
            for (int i = 0; i < mt; i++)
                for (int64_t n = t0; n < n1 && n < t0 + 4; n++)
                    y[(m0 + i) * ldy + n] = dot_scalar(type, w + n * row_bytes, c + i * K, dx + i * nb,
                                                       sums + (m0 + i) * nb, nb);
        }
    }
}

/* y[m * ldy + n] = x[m] . W[n] for m < M, n < N.
 *
 * x: float32 [M, K] (rows K apart); w: N rows of K weights in blocks of `type` (any type
 * of blocks.h: K a multiple of 32, of 256 for the K-quants; Q4_0/Q4_1/Q8_0/Q4_K | HR_ROWS16:
 * interleaved by 16 rows, rows16.c, N a multiple of 16, on 16-bit codes whatever the path); y: float32, rows ldy apart;
 * work: at least hr_work_bytes(M, K) bytes, for the quantized rows. threads: OpenMP
 * threads over N (the caller's count; torch's libgomp is the one loaded, so they are
 * torch's own pool); scalar: the plain C product.
 * Returns 0, or -1 for a type or a K it does not take.
 */
int64_t hr_work_bytes(int64_t M, int64_t K) { return M * (2 * K + K / 32 * 12); }

int hr_block_gemv(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                  int64_t ldy, void *work, int threads, int scalar) {
    const int rows16 = (type & HR_ROWS16) != 0;  /* interleaved blocks (rows16.c) */
    if (rows16) {
        type &= ~HR_ROWS16;
        if (!hr_rows16_takes(type) || N % 16 || !hr_rows16_available()) return -1;
        scalar &= ~HR_ACT8;  /* the interleaved products take 16-bit codes */
    }
    const int be = hr_block_elements(type);
    if (be == 0 || K % be != 0 || M < 0 || N < 0) return -1;
    if (K == 0) {  /* an empty sum */
        for (int64_t m = 0; m < M; m++) memset(y + m * ldy, 0, N * sizeof(float));
        return 0;
    }
    const int64_t nb = K / 32;
    int16_t *codes = (int16_t *)work;
    float *scales = (float *)(codes + M * K);
    int32_t *sums = (int32_t *)(scales + M * nb);
    float *scaled_sums = (float *)(sums + M * nb);  /* dx * s per block */
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M * K >= 16384)
    for (int64_t m = 0; m < M; m++) {
        hr_quantize_for(type, scalar, x + m * K, K, codes + m * K, scales + m * nb, sums + m * nb);
        for (int64_t b = 0; b < nb; b++) scaled_sums[m * nb + b] = scales[m * nb + b] * (float)sums[m * nb + b];
    }
    /* Work items of 8 weight rows, the AVX-512 tile's; 4 for one row of Q8_0 (a tied LM
     * head's decode), which read the default model's head (28 MiB, streamed from memory,
     * 2 Zen 4 cores) in 0.84-0.93 ms so against 1.27-1.45 ms in items of 8. */
    const int64_t item = rows16 ? 16 : type == Q8_0 && M == 1 ? 4 : 8, tiles = (N + item - 1) / item;
    if (tiles < 8 * threads) threads = tiles >= 8 ? (int)(tiles / 8) : 1;  /* a few tiles a thread */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * item, n1 = n0 + item < N ? n0 + item : N;
        if (rows16)
            hr_rows16(type, w, K, codes, scales, sums, scaled_sums, M, n0, n1, y, ldy);
        else
            hr_rows(type, w, K, codes, scales, sums, scaled_sums, M, n0, n1, y, ldy, scalar);
    }
    return 0;
}

/* Dequantize rows [lo, hi) of N x K blocks of `type` into float32 out[(n - lo) * K + k]
 * (w = dw * u + mw, dw * (u - 8) or dw * q, computed in float32 as gguf's dequantizers
 * do; the K-quants by hr_kquant_dequantize_row), threads over rows: the prefill path
 * multiplies them with a float32 GEMM, a K-quant embedding's lookup reads its rows.
 * Returns 0, or -1 for a type or a K it does not take. */
int hr_dequantize_rows(int type, const uint8_t *w, int64_t K, int64_t lo, int64_t hi, float *out, int threads) {
    const int kquant = hr_is_kquant(type);
    if ((type != Q4_0 && type != Q4_1 && type != Q8_0 && !kquant) || K % (kquant ? 256 : 32) != 0 || lo < 0 ||
        hi < lo)
        return -1;
    const int64_t nb = K / 32, row_bytes = K / hr_block_elements(type) * hr_block_bytes(type);
    if (threads < 1) threads = 1;
    if (hi - lo < 16 * threads) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = lo; n < hi; n++) {
        const uint8_t *row = w + n * row_bytes;
        float *dst = out + (n - lo) * K;
        if (kquant) {
            hr_kquant_dequantize_row(type, row, K, dst);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * block_bytes(type);
            const float d = f16_to_f32(blk);
            float *o = dst + b * 32;
            if (type == Q8_0) {
                const int8_t *q = (const int8_t *)(blk + 2);
                for (int j = 0; j < 32; j++) o[j] = d * (float)q[j];
            } else {
                const uint8_t *qs = blk + (type == Q4_1 ? 4 : 2);
                const float m = type == Q4_1 ? f16_to_f32(blk + 2) : 0.0f;
                if (type == Q4_1) {
                    for (int j = 0; j < 16; j++) { o[j] = d * (float)(qs[j] & 15) + m; o[j + 16] = d * (float)(qs[j] >> 4) + m; }
                } else {
                    for (int j = 0; j < 16; j++) { o[j] = d * (float)((qs[j] & 15) - 8); o[j + 16] = d * (float)((qs[j] >> 4) - 8); }
                }
            }
        }
    }
    return 0;
}
