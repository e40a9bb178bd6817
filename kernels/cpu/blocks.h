/* What the CPU block kernels share: ggml's type ids, float16 to float32, the vector build
 * chosen by the compiler's target, and the serial row products each block family
 * provides (block_gemv.c: Q4_0/Q4_1/Q8_0; kquant.c: Q4_K/Q5_K/Q6_K; mxfp4.c: MXFP4).
 *
 * A row product takes activation rows already quantized by hr_quantize_row (block_gemv.c):
 * per block of 32, int16 codes c, a float32 scale dx, the codes' sum s and dx * s (dxs).
 * With HR_ACT8 in the path argument, the K-quant products (kquant8.c) take 8-bit codes
 * instead (hr_quantize_row8), in the same 2K bytes a row, so the same buffers and row
 * offsets serve both.
 */
#ifndef HR_BLOCKS_H
#define HR_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HR_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HR_AVX512 1  /* the tiles of block_gemm.c and kquant_gemm.c */
#endif
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };  /* ggml's type ids */

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef HR_AVX2
    return _cvtsh_ss(h);
#else
    /* IEEE half to float by hand (normal, subnormal, inf/nan). */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline int hr_is_kquant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* Weights per block and bytes per block of a type; 0 for a type without a kernel. */
static inline int hr_block_elements(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == MXFP4 ? 32 : hr_is_kquant(type) ? 256 : 0;
}
static inline int hr_block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        case MXFP4: return 17;
        default: return 0;
    }
}

/* Per activation row: K int16 codes, then K / 32 scales dx, sums s (int32) and dx * s. */
void hr_quantize_row(const float *x, int64_t K, int16_t *codes, float *scales, int32_t *sums);

/* Which product the row products take (their `scalar` argument): the fastest the build
 * has; the plain C one; the AVX2 tile where the build has AVX-512 too (tests, A/B). */
enum { HR_PATH_BEST = 0, HR_PATH_C = 1, HR_PATH_AVX2 = 2 };
/* A flag on a path: the K-quant products take 8-bit activation codes (kquant8.c; the
 * cpu_kquant_act_bits switch). Other types ignore it and keep 16-bit codes. */
enum { HR_PATH_MASK = 3, HR_ACT8 = 4 };

/* Whether rows multiplied by `type` blocks under `path` take 8-bit codes. */
static inline int hr_act8(int type, int path) { return (path & HR_ACT8) != 0 && hr_is_kquant(type); }

/* Per activation row (K a multiple of 256), into 2K bytes at codes: K int8 codes
 * c = round(x / dx) per block of 32 with dx = D / 2^k, D = max|x| / 127 of its group of
 * 256 and k the largest of 0..6 with 2^k max|x_block| <= max|x_group| (a power of two
 * apart, so the products sum in int32 over a group: kquant8.c); then K / 32 bytes 6 - k
 * and K / 256 floats D / 64. scales: K / 32 dx; sums: the codes' sums (int32) per block.
 * NaN and tiny blocks as hr_quantize_row. */
void hr_quantize_row8(const float *x, int64_t K, int8_t *codes, float *scales, int32_t *sums);

/* One row quantized for products by `type` blocks under `path`: hr_quantize_row8 into
 * codes' 2K-byte slot where hr_act8, else 16-bit codes. */
static inline void hr_quantize_for(int type, int path, const float *x, int64_t K, int16_t *codes, float *scales,
                                   int32_t *sums) {
    if (hr_act8(type, path))
        hr_quantize_row8(x, K, (int8_t *)codes, scales, sums);
    else
        hr_quantize_row(x, K, codes, scales, sums);
}

/* Sub-block j's 6-bit scale and min of a Q4_K/Q5_K block's scales[12] (ggml's
 * get_scale_min_k4). */
static inline void hr_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#ifdef HR_AVX2
/* The sum of 8 float lanes: (l0 + l4) + (l2 + l6), plus (l1 + l5) + (l3 + l7). */
static inline float hr_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* a . b over n floats. A plain C sum is one chain of dependent adds (the compiler may not
 * reorder float sums), a few cycles an element: at a head size of 64 and a few hundred
 * tokens of context, the attention's scores took about a third of the default model's
 * decode step that way. With AVX2, two 8-lane accumulators, then the tail in plain C. */
