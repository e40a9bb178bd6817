/* One decoder layer of a decode step on the CPU, in one call.
 *
 * A decode step on the CPU is thousands of small torch ops (norms, rotary, the paged
 * attention's gathers, casts), each costing a few microseconds of dispatch: more than
 * the arithmetic of a small model. This runs a whole Llama/Qwen2/Qwen3-family layer for
 * B rows of one new token each, float32 throughout, the projections from GGUF blocks
 * through hr_block_gemv (block_gemv.c). Its reference is the torch layer it replaces
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
 * The KV pool is float32, or llama.cpp's q8_0 or q4_0 blocks (--kv-cache-dtype; kv_type
 * Q8_0 or Q4_0): each head's row is D / 32 blocks of a float16 scale and 32 codes,
 * written here as kernels/attention/kv_store.py writes them, and the attention reads the
 * codes in place (a block's dot product times its scale).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#ifndef HR_AVX2
#define HR_AVX2 1
#endif
#endif

int hr_block_gemv(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                  int64_t ldy, void *work, int threads, int scalar);
int64_t hr_work_bytes(int64_t M, int64_t K);

/* One projection, N x K: up to HR_PROJ_PARTS runs of rows, each of one block type
 * (Q4_K_M's q/k/v: q and k in Q4_K, v in Q6_K), stacked along N. */
#define HR_PROJ_PARTS 3
typedef struct {
    const uint8_t *blocks[HR_PROJ_PARTS];
    int32_t type[HR_PROJ_PARTS];
    int32_t parts;
    int64_t rows[HR_PROJ_PARTS];
} hr_proj;

/* The layer's weights and shapes; pointers the caller's tensors keep alive. */
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *input_norm, *post_norm;       /* [hidden] */
    const float *q_norm, *k_norm;              /* [head_dim] each, or NULL (no per-head norm) */
    const float *qkv_bias;                     /* [(Hq + 2 Hk) D] or NULL */
    hr_proj qkv, o, gate_up, down;
    void *k_cache, *v_cache;                   /* [slots, Hk, D] float32, or [slots, Hk, D / 32 * 34 (18)] */
    int32_t kv_type;                           /* 0: float32; Q8_0 or Q4_0: blocks */
    int32_t pad;
} hr_layer;

/* The step: B rows of one token each. */
typedef struct {
    int64_t rows, page_size, max_pages;
    const int64_t *positions, *out_slots, *seq_lens;  /* [B] */
    const int64_t *page_table;                         /* [B, max_pages] */
    const float *cos_sin;                              /* [max_pos, D]: cos | sin halves */
    int32_t threads, first;                            /* first: residual = h */
    int32_t path, pad;                                 /* the projections' HR_PATH_* (blocks.h) */
} hr_step;

/* float to IEEE half, rounding to nearest even (torch's .to(torch.float16)). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  /* 65520 and above round to inf */
    if (ax < 0x38800000) {                                      /* below 2^-14: a subnormal half */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));  /* exact scaling, then RNE */
    }
    uint32_t h = ((ax >> 23) - 112) << 10 | (ax & 0x7fffff) >> 13;
    const uint32_t rest = ax & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

/* n values (n % 32 == 0) as q8_0 or q4_0 blocks, as llama.cpp's quantize_row_q8_0_ref
 * and quantize_row_q4_0_ref write them (kernels/attention/kv_store.py: the same bytes). */
static void quantize_kv(int type, const float *x, int64_t n, uint8_t *out) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + b * 32;
        uint8_t *blk = out + b * (type == Q8_0 ? 34 : 18);
        float amax = 0.0f, max = 0.0f;  /* the largest magnitude, and that value (the first) */
        for (int j = 0; j < 32; j++)
            if (amax < fabsf(xb[j])) amax = fabsf(xb[j]), max = xb[j];
        const float d = type == Q8_0 ? amax / 127.0f : max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = f32_to_f16(d);
        memcpy(blk, &h, 2);
        if (type == Q8_0) {
            for (int j = 0; j < 32; j++) ((int8_t *)(blk + 2))[j] = (int8_t)roundf(xb[j] * id);
        } else {
            for (int j = 0; j < 16; j++) {
                /* Products and sums apart (no contraction into an FMA), as torch rounds them. */
                const float x0 = xb[j] * id, x1 = xb[16 + j] * id;
                const float lo = fminf(fmaxf(floorf(x0 + 8.5f), 0.0f), 15.0f);
                const float hi = fminf(fmaxf(floorf(x1 + 8.5f), 0.0f), 15.0f);
                blk[2 + j] = (uint8_t)((uint8_t)lo | (uint8_t)hi << 4);
            }
        }
    }
}

