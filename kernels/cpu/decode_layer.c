/* One decoder layer of a decode step on the CPU, in one call.
 *
 * A decode step on the CPU is thousands of small torch ops (norms, rotary, the paged
 * attention's gathers, casts), each costing a few microseconds of dispatch: more than
 * the arithmetic of a small model. This runs a whole Llama/Qwen2/Qwen3-family layer for
 * B rows of one new token each, float32 throughout: layer_rows.c's hr_layer_in (norm,
 * q/k/v, rotary, the KV store), the attention over each row's pages here, then
 * hr_layer_out (o, the MLP). Its reference is the torch layer it replaces
 * (engine/models/decoder.py: DecoderLayer.forward over the torch attention backend);
 * kernels/cpu/decode_layer.py has the entry point and tests compare the two.
 *
 * Per row, with the residual stream r and the previous layer's MLP output h:
 *     r += h (or r = h at the first layer); x = rms_norm(r) * w_in
 *     q, k, v = split(x @ Wqkv.T (+ bias)); per head: rms_norm(q), rms_norm(k) (Qwen3)
 *     q, k = rotary(q, k, position) (GPT-NeoX halves); K/V pool[slot] = k, v
 *     a = softmax(q K^T * scale) V over the row's pages (GQA: Hq / Hk query heads a KV head)
 *     r += a @ Wo.T; x = rms_norm(r) * w_post; h = down(silu(gate(x)) * up(x)), or h = x where
 *     the layer has no MLP (gate_up.parts 0: a mixture-of-experts layer, its experts the caller's)
 *
 * The KV pool is float32, float16 (--kv-cache-dtype f16; kv_type KV_F16: each value widened
 * as it is read, F16C), or llama.cpp's q8_0 or q4_0 blocks (kv_type Q8_0 or Q4_0): each
 * head's row is D / 32 blocks of a float16 scale and 32 codes, written here as
 * kernels/attention/kv_store.py writes them, and the attention reads the codes in place
 * (a block's dot product times its scale).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer.h"

/* One block's 32 codes as floats, unscaled (q4_0's less 8). */
static inline void block_codes(int type, const uint8_t *blk, float *out) {
    if (type == Q8_0) {
        for (int j = 0; j < 32; j++) out[j] = (float)((const int8_t *)(blk + 2))[j];
    } else {
        for (int j = 0; j < 16; j++) {
            out[j] = (float)((blk[2 + j] & 15) - 8);
            out[16 + j] = (float)((blk[2 + j] >> 4) - 8);
        }
    }
}

/* a . a pool row of n values: float32 (type 0), float16 (KV_F16), or q8_0/q4_0 blocks,
 * each block's product with its codes times its scale. */
static inline float kv_dot(int type, const float *a, const uint8_t *row, int64_t n) {
    if (type == 0) return hr_dot(a, (const float *)row, n);
    if (type == KV_F16) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += a[i] * f16_to_f32(row + 2 * i);
        return s;
    }
    const int bb = type == Q8_0 ? 34 : 18;
    float s = 0.0f, codes[32];
    for (int64_t b = 0; b < n / 32; b++) {
        block_codes(type, row + b * bb, codes);
        s += f16_to_f32(row + b * bb) * hr_dot(a + b * 32, codes, 32);
    }
    return s;
}

/* out += p * a pool row of n values. */
static inline void kv_axpy(int type, float *out, float p, const uint8_t *row, int64_t n) {
    if (type == 0) {
        for (int64_t i = 0; i < n; i++) out[i] += p * ((const float *)row)[i];
        return;
    }
    if (type == KV_F16) {
        for (int64_t i = 0; i < n; i++) out[i] += p * f16_to_f32(row + 2 * i);
        return;
    }
    const int bb = type == Q8_0 ? 34 : 18;
    float codes[32];
    for (int64_t b = 0; b < n / 32; b++) {
        block_codes(type, row + b * bb, codes);
        const float pd = p * f16_to_f32(row + b * bb);
        for (int j = 0; j < 32; j++) out[b * 32 + j] += pd * codes[j];
    }
}

