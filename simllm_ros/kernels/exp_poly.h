/* Cephes' expf polynomial, for x in [-87, 88] (callers clamp): the attention's softmax and the layers' SiLU.
   exp(x) = y * s with s = 2^n; the parts are returned apart so that a caller's `1 + exp(x)` can be the one fused
   multiply-add fma(y, s, 1) it has always been, written out (the build turns contraction off). The 16-lane form
   (AVX-512) and the one-lane form (every other CPU) perform the same operations, so both give the same bits.
   Ours rather than libm's expf, whose bits may differ between C libraries. The same parts give expm1 without the
   cancellation of exp(x) - 1 (exp = 1 + inner, scaled), and with it tanh for attention-score soft-capping. */
#ifndef SIMLLM_EXP_POLY_H
#define SIMLLM_EXP_POLY_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_poly1_inner(float x, float *scale) {  /* exp(x) = (1 + inner) * scale */
    const float n = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const int32_t e = ((int32_t)n + 127) << 23;
    memcpy(scale, &e, 4);
    return fmaf(p * r, r, r);
}
static inline float exp_poly1_parts(float x, float *scale) { return exp_poly1_inner(x, scale) + 1.0f; }
static inline float exp_poly1(float x) { float s; const float y = exp_poly1_parts(x, &s); return y * s; }

/* cap * tanh(x / cap) (Gemma 2's attention-score soft-capping): tanh(|y|) = -m / (2 + m) with m = expm1(-2|y|)
   (in (-1, 0]: no cancellation near 0), the sign of y put back. Every CPU computes these same operations. */
static inline float softcap1(float x, float cap) {
    const float y = x / cap;
    float z = -2.0f * fabsf(y);
    if (z < -87.0f) z = -87.0f;
    float s;
    const float in = exp_poly1_inner(z, &s);
    const float m = fmaf(s, in, s - 1.0f);
    return copysignf(-m / (2.0f + m), y) * cap;
}

#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 exp_poly_inner(__m512 x, __m512 *scale) {
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    *scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)),
                                                   23));
    return _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r);
}
static inline __m512 exp_poly_parts(__m512 x, __m512 *scale) {
    return _mm512_add_ps(exp_poly_inner(x, scale), _mm512_set1_ps(1.0f));
}
static inline __m512 exp_poly(__m512 x) { __m512 s; const __m512 y = exp_poly_parts(x, &s); return _mm512_mul_ps(y, s); }
/* softcap1 on 16 lanes: the same operations */
static inline __m512 softcap16(__m512 x, __m512 cap) {
    const __m512i sbit = _mm512_set1_epi32((int)0x80000000u), mag = _mm512_set1_epi32(0x7fffffff);
    const __m512i y = _mm512_castps_si512(_mm512_div_ps(x, cap));
    const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(y, mag));
    const __m512 z = _mm512_max_ps(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)), _mm512_set1_ps(-87.0f));
    __m512 s;
    const __m512 in = exp_poly_inner(z, &s);
    const __m512 m = _mm512_fmadd_ps(s, in, _mm512_sub_ps(s, _mm512_set1_ps(1.0f)));
    const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(m), sbit));  /* -m */
    const __m512i t = _mm512_castps_si512(_mm512_div_ps(neg, _mm512_add_ps(_mm512_set1_ps(2.0f), m)));
    /* copysign(t, y) */
    const __m512 ct = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(t, mag), _mm512_and_si512(y, sbit)));
    return _mm512_mul_ps(ct, cap);
}
#endif
#endif