/* quantize_kv for the tests: x [rows, n] float32 into out [rows, n / 32 * block bytes]. */
void hr_quantize_kv(int type, const float *x, int64_t rows, int64_t n, uint8_t *out) {
    for (int64_t r = 0; r < rows; r++) quantize_kv(type, x + r * n, n, out + r * (n / 32) * (type == Q8_0 ? 34 : 18));
}

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

/* a . a pool row of n values: float32 (type 0), or q8_0/q4_0 blocks, each block's product
 * with its codes times its scale. */
static inline float kv_dot(int type, const float *a, const uint8_t *row, int64_t n) {
    if (type == 0) return hr_dot(a, (const float *)row, n);
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

/* sc[t] = scale * q . K[t] over a float32 pool's context of len tokens: eight tokens at a
 * time, their eight sums reduced together (one transpose of horizontal adds), not one
 * horizontal reduction a token. */
static void scores_f32(const float *q, context_rows rows, int64_t len, int64_t D, float scale, float *sc) {
    int64_t t = 0;
#ifdef HR_AVX2
    if (D % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 8 <= len; t += 8) {
            const float *k[8];
            __m256 a[8];
            for (int j = 0; j < 8; j++) {
                k[j] = (const float *)next_row(&rows);
                a[j] = _mm256_setzero_ps();
            }
            for (int64_t i = 0; i < D; i += 8) {
                const __m256 qv = _mm256_loadu_ps(q + i);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + i), a[j]);
            }
            const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
            _mm256_storeu_ps(sc + t, _mm256_mul_ps(sums, vscale));
        }
    }
#endif
    for (; t < len; t++) sc[t] = hr_dot(q, (const float *)next_row(&rows), D) * scale;
}

/* out[0..D) = sum over t of p[t] * V[t] over a float32 pool's context: the sums kept in
 * registers across the tokens (heads of up to 128 values) rather than read and written
 * back a token. */
