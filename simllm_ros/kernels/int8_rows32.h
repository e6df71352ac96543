/* GGUF's formats with a scale per group of 32 inputs (Q8_0, Q5_0, Q5_1, Q4_0, IQ4_NL, IQ4_XS) times rows quantized
   to 8 bits per 32, as llama.cpp multiplies them by Q8_0: each format's part of a product, over int8_rows.h's row
   quantizer, integer vector helpers and DEFINE_PART8. int4_vector.c defines the entries (DEFINE_MM8). */
#ifndef SIMLLM_INT8_ROWS32_H
#define SIMLLM_INT8_ROWS32_H

#include "int8_rows.h"

/* ---- 8-bit codes with a scale per 32 times 8-bit rows ("q8r": GGUF's Q8_0) ----
   The rows quantized per 32 inputs (as llama.cpp's Q8_0 rows). Per output and group of 32: isum = sum of code_w *
   code_x, exact in int32; then out = fma(d * dx, (float)isum, out), groups in order from 0. Weights (BLOB8R bytes per
   16 outputs x group, 8.5 bits a weight, as the file): 8 chunks of 64 bytes (chunk t, byte 4j + i: output j's code of input 4t + i,
   signed), then the 16 d (float16: the file's). VNNI takes unsigned weights: it adds 128 to each (xor 0x80) and takes 128 times
   the row's code sum back, the same integer. */
#define BLOB8R 544

/* Signed 8-bit weights times signed 8-bit row codes, four products summed into each int32 lane, where there is no
   VNNI: pmaddubsw takes |w| as unsigned and x with w's sign (int16 pairs at most 2 * 128 * 127), pmaddwd adds the
   pairs. Integer sums, exact: the same int32 as VNNI's or any other order. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(__AVX512VNNI__)
static inline __m512i sdot4(__m512i w, __m512i x) {
    const __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), _mm512_set1_epi16(1));
}
#elif !defined(__AVX512F__) && defined(__AVX2__)
static inline __m256i sdot4(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline void gdot8(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
#if defined(__AVX512VNNI__)
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i a = _mm512_set1_epi32(-128 * xs);
    for (int t = 0; t < 8; t++)
        a = dpbx(a, _mm512_xor_si512(_mm512_loadu_si512((const void *)(c + 64 * t)), flip), xg + 4 * t);
    is[0] = _mm512_add_epi32(is[0], a);
#else
    (void)xs;
    for (int t = 0; t < 8; t++)
        is[0] = _mm512_add_epi32(is[0], sdot4(_mm512_loadu_si512((const void *)(c + 64 * t)),
                                              _mm512_set1_epi32(rd32(xg + 4 * t))));
#endif
}
#elif !defined(__AVX512F__) && defined(__AVX2__)
static inline void gdot8(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
    (void)xs;
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 8; t++)
            is[h] = (vi)_mm256_add_epi32((__m256i)is[h],
                                         sdot4(_mm256_loadu_si256((const __m256i *)(const void *)(c + 64 * t + 32 * h)),
                                               _mm256_set1_epi32(rd32(xg + 4 * t))));
}
#elif !defined(__AVX512F__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
static inline void gdot8(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
    (void)xs;
    int32x4_t a[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int t = 0; t < 8; t++) {
        const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 4 * t)));
        for (int q = 0; q < 4; q++) a[q] = vdotq_s32(a[q], vld1q_s8((const int8_t *)(c + 64 * t + 16 * q)), x);
    }
    add4q(is, a);
}
#else
static inline void gdot8(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
    (void)xs;
    int32_t t[16] = {0};
    for (int q = 0; q < 8; q++)
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 4; i++) t[j] += (int8_t)c[64 * q + 4 * j + i] * xg[4 * q + i];
    add16(is, t);
}
#endif

static inline __attribute__((always_inline)) void sb8r(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                        vw o[QROWS][NH], const int NR) {
    for (int r = 0; r < NR; r++) {
        vi is[NH];
        for (int h = 0; h < NH; h++) is[h] = VI_ZERO;
        gdot8(blk, (const int8_t *)xr[r] + (long)s * GROUP, qrow_sums32(xr[r], K, GROUP)[s], is);
        const float dx = qrow_scales(xr[r], K)[s];
        for (int h = 0; h < NH; h++) o[r][h] = FMA(VW_F16(blk + 512 + 2 * VL * h) * bc(dx), VI_F(is[h]), o[r][h]);
    }
}
DEFINE_PART8(part8r, sb8r, BLOB8R, GROUP, GROUP)

/* ---- Q5_0 and Q4_0 weights times 8-bit rows ("q5r", "q4r") ----
   The rows as for q8r (per 32 inputs). Per output and group of 32: isum = sum of u * code_x minus 16 * xsum_g
   (u = the file's code -16..15 plus 16, 0..31), exact in int32 and equal to q8r's sum of code_w * code_x; then
   out = fma(d * dx, (float)isum, out), groups in order from 0: q8r's bits for the same codes. Weights (BLOB5R bytes
   per 16 outputs x group, 5.5 bits a weight, as the file): u's low 4 bits in 4 chunks of 64 bytes (chunk p, byte
   4j + i: output j's input 8p + i in the low nibble, 8p + 4 + i in the high), u's top bits in 64 bytes (byte 4j + i,
   bit 2p: output j's input 8p + i, bit 2p + 1: its input 8p + 4 + i), then the 16 d (float16: the file's).
   Q4_0 ("q4r") is the same without the top bits: u = the file's code 0..15, isum = sum of u * code_x minus 8 * xsum_g,
   BLOB4R bytes (4.5 bits a weight, as the file): the 256 bytes of nibbles, then the 16 d.
   Q5_1 ("q51r": weight d * code + m, codes 0..31) takes Q5_0's codes without the offset: isum = sum of code *
   code_x; then out = fma(d * dx, (float)isum, out) and out = fma(m * dx, (float)xsum_g, out), as llama.cpp's
   Q5_1 x Q8_1; BLOB51R bytes (6 bits a weight, as the file): Q5_0's nibbles and top bits, the 16 d, the 16 m. */
