/* What librmsnorm exports: RMSNorm of rows, each row computed alone in a fixed order (rmsnorm.c).
   y [M, E] (rows contiguous) from x rows at x_stride (0: one row repeated) and the weight w [E]; E in 16s.
   One plain prototype per entry; kernels/abi.py checks the Python bindings against them. */
#ifndef SIMLLM_RMSNORM_API_H
#define SIMLLM_RMSNORM_API_H

#include <stdint.h>

/* bf16 rows, rounded to bf16 where transformers rounds */
void simllm_rmsnorm_bf16(const uint16_t *x, long x_stride, const uint16_t *w, uint16_t *y, int M, int E, float eps);
/* float32 rows (the float32 runner) */
void simllm_rmsnorm_f32(const float *x, long x_stride, const float *w, float *y, int M, int E, float eps);

#endif