/* KV head kvh's rows (head_bytes) of a sequence's context, token after token through its
 * pages: no division a token (a page's index and offset are carried instead). */
typedef struct {
    const uint8_t *cache;
    const int64_t *pages;
    int64_t page_size, page, offset, Hk, kvh, head_bytes;
} context_rows;

static inline context_rows rows_of(const void *cache, const int64_t *pages, int64_t page_size, int64_t Hk,
                                   int64_t kvh, int64_t head_bytes) {
    context_rows it = {(const uint8_t *)cache, pages, page_size, 0, 0, Hk, kvh, head_bytes};
    return it;
}

static inline const uint8_t *next_row(context_rows *it) {
    const int64_t slot = it->pages[it->page] * it->page_size + it->offset;
    if (++it->offset == it->page_size) {
        it->offset = 0;
        it->page++;
    }
    return it->cache + (slot * it->Hk + it->kvh) * it->head_bytes;
}

#ifdef HR_AVX2
/* Eight values of a plain pool's row: float32, or float16 widened (half: a constant at
 * each call, so the branch folds away). */
static inline __attribute__((always_inline)) __m256 load8(const uint8_t *row, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i)))
                : _mm256_loadu_ps((const float *)row + i);
}
#endif

/* sc[t] = scale * q . K[t] over a float32 (half 0) or float16 (half 1) pool's context of
 * len tokens: eight tokens at a time, their eight sums reduced together (one transpose of
 * horizontal adds), not one horizontal reduction a token. */
static inline __attribute__((always_inline)) void scores_plain(const float *q, context_rows rows, int64_t len,
                                                               int64_t D, float scale, float *sc, int half) {
    int64_t t = 0;
#ifdef HR_AVX2
    if (D % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 8 <= len; t += 8) {
            const uint8_t *k[8];
            __m256 a[8];
            for (int j = 0; j < 8; j++) {
                k[j] = next_row(&rows);
                a[j] = _mm256_setzero_ps();
            }
            for (int64_t i = 0; i < D; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, load8(k[j], i, half), a[j]);
            }
            const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
            _mm256_storeu_ps(sc + t, _mm256_mul_ps(sums, vscale));
        }
    }
#endif
    for (; t < len; t++) sc[t] = kv_dot(half ? KV_F16 : 0, q, next_row(&rows), D) * scale;
}

/* out[0..D) = sum over t of p[t] * V[t] over a float32 (half 0) or float16 (half 1) pool's
 * context: the sums kept in registers across the tokens (heads of up to 128 values)
 * rather than read and written back a token. */
static inline __attribute__((always_inline)) void weighted_sum_plain(const float *p, context_rows rows, int64_t len,
                                                                     int64_t D, float *out, int half) {
#ifdef HR_AVX2
    if (D % 8 == 0 && D <= 128) {
        __m256 acc[16];
        const int64_t n = D / 8;
        for (int64_t i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const uint8_t *v = next_row(&rows);
            const __m256 pv = _mm256_set1_ps(p[t]);
            for (int64_t i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(pv, load8(v, 8 * i, half), acc[i]);
        }
        for (int64_t i = 0; i < n; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
        return;
    }
#endif
    memset(out, 0, D * 4);
    for (int64_t t = 0; t < len; t++) kv_axpy(half ? KV_F16 : 0, out, p[t], next_row(&rows), D);
}

/* sc[0..len) = softmax(sc[0..len)) in place. */
static void softmax_in_place(float *sc, int64_t len) {
    float top = -INFINITY, total = 0.0f;
    int64_t t = 0;
#ifdef HR_AVX2
    __m256 vtop = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= len; t += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(sc + t));
    float lanes[8];
    _mm256_storeu_ps(lanes, vtop);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
#endif
    for (; t < len; t++) top = sc[t] > top ? sc[t] : top;
    t = 0;
#ifdef HR_AVX2
    const __m256 vmax = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vmax));
        _mm256_storeu_ps(sc + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
    for (int j = 0; j < 8; j++) total += lanes[j];
#endif
    for (; t < len; t++) total += (sc[t] = expf(sc[t] - top));
    const float inv = 1.0f / total;
    for (t = 0; t < len; t++) sc[t] *= inv;
}