#define BLOB5R 352
#define BLOB4R 288
#define BLOB51R 384

/* Q5_0 (top, no mins), Q4_0 (neither) or Q5_1 (top, mins): the group's unsigned codes' sums, less 16 (8) times the
   row's code sum where the format has no mins, then one fma, and where it has, a second for the mins. */
static inline __attribute__((always_inline)) void sb5r4r(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                          vw o[QROWS][NH], const int NR, const int top,
                                                          const int mins) {
    for (int r = 0; r < NR; r++) {
        const int32_t xs = qrow_sums32(xr[r], K, GROUP)[s];
        vi is[NH];
        for (int h = 0; h < NH; h++) is[h] = VI_BC(mins ? 0 : -(top ? 16 : 8) * xs);
        gdotn(blk, (const int8_t *)xr[r] + (long)s * GROUP, is, 4, top);  /* 32 inputs: 4 chunks, 1 top bit or none */
        const float dx = qrow_scales(xr[r], K)[s];
        const uint8_t *d = blk + 256 + (top ? 64 : 0);
        for (int h = 0; h < NH; h++) o[r][h] = FMA(VW_F16(d + 2 * VL * h) * bc(dx), VI_F(is[h]), o[r][h]);
        if (mins)
            for (int h = 0; h < NH; h++) o[r][h] = FMA(VW_F16(d + 32 + 2 * VL * h) * bc(dx), bc((float)xs), o[r][h]);
    }
}
static inline __attribute__((always_inline)) void sb5r(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                        vw o[QROWS][NH], const int NR) {
    sb5r4r(blk, xr, s, K, o, NR, 1, 0);
}
static inline __attribute__((always_inline)) void sb4r(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                        vw o[QROWS][NH], const int NR) {
    sb5r4r(blk, xr, s, K, o, NR, 0, 0);
}
static inline __attribute__((always_inline)) void sb51r(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    sb5r4r(blk, xr, s, K, o, NR, 1, 1);
}
DEFINE_PART8(part5r, sb5r, BLOB5R, GROUP, GROUP)
DEFINE_PART8(part4r, sb4r, BLOB4R, GROUP, GROUP)
DEFINE_PART8(part51r, sb51r, BLOB51R, GROUP, GROUP)

/* ---- IQ4_NL and IQ4_XS weights times 8-bit rows ("iq4r", "iq4xs") ----
   The rows as for q8r (per 32 inputs). The weights are 4-bit indices into llama.cpp's table of 16 values
   (kvalues_iq4nl, -127..113) with a scale per 32: IQ4_NL's d (float16), IQ4_XS's d * (sub-scale - 32), a float16
   times 6 bits, exact in float32. Per output and group of 32: isum = sum of value * code_x, exact in int32 (the
   table looked up in registers: pshufb, tbl); then out = fma(s * dx, (float)isum, out), groups in order from 0:
   q8r's bits for the same values and scale. Weights, at the files' bits: "iq4r" (IQ4_NL, BLOBIQ4 bytes per 16
   outputs x group, 4.5 bits a weight) the indices as q4r's nibbles (4 chunks of 64 bytes), then the 16 d (float16);
   "iq4xs" (BLOBIQ4XS bytes per 16 outputs x super-block of 256, 4.3125 bits against the file's 4.25) the 16 d
   (float16), then per group of 32 the nibbles and the 16 sub-scales less 32 (int8), s = d * that worked out in
   float32 (exact: the same number as the file's dequantization takes). VNNI takes unsigned weights: the table plus
   128 and 128 times the row's code sum back, the same integer. */
