/* A mixture-of-experts layer's CPU experts for one step, in one call: every routed
 * (token, expert, router weight) pair given, each expert's gate/up, SiLU-and-mul and
 * down over its GGUF blocks, the outputs summed into out with the router weights.
 * gpt-oss's experts add their biases to gate/up and down and take the clamped SwiGLU
 * (limit > 0: gate clamped above at limit, up at +-limit, (up + 1) * gate *
 * sigmoid(alpha * gate)) in place of SiLU-and-mul.
 *
 * Called through ctypes by kernels/cpu/moe_experts.py (which holds the torch reference).
 * One OpenMP parallel region (num_threads: the caller's count, from the cores the
 * process may use) runs the phases, each a worksharing loop ended by its barrier:
 *
 *   1. each token's hidden state quantized once (hr_quantize_row: int16 codes per
 *      block of 32), then copied to its pairs' rows;
 *   2. gate and up: work items of ROWS weight rows of one expert's projection, for all
 *      of that expert's pairs at once (the weights are read once per step), in the
 *      order the stacks hold them, each thread a contiguous run (schedule(static)): a
 *      core streams its experts' rows in order, as the dense products do, where items
 *      handed out one at a time alternated between the cores and read at ~15 GB/s;
 *   3. h = silu(gate) * up per pair (float32; biases added first, the clamped SwiGLU
 *      where asked), quantized the same way;
 *   4. down: work items of ROWS rows of one expert's down projection (its bias added),
 *      split as gate and up;
 *   5. out[token] += weight * y[pair], over column chunks, pairs in the given order (so
 *      the sums are the same at any thread count).
 *
 * Pairs arrive grouped by expert: group g is pairs [start[g], start[g + 1]) of expert
 * expert[g]. Weights: gate and up [E, I, H / be * bb] and down [E, H, I / be * bb]
 * bytes, each of its own type (blocks.h). A type id with HR_ROWS16: each expert's rows of
 * that projection interleaved by 16 (rows16.c; its rows a multiple of 16), multiplied by
 * hr_rows16 on 16-bit activation codes (the rows it reads are quantized so); work items
 * of ROWS rows start at multiples of 16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "activation.h"
#include "blocks.h"

enum { ROWS = 32, COLS = 256 };  /* rows of a product work item; output columns of a sum item */

/* Quantized rows: codes [n, K], then scales, sums and dx * sums [n, K / 32] each. */
typedef struct {
    int16_t *codes;
    float *dx;
    int32_t *sums;
    float *dxs;
} quantized;

static int64_t quantized_bytes(int64_t n, int64_t K) { return n * (2 * K + K / 32 * 12); }

static quantized quantized_at(void *at, int64_t n, int64_t K) {
    quantized q;
    q.codes = (int16_t *)at;
    q.dx = (float *)(q.codes + n * K);
    q.sums = (int32_t *)(q.dx + n * (K / 32));
    q.dxs = (float *)(q.sums + n * (K / 32));
    return q;
}

/* Row r of q from x, for products by `type` blocks under `path` (8-bit codes where
 * hr_act8: the first K bytes of the row's slot). */
static void quantize_one(int type, int path, const float *x, int64_t K, quantized q, int64_t r) {
    const int64_t nb = K / 32;
    hr_quantize_for(type, path, x, K, q.codes + r * K, q.dx + r * nb, q.sums + r * nb);
    for (int64_t b = 0; b < nb; b++) q.dxs[r * nb + b] = q.dx[r * nb + b] * (float)q.sums[r * nb + b];
}

/* A projection's type id of `rows` rows: 1 with HR_ROWS16 (taken off *type), 0 without,
 * -1 for interleaved blocks hr_rows16 does not take (type, rows or build). */
static int interleaved(int *type, int64_t rows) {
    if (!(*type & HR_ROWS16)) return 0;
    *type &= ~HR_ROWS16;
    return hr_rows16_takes(*type) && rows % 16 == 0 && hr_rows16_available() ? 1 : -1;
}

/* The path rows multiplied by `type` blocks are quantized under: no 8-bit codes for
 * interleaved blocks (x16). */
static int path_for(int type, int x16, int path) { return x16 || !hr_act8(type, path) ? path & ~HR_ACT8 : path; }

/* Rows [n0, n1) of one expert's projection for m quantized rows from row r of q, into y
 * (rows ldy apart): hr_rows16 where interleaved, else hr_rows. */
static void product(int type, int x16, const uint8_t *w, int64_t K, quantized q, int64_t r, int64_t m, int64_t n0,
                    int64_t n1, float *y, int64_t ldy, int path) {
    const int64_t nb = K / 32;
    if (x16)
        hr_rows16(type, w, K, q.codes + r * K, q.dx + r * nb, q.sums + r * nb, q.dxs + r * nb, m, n0, n1, y, ldy);
    else
        hr_rows(type, w, K, q.codes + r * K, q.dx + r * nb, q.sums + r * nb, q.dxs + r * nb, m, n0, n1, y, ldy, path);
}

