/* GGUF's K-quants times rows quantized to 8 bits, with integer dot products, as llama.cpp multiplies them by Q8_K:
   the row quantizer, the integer vector helpers per CPU, and each format's part of a product (static functions over
   the vector layer and a thread's job). int4_vector.c defines the library's entries over these parts (DEFINE_MM8);
   int4_vector_api.h declares them. */
#ifndef SIMLLM_INT8_ROWS_H
#define SIMLLM_INT8_ROWS_H

#include <stdint.h>
#include <string.h>
#include "vector_isa.h"
#include "vector_product.h"

/* ---- Q4_K weights times 8-bit rows ("q4k8"): integer dot products, as llama.cpp multiplies Q4_K by Q8_K ----
   Each row's inputs are quantized per block of 256 (QBLK): scale dx = amax / 127, code = round-to-even of
   x * (127 / amax), clamped to -127..127 (NaN to 0). Per output and super-block of 256 inputs: isum_g = sum of
   code_w * code_x over group g's 32 inputs, acc = sum_g sub-scale_g * isum_g, ms = sum_g sub-min_g * xsum_g (xsum_g:
   the group's input codes added), all exact in int32 (at most 8 * 63 * 32 * 15 * 127 < 2^31); then
   out = fma(d * dx, (float)acc, out) and out = fma(-(dmin * dx), (float)ms, out), super-blocks in order from 0.
   Integer sums are exact in any order, so VNNI, AVX2, NEON's sdot and plain C compute the same bits; only the
   float steps above are fixed. Weights: BLOB4K8 below; a group's codes in 4 chunks of 64 bytes (chunk p, byte
   4j + i: output j's code of input 8p + i in the low nibble, of 8p + 4 + i in the high). */
#define QBLK 256
#define QROWS 4  /* rows at a time over a block's weights */

/* A row's quantized inputs, in blocks of BLK (256, or 32 for Q8_0-style products): K codes, then K/BLK float32
   scales, then the codes' sums per 32 and per 16 (int32). At most 1.5 K bytes. */
static inline long qrow_bytes(int K, int BLK) {
    return (long)K + (long)(K / BLK) * 4 + (long)(K / GROUP) * 4 + (long)(K / 16) * 4;
}
static inline const float *qrow_scales(const uint8_t *row, int K) { return (const float *)(const void *)(row + K); }
static inline const int32_t *qrow_sums32(const uint8_t *row, int K, int BLK) {
    return (const int32_t *)(const void *)(row + K + (long)(K / BLK) * 4);
}
static inline const int32_t *qrow_sums16(const uint8_t *row, int K, int BLK) {
    return qrow_sums32(row, K, BLK) + K / GROUP;
}

/* One block of BLK inputs p -> its codes c, scale *dx and code sums per 16 s16, as described above. The AVX-512 form
   does the same operations on 16 inputs at once: amax is exact in any order (|x| > amax ? |x| : amax: a NaN never
   enters, as maxps keeps its second operand), the clamps keep a NaN (minps and maxps take it as their second
   operand) for the ORD mask to make 0, and cvtps rounds to nearest even as rintf does; the sums are integers. */
static inline void quantize_block(const float *p, int8_t *c, float *dx, int32_t *s16, const int BLK) {
#if defined(__AVX512F__)
    __m512 am = _mm512_setzero_ps();
    for (int i = 0; i < BLK; i += 16) am = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(p + i)), am);
    const float amax = _mm512_reduce_max_ps(am);
#else
    float amax = 0.f;
    for (int i = 0; i < BLK; i++) {
        const float a = __builtin_fabsf(p[i]);
        amax = a > amax ? a : amax;
    }
#endif
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    *dx = amax / 127.f;
#if defined(__AVX512F__)
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    for (int i = 0; i < BLK; i += 16) {
        __m512 f = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_mul_ps(_mm512_loadu_ps(p + i), vinv)));
        f = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(f, f, _CMP_ORD_Q), f);
        const __m512i q = _mm512_cvtps_epi32(f);
        _mm_storeu_si128((__m128i *)(void *)(c + i), _mm512_cvtepi32_epi8(q));
        s16[i / 16] = _mm512_reduce_add_epi32(q);
    }
