/* What libint4_amx exports: 4-bit (and 8-bit LM head) weight products on bf16 rows with AMX tiles
   (int4_amx.c), and the pool's entries. Builds without AMX export the same names as stubs (init says -1).
   One plain prototype per entry; kernels/abi.py checks the Python bindings against them. */
#ifndef SIMLLM_INT4_AMX_API_H
#define SIMLLM_INT4_AMX_API_H

#include <stdint.h>
#include "pool_api.h"

/* Ask Linux for the AMX tile state: 0 granted, else the kernel must not be used */
int simllm_int4_init(void);
/* y [M, N] bf16 = x [M, K] bf16 times 4-bit weights; xsum [M, K/32] gets the group sums; scratch per thread */
void simllm_int4_mm(const uint16_t *x, long x_stride, const uint8_t *w, uint16_t *y, long y_stride, int M, int N,
                    int K, float *xsum, uint8_t *scratch, long scratch_per_thread, int nthreads);
/* y [M, N] float32 = x [M, K] bf16 times 8-bit weights: the LM head's logits */
void simllm_int8_mm(const uint16_t *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                    uint8_t *scratch, long scratch_per_thread, int nthreads);

#endif
