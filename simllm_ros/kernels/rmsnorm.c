#include <stdint.h>
#include <string.h>
#include <math.h>
#include "rmsnorm_api.h"

typedef uint16_t bf16;
static inline float f32(bf16 b) { uint32_t u = ((uint32_t)b) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline bf16 to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* 1 / sqrt(mean + eps) of a row's squares summed in 16 lanes (one fused multiply-add per square): the lanes added
   in a fixed tree. */
static inline float inv_rms(float acc[16], int E, float eps) {
    for (int s = 8; s >= 1; s >>= 1)
        for (int l = 0; l < s; l++) acc[l] += acc[l + s];
    return 1.0f / sqrtf(acc[0] / (float)E + eps);
}

/* One row at a time: the squares (as IN gives x's elements in float32) summed by inv_rms, then y = OUT(w, x, r). x
   rows at x_stride (0: one row repeated), y rows contiguous, E a multiple of 16. */
#define DEFINE_RMSNORM(NAME, T, IN, OUT)                                                                  \
void NAME(const T *x, long x_stride, const T *w, T *y, int M, int E, float eps) {                         \
    for (int m = 0; m < M; m++) {                                                                         \
        const T *xr = x + (long)m * x_stride;                                                             \
        T *yr = y + (long)m * E;                                                                          \
        float acc[16] = {0};                                                                              \
        for (int k = 0; k < E; k += 16)                                                                   \
            for (int l = 0; l < 16; l++) { float v = IN(xr[k + l]); acc[l] = fmaf(v, v, acc[l]); }       \
        const float r = inv_rms(acc, E, eps);                                                             \
        for (int k = 0; k < E; k++) yr[k] = OUT(w[k], xr[k], r);                                          \
    }                                                                                                     \
}

/* bf16: y[m] = w * bf16(x[m] / sqrt(mean(x[m]^2) + eps)), rounded to bf16 as transformers rounds. */
#define BF16_OUT(w, x, r) to_bf16(f32(w) * f32(to_bf16(f32(x) * (r))))
DEFINE_RMSNORM(simllm_rmsnorm_bf16, bf16, f32, BF16_OUT)

/* float32 (the 4-bit float32 runner: int4_vector_kernel): y[m] = w * (x[m] * r), the sum of squares in the same
   16 lanes and tree. */
#define F32_IN(x) (x)
#define F32_OUT(w, x, r) ((w) * ((x) * (r)))
DEFINE_RMSNORM(simllm_rmsnorm_f32, float, F32_IN, F32_OUT)
