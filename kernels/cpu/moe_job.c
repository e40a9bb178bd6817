/* One offloaded MoE layer's CPU half of a decode step, as a job that finds its own
 * pairs: the step's hidden rows, routed ids and router weights (copied into host
 * buffers by the device, in stream order), the layer's device lut (an expert's cache
 * slot, -1 for one the GPU reads over the bus, HR_CPU_RUN for one the CPU runs), and the
 * layer's blocks. moe_cpu_job gathers the routed pairs whose expert the lut gives the
 * CPU, runs them with hr_moe_experts (moe_experts.c) over the cores, and writes the
 * weighted sums [T, H] float32 (zeros in rows with no such pair).
 *
 * moe_cpu_job(void *) has the shape of a CUDA host function (cudaHostFn_t): the engine
 * queues it on a side stream between the copies in and the copy of the sums out, so a
 * captured decode graph holds it as a host node. It runs on the CUDA runtime's callback
 * thread: it calls no CUDA and no Python, allocates nothing (the caller's work bytes),
 * and opens its own OpenMP region of job->threads threads from that thread.
 *
 * Each call adds to the struct's running totals (runs, busy_ns from CLOCK_MONOTONIC, and
 * the pairs run; over the calls that ran a pair, the sums a least-squares line of time
 * against pairs needs): the engine reads them between steps, never writes them, and
 * refits the CPU's rates, per call and per pair, by what the job really took inside the
 * decode steps (engine/layers/moe/cpu_share.py).
 *
 * Rows whose live flag is 0 (a CUDA graph's padding rows) are skipped whole: no pair,
 * no conversion, no quantization. The pairs are taken in (row, k) order and grouped by
 * expert, ascending, stably: the order engine/layers/moe/cpu_runs.py's gather and
 * kernels/cpu/moe_experts.py's group_pairs give, so the sums are the same bits.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime and CLOCK_MONOTONIC under -std=c11 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "blocks.h"

enum { HR_CPU_RUN = -2 };           /* the lut's code for an expert the CPU runs */
enum { HR_F32 = 0, HR_BF16 = 1, HR_F16 = 2 };  /* dtypes of x and weights */

/* Field order and types are kernels/cpu/moe_job.py's JobStruct. */
typedef struct {
    const void *x;           /* [T, H], x_dtype */
    const int64_t *ids;      /* [T, K] */
    const void *weights;     /* [T, K], w_dtype */
    const float *live;       /* [T]: 0 for a padding row; NULL: every row live */
    const int64_t *lut;      /* [E] */
    float *out;              /* [T, H] float32, written whole */
    void *work;              /* work_bytes, hr_moe_job_work_bytes(T, H, I, K, E) at least */
    const uint8_t *gate, *up, *down;
    int64_t T, H, I, K, E, work_bytes;
    int32_t x_dtype, w_dtype, tg, tu, td, threads, path;
    int32_t status;          /* out: 0 done; -1 a type or size hr_moe_experts refused; -2 work too small;
                                -3 an id outside 0..E-1; -4 an unknown dtype */
    int64_t pairs;           /* out: the CPU pairs it ran */
    int64_t runs, busy_ns, pairs_run;  /* out, running totals over every call: calls, their
                                          wall nanoseconds, the pairs they ran */
    int64_t paired_runs, paired_ns, pairs_sq;  /* out, over the calls that ran a pair: calls, their
                                                  nanoseconds, the sum of their pairs squared */
    double pair_ns;          /* out: the sum over those calls of pairs x nanoseconds (a line's fit) */
} hr_moe_job;

int hr_moe_experts(const float *x, int64_t T, int64_t H, int64_t I, const int32_t *token, const float *weight,
                   int64_t P, const int32_t *expert, const int32_t *start, int64_t G, const uint8_t *gate,
                   const uint8_t *up, const uint8_t *down, int tg, int tu, int td, const float *bias_gate_up,
                   const float *bias_down, float alpha, float limit, float *out, void *work, int threads,
                   int scalar);
