/* The thread split of a weight product, shared by both product kernels (int4_amx.c, int4_vector.c).
   PRODUCT_RUN(X_T, Y_T, XSUM_T, SCRATCH_T) defines, over the including source's job_t (fields x, x_stride, w, y,
   y_stride, M, K, xsum, b0, b1, scratch) and its `part` functions (a job's output blocks b0..b1-1 of 16 outputs):

       static void run(void *(*part)(void *), const X_T *x, long x_stride, const uint8_t *w, Y_T *y, long y_stride,
                       int M, int N, int K, XSUM_T *xsum, SCRATCH_T *scratch, long scratch_per_thread, int nthreads)

   Threads split the N/16 output blocks, never a sum: job i takes blocks nb*i/n .. nb*(i+1)/n - 1 and the scratch
   at scratch + i * scratch_per_thread (in SCRATCH_Ts). Where the pool's workers are busy (another caller's
   product) or cannot start, the caller computes every block alone: the same bits either way. */
#ifndef SIMLLM_PRODUCT_RUN_H
#define SIMLLM_PRODUCT_RUN_H

#include <stdint.h>
#include "pool.h"

#define PRODUCT_RUN(X_T, Y_T, XSUM_T, SCRATCH_T)                                                                  \
static job_t pool_jobs[MAXT];                                                                                     \
static void run(void *(*part)(void *), const X_T *x, long x_stride, const uint8_t *w, Y_T *y, long y_stride,     \
                int M, int N, int K, XSUM_T *xsum, SCRATCH_T *scratch, long scratch_per_thread, int nthreads) {  \
    const int nb = N / 16;                                                                                        \
    if (nthreads > nb) nthreads = nb;                                                                             \
    if (nthreads > MAXT) nthreads = MAXT;                                                                         \
    if (nthreads > 1 && pthread_mutex_trylock(&pool_use) != 0) {  /* busy: compute alone */                       \
        nthreads = 1;                                                                                             \
        if (pool_prof) pool_stat[3] += 1;                                                                         \
    }                                                                                                             \
    if (nthreads < 1) nthreads = 1;                                                                               \
    job_t alone[1];                                                                                               \
    job_t *jobs = nthreads > 1 ? pool_jobs : alone;                                                               \
    for (int i = 0; i < nthreads; i++)                                                                            \
        jobs[i] = (job_t){.x = x, .x_stride = x_stride, .w = w, .y = y, .y_stride = y_stride, .M = M, .K = K,     \
                          .xsum = xsum, .b0 = (int)((long)nb * i / nthreads),                                     \
                          .b1 = (int)((long)nb * (i + 1) / nthreads), .scratch = scratch + i * scratch_per_thread}; \
    if (nthreads == 1) { part(&jobs[0]); return; }                                                                \
    if (!pool_start(nthreads)) {  /* could not start workers: alone, the same bits */                             \
        job_t one = jobs[0]; one.b1 = nb;                                                                         \
        part(&one);                                                                                               \
        pthread_mutex_unlock(&pool_use);                                                                          \
        return;                                                                                                   \
    }                                                                                                             \
    pool_dispatch(part, jobs, sizeof(job_t), nthreads);                                                           \
}

#endif
