/* The vector layer of the float32 products (int4_vector.c, int8_rows.h, int8_rows32.h): one output lane per
   float, VL lanes a vector, and per CPU the instructions that load, broadcast, fuse multiply-adds and widen codes.
   Which branch a build takes (the compiler's target, -march=native by default; docs/kernels.md):

       target                      VL  vw          FMA(a, b, c)            codes widened by
       AVX-512F                    16  __m512      _mm512_fmadd_ps         _mm512_cvtepu8/epi8_epi32
       AVX2 + FMA (x86-64-v3)       8  v8 (GCC)    _mm256_fmadd_ps         _mm256_cvtepu8/epi8_epi32
       aarch64 NEON                 8  v8 (GCC)    vfmaq_f32, two halves   __builtin_convertvector
       anything else                8  v8 (GCC)    fmaf lane by lane       __builtin_convertvector
*/
#ifndef SIMLLM_VECTOR_ISA_H
#define SIMLLM_VECTOR_ISA_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint8_t u8x8 __attribute__((vector_size(8), aligned(1)));
typedef int8_t i8x8 __attribute__((vector_size(8), aligned(1)));
static inline v8 ld8(const float *p) { return *(const v8u *)p; }

/* Output lanes per vector (VL): 16 with AVX-512 (one vector per block of 16 outputs), else 8 (two). A lane is
   one output, so the width decides how many outputs an instruction computes, never an output's operations:
   every build computes the same bits (test_numerics_contract). FMA(a, b, c) is c + a * b with one rounding on
   every CPU (the build turns contraction off, so it is written out): vfmadd, NEON's fmla, else fmaf lane by lane
   (a correctly rounded libm call where the CPU has no FMA: slow, the same bits). DEC4/DEC8 give the 16 weights of
   KS4 = 2 inputs (4-bit codes 0..15: a pair shares 16 bytes, one widening for both) or KS8 = 1 input (8-bit codes
   -127..127) as floats, w[t][h]: input t, outputs VL*h.. in order. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef __m512 vw;
#define FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
static inline vw ld(const float *p) { return _mm512_loadu_ps(p); }
static inline void st(float *p, vw v) { _mm512_storeu_ps(p, v); }
static inline vw bc(float f) { return _mm512_set1_ps(f); }
/* 16 bytes (byte j: output j's two codes) -> 16 int32 -> the low nibbles (first input) and high (second) */
#define DEC4(p, w) do { const __m512i i_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))); \
        (w)[0][0] = _mm512_cvtepi32_ps(_mm512_and_si512(i_, _mm512_set1_epi32(15)));                     \
        (w)[1][0] = _mm512_cvtepi32_ps(_mm512_srli_epi32(i_, 4)); } while (0)
#define DEC8(p, w) do {                                                                                   \
        (w)[0][0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p)))); \
    } while (0)
/* VL unsigned bytes -> floats (Q4_K's sub-scales and sub-mins) */
#define CVTU8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))))
#else
#define VL 8
typedef v8 vw;
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__FMA__) && defined(__AVX2__)
#define FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#elif defined(__ARM_NEON)
#include <arm_neon.h>
typedef union { v8 v; float32x4_t q[2]; } v8q;
static inline v8 fma8(v8 a, v8 b, v8 c) {
    const v8q x = {a}, y = {b};
    v8q z = {c};
    z.q[0] = vfmaq_f32(z.q[0], x.q[0], y.q[0]);
    z.q[1] = vfmaq_f32(z.q[1], x.q[1], y.q[1]);
    return z.v;
}
#define FMA(a, b, c) fma8((a), (b), (c))
#else
#include <math.h>
static inline v8 fma8(v8 a, v8 b, v8 c) {
    for (int l = 0; l < 8; l++) c[l] = fmaf(a[l], b[l], c[l]);
    return c;
}
#define FMA(a, b, c) fma8((a), (b), (c))
#endif
static inline vw ld(const float *p) { return ld8(p); }
static inline void st(float *p, vw v) { *(v8u *)p = v; }
static inline vw bc(float f) { return (v8){f, f, f, f, f, f, f, f}; }
/* Eight codes widened to int32: x86's one-instruction widening (GCC expands the generic conversion of an 8-byte
   vector byte by byte there), the generic conversion elsewhere (aarch64: ushll/sshll). */
#if defined(__AVX2__)
#define U8X8(p) ((v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))))
#define I8X8(p) ((v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))))
#else
#define U8X8(p) __builtin_convertvector(*(const u8x8 *)(p), v8i)
#define I8X8(p) __builtin_convertvector(*(const i8x8 *)(p), v8i)
#endif
#define CVTU8(p) __builtin_convertvector(U8X8(p), v8)
#define DEC4(p, w) do { const v8i c_ = U8X8(p), d_ = U8X8((p) + 8);                                      \
        (w)[0][0] = __builtin_convertvector(c_ & 15, v8); (w)[0][1] = __builtin_convertvector(d_ & 15, v8); \
        (w)[1][0] = __builtin_convertvector(c_ >> 4, v8); (w)[1][1] = __builtin_convertvector(d_ >> 4, v8); } while (0)
#define DEC8(p, w) do { (w)[0][0] = __builtin_convertvector(I8X8(p), v8);                                 \
        (w)[0][1] = __builtin_convertvector(I8X8((p) + 8), v8); } while (0)
#endif
#define NH (16 / VL)

#endif