#define BLOBIQ4 288
#define GRPIQ4XS 272
#define BLOBIQ4XS (32 + 8 * GRPIQ4XS)
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline void gdotiq4(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i T = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)IQ4_VALUES));
#if defined(__AVX512VNNI__)
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i a = _mm512_set1_epi32(-128 * xs);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * p));
        const __m512i lo = _mm512_shuffle_epi8(T, _mm512_and_si512(v, m4));
        const __m512i hi = _mm512_shuffle_epi8(T, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        a = dpbx(a, _mm512_xor_si512(lo, flip), xg + 8 * p);
        a = dpbx(a, _mm512_xor_si512(hi, flip), xg + 8 * p + 4);
    }
    is[0] = _mm512_add_epi32(is[0], a);
#else
    (void)xs;
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * p));
        for (int h = 0; h < 2; h++) {
            const __m512i w = _mm512_shuffle_epi8(T, _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, m4));
            is[0] = _mm512_add_epi32(is[0], sdot4(w, _mm512_set1_epi32(rd32(xg + 8 * p + 4 * h))));
        }
    }
#endif
}
#elif !defined(__AVX512F__) && defined(__AVX2__)
static inline void gdotiq4(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
    (void)xs;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i T = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)IQ4_VALUES));
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(c + 64 * p + 32 * h));
            const __m256i lo = _mm256_shuffle_epi8(T, _mm256_and_si256(v, m4));
            const __m256i hi = _mm256_shuffle_epi8(T, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            const __m256i a = sdot4(lo, _mm256_set1_epi32(rd32(xg + 8 * p)));
            const __m256i b = sdot4(hi, _mm256_set1_epi32(rd32(xg + 8 * p + 4)));
            is[h] = (vi)_mm256_add_epi32((__m256i)is[h], _mm256_add_epi32(a, b));
        }
}
#elif !defined(__AVX512F__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
static inline void gdotiq4(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
    (void)xs;
    const int8x16_t T = vld1q_s8(IQ4_VALUES);
    const uint8x16_t m4 = vdupq_n_u8(15);
    int32x4_t a[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int p = 0; p < 4; p++) {
        const int8x16_t xa = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 8 * p)));
        const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 8 * p + 4)));
        for (int q = 0; q < 4; q++) {
            const uint8x16_t v = vld1q_u8(c + 64 * p + 16 * q);
            a[q] = vdotq_s32(a[q], vqtbl1q_s8(T, vandq_u8(v, m4)), xa);
            a[q] = vdotq_s32(a[q], vqtbl1q_s8(T, vshrq_n_u8(v, 4)), xb);
        }
    }
    add4q(is, a);
}
#else
static inline void gdotiq4(const uint8_t *c, const int8_t *xg, int32_t xs, vi *is) {
    (void)xs;
    int32_t t[16] = {0};
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 4; i++) {
                const int v = c[64 * p + 4 * j + i];
                t[j] += IQ4_VALUES[v & 15] * xg[8 * p + i] + IQ4_VALUES[v >> 4] * xg[8 * p + 4 + i];
            }
    add16(is, t);
}
#endif

/* One group of 32 (its 256 index bytes at c, the rows' group q) for NR rows with the 16 outputs' scales sc. */
static inline __attribute__((always_inline)) void iq4group(const uint8_t *c, const vw sc[NH], const uint8_t *const *xr,
                                                           int q, int K, vw o[QROWS][NH], const int NR) {
    for (int r = 0; r < NR; r++) {
        vi is[NH];
        for (int h = 0; h < NH; h++) is[h] = VI_ZERO;
        gdotiq4(c, (const int8_t *)xr[r] + (long)q * GROUP, qrow_sums32(xr[r], K, GROUP)[q], is);
        const float dx = qrow_scales(xr[r], K)[q];
        for (int h = 0; h < NH; h++) o[r][h] = FMA(sc[h] * bc(dx), VI_F(is[h]), o[r][h]);
    }
}
static inline __attribute__((always_inline)) void sbiq4(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    vw sc[NH];
    for (int h = 0; h < NH; h++) sc[h] = VW_F16(blk + 256 + 2 * VL * h);
    iq4group(blk, sc, xr, s, K, o, NR);
}
DEFINE_PART8(partiq4, sbiq4, BLOBIQ4, GROUP, GROUP)

/* IQ4_XS: a super-block's 8 groups in order, each group's scales d * (sub-scale - 32) worked out once for the rows. */
static inline __attribute__((always_inline)) void sbiq4xs(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                           vw o[QROWS][NH], const int NR) {
    for (int g = 0; g < 8; g++) {
        const uint8_t *wg = blk + 32 + g * GRPIQ4XS;
        vw sc[NH];
        for (int h = 0; h < NH; h++) sc[h] = VW_F16(blk + 2 * VL * h) * VI_F(VI_I8(wg + 256 + VL * h));
        iq4group(wg, sc, xr, 8 * s + g, K, o, NR);
    }
}
DEFINE_PART8(partiq4xs, sbiq4xs, BLOBIQ4XS, QBLK, GROUP)

#endif