static inline float hr_dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef HR_AVX2
    if (n >= 8) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s = hr_hsum8(_mm256_add_ps(s0, s1));
    }
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[i * ldy + n] = x_i . W[n] for i < M and n0 <= n < n1, one thread. W: rows of
 * row_bytes bytes of `type`, K weights each; codes: M rows K apart; dx, sums, dxs: M rows
 * K / 32 apart. scalar: an HR_PATH_* (HR_PATH_C: the plain C product). */
void hr_legacy_rows(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                    const int32_t *sums, const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y,
                    int64_t ldy, int scalar);
/* hr_legacy_rows' AVX-512 tile (block_gemm.c): rows n0 up to the returned row (n0 plus
 * a multiple of 4, at most n1) done, the rest left to the caller. */
int64_t hr_legacy_rows512(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                          const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy);
/* hr_kquant_rows' AVX-512 tile (kquant_gemm.c), as hr_legacy_rows512 for Q4_K/Q5_K/Q6_K. */
int64_t hr_kquant_rows512(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                          const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy);
void hr_kquant_rows(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                    const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy, int scalar);
/* One row of Q4_K/Q5_K/Q6_K blocks (K / 256 of them) as float32, gguf's values. */
void hr_kquant_dequantize_row(int type, const uint8_t *row, int64_t K, float *out);
/* hr_kquant_rows on 8-bit rows of hr_quantize_row8 (kquant8.c), row i at codes + i * ldc
 * bytes; dxs: dx * s per block. */
void hr_kquant_rows8(int type, const uint8_t *w, int64_t K, const int8_t *codes, int64_t ldc, const float *dxs,
                     int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy, int path);
void hr_mxfp4_rows(const uint8_t *w, int64_t K, const int16_t *codes, const float *dx, int64_t M, int64_t n0,
                   int64_t n1, float *y, int64_t ldy);

/* A type id with this flag: blocks of 16 weight rows interleaved (rows16.c), N a multiple
 * of 16; only where hr_rows16_available(). */
enum { HR_ROWS16 = 0x100 };
int hr_rows16_available(void);
/* The types whose blocks interleave: Q4_0, Q4_1, Q8_0 and the K-quants (16-bit activation codes). */
static inline int hr_rows16_takes(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0 || hr_is_kquant(type); }
/* y[i * ldy + n] = x_i . W[n] for i < M and n0 <= n < n1 (multiples of 16) of interleaved
 * blocks of a type hr_rows16_takes (rows16.c), one thread, on 16-bit activation codes.
 * Returns 0, or -1 for a type, K, rows or a build it does not take. */
int hr_rows16(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx, const int32_t *sums,
              const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y, int64_t ldy);
/* Rows ids[0..n) of N rows of interleaved K-quant blocks as float32 out[i * K ...]
 * (rows16.c). Returns 0, or -1 for a type, K or an id it does not take. */
int hr_rows16_dequantize(int type, const uint8_t *w, int64_t K, int64_t N, const int64_t *ids, int64_t n,
                         float *out);

/* Either of the two by type; -1 for a type or a K it does not take. */
static inline int hr_rows(int type, const uint8_t *w, int64_t K, const int16_t *codes, const float *dx,
                          const int32_t *sums, const float *dxs, int64_t M, int64_t n0, int64_t n1, float *y,
                          int64_t ldy, int scalar) {
    const int be = hr_block_elements(type);
    if (be == 0 || K % be != 0) return -1;
    if (hr_act8(type, scalar))
        hr_kquant_rows8(type, w, K, (const int8_t *)codes, 2 * K, dxs, M, n0, n1, y, ldy, scalar & HR_PATH_MASK);
    else if (type == MXFP4)
        hr_mxfp4_rows(w, K, codes, dx, M, n0, n1, y, ldy);
    else if (hr_is_kquant(type))
        hr_kquant_rows(type, w, K, codes, dx, dxs, M, n0, n1, y, ldy, scalar & HR_PATH_MASK);
    else
        hr_legacy_rows(type, w, K, codes, dx, sums, dxs, M, n0, n1, y, ldy, scalar & HR_PATH_MASK);
    return 0;
}

#endif
