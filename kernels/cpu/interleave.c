/* GGUF blocks interleaved by 16 weight rows, the layout rows16.c multiplies, written at
 * load: the same bytes reordered, byte for byte what kernels/cpu/rows16.py's torch
 * interleave writes (its docstring has the layout; the tests compare the two). One pass
 * over the blocks, the 16-row groups spread over the threads: a Qwen3-30B-A3B-shape
 * layer's experts (390 MB) took about a second through torch's reshapes and copies.
 */
#include <stdint.h>
#include <string.h>

#include "blocks.h"

enum { R = 16 };

/* Legacy blocks (Q4_0, Q4_1, Q8_0): a chunk a block of the group's 16 rows, their
 * float16 d (then Q4_1's m), then code byte 32k + 2j + t = the file's qs[2k + t] of row j. */
static void legacy(const uint8_t *const *row, int64_t nb, int scale_bytes, int code_bytes, uint8_t *dst) {
    const int bb = scale_bytes + code_bytes;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *c = dst + b * R * bb;
        for (int j = 0; j < R; j++) {
            const uint8_t *blk = row[j] + b * bb;
            for (int s = 0; s < scale_bytes / 2; s++) memcpy(c + s * 2 * R + 2 * j, blk + 2 * s, 2);
            for (int k = 0; k < code_bytes / 2; k++) memcpy(c + R * scale_bytes + 32 * k + 2 * j, blk + scale_bytes + 2 * k, 2);
        }
    }
}

/* Q4_K / Q5_K: d, dmin, 12 scale planes, codes (byte 512p + 32k + 2j + t = qs[32p + 2k + t]);
 * Q5_K then byte 32k + 2j + t = qh[2k + t]. */
static void q4k(const uint8_t *const *row, int64_t nsb, int five, uint8_t *dst) {
    const int bb = five ? 176 : 144;
    for (int64_t s = 0; s < nsb; s++) {
        uint8_t *c = dst + s * R * bb;
        for (int j = 0; j < R; j++) {
            const uint8_t *blk = row[j] + s * bb, *qs = blk + bb - 128;
            memcpy(c + 2 * j, blk, 2);
            memcpy(c + 32 + 2 * j, blk + 2, 2);
            for (int p = 0; p < 12; p++) c[64 + 16 * p + j] = blk[4 + p];
            for (int p = 0; p < 4; p++)
                for (int k = 0; k < 16; k++) memcpy(c + 256 + 512 * p + 32 * k + 2 * j, qs + 32 * p + 2 * k, 2);
            if (five)
                for (int k = 0; k < 16; k++) memcpy(c + 2304 + 32 * k + 2 * j, blk + 16 + 2 * k, 2);
        }
    }
}

/* Q6_K: d, the scales by sub-block, ql (byte 1024h + 32k + 2j + t = ql[64h + 2k + t]),
 * then the top 2 bits: byte 2336 + 512h + 32m + 2j + t packs, low bits first, those of
 * weights 4m + t, 64 + 4m + t, 4m + 2 + t and 64 + 4m + 2 + t of half h, where weight i's
 * are bits 2(i / 32) of qh[32h + i % 32]. */
static void q6k(const uint8_t *const *row, int64_t nsb, uint8_t *dst) {
    for (int64_t s = 0; s < nsb; s++) {
        uint8_t *c = dst + s * R * 210;
        for (int j = 0; j < R; j++) {
            const uint8_t *blk = row[j] + s * 210, *ql = blk, *qh = blk + 128;
            memcpy(c + 2 * j, blk + 208, 2);
            for (int sb = 0; sb < 16; sb++) c[32 + 16 * sb + j] = blk[192 + sb];
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 32; k++) memcpy(c + 288 + 1024 * h + 32 * k + 2 * j, ql + 64 * h + 2 * k, 2);
            for (int h = 0; h < 2; h++) {
                uint8_t top[128];  /* weight i's top bits: bits 2(i / 32) of qh[32h + i % 32] */
                for (int i = 0; i < 128; i++) top[i] = (qh[32 * h + (i & 31)] >> (2 * (i >> 5))) & 3;
                for (int m = 0; m < 16; m++)
                    for (int t = 0; t < 2; t++)
                        c[2336 + 512 * h + 32 * m + 2 * j + t] =
                            (uint8_t)(top[4 * m + t] | top[64 + 4 * m + t] << 2 | top[4 * m + 2 + t] << 4 |
                                      top[64 + 4 * m + 2 + t] << 6);
            }
        }
    }
}

/* N rows (a multiple of 16) of `type` blocks, row_bytes each, from src into dst (as
 * large; not src) interleaved. Returns 0, or -1 for a type it does not take or N not a
 * multiple of 16. */
int hr_rows16_interleave(int type, const uint8_t *src, int64_t N, int64_t row_bytes, uint8_t *dst, int threads) {
    if (N % R || N < 0 || row_bytes <= 0) return -1;
    int scale_bytes = 0, code_bytes = 0;
    if (type == Q4_0) scale_bytes = 2, code_bytes = 16;
    else if (type == Q4_1) scale_bytes = 4, code_bytes = 16;
    else if (type == Q8_0) scale_bytes = 2, code_bytes = 32;
    else if (type != Q4_K && type != Q5_K && type != Q6_K) return -1;
    const int64_t bb = scale_bytes ? scale_bytes + code_bytes : hr_block_bytes(type);
    if (row_bytes % bb) return -1;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
    for (int64_t g = 0; g < N / R; g++) {
        const uint8_t *row[R];
        for (int j = 0; j < R; j++) row[j] = src + (g * R + j) * row_bytes;
        uint8_t *out = dst + g * R * row_bytes;
        if (scale_bytes) legacy(row, row_bytes / bb, scale_bytes, code_bytes, out);
        else if (type == Q6_K) q6k(row, row_bytes / bb, out);
        else q4k(row, row_bytes / bb, type == Q5_K, out);
    }
    return 0;
}