#else
    for (int i = 0; i < BLK; i++) {
        float f = p[i] * inv;
        f = f > 127.f ? 127.f : (f < -127.f ? -127.f : f);
        c[i] = f == f ? (int8_t)__builtin_rintf(f) : 0;
    }
    for (int g = 0; g < BLK / 16; g++) {
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += c[g * 16 + i];
        s16[g] = t;
    }
#endif
}

static void quantize_rows(const float *x, long x_stride, int M, int K, uint8_t *q, const int BLK) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (long)m * x_stride;
        uint8_t *row = q + (long)m * qrow_bytes(K, BLK);
        int8_t *c = (int8_t *)row;
        float *dx = (float *)(void *)(row + K);
        int32_t *bs = (int32_t *)(void *)(dx + K / BLK);
        for (int b = 0; b < K / BLK; b++)
            quantize_block(xr + b * BLK, c + b * BLK, dx + b, bs + K / GROUP + b * (BLK / 16), BLK);
        for (int g = 0; g < K / GROUP; g++) bs[g] = bs[K / GROUP + 2 * g] + bs[K / GROUP + 2 * g + 1];
    }
}

static inline int32_t rd32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
typedef uint32_t v8u32 __attribute__((vector_size(32)));

/* float16 -> float32, exact (normals, subnormals as m * 2^-24, inf and NaN) */
static inline __attribute__((unused)) float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t b;
    if (e == 0) {
        const float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&b, &f, 4);
        b |= sign;
    } else {
        b = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    }
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline __attribute__((unused)) v8 f16x8(const uint8_t *p) {
    v8 v;
    for (int l = 0; l < 8; l++) {
        uint16_t h;
        memcpy(&h, p + 2 * l, 2);
        v[l] = f16_to_f32(h);
    }
    return v;
}

/* vi: VL int32 lanes (an output each), as vw. GDOT(c, xg, is) adds group sums into is[NH]: c a group's 256 code
   bytes, xg the row's 32 input codes. */
#if defined(__AVX512F__)
typedef __m512i vi;
#define VI_ZERO _mm512_setzero_si512()
#define VI_ADD(a, b) _mm512_add_epi32((a), (b))
#define VI_MUL(a, b) _mm512_mullo_epi32((a), (b))
#define VI_BC(i) _mm512_set1_epi32(i)
#define VI_F(a) _mm512_cvtepi32_ps(a)
#define VI_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define VI_AND(a, i) _mm512_and_si512((a), _mm512_set1_epi32(i))
#define VI_OR(a, b) _mm512_or_si512((a), (b))
#define VI_SHL(a, n) _mm512_slli_epi32((a), (n))
#define VI_SRL(a, n) _mm512_srli_epi32((a), (n))
#define VI_SRLV(a, s) _mm512_srlv_epi32((a), (s))
#define VI_LANES(h) _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
/* 16 float16 values -> float32 (exact) */
#define VW_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#if defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
/* acc + u (bytes 0..255) times the 4 signed bytes at p, broadcast to every lane, with the broadcast inside vpdpbusd
   ({1to16}): the compiler emits a vpbroadcastd of its own, which takes a vector slot beside the dot products, and a
   row's broadcasts were a fourth of a multi-row product's vector instructions. The same integers either way. */
