/* What liblayers exports: decoder layers in one call a pass (layers.c over layer_stack.h), and the steps
   between products on their own (RoPE, SiLU/GELU times up) for layers that run in Python. The products,
   norms and attention they call come from the other libraries, through the addresses in the pass record.
   One plain prototype per entry; kernels/abi.py checks the Python bindings against them. A [tag] opens the
   comment of an entry that only some builds define (docs/kernels.md). */
#ifndef SIMLLM_LAYERS_API_H
#define SIMLLM_LAYERS_API_H

#include <stdint.h>

struct simllm_pass;    /* layers.c's pass_t: a bf16 pass's kernels, shapes and buffers (layer_kernel.py's _Pass) */
struct simllm_pass32;  /* layers.c's pass32_t: the same record with float32 entry points */

/* 1 where this build has the bf16 entries ([avx512]), else 0 */
int simllm_layers_available(void);
/* [avx512] bf16 layers first..last-1 over h [M, E] in place (layers.c says what weights, eps and ws hold) */
void simllm_layers_bf16(const struct simllm_pass *P, uint16_t *h, int M, int first, int last, const int64_t *weights,
                        const float *eps, const uint16_t *cos, const uint16_t *sin, uint16_t *ws);
/* float32 layers, portable C for any CPU */
void simllm_layers_f32(const struct simllm_pass32 *P, float *h, int M, int first, int last, const int64_t *weights,
                       const float *eps, const float *cos, const float *sin, float *ws);
/* [avx512] RoPE of the first H heads of each bf16 row, rounded as torch's bf16 ops */
void simllm_rope_bf16(const uint16_t *x, long row_stride, int M, int H, int D, const uint16_t *cos,
                      const uint16_t *sin, uint16_t *out);
/* [avx512] silu(gate) * up of bf16 rows gu [M, 2I] -> a [M, I] */
void simllm_silu_mul_bf16(const uint16_t *gu, long gu_stride, int M, int I, uint16_t *a, long a_stride);
/* RoPE of float32 rows: the first rot dimensions of each head turn, the rest stay */
void simllm_rope_f32(const float *x, long row_stride, int M, int H, int D, int rot, const float *cos,
                     const float *sin, float *out);
/* silu(gate) * up of float32 rows gu [M, 2I] -> a [M, I] */
void simllm_silu_mul_f32(const float *gu, long gu_stride, int M, int I, float *a, long a_stride);
/* The first index of the largest of n floats, a NaN counting as largest (torch.argmax's answer): greedy's pick */
long simllm_argmax_f32(const float *x, long n);
/* tanh GELU(gate) * up of float32 rows (Gemma 3's MLP) */
void simllm_gelu_tanh_mul_f32(const float *gu, long gu_stride, int M, int I, float *a, long a_stride);

#endif