/* Work bytes hr_moe_experts takes for T tokens and P pairs. */
int64_t hr_moe_work_bytes(int64_t T, int64_t H, int64_t I, int64_t P) {
    return quantized_bytes(T, H) + quantized_bytes(P, H) + quantized_bytes(P, I) + 4 * P * (2 * I + H) + 64;
}

/* out[token[p]] += weight[p] * down_e(silu(gate_e(x)) * up_e(x)) for every pair p.
 *
 * x: float32 [T, H]; token, weight: [P] (tokens below T); expert, start: [G] and [G + 1]
 * (start[0] = 0, start[G] = P, experts below the stacks' E); gate, up, down: the stacks'
 * first bytes; tg, tu, td: their types; bias_gate_up: float32 [E, 2I] (gate half first)
 * and bias_down [E, H], or both NULL; limit > 0: the clamped SwiGLU with alpha; out:
 * float32 [T, H], added to; work: hr_moe_work_bytes(T, H, I, P) bytes. Returns 0, or -1
 * for a type or a size it does not take (H a multiple of the gate's and up's block, I of
 * the down's; interleaved blocks: as interleaved() says).
 */
int hr_moe_experts(const float *x, int64_t T, int64_t H, int64_t I, const int32_t *token, const float *weight,
                   int64_t P, const int32_t *expert, const int32_t *start, int64_t G, const uint8_t *gate,
                   const uint8_t *up, const uint8_t *down, int tg, int tu, int td, const float *bias_gate_up,
                   const float *bias_down, float alpha, float limit, float *out, void *work, int threads,
                   int scalar) {
    const int xg = interleaved(&tg, I), xu = interleaved(&tu, I), xd = interleaved(&td, H);
    const int bg = hr_block_elements(tg), bu = hr_block_elements(tu), bd = hr_block_elements(td);
    if (!bg || !bu || !bd || H <= 0 || I <= 0 || H % bg || H % bu || I % bd || T < 0 || P < 0 || G < 0) return -1;
    if (xg < 0 || xu < 0 || xd < 0) return -1;
    if (P == 0) return 0;
    /* the hidden rows take 8-bit codes only where both gate and up read them */
    const int path_gu = path_for(tg, xg, scalar) & path_for(tu, xu, scalar), path_d = path_for(td, xd, scalar);
    const int64_t gate_bytes = I * (H / bg) * hr_block_bytes(tg), up_bytes = I * (H / bu) * hr_block_bytes(tu);
    const int64_t down_bytes = H * (I / bd) * hr_block_bytes(td);
    char *at = (char *)work;
    const quantized xq = quantized_at(at, T, H);
    at += quantized_bytes(T, H);
    const quantized pq = quantized_at(at, P, H);
    at += quantized_bytes(P, H);
    const quantized hq = quantized_at(at, P, I);
    at += quantized_bytes(P, I);
    float *g = (float *)at, *u = g + P * I, *y = u + P * I;
    const int64_t nbh = H / 32;
    const int64_t tiles_i = (I + ROWS - 1) / ROWS, tiles_h = (H + ROWS - 1) / ROWS, chunks = (H + COLS - 1) / COLS;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) quantize_one(tg, path_gu, x + t * H, H, xq, t);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            const int64_t t = token[p];
            memcpy(pq.codes + p * H, xq.codes + t * H, H * sizeof(int16_t));
            memcpy(pq.dx + p * nbh, xq.dx + t * nbh, nbh * sizeof(float));
            memcpy(pq.sums + p * nbh, xq.sums + t * nbh, nbh * sizeof(int32_t));
            memcpy(pq.dxs + p * nbh, xq.dxs + t * nbh, nbh * sizeof(float));
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < G * 2 * tiles_i; item++) {
            const int64_t grp = item / (2 * tiles_i), r = item % (2 * tiles_i), is_up = r / tiles_i;
            const int64_t n0 = (r % tiles_i) * ROWS, n1 = n0 + ROWS < I ? n0 + ROWS : I, p0 = start[grp];
            const int64_t m = start[grp + 1] - p0;
            const uint8_t *w = is_up ? up + expert[grp] * up_bytes : gate + expert[grp] * gate_bytes;
            product(is_up ? tu : tg, is_up ? xu : xg, w, H, pq, p0, m, n0, n1, (is_up ? u : g) + p0 * I, I, path_gu);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t grp = 0; grp < G; grp++) {
            const float *bg = bias_gate_up ? bias_gate_up + expert[grp] * 2 * I : NULL;
            for (int64_t p = start[grp]; p < start[grp + 1]; p++) {
                float *h = g + p * I;  /* act(gate, up), in place of the gate's row */
                if (!bg && limit <= 0.0f) {  /* SiLU(gate) * up, 8 lanes at a time */
                    hr_silu_mul_row(h, u + p * I, I);
                    quantize_one(td, path_d, h, I, hq, p);
                    continue;
                }
                for (int64_t i = 0; i < I; i++) {
                    float gi = h[i], ui = u[p * I + i];
                    if (bg) gi += bg[i], ui += bg[I + i];
                    if (limit > 0.0f) {
                        gi = gi < limit ? gi : limit;
                        ui = ui < -limit ? -limit : ui > limit ? limit : ui;
                        h[i] = (ui + 1.0f) * gi / (1.0f + expf(-alpha * gi));
                    } else {
                        h[i] = gi / (1.0f + expf(-gi)) * ui;
                    }
                }
                quantize_one(td, path_d, h, I, hq, p);
            }
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < G * tiles_h; item++) {
            const int64_t grp = item / tiles_h, n0 = (item % tiles_h) * ROWS, n1 = n0 + ROWS < H ? n0 + ROWS : H;
            const int64_t p0 = start[grp], m = start[grp + 1] - p0;
            product(td, xd, down + expert[grp] * down_bytes, I, hq, p0, m, n0, n1, y + p0 * H, H, path_d);
            if (bias_down)
                for (int64_t p = p0; p < p0 + m; p++)
                    for (int64_t n = n0; n < n1; n++) y[p * H + n] += bias_down[expert[grp] * H + n];
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t c0 = c * COLS, c1 = c0 + COLS < H ? c0 + COLS : H;
            for (int64_t p = 0; p < P; p++) {
                float *o = out + (int64_t)token[p] * H;
                const float *yp = y + p * H, wp = weight[p];
                for (int64_t k = c0; k < c1; k++) o[k] += wp * yp[k];
            }
        }
    }
    return 0;
}