typedef int32_t __attribute__((may_alias)) i32_alias;
static inline __attribute__((always_inline)) __m512i dpbx(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const i32_alias *)(const void *)p));
    return acc;
}
#define DPBX(acc, u, p) dpbx((acc), (u), (p))
#else
#define DPB(acc, u, s) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), _mm512_set1_epi16(1)))
#define DPBX(acc, u, p) DPB((acc), (u), _mm512_set1_epi32(rd32(p)))
#endif
static inline void gdot(const uint8_t *c, const int8_t *xg, vi *is) {
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * p));
        is[0] = DPBX(is[0], _mm512_and_si512(v, m4), xg + 8 * p);
        is[0] = DPBX(is[0], _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), xg + 8 * p + 4);
    }
}
#define HAVE_GDOT
#endif
#else
typedef v8i vi;
#define VI_ZERO ((v8i){0, 0, 0, 0, 0, 0, 0, 0})
#define VI_ADD(a, b) ((a) + (b))
#define VI_MUL(a, b) ((a) * (b))
#define VI_BC(i) (VI_ZERO + (int32_t)(i))
#define VI_F(a) __builtin_convertvector((a), v8)
#define VI_U8(p) U8X8(p)
#define VI_AND(a, i) ((a) & (int32_t)(i))
#define VI_OR(a, b) ((a) | (b))
#define VI_SHL(a, n) ((a) << (n))
#define VI_SRL(a, n) ((v8i)((v8u32)(a) >> (n)))
#define VI_SRLV(a, s) ((v8i)((v8u32)(a) >> (v8u32)(s)))
#define VI_LANES(h) ((v8i){0, 1, 2, 3, 4, 5, 6, 7} + 8 * (h))
#if defined(__AVX2__) && defined(__F16C__)
#define VW_F16(p) ((v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p))))
#else
#define VW_F16(p) f16x8(p)
#endif
#if defined(__AVX2__)
static inline void gdot(const uint8_t *c, const int8_t *xg, vi *is) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++) {  /* int16 sums: at most 8 pairs of 2 * 15 * 127 */
        __m256i s = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(c + 64 * p + 32 * h));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(v, m4), _mm256_set1_epi32(rd32(xg + 8 * p))));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                                         _mm256_set1_epi32(rd32(xg + 8 * p + 4))));
        }
        is[h] = (vi)_mm256_add_epi32((__m256i)is[h], _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
    }
}
#define HAVE_GDOT
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
typedef union { v8i v; int32x4_t q[2]; } v8iq;
/* is[2] (16 lanes as two v8i) += a[4] (four NEON vectors of 4 sums, outputs in order) */
static inline void add4q(vi *is, const int32x4_t *a) {
    for (int h = 0; h < 2; h++) {
        v8iq u = {is[h]};
        u.q[0] = vaddq_s32(u.q[0], a[2 * h]);
        u.q[1] = vaddq_s32(u.q[1], a[2 * h + 1]);
        is[h] = u.v;
    }
}
static inline void gdot(const uint8_t *c, const int8_t *xg, vi *is) {
    const uint8x16_t m4 = vdupq_n_u8(15);
    int32x4_t a[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int p = 0; p < 4; p++) {
        const int8x16_t xa = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 8 * p)));
        const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 8 * p + 4)));
        for (int t = 0; t < 4; t++) {
            const uint8x16_t v = vld1q_u8(c + 64 * p + 16 * t);
            a[t] = vdotq_s32(a[t], vreinterpretq_s8_u8(vandq_u8(v, m4)), xa);
            a[t] = vdotq_s32(a[t], vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), xb);
        }
    }
    add4q(is, a);
}
#define HAVE_GDOT
#endif
#endif
/* is[NH] += 16 int32 sums in output order (the plain C paths') */
static inline __attribute__((unused)) void add16(vi *is, const int32_t *t) {
#if defined(__AVX512F__)
    is[0] = _mm512_add_epi32(is[0], _mm512_loadu_si512((const void *)t));
#else
    for (int h = 0; h < NH; h++)
        for (int l = 0; l < VL; l++) is[h][l] += t[VL * h + l];
#endif
}

#if !defined(HAVE_GDOT)  /* plain C: the same integer sums */
static inline void gdot(const uint8_t *c, const int8_t *xg, vi *is) {
    int32_t t[16] = {0};
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 4; i++) {
                const int u = c[64 * p + 4 * j + i];
                t[j] += (u & 15) * xg[8 * p + i] + (u >> 4) * xg[8 * p + 4 + i];
            }
    add16(is, t);
}
#endif

/* Q4_K for 8-bit rows, BLOB4K8 bytes per 16 outputs x super-block (4.5 bits a weight, as the file): the 16 d and 16
   dmin (float16, as the file), then per group the 16 sub-scales' and sub-mins' low 4 bits (byte j: output j's
   sub-scale low, sub-min high), then per group their top 2 bits (a 32-bit word each: bits 2j..2j+1 output j's),
   then per group the codes (4 chunks of 64 bytes, as above). Its product (sbk8, shared with Q5_K's) follows Q6_K's
   section, which defines the code planes Q5_K reads. */