int64_t hr_moe_work_bytes(int64_t T, int64_t H, int64_t I, int64_t P);

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else {  /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float value_at(const void *p, int64_t i, int dtype) {
    if (dtype == HR_F32) return ((const float *)p)[i];
    const uint16_t v = ((const uint16_t *)p)[i];
    if (dtype == HR_BF16) {
        const uint32_t bits = (uint32_t)v << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return half_to_float(v);
}

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* The job's own arrays, then hr_moe_experts' work for T rows and T * K pairs. */
int64_t hr_moe_job_work_bytes(int64_t T, int64_t H, int64_t I, int64_t K, int64_t E) {
    return 2 * align64(4 * T * H) + align64(4 * T) + 2 * align64(4 * T * K) + 3 * align64(4 * (E + 1))
           + hr_moe_work_bytes(T, H, I, T * K);
}

static void run_job(hr_moe_job *job) {
    const int64_t T = job->T, H = job->H, K = job->K, E = job->E;
    job->pairs = 0;
    if (job->x_dtype < HR_F32 || job->x_dtype > HR_F16 || job->w_dtype < HR_F32 || job->w_dtype > HR_F16) {
        job->status = -4;
        return;
    }
    if (job->work_bytes < hr_moe_job_work_bytes(T, H, job->I, K, E)) {
        job->status = -2;
        return;
    }
    memset(job->out, 0, (size_t)(T * H) * sizeof(float));
    char *at = (char *)job->work;
    float *xc = (float *)at;         /* the rows with a CPU pair, float32, compacted */
    at += align64(4 * T * H);
    float *yc = (float *)at;         /* their sums */
    at += align64(4 * T * H);
    int32_t *local = (int32_t *)at;  /* a row's place in xc, -1 for none */
    at += align64(4 * T);
    int32_t *token = (int32_t *)at;
    at += align64(4 * T * K);
    float *weight = (float *)at;
    at += align64(4 * T * K);
    int32_t *count = (int32_t *)at;  /* pairs per expert, then each expert's next free pair */
    at += align64(4 * (E + 1));
    int32_t *expert = (int32_t *)at;
    at += align64(4 * (E + 1));
    int32_t *start = (int32_t *)at;
    at += align64(4 * (E + 1));
    memset(count, 0, (size_t)E * sizeof(int32_t));
    int64_t rows = 0, pairs = 0;
    for (int64_t t = 0; t < T; t++) {
        local[t] = -1;
        if (job->live && job->live[t] == 0.0f) continue;
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = job->ids[t * K + k];
            if (e < 0 || e >= E) {
                job->status = -3;
                return;
            }
            if (job->lut[e] != HR_CPU_RUN) continue;
            count[e]++;
            pairs++;
            if (local[t] < 0) local[t] = (int32_t)rows++;
        }
    }
    job->status = 0;
    if (!pairs) return;
    int64_t groups = 0;
    start[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!count[e]) continue;
        expert[groups] = (int32_t)e;
        start[groups + 1] = start[groups] + count[e];
        count[e] = start[groups];  /* now the expert's next free pair */
        groups++;
    }
    for (int64_t t = 0; t < T; t++) {
        if (local[t] < 0) continue;
        const int64_t r = local[t];
        for (int64_t h = 0; h < H; h++) xc[r * H + h] = value_at(job->x, t * H + h, job->x_dtype);
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = job->ids[t * K + k];
            if (job->lut[e] != HR_CPU_RUN) continue;
            const int32_t p = count[e]++;
            token[p] = (int32_t)r;
            weight[p] = value_at(job->weights, t * K + k, job->w_dtype);
        }
    }
    memset(yc, 0, (size_t)(rows * H) * sizeof(float));
    if (hr_moe_experts(xc, rows, H, job->I, token, weight, pairs, expert, start, groups, job->gate, job->up,
                       job->down, job->tg, job->tu, job->td, NULL, NULL, 0.0f, 0.0f, yc, at, job->threads,
                       job->path) != 0) {
        job->status = -1;
        return;
    }
    for (int64_t t = 0; t < T; t++)
        if (local[t] >= 0) memcpy(job->out + t * H, yc + (int64_t)local[t] * H, (size_t)H * sizeof(float));
    job->pairs = pairs;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void moe_cpu_job(void *arg) {
    hr_moe_job *job = (hr_moe_job *)arg;
    const int64_t start = now_ns();
    run_job(job);
    const int64_t took = now_ns() - start;
    job->busy_ns += took;
    job->pairs_run += job->pairs;
    job->runs++;
    if (job->pairs > 0) {  /* a call with no pair returns before its threads start */
        job->paired_runs++;
        job->paired_ns += took;
        job->pairs_sq += job->pairs * job->pairs;
        job->pair_ns += (double)job->pairs * (double)took;
    }
}