/* Work bytes hr_moe_routed takes for T tokens, E experts, K of them a token. */
int64_t hr_moe_routed_work_bytes(int64_t T, int64_t H, int64_t I, int64_t E, int64_t K) {
    return hr_moe_work_bytes(T, H, I, T * K) + 4 * (T * E + 4 * T * K + 3 * E + 2) + 64;
}

/* Token t's K largest of logits[0..E) (ties to the lower id), largest first, into ids and
 * their softmax probabilities into w (divided by their own sum where renorm). */
static void top_k(const float *logits, int64_t E, int64_t K, int renorm, int32_t *ids, float *w) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        if (n == K && logits[e] <= logits[ids[K - 1]]) continue;
        int64_t at = n < K ? n++ : K - 1;
        while (at > 0 && logits[e] > logits[ids[at - 1]]) { ids[at] = ids[at - 1]; at--; }
        ids[at] = (int32_t)e;
    }
    const float top = logits[ids[0]];
    float all = 0.0f, kept = 0.0f;
    for (int64_t e = 0; e < E; e++) all += expf(logits[e] - top);
    for (int64_t k = 0; k < K; k++) kept += w[k] = expf(logits[ids[k]] - top);
    const float denominator = renorm ? kept : all;
    for (int64_t k = 0; k < K; k++) w[k] /= denominator;
}

/* hr_moe_experts on the pairs routed here: the router's logits x . router[e] (+
 * router_bias[e] where given; router float32 [E, H], its rows over the threads), each
 * token's top K experts by softmax probability (divided by their sum where renorm: the
 * same values as a softmax over the K logits alone), grouped by expert in ascending id,
 * tokens in order within a group (the order a stable sort by expert gives). The other
 * arguments are hr_moe_experts'; work: hr_moe_routed_work_bytes(T, H, I, E, K) bytes.
 * Returns as hr_moe_experts, or -1 for K outside 1..E. */
int hr_moe_routed(const float *x, int64_t T, int64_t H, int64_t I, const float *router, const float *router_bias,
                  int64_t E, int64_t K, int renorm, const uint8_t *gate, const uint8_t *up, const uint8_t *down,
                  int tg, int tu, int td, const float *bias_gate_up, const float *bias_down, float alpha, float limit,
                  float *out, void *work, int threads, int scalar) {
    if (K < 1 || K > E || T < 0) return -1;
    const int64_t P = T * K;
    float *logits = (float *)((char *)work + hr_moe_work_bytes(T, H, I, P));
    int32_t *ids = (int32_t *)(logits + T * E);
    float *w = (float *)(ids + P), *weight = w + P;
    int32_t *token = (int32_t *)(weight + P), *count = token + P, *expert = count + E, *start = expert + E;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * E * H >= 65536)
    for (int64_t te = 0; te < T * E; te++)
        logits[te] = hr_dot(x + te / E * H, router + te % E * H, H) + (router_bias ? router_bias[te % E] : 0.0f);
    for (int64_t t = 0; t < T; t++) top_k(logits + t * E, E, K, renorm, ids + t * K, w + t * K);
    memset(count, 0, E * sizeof(int32_t));
    for (int64_t p = 0; p < P; p++) count[ids[p]]++;
    int64_t G = 0;
    start[0] = 0;
    for (int64_t e = 0; e < E; e++)
        if (count[e]) {
            expert[G] = (int32_t)e;
            start[G + 1] = start[G] + count[e];
            count[e] = start[G];  /* now where expert e's next pair goes */
            G++;
        }
    for (int64_t p = 0; p < P; p++) {
        const int32_t at = count[ids[p]]++;
        token[at] = (int32_t)(p / K);
        weight[at] = w[p];
    }
    return hr_moe_experts(x, T, H, I, token, weight, P, expert, start, G, gate, up, down, tg, tu, td, bias_gate_up,
                          bias_down, alpha, limit, out, work, threads, scalar);
}