#define SC4K8 64
#define TOP4K8 192
#define CODES4K8 256
#define BLOB4K8 2304

/* Output blocks b0..b1-1 for every row: per block, rows in QROWS over its weights (which stay in cache); SB: the
   function of UNIT inputs (sb4k8, sb6k8: a super-block of 256; sb8r: a group of 32), SBBYTES their bytes per 16
   outputs; BLK: the rows' block. A few rows (decode steps of several requests, more than QROWS and up to FEWROWS)
   go the other way round: per unit of weights, every group of QROWS rows over it, their outputs kept between units
   in ob, and the unit two blocks ahead asked into L2 meanwhile. There the weights' reads and the rows' dot products
   were found to add up rather than overlap (8 rows from memory took about the in-cache time of 8 rows plus the
   read time of 1): the prefetch made 8-row products of a 1.5B file's gate/up 15-25% faster (a burst into L1 one
   block ahead, 30% slower; the loop order alone, no change). Each row's outputs take the same steps in the same
   order (units from 0) either way: the same bits. */
#define FEWROWS 16
#define DEFINE_PART8(NAME, SB, SBBYTES, UNIT, BLK)                                                            \
static inline __attribute__((always_inline)) void NAME##_unit(const uint8_t *blk, const uint8_t *q, long qb,   \
                                                              int r0, int R, int s, int K, vw o[QROWS][NH]) { \
    const uint8_t *xr[QROWS];                                                                             \
    for (int r = 0; r < QROWS; r++) xr[r] = q + (long)(r0 + (r < R ? r : 0)) * qb;                        \
    switch (R) {                                                                                          \
    case 4: SB(blk, xr, s, K, o, 4); break;                                                               \
    case 3: SB(blk, xr, s, K, o, 3); break;                                                               \
    case 2: SB(blk, xr, s, K, o, 2); break;                                                               \
    default: SB(blk, xr, s, K, o, 1); break;                                                              \
    }                                                                                                     \
}                                                                                                         \
static void *NAME(void *arg) {                                                                            \
    const job_t *J = arg;                                                                                 \
    const int S = J->K / (UNIT);                                                                          \
    const long bbytes = (long)S * (SBBYTES), qb = qrow_bytes(J->K, BLK);                                  \
    const uint8_t *q = (const uint8_t *)(const void *)J->xsum;                                            \
    for (int b = J->b0; b < J->b1; b++) {                                                                 \
        const uint8_t *wb = J->w + b * bbytes;                                                            \
        if (J->M > QROWS && J->M <= FEWROWS) {                                                            \
            vw ob[FEWROWS + QROWS][NH];                                                                   \
            for (int r = 0; r < (J->M + QROWS - 1) / QROWS * QROWS; r++)                                  \
                for (int h = 0; h < NH; h++) ob[r][h] = bc(0.f);                                          \
            for (int s = 0; s < S; s++) {                                                                 \
                if (b + 2 < J->nb) {                                                                      \
                    const char *next = (const char *)(wb + 2 * bbytes + (long)s * (SBBYTES));             \
                    for (int l = 0; l < (SBBYTES); l += 64) __builtin_prefetch(next + l, 0, 2);          \
                }                                                                                         \
                for (int r0 = 0; r0 < J->M; r0 += QROWS) {                                                \
                    const int R = J->M - r0 < QROWS ? J->M - r0 : QROWS;                                  \
                    vw o[QROWS][NH];                                                                      \
                    for (int r = 0; r < QROWS; r++)                                                       \
                        for (int h = 0; h < NH; h++) o[r][h] = ob[r0 + r][h];                             \
                    NAME##_unit(wb + (long)s * (SBBYTES), q, qb, r0, R, s, J->K, o);                      \
                    for (int r = 0; r < R; r++)                                                           \
                        for (int h = 0; h < NH; h++) ob[r0 + r][h] = o[r][h];                             \
                }                                                                                         \
            }                                                                                             \
            for (int r = 0; r < J->M; r++)                                                                \
                for (int h = 0; h < NH; h++) st(J->y + (long)r * J->y_stride + 16 * b + VL * h, ob[r][h]); \
            continue;                                                                                     \
        }                                                                                                 \
        for (int r0 = 0; r0 < J->M; r0 += QROWS) {                                                        \
            const int R = J->M - r0 < QROWS ? J->M - r0 : QROWS;                                          \
            vw o[QROWS][NH];                                                                              \
            for (int r = 0; r < QROWS; r++)                                                               \
                for (int h = 0; h < NH; h++) o[r][h] = bc(0.f);                                           \
            for (int s = 0; s < S; s++) NAME##_unit(wb + (long)s * (SBBYTES), q, qb, r0, R, s, J->K, o);   \
            for (int r = 0; r < R; r++)                                                                   \
                for (int h = 0; h < NH; h++) st(J->y + (long)(r0 + r) * J->y_stride + 16 * b + VL * h, o[r][h]); \
        }                                                                                                 \
    }                                                                                                     \
    return 0;                                                                                             \
}
/* NAME, a product's entry (simllm_vec_int4_mm's signature): the rows quantized to 8 bits per BLK inputs into xsum,
   then PART (DEFINE_PART8's) over the output blocks on nthreads threads. */
