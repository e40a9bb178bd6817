/* Float32 element-wise math the CPU kernels share: e^x for the decode attention's softmax
 * and SiLU for the MLPs (layer_rows.c) and the MoE experts (moe_experts.c), 8 lanes at a
 * time with AVX2 and FMA, else plain C.
 */
#ifndef HR_ACTIVATION_H
#define HR_ACTIVATION_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#ifndef HR_AVX2
#define HR_AVX2 1
#endif
#endif

#ifdef HR_AVX2
/* e^x for x <= 0, 8 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6
 * polynomial, 2^n into the exponent), within 2 ulp of expf; below -87 (2^-126) it gives
 * about 1e-38 instead of a subnormal or 0, which a softmax's sum does not see. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* g[i] = silu(g[i]) u[i] for i < n: g times the sigmoid of g, from e = e^-|g| (1 / (1 + e)
 * at g >= 0, e / (1 + e) below, so no e^x overflows), within a few ulp of torch's. */
static inline void hr_silu_mul_row(float *g, const float *u, int64_t n) {
    int64_t i = 0;
#ifdef HR_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));
        const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), x);  /* x's sign bit: e / (1 + e) */
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#endif
