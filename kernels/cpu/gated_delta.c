/* A decode step of Gated DeltaNet layers (Qwen3-Next, Qwen3.5/3.6) after their input
 * projections, for B sequences of one new token each, in one call: the causal depthwise
 * conv over each sequence's last K - 1 inputs and SiLU, q and k L2-normed (q scaled by
 * Dk^-1/2) and repeated from the key heads to the value heads, beta = sigmoid(b), the
 * log-decay g = -exp(A_log) * softplus(a + dt_bias), and the gated delta rule on the
 * float32 state S [Dk, Dv] of each value head:
 *
 *   S <- e^g S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.
 *
 * With e^g S read once for both products (S^T k and S^T q of the old state), o = e^g
 * S^T q + (k . q) delta, and S written in a second pass: the state is read twice and
 * written once, where the torch reference makes five passes. kernels/cpu/gated_delta.py
 * holds the entry point and the torch reference the tests compare it with.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "blocks.h"

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* torch's softplus (beta 1, threshold 20). */
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* mixed: [B, C] (q | k | v, C = 2 Hk Dk + Hv Dv); conv_pool: [slots, C, K - 1] and
 * conv_w: [C, K], float32; a, b: [B, Hv]; A_log, dt_bias: [Hv]; ssm_pool: [slots, Hv, Dk,
 * Dv] float32; slots: [B]; fresh: [B], nonzero where the sequence starts here (its states
 * read as zeros); o: [B, Hv, Dv]; work: B * C floats. The pools are updated in place.
 * Returns 0, or -1 for shapes it does not take (Hv not a multiple of Hk, K < 2). */
int hr_gdn_decode(const float *mixed, int64_t B, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K,
                  float *conv_pool, const float *conv_w, const float *a, const float *b, const float *A_log,
                  const float *dt_bias, float *ssm_pool, const int64_t *slots, const uint8_t *fresh, float *o,
                  float *work, int threads) {
    if (Hk <= 0 || Hv % Hk || K < 2 || Dk <= 0 || Dv <= 0 || B < 0) return -1;
    const int64_t C = 2 * Hk * Dk + Hv * Dv, per = Hv / Hk;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < B * C; bc++) {
            const int64_t r = bc / C, c = bc % C;
            float *hist = conv_pool + (slots[r] * C + c) * (K - 1);
            const float *w = conv_w + c * K, x = mixed[bc];
            if (fresh[r]) memset(hist, 0, (K - 1) * sizeof(float));
            float y = w[K - 1] * x;
            for (int64_t j = 0; j < K - 1; j++) y += w[j] * hist[j];
            for (int64_t j = 0; j + 1 < K - 1; j++) hist[j] = hist[j + 1];
            hist[K - 2] = x;
            work[bc] = silu(y);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * Hv; task++) {
            const int64_t r = task / Hv, h = task % Hv, kh = h / per;
            const float *row = work + r * C;
            const float *q = row + kh * Dk, *k = row + Hk * Dk + kh * Dk, *v = row + 2 * Hk * Dk + h * Dv;
            float *S = ssm_pool + (slots[r] * Hv + h) * Dk * Dv, *out = o + task * Dv;
            if (fresh[r]) memset(S, 0, Dk * Dv * sizeof(float));
            const float qq = hr_dot(q, q, Dk), kk = hr_dot(k, k, Dk), qk = hr_dot(q, k, Dk);
            const float qs = 1.0f / sqrtf(qq + 1e-6f) / sqrtf((float)Dk), ks = 1.0f / sqrtf(kk + 1e-6f);
            const float beta = 1.0f / (1.0f + expf(-b[task]));
            const float decay = expf(-expf(A_log[h]) * softplus(a[task] + dt_bias[h]));
            float remembered[Dv], delta[Dv];  /* S^T k and S^T q of the old state, unscaled */
            for (int64_t j = 0; j < Dv; j++) remembered[j] = out[j] = 0.0f;
            for (int64_t i = 0; i < Dk; i++) {
                const float ki = k[i], qi = q[i], *s = S + i * Dv;
                for (int64_t j = 0; j < Dv; j++) remembered[j] += s[j] * ki, out[j] += s[j] * qi;
            }
            for (int64_t j = 0; j < Dv; j++) {
                delta[j] = beta * (v[j] - decay * ks * remembered[j]);
                out[j] = decay * qs * out[j] + qk * ks * qs * delta[j];
            }
            for (int64_t i = 0; i < Dk; i++) {
                const float ki = k[i] * ks;
                float *s = S + i * Dv;
                for (int64_t j = 0; j < Dv; j++) s[j] = decay * s[j] + ki * delta[j];
            }
        }
    }
    return 0;
}