#define DEFINE_MM8(NAME, PART, BLK)                                                                            \
void NAME(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,         \
          float *xsum, float *buf, long buf_per_thread, int nthreads) {                                         \
    quantize_rows(x, x_stride, M, K, (uint8_t *)(void *)xsum, BLK);                                             \
    run(PART, x, x_stride, w, y, y_stride, M, N, K, xsum, buf, buf_per_thread, nthreads);                       \
}
/* ---- Q6_K weights times 8-bit rows ("q6k8") ----
   The rows as for q4k8, with their group sums per 16 inputs too. Per output and super-block of 256 inputs: for each
   group g of 16, isum_g = sum of u * code_x minus 32 * xsum16_g (u = the file's code -32..31 plus 32, 0..63),
   acc = sum_g sub-scale_g * isum_g (int8 sub-scales), exact in int32 (at most 16 * 127 * 16 * 95 * 127); then
   out = fma(d * dx, (float)acc, out), super-blocks in order from 0. Weights (BLOB6K bytes per 16 outputs x
   super-block, 6.625 bits a weight, as the file's 6.5625 nearly): the 16 d (float32), then per group u's low 4 bits
   in 2 chunks of 64 bytes (chunk p, byte 4j + i: output j's input 8p + i in the low nibble, 8p + 4 + i in the high),
   u's top 2 bits in 64 bytes (byte 4j + i, bits 2t..2t+1: output j's input 4t + i), and the 16 sub-scales. */
#define GRP6K 208
#define HEAD6K 64
#define BLOB6K (HEAD6K + 16 * GRP6K)

#if defined(__AVX512F__)
#define VI_I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#else
#define VI_I8(p) I8X8(p)
#endif

/* gdotn adds one group's sums into is[NH] for codes stored as nibbles plus a plane of top bits (Q6_K's groups of 16,
   Q5_0's and Q4_0's of 32): c its code bytes, P chunks of 64 bytes of nibbles (chunk p, byte 4j + i: output j's input
   8p + i in the low nibble, 8p + 4 + i in the high), then, where B > 0, 64 bytes of top bits (byte 4j + i, bits
   Bt..Bt+B-1: output j's input 4t + i); xg the row's 8P input codes. P and B are constants at every call (Q6_K: 2, 2;
   Q5_0: 4, 1; Q4_0: 4, 0), so the compiler drops what a format does not use. Quad t's top bits go to bit 4 by one
   shift of 4 - Bt within 16-bit lanes and a mask: a bit that crosses a byte lands below bit 4 or above bit 3 + B,
   where the mask drops it. */
