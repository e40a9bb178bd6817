/* A decoder layer's row work around its attention on the CPU (layer.h declares it), for B
 * rows of one token each: a decode step's rows (decode_layer.c runs its attention between
 * the two halves) or a prefill or extend chunk's tokens (engine/layers/cpu_decode.py runs
 * torch's attention backend between them), float32 throughout, the projections from GGUF
 * blocks through hr_block_gemv (block_gemv.c). From 16 rows on, the per-row work (norms,
 * rotary, the KV store, SiLU) spreads over the step's threads; a decode step's few rows
 * keep to one. Its reference is the torch layer (engine/models/decoder.py:
 * DecoderLayer.forward); tests/test_cpu_kernels.py compares the two.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "layer.h"

/* Rows from which the per-row loops take the step's threads. */
enum { HR_PARALLEL_ROWS = 16 };

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

/* n values into a pool row of kv_type (layer.h): float32 as they are, float16 rounded to
 * nearest even (torch's .to(torch.float16)), or q8_0/q4_0 blocks (n % 32 == 0). */
static void store_kv(int type, const float *x, int64_t n, uint8_t *out) {
    if (type == 0) {
        memcpy(out, x, n * 4);
    } else if (type == KV_F16) {
        int64_t i = 0;
#ifdef HR_AVX2
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) {
            const uint16_t h = f32_to_f16(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    } else {
        quantize_kv(type, x, n, out);
    }
}

/* store_kv for the tests: x [rows, n] float32 into out [rows, hr_kv_head_bytes(type, n)]. */
void hr_quantize_kv(int type, const float *x, int64_t rows, int64_t n, uint8_t *out) {
    for (int64_t r = 0; r < rows; r++) store_kv(type, x + r * n, n, out + r * hr_kv_head_bytes(type, n));
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

int hr_layer_in(const hr_layer *L, const hr_step *S, float *h, float *residual, void *scratch) {
    const int64_t B = S->rows, H = L->hidden, D = L->head_dim, Hq = L->num_heads, Hk = L->num_kv_heads;
    const int64_t qsize = Hq * D, kvsize = Hk * D, qkv_n = qsize + 2 * kvsize;
    const int kv = L->kv_type, threads = S->threads > 1 && B >= HR_PARALLEL_ROWS ? S->threads : 1;
    const int64_t kv_row_bytes = Hk * hr_kv_head_bytes(kv, D);
    const hr_scratch s = hr_scratch_of(L, B, scratch);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++) {
        float *r = residual + b * H;
        const float *hb = h + b * H;
        if (S->first) memcpy(r, hb, H * 4);
        else for (int64_t i = 0; i < H; i++) r[i] += hb[i];
        rms_norm_row(r, L->input_norm, s.x + b * H, H, L->eps);
    }
    const int err = proj(&L->qkv, s.x, B, H, s.qkv, s.work, S->threads, S->path);
    if (err) return err;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++) {
        float *row = s.qkv + b * qkv_n;
        if (L->qkv_bias) for (int64_t i = 0; i < qkv_n; i++) row[i] += L->qkv_bias[i];
        const float *cs = S->cos_sin + S->positions[b] * D;
        for (int64_t hd = 0; hd < Hq + Hk; hd++) {  /* q heads, then k heads */
            float *head = row + hd * D;
            if (L->q_norm) rms_norm_row(head, hd < Hq ? L->q_norm : L->k_norm, head, D, L->eps);
            rotate(head, cs, D);
        }
        const int64_t slot = S->out_slots[b];
        store_kv(kv, row + qsize, kvsize, (uint8_t *)L->k_cache + slot * kv_row_bytes);
        store_kv(kv, row + qsize + kvsize, kvsize, (uint8_t *)L->v_cache + slot * kv_row_bytes);
    }
    return 0;
}

int hr_layer_out(const hr_layer *L, const hr_step *S, const float *attn, float *h, float *residual, void *scratch) {
    const int64_t B = S->rows, H = L->hidden, I = L->intermediate, qsize = L->num_heads * L->head_dim;
    const int threads = S->threads > 1 && B >= HR_PARALLEL_ROWS ? S->threads : 1;
    const hr_scratch s = hr_scratch_of(L, B, scratch);
    int err;
    if ((err = proj(&L->o, attn, B, qsize, s.o, s.work, S->threads, S->path))) return err;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++) {
        float *r = residual + b * H;
        for (int64_t i = 0; i < H; i++) r[i] += s.o[b * H + i];
        rms_norm_row(r, L->post_norm, s.x + b * H, H, L->eps);
    }
    if (L->gate_up.parts == 0) {  /* no MLP (a mixture-of-experts layer's): the normed rows back */
        memcpy(h, s.x, B * H * 4);
        return 0;
    }
    if ((err = proj(&L->gate_up, s.x, B, H, s.gate_up, s.work, S->threads, S->path))) return err;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++) hr_silu_mul_row(s.gate_up + b * 2 * I, s.gate_up + b * 2 * I + I, I);  /* into the gate half */
    /* The down projection reads rows 2 I apart: compact them first. */
    for (int64_t b = 1; b < B; b++) memmove(s.gate_up + b * I, s.gate_up + b * 2 * I, I * 4);
    return proj(&L->down, s.gate_up, B, I, h, s.work, S->threads, S->path);
}
