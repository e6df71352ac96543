/* The thread split of a weight product, shared by both product kernels (int4_amx.c, int4_vector.c).
   PRODUCT_RUN(X_T, Y_T, XSUM_T, SCRATCH_T) defines, over the including source's job_t (fields x, x_stride, w, y,
   y_stride, M, K, xsum, b0, b1, scratch) and its `part` functions (a job's output blocks b0..b1-1 of 16 outputs):

       static void run(void *(*part)(void *), const X_T *x, long x_stride, const uint8_t *w, Y_T *y, long y_stride,
                       int M, int N, int K, XSUM_T *xsum, SCRATCH_T *scratch, long scratch_per_thread, int nthreads)

   Threads split the N/16 output blocks, never a sum: the blocks are cut into chunks that shrink toward the end
   (chunk c of C ends at block nb - nb (C-c-1)^2 / C^2: the first ~2/C of the blocks, the last ~1/C^2), so the
   thread that finishes first waits at most for a small chunk. Each is computed whole by the thread that claims it,
   with its scratch at scratch + tid * scratch_per_thread (in SCRATCH_Ts). Where the pool's workers are busy
   (another caller's product) or cannot start, the caller computes every block alone: the same bits either way. */
#ifndef SIMLLM_PRODUCT_RUN_H
#define SIMLLM_PRODUCT_RUN_H

#include <stdint.h>
#include "pool.h"

/* Chunks per thread a product is cut into: the threads take chunks until none is left (pool.h), so a thread that
   starts late or runs slow takes fewer; more chunks balance better and cost a claim each (~0.1 us). */
#define PRODUCT_CHUNKS_PER_THREAD 8
/* ... and no more chunks than one per this many multiply-adds (at least one per thread): a claim moves a cache line
   between cores, and a one-row product of ~1M multiply-adds (a 0.5B model's q or o) took 16 claims. */
#define PRODUCT_CHUNK_MACS 131072L

#define PRODUCT_RUN(X_T, Y_T, XSUM_T, SCRATCH_T)                                                                  \
typedef struct { job_t job; void *(*part)(void *); int nb, chunks; long scratch_per_thread; } product_ctx_t;       \
static void product_chunk(void *ctx, int c, int tid) {                                                            \
    const product_ctx_t *p = ctx;                                                                                 \
    job_t j = p->job;                                                                                             \
    const long C = p->chunks, nb = p->nb;                                                                         \
    j.b0 = (int)(nb - nb * (C - c) * (C - c) / (C * C));                                                          \
    j.b1 = (int)(nb - nb * (C - c - 1) * (C - c - 1) / (C * C));                                                  \
    j.scratch = p->job.scratch + tid * p->scratch_per_thread;                                                     \
    p->part(&j);                                                                                                  \
}                                                                                                                 \
static void run(void *(*part)(void *), const X_T *x, long x_stride, const uint8_t *w, Y_T *y, long y_stride,     \
                int M, int N, int K, XSUM_T *xsum, SCRATCH_T *scratch, long scratch_per_thread, int nthreads) {  \
    const int nb = N / 16;                                                                                        \
    if (nthreads > nb) nthreads = nb;                                                                             \
    if (nthreads > MAXT) nthreads = MAXT;                                                                         \
    if (nthreads > 1 && pthread_mutex_trylock(&pool_use) != 0) {  /* busy: compute alone */                       \
        nthreads = 1;                                                                                             \
        if (pool_prof) pool_stat[3] += 1;                                                                         \
    }                                                                                                             \
    job_t one = {.x = x, .x_stride = x_stride, .w = w, .y = y, .y_stride = y_stride, .M = M, .K = K,              \
                 .xsum = xsum, .b0 = 0, .b1 = nb, .scratch = scratch, .nb = nb};                                            \
    if (nthreads <= 1) { part(&one); return; }                                                                    \
    if (!pool_start(nthreads)) {  /* could not start workers: alone, the same bits */                             \
        part(&one);                                                                                               \
        pthread_mutex_unlock(&pool_use);                                                                          \
        return;                                                                                                   \
    }                                                                                                             \
    int chunks = nthreads * PRODUCT_CHUNKS_PER_THREAD;                                                            \
    const long by_work = (long)M * N * K / PRODUCT_CHUNK_MACS;                                                    \
    if (chunks > by_work) chunks = by_work > nthreads ? (int)by_work : nthreads;                                  \
    if (chunks > nb) chunks = nb;                                                                                 \
    product_ctx_t ctx = {one, part, nb, chunks, scratch_per_thread};                                              \
    pool_run(product_chunk, &ctx, chunks, nthreads);                                                              \
}

#endif