/* The attention of one query head over a plain pool (float32 or float16), one function
 * each so that each inlines its own loads. */
static void attend_f32(const float *q, context_rows keys, context_rows values, int64_t len, int64_t D, float scale,
                       float *sc, float *out) {
    scores_plain(q, keys, len, D, scale, sc, 0);
    softmax_in_place(sc, len);
    weighted_sum_plain(sc, values, len, D, out, 0);
}

static void attend_f16(const float *q, context_rows keys, context_rows values, int64_t len, int64_t D, float scale,
                       float *sc, float *out) {
    scores_plain(q, keys, len, D, scale, sc, 1);
    softmax_in_place(sc, len);
    weighted_sum_plain(sc, values, len, D, out, 1);
}

/* Bytes of scratch hr_decode_layer needs for `rows` rows and `max_len` tokens of context
 * (hr_layer_in and hr_layer_out alone: max_len 0); the regions as hr_scratch_of lays them. */
int64_t hr_decode_scratch_bytes(const hr_layer *L, int64_t rows, int64_t max_len) {
    const int64_t qkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
    const int64_t floats = rows * (L->hidden + qkv + L->num_heads * L->head_dim + 2 * L->intermediate + L->hidden);
    return floats * 4 + (hr_work_bytes(rows, hr_widest(L)) + 63) / 64 * 64 + rows * L->num_heads * max_len * 4 + 64;
}

/* h: [B, hidden] the previous MLP output, replaced by this layer's; residual: [B, hidden],
 * updated. Returns 0, or -1: the gemv's (a block type it does not take), a KV type it does
 * not read, or a block pool whose head dim is not whole blocks. */
int hr_decode_layer(const hr_layer *L, const hr_step *S, float *h, float *residual, void *scratch,
                    int64_t max_len) {
    const int64_t B = S->rows, D = L->head_dim, Hq = L->num_heads, Hk = L->num_kv_heads;
    const int64_t qsize = Hq * D, qkv_n = qsize + 2 * Hk * D;
    const int threads = S->threads;
    const int kv = L->kv_type;
    const int64_t head_bytes = hr_kv_head_bytes(kv, D);
    if ((kv == Q8_0 || kv == Q4_0) ? D % 32 != 0 : kv != 0 && kv != KV_F16) return -1;
    const hr_scratch s = hr_scratch_of(L, B, scratch);
    int err;
    if ((err = hr_layer_in(L, S, h, residual, scratch))) return err;

    /* Attention, a (row, query head) a task. */
    const int64_t group = Hq / Hk, tasks = B * Hq;
    const int att_threads = tasks < threads ? (int)tasks : threads;
#pragma omp parallel for schedule(static) num_threads(att_threads) if (att_threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / Hq, hq = task % Hq, kvh = hq / group, len = S->seq_lens[b];
        const float *q = s.qkv + b * qkv_n + hq * D;
        float *sc = s.scores + task * max_len, *out = s.attn + b * qsize + hq * D;
        const int64_t *pages = S->page_table + b * S->max_pages;
        const context_rows keys = rows_of(L->k_cache, pages, S->page_size, Hk, kvh, head_bytes);
        const context_rows values = rows_of(L->v_cache, pages, S->page_size, Hk, kvh, head_bytes);
        if (kv == 0 || kv == KV_F16) {
            (kv ? attend_f16 : attend_f32)(q, keys, values, len, D, L->scale, sc, out);
            continue;
        }
        context_rows it = keys;
        for (int64_t t = 0; t < len; t++) sc[t] = kv_dot(kv, q, next_row(&it), D) * L->scale;
        softmax_in_place(sc, len);
        it = values;
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
        for (int64_t t = 0; t < len; t++) kv_axpy(kv, out, sc[t], next_row(&it), D);
    }
    return hr_layer_out(L, S, s.attn, h, residual, scratch);
}
