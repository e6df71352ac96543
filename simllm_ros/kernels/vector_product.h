/* What the float32 products' sources share besides the vector layer (vector_isa.h): the group sizes of the
   formats, a thread's job, and `run`, the thread split (product_run.h's PRODUCT_RUN, instantiated once in
   int4_vector.c), declared here so that int8_rows.h and int8_rows32.h say what they use. */
#ifndef SIMLLM_VECTOR_PRODUCT_H
#define SIMLLM_VECTOR_PRODUCT_H

#include <stdint.h>

#define GROUP 32
#define SB4K 8     /* groups of 32 per GGUF Q4_K super-block (256 inputs), which share d and dmin */

/* A thread's share of a product: output blocks b0..b1-1 of 16 outputs for rows x [M, K] (run fills it) */
typedef struct {
    const float *x; long x_stride; const uint8_t *w; float *y; long y_stride;
    int M, K; const float *xsum; int b0, b1; float *scratch;
    int nb;  /* the product's blocks in all: a prefetch ahead stays within the weights */
} job_t;

/* The thread split over `part` (product_run.h): int4_vector.c's PRODUCT_RUN(float, float, const float, float) */
static void run(void *(*part)(void *), const float *x, long x_stride, const uint8_t *w, float *y, long y_stride,
                int M, int N, int K, const float *xsum, float *scratch, long scratch_per_thread, int nthreads);

#endif
