/* MXFP4 row products on the CPU: y = x . W[n] with W in GGML's block_mxfp4 blocks
 * (gpt-oss's experts, from llama.cpp's GGUF or repacked from OpenAI's safetensors).
 *
 * Called by hr_block_gemv (block_gemv.c) and hr_moe_experts (moe_experts.c) through
 * hr_rows (blocks.h), on activation rows quantized as for the other types: per block of
 * 32, int16 codes c = round(x / dx), dx = max|x| / 32767 (hr_quantize_row).
 *
 * Block layout (ggml-common.h; gguf.quants.MXFP4 decodes the same), 32 weights a block:
 *   MXFP4 {u8 e; u8 qs[16]}   17 bytes
 * weight j (j < 16) is the low nibble of qs[j], weight j + 16 its high nibble; a nibble is
 * an E2M1 code (sign bit highest), read as twice its value, an integer u in [-12, 12]
 * (KVALUES, gguf's kvalues), and the block's scale is 2**(e - 128) (ggml's
 * ggml_e8m0_to_fp32_half: half of the E8M0 power of two, since u is doubled). A block's
 * product is
 *
 *     dx_b * 2**(e - 128) * (u . c_b)
 *
 * with u . c_b exact in int32 (|u| <= 12, |c| <= 32767, 32 terms), the sum over blocks
 * accumulated in float32. One plain C loop the compiler vectorizes (the 16-entry table
 * lookup and the int16 products); `scalar` selects nothing here.
 */
#include <stdint.h>
#include <string.h>

#include "blocks.h"

static const int8_t KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2**(e - 128) as ggml_e8m0_to_fp32_half builds it (the two smallest subnormal). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

void hr_mxfp4_rows(const uint8_t *w, int64_t K, const int16_t *codes, const float *dx, int64_t M, int64_t n0,
                   int64_t n1, float *y, int64_t ldy) {
    const int64_t nb = K / 32, row_bytes = nb * 17;
    int16_t u[32];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t i = 0; i < M; i++) y[i * ldy + n] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * 17;
            for (int l = 0; l < 16; l++) {
                u[l] = KVALUES[blk[1 + l] & 15];
                u[l + 16] = KVALUES[blk[1 + l] >> 4];
            }
            const float d = e8m0_half(blk[0]);
            for (int64_t i = 0; i < M; i++) {
                const int16_t *c = codes + i * K + b * 32;
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += (int32_t)u[l] * c[l];
                y[i * ldy + n] += dx[i * nb + b] * d * (float)dot;
            }
        }
    }
}
