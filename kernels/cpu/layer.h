/* What a decoder layer on the CPU shares between decode_layer.c (a decode step's layer in
 * one call) and layer_rows.c (the row work around the attention, which a prefill chunk
 * runs too): the layer's and the step's structs (kernels/cpu/decode_layer.py mirrors them
 * field for field) and where a layer's scratch keeps what.
 */
#ifndef HR_LAYER_H
#define HR_LAYER_H

#include <stdint.h>

#include "activation.h"
#include "blocks.h"

int hr_block_gemv(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                  int64_t ldy, void *work, int threads, int scalar);
int64_t hr_work_bytes(int64_t M, int64_t K);

/* A float16 KV pool's kv_type (ggml's GGML_TYPE_F16); 0 is float32, Q8_0 and Q4_0 blocks. */
enum { KV_F16 = 1 };

/* Bytes of one KV head's row of D values in a pool of kv_type. */
static inline int64_t hr_kv_head_bytes(int kv_type, int64_t D) {
    return kv_type == 0 ? D * 4 : kv_type == KV_F16 ? D * 2 : D / 32 * (kv_type == Q8_0 ? 34 : 18);
}

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
    void *k_cache, *v_cache;                   /* [slots, Hk, D] float32 or float16, or [slots, Hk, D / 32 * 34 (18)] */
    int32_t kv_type;                           /* 0: float32; KV_F16: float16; Q8_0 or Q4_0: blocks */
    int32_t pad;
} hr_layer;

/* The step: B rows of one token each (a decode step's sequences, or a prefill or extend
 * chunk's tokens: seq_lens and page_table are read by the decode attention alone). */
typedef struct {
    int64_t rows, page_size, max_pages;
    const int64_t *positions, *out_slots, *seq_lens;  /* [B] */
    const int64_t *page_table;                         /* [B, max_pages] */
    const float *cos_sin;                              /* [max_pos, D]: cos | sin halves */
    int32_t threads, first;                            /* first: residual = h */
    int32_t path, pad;                                 /* the projections' HR_PATH_* (blocks.h) */
} hr_step;

/* A layer's scratch for B rows, one region after another: x [B, H] (normed rows), qkv
 * [B, (Hq + 2 Hk) D], attn [B, Hq D], gate_up [B, 2 I], o [B, H], the block GEMV's work,
 * then the decode attention's scores [B, Hq, max_len]. */
typedef struct {
    float *x, *qkv, *attn, *gate_up, *o;
    void *work;
    float *scores;
} hr_scratch;

/* The widest input a projection of L takes (the GEMV's work is sized by it). */
static inline int64_t hr_widest(const hr_layer *L) {
    int64_t widest = L->hidden > L->intermediate ? L->hidden : L->intermediate;
    return L->num_heads * L->head_dim > widest ? L->num_heads * L->head_dim : widest;
}

static inline hr_scratch hr_scratch_of(const hr_layer *L, int64_t B, void *scratch) {
    const int64_t qkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
    hr_scratch s;
    s.x = (float *)scratch;
    s.qkv = s.x + B * L->hidden;
    s.attn = s.qkv + B * qkv;
    s.gate_up = s.attn + B * L->num_heads * L->head_dim;
    s.o = s.gate_up + B * 2 * L->intermediate;
    s.work = s.o + B * L->hidden;
    s.scores = (float *)((uint8_t *)s.work + (hr_work_bytes(B, hr_widest(L)) + 63) / 64 * 64);
    return s;
}


/* The layer up to its attention for the step's rows, h and residual [B, H]: r += h (r = h
 * when S->first); x = rms_norm(r) w_in; q, k, v = split(x Wqkv^T (+ bias)) into the
 * scratch's qkv rows; per head rms_norm(q), rms_norm(k) where the layer has them; q, k
 * rotated at each row's position (GPT-NeoX halves); k, v stored at each row's slot of the
 * pool. Returns 0, or -1: a projection's block type the GEMV does not take. */
int hr_layer_in(const hr_layer *L, const hr_step *S, float *h, float *residual, void *scratch);
/* The layer after its attention: attn [B, Hq D] (the attention's output rows); r += attn
 * Wo^T; x = rms_norm(r) w_post; h = down(silu(gate(x)) up(x)), or h = x where the layer
 * has no MLP (gate_up.parts 0: a mixture-of-experts layer, its experts the caller's).
 * Returns 0 or -1 as hr_layer_in. */
int hr_layer_out(const hr_layer *L, const hr_step *S, const float *attn, float *h, float *residual, void *scratch);

#endif