#define TOPMASK(B) ((char)(((1 << (B)) - 1) << 4))
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512i topn(__m512i H, int t, const int B) {
    const int sh = 4 - B * t;
    const __m512i v = sh >= 0 ? _mm512_sll_epi16(H, _mm_cvtsi32_si128(sh)) : _mm512_srl_epi16(H, _mm_cvtsi32_si128(-sh));
    return _mm512_and_si512(v, _mm512_set1_epi8(TOPMASK(B)));
}
static inline __attribute__((always_inline)) void gdotn(const uint8_t *c, const int8_t *xg, vi *is, const int P,
                                                         const int B) {
    const __m512i m4 = _mm512_set1_epi8(15);  /* pmaddubsw pairs: at most 2 * 63 * 127 */
    const __m512i H = B ? _mm512_loadu_si512((const void *)(c + 64 * P)) : _mm512_setzero_si512();
    for (int p = 0; p < P; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * p));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (B) { lo = _mm512_or_si512(lo, topn(H, 2 * p, B)); hi = _mm512_or_si512(hi, topn(H, 2 * p + 1, B)); }
        is[0] = DPBX(is[0], lo, xg + 8 * p);
        is[0] = DPBX(is[0], hi, xg + 8 * p + 4);
    }
}
#elif !defined(__AVX512F__) && defined(__AVX2__)
static inline __m256i topn(__m256i H, int t, const int B) {
    const int sh = 4 - B * t;
    const __m256i v = sh >= 0 ? _mm256_sll_epi16(H, _mm_cvtsi32_si128(sh)) : _mm256_srl_epi16(H, _mm_cvtsi32_si128(-sh));
    return _mm256_and_si256(v, _mm256_set1_epi8(TOPMASK(B)));
}
static inline __attribute__((always_inline)) void gdotn(const uint8_t *c, const int8_t *xg, vi *is, const int P,
                                                         const int B) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++) {  /* int16 sums of two pairs: at most 4 * 63 * 127 */
        const __m256i H = B ? _mm256_loadu_si256((const __m256i *)(const void *)(c + 64 * P + 32 * h))
                            : _mm256_setzero_si256();
        for (int p = 0; p < P; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(c + 64 * p + 32 * h));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (B) { lo = _mm256_or_si256(lo, topn(H, 2 * p, B)); hi = _mm256_or_si256(hi, topn(H, 2 * p + 1, B)); }
            const __m256i a = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(rd32(xg + 8 * p)));
            const __m256i b = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(rd32(xg + 8 * p + 4)));
            is[h] = (vi)_mm256_add_epi32((__m256i)is[h], _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1)));
        }
    }
}
#elif !defined(__AVX512F__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
static inline __attribute__((always_inline)) void gdotn(const uint8_t *c, const int8_t *xg, vi *is, const int P,
                                                         const int B) {
    const uint8x16_t m4 = vdupq_n_u8(15), m = vdupq_n_u8((uint8_t)TOPMASK(B));
    int32x4_t a[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int q = 0; q < 4; q++) {
        const uint8x16_t H = B ? vld1q_u8(c + 64 * P + 16 * q) : vdupq_n_u8(0);
        for (int p = 0; p < P; p++) {  /* quad t's top bits to bit 4: a byte shift by 4 - Bt (right where < 0) */
            const uint8x16_t v = vld1q_u8(c + 64 * p + 16 * q);
            const uint8x16_t tl = vandq_u8(vshlq_u8(H, vdupq_n_s8((int8_t)(4 - B * 2 * p))), m);
            const uint8x16_t th = vandq_u8(vshlq_u8(H, vdupq_n_s8((int8_t)(4 - B * (2 * p + 1)))), m);
            const int8x16_t xa = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 8 * p)));
            const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 8 * p + 4)));
            a[q] = vdotq_s32(a[q], vreinterpretq_s8_u8(vorrq_u8(vandq_u8(v, m4), tl)), xa);
            a[q] = vdotq_s32(a[q], vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(v, 4), th)), xb);
        }
    }
    add4q(is, a);
}
#else
static inline __attribute__((always_inline)) void gdotn(const uint8_t *c, const int8_t *xg, vi *is, const int P,
                                                         const int B) {
    int32_t t[16] = {0};
    const int mask = (1 << B) - 1;
    for (int p = 0; p < P; p++)
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 4; i++) {
                const int v = c[64 * p + 4 * j + i], H = B ? c[64 * P + 4 * j + i] : 0;
                t[j] += ((v & 15) | (((H >> (B * 2 * p)) & mask) << 4)) * xg[8 * p + i]
                      + ((v >> 4) | (((H >> (B * (2 * p + 1))) & mask) << 4)) * xg[8 * p + 4 + i];
            }
    add16(is, t);
}
#endif