static void weighted_sum_f32(const float *p, context_rows rows, int64_t len, int64_t D, float *out) {
#ifdef HR_AVX2
    if (D % 8 == 0 && D <= 128) {
        __m256 acc[16];
        const int64_t n = D / 8;
        for (int64_t i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++) {
            const float *v = (const float *)next_row(&rows);
            const __m256 pv = _mm256_set1_ps(p[t]);
            for (int64_t i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int64_t i = 0; i < n; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
        return;
    }
#endif
    memset(out, 0, D * 4);
    for (int64_t t = 0; t < len; t++) kv_axpy(0, out, p[t], next_row(&rows), D);
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

static void rms_norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    /* As torch's F.rms_norm in float32: x * rsqrt(mean(x^2) + eps) * w. */
    const float ss = hr_dot(x, x, n);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void rotate(float *x, const float *cs, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float c = cs[i], s = cs[half + i], x1 = x[i], x2 = x[half + i];
        x[i] = x1 * c - x2 * s;
        x[half + i] = x2 * c + x1 * s;
    }
}

static int proj(const hr_proj *p, const float *x, int64_t m, int64_t k, float *y, void *work, int threads,
                int path) {
    int64_t n = 0, at = 0;
    if (p->parts < 1 || p->parts > HR_PROJ_PARTS) return -1;
    for (int i = 0; i < p->parts; i++) n += p->rows[i];
    for (int i = 0; i < p->parts; i++) {  /* each part's columns of y's rows of n */
        const int err = hr_block_gemv(p->type[i], x, m, k, p->blocks[i], p->rows[i], y + at, n, work, threads, path);
        if (err) return err;
        at += p->rows[i];
    }
    return 0;
}

/* Bytes of scratch hr_decode_layer needs for `rows` rows and `max_len` tokens of context. */
int64_t hr_decode_scratch_bytes(const hr_layer *L, int64_t rows, int64_t max_len) {
    const int64_t qkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
    int64_t widest = L->hidden > L->intermediate ? L->hidden : L->intermediate;
    if (L->num_heads * L->head_dim > widest) widest = L->num_heads * L->head_dim;
    const int64_t floats = rows * (L->hidden + qkv + L->num_heads * L->head_dim + 2 * L->intermediate +
                                   L->hidden) + rows * L->num_heads * max_len;
    return floats * 4 + hr_work_bytes(rows, widest) + 64;
}

/* h: [B, hidden] the previous MLP output, replaced by this layer's; residual: [B, hidden],
 * updated. Returns 0, or -1: the gemv's (a block type it does not take), or a q8_0 pool
 * whose head dim is not whole blocks. */
int hr_decode_layer(const hr_layer *L, const hr_step *S, float *h, float *residual, void *scratch,
                    int64_t max_len) {
    const int64_t B = S->rows, H = L->hidden, D = L->head_dim, Hq = L->num_heads, Hk = L->num_kv_heads;
    const int64_t I = L->intermediate, qsize = Hq * D, kvsize = Hk * D, qkv_n = qsize + 2 * kvsize;
    const int threads = S->threads;
    const int kv = L->kv_type;
    const int64_t head_bytes = kv ? D / 32 * (kv == Q8_0 ? 34 : 18) : D * 4, kv_row_bytes = Hk * head_bytes;
    if ((kv && D % 32) || (kv && kv != Q8_0 && kv != Q4_0)) return -1;
    float *x = (float *)scratch;                /* [B, H] normed rows */
    float *qkv = x + B * H;                     /* [B, qkv_n] */
    float *attn = qkv + B * qkv_n;              /* [B, Hq * D] */
    float *gate_up = attn + B * qsize;          /* [B, 2 I] */
    float *o = gate_up + B * 2 * I;             /* [B, H] */
    float *scores = o + B * H;                  /* [B, Hq, max_len] */
    void *work = scores + B * Hq * max_len;
    int err;

    for (int64_t b = 0; b < B; b++) {
        float *r = residual + b * H;
        const float *hb = h + b * H;
        if (S->first) memcpy(r, hb, H * 4);
        else for (int64_t i = 0; i < H; i++) r[i] += hb[i];
        rms_norm_row(r, L->input_norm, x + b * H, H, L->eps);
    }
    if ((err = proj(&L->qkv, x, B, H, qkv, work, threads, S->path))) return err;

    for (int64_t b = 0; b < B; b++) {
        float *row = qkv + b * qkv_n;
        if (L->qkv_bias) for (int64_t i = 0; i < qkv_n; i++) row[i] += L->qkv_bias[i];
        const float *cs = S->cos_sin + S->positions[b] * D;
        for (int64_t hd = 0; hd < Hq + Hk; hd++) {  /* q heads, then k heads */
            float *head = row + hd * D;
            if (L->q_norm) rms_norm_row(head, hd < Hq ? L->q_norm : L->k_norm, head, D, L->eps);
            rotate(head, cs, D);
        }
        const int64_t slot = S->out_slots[b];
        if (kv) {
            quantize_kv(kv, row + qsize, kvsize, (uint8_t *)L->k_cache + slot * kv_row_bytes);
            quantize_kv(kv, row + qsize + kvsize, kvsize, (uint8_t *)L->v_cache + slot * kv_row_bytes);
        } else {
            memcpy((float *)L->k_cache + slot * kvsize, row + qsize, kvsize * 4);
            memcpy((float *)L->v_cache + slot * kvsize, row + qsize + kvsize, kvsize * 4);
        }
    }

    /* Attention, a (row, query head) a task. */
    const int64_t group = Hq / Hk, tasks = B * Hq;
    const int att_threads = tasks < threads ? (int)tasks : threads;
#pragma omp parallel for schedule(static) num_threads(att_threads) if (att_threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / Hq, hq = task % Hq, kvh = hq / group, len = S->seq_lens[b];
        const float *q = qkv + b * qkv_n + hq * D;
        float *sc = scores + task * max_len, *out = attn + b * qsize + hq * D;
        const int64_t *pages = S->page_table + b * S->max_pages;
        const context_rows keys = rows_of(L->k_cache, pages, S->page_size, Hk, kvh, head_bytes);
        const context_rows values = rows_of(L->v_cache, pages, S->page_size, Hk, kvh, head_bytes);
        if (kv == 0) {
            scores_f32(q, keys, len, D, L->scale, sc);
        } else {
            context_rows it = keys;
            for (int64_t t = 0; t < len; t++) sc[t] = kv_dot(kv, q, next_row(&it), D) * L->scale;
        }
        softmax_in_place(sc, len);
        if (kv == 0) {
            weighted_sum_f32(sc, values, len, D, out);
            continue;
        }
        context_rows it = values;
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
        for (int64_t t = 0; t < len; t++) kv_axpy(kv, out, sc[t], next_row(&it), D);
    }

    if ((err = proj(&L->o, attn, B, qsize, o, work, threads, S->path))) return err;
    for (int64_t b = 0; b < B; b++) {
        float *r = residual + b * H;
        for (int64_t i = 0; i < H; i++) r[i] += o[b * H + i];
        rms_norm_row(r, L->post_norm, x + b * H, H, L->eps);
    }
    if (L->gate_up.parts == 0) {  /* no MLP (a mixture-of-experts layer's): the normed rows back */
        memcpy(h, x, B * H * 4);
        return 0;
    }
    if ((err = proj(&L->gate_up, x, B, H, gate_up, work, threads, S->path))) return err;
    for (int64_t b = 0; b < B; b++) {  /* SiLU(gate) * up, into the gate half */
        float *g = gate_up + b * 2 * I;
        for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
    }
    /* The down projection reads rows 2 I apart: compact them first. */
    for (int64_t b = 1; b < B; b++) memmove(gate_up + b * I, gate_up + b * 2 * I, I * 4);
    return proj(&L->down, gate_up, B, I, h, work, threads, S->path);
}