/* NR rows times one block of 16 outputs over super-block s of weights in groups of 16 with int8 sub-scales and a
   float32 d per output (Q6_K: codes u - 32 with u in nibbles plus 2 top bits, GRP6K bytes a group; Q3_K: codes u - 4
   with u in nibbles alone, GRP3K): isum_g = sum of u * code_x minus OFF * xsum16_g. GRP, B and OFF are constants at
   each call: the compiler keeps one product per format. */
static inline __attribute__((always_inline)) void sbg16(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR, const int GRP, const int B,
                                                         const int OFF) {
    vi acc[QROWS][NH];
    for (int r = 0; r < NR; r++) for (int h = 0; h < NH; h++) acc[r][h] = VI_ZERO;
    for (int g = 0; g < 16; g++) {
        const uint8_t *wg = blk + HEAD6K + g * GRP;
        vi scv[NH];
        for (int h = 0; h < NH; h++) scv[h] = VI_I8(wg + 128 + (B ? 64 : 0) + VL * h);
        for (int r = 0; r < NR; r++) {
            const int8_t *xg = (const int8_t *)xr[r] + (long)s * QBLK + g * 16;
            vi is[NH];
            for (int h = 0; h < NH; h++) is[h] = VI_BC(-OFF * qrow_sums16(xr[r], K, QBLK)[s * 16 + g]);
            gdotn(wg, xg, is, 2, B);  /* 16 inputs: 2 chunks, B top bits */
            for (int h = 0; h < NH; h++) acc[r][h] = VI_ADD(acc[r][h], VI_MUL(scv[h], is[h]));
        }
    }
    const float *d = (const float *)(const void *)blk;
    for (int r = 0; r < NR; r++) {
        const float dx = qrow_scales(xr[r], K)[s];
        for (int h = 0; h < NH; h++) o[r][h] = FMA(ld(d + VL * h) * bc(dx), VI_F(acc[r][h]), o[r][h]);
    }
}
static inline __attribute__((always_inline)) void sb6k8(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    sbg16(blk, xr, s, K, o, NR, GRP6K, 2, 32);
}
DEFINE_PART8(part6k8, sb6k8, BLOB6K, QBLK, QBLK)

/* ---- Q3_K weights times 8-bit rows ("q3k8") ----
   GGUF's Q3_K (codes -4..3, 6-bit sub-scales less 32 per group of 16, d per 256), as llama.cpp's Q3_K_S/M/L files
   keep most projections: Q6_K's form with u = code + 4 (0..7) in nibbles and no top bits, so the rows, the sums
   (isum_g = sum of u * code_x minus 4 * xsum16_g, at most 16 * 32 * 16 * 7 * 127 < 2^31) and the float steps are
   q6k8's. Weights: BLOB3K bytes per 16 outputs x super-block (4.625 bits a weight against the file's 3.4375): the
   16 d (float32), then per group u in 2 chunks of 64 bytes (q6k8's nibble layout) and the 16 sub-scales (int8). */
#define GRP3K 144
#define BLOB3K (HEAD6K + 16 * GRP3K)
static inline __attribute__((always_inline)) void sb3k8(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    sbg16(blk, xr, s, K, o, NR, GRP3K, 0, 4);
}
DEFINE_PART8(part3k8, sb3k8, BLOB3K, QBLK, QBLK)

/* ---- Q5_K weights times 8-bit rows ("q5k8") ----
   Q4_K's super-blocks (d and dmin, 6-bit sub-scales and sub-mins per group of 32) with codes 0..31, as llama.cpp's
   Q4_K_S and Q5_K_M files keep some or most projections. The rows and the sums as for q4k8 (isum_g of codes 0..31:
   at most 8 * 63 * 32 * 31 * 127 < 2^31, exact in int32), the same float steps in the same order. Weights: BLOB5K8
   bytes per 16 outputs x super-block (5.5 bits a weight, as the file): q4k8's head, sub-scale and top-bit bytes,
   then per group the codes' low 4 bits in 4 chunks of 64 bytes (q4k8's code layout) and their fifth bits in 64
   bytes (byte 4j + i, bit 2p: output j's input 8p + i, bit 2p + 1: its input 8p + 4 + i), as Q5_0's for 8-bit rows. */
#define GRP5K8 320
#define BLOB5K8 (CODES4K8 + 8 * GRP5K8)

/* NR rows (quantized, at xr[r]) times one block of 16 outputs over super-block s of Q4_K (FIVE 0) or Q5_K (FIVE 1)
   weights: their outputs o[r] updated. FIVE is a constant at each call: the compiler keeps one product. */
static inline __attribute__((always_inline)) void sbk8(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                        vw o[QROWS][NH], const int NR, const int FIVE) {
    vi acc[QROWS][NH], ms[QROWS][NH], lane2[NH];
    for (int r = 0; r < NR; r++) for (int h = 0; h < NH; h++) acc[r][h] = ms[r][h] = VI_ZERO;
    for (int h = 0; h < NH; h++) lane2[h] = VI_SHL(VI_LANES(h), 1);
    for (int g = 0; g < SB4K; g++) {
        const uint8_t *lo = blk + SC4K8 + 16 * g, *top = blk + TOP4K8 + 8 * g;
        const int32_t tsc = rd32((const int8_t *)top), tmn = rd32((const int8_t *)(top + 4));
        vi scv[NH], mnv[NH];
        for (int h = 0; h < NH; h++) {
            const vi b = VI_U8(lo + VL * h);
            scv[h] = VI_OR(VI_AND(b, 15), VI_SHL(VI_AND(VI_SRLV(VI_BC(tsc), lane2[h]), 3), 4));
            mnv[h] = VI_OR(VI_SRL(b, 4), VI_SHL(VI_AND(VI_SRLV(VI_BC(tmn), lane2[h]), 3), 4));
        }
        for (int r = 0; r < NR; r++) {
            const int8_t *xg = (const int8_t *)xr[r] + (long)s * QBLK + g * GROUP;
            const int32_t *bs = qrow_sums32(xr[r], K, QBLK);
            vi is[NH];
            for (int h = 0; h < NH; h++) is[h] = VI_ZERO;
            if (FIVE) gdotn(blk + CODES4K8 + GRP5K8 * g, xg, is, 4, 1);  /* 32 inputs: 4 chunks, 1 top bit */
            else gdot(blk + CODES4K8 + 256 * g, xg, is);
            for (int h = 0; h < NH; h++) {
                acc[r][h] = VI_ADD(acc[r][h], VI_MUL(scv[h], is[h]));
                ms[r][h] = VI_ADD(ms[r][h], VI_MUL(mnv[h], VI_BC(bs[s * SB4K + g])));
            }
        }
    }
    for (int r = 0; r < NR; r++) {
        const float dx = qrow_scales(xr[r], K)[s];
        for (int h = 0; h < NH; h++) {
            const vw dd = VW_F16(blk + 2 * VL * h) * bc(dx), dm = -(VW_F16(blk + 32 + 2 * VL * h) * bc(dx));
            o[r][h] = FMA(dd, VI_F(acc[r][h]), o[r][h]);
            o[r][h] = FMA(dm, VI_F(ms[r][h]), o[r][h]);
        }
    }
}

static inline __attribute__((always_inline)) void sb4k8(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    sbk8(blk, xr, s, K, o, NR, 0);
}
static inline __attribute__((always_inline)) void sb5k8(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    sbk8(blk, xr, s, K, o, NR, 1);
}
DEFINE_PART8(part4k8, sb4k8, BLOB4K8, QBLK, QBLK)

DEFINE_PART8(part5k8, sb5k8, BLOB5K8, QBLK, QBLK)

/* The products of groups of 32 (Q8_0, Q5_0, Q4_0 on rows quantized per 32): int8_rows32.h */
#endif
