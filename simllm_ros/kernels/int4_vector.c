#include <stdint.h>
#include <string.h>
#include "product_run.h"

#define GROUP 32
#define BLOB4 384  /* 16 outputs x one group: input k's 16 codes in 8 bytes at 8k (byte j: output j low, j + 8 high
                      nibble), then 16 steps and 16 bases, float32 */
#define BLOB8 576  /* input k's 16 signed codes at 16k, then 16 scales */
#define GROUP6 16  /* inputs per group of the 16-input 8-bit format (GGUF's Q6_K: a scale per 16 weights) */
#define BLOB6 320  /* 16 outputs x one group of 16: input k's 16 signed codes at 16k, then 16 scales */
#define SB4K 8     /* groups of 32 per GGUF Q4_K super-block (256 inputs), which share d and dmin */
#define HEAD4K 128 /* a super-block's head for 16 outputs: 16 d, then 16 dmin, float32 */
#define GRP4K 288  /* a Q4_K group for 16 outputs: BLOB4's 256 bytes of codes, then 16 sub-scales and 16 sub-mins */
#define BLOB4K (HEAD4K + SB4K * GRP4K)  /* 2432 bytes per 16 outputs x super-block: 4.75 bits a weight (BLOB4: 6) */
#define RCHUNK 36  /* rows per chunk in the buffered path: their inputs stay in L2 while the blocks pass */
#define PREFETCH 8  /* groups ahead in the one-row path: the weights stream from memory while it computes */

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
   (a correctly rounded libm call where the CPU has no FMA: slow, the same bits). DEC4/DEC8 give input k's 16
   weights as floats, outputs 0-15 in order across the NH vectors: 4-bit codes 0..15, or 8-bit codes -127..127. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef __m512 vw;
#define FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
static inline vw ld(const float *p) { return _mm512_loadu_ps(p); }
static inline void st(float *p, vw v) { _mm512_storeu_ps(p, v); }
static inline vw bc(float f) { return _mm512_set1_ps(f); }
/* 8 bytes (byte j: output j low nibble, j + 8 high) -> 16 codes in output order -> 16 floats */
#define DEC4(p, w) do { const __m128i b_ = _mm_loadl_epi64((const __m128i *)(const void *)(p));                \
        const __m128i c_ = _mm_and_si128(_mm_unpacklo_epi64(b_, _mm_srli_epi16(b_, 4)), _mm_set1_epi8(15));   \
        (w)[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c_)); } while (0)
#define DEC8(p, w) do {                                                                                   \
        (w)[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p)))); \
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
#define DEC4(p, w) do { const v8i c_ = U8X8(p);                                                           \
        (w)[0] = __builtin_convertvector(c_ & 15, v8); (w)[1] = __builtin_convertvector(c_ >> 4, v8); } while (0)
#define DEC8(p, w) do { (w)[0] = __builtin_convertvector(I8X8(p), v8);                                    \
        (w)[1] = __builtin_convertvector(I8X8((p) + 8), v8); } while (0)
#endif
#define NH (16 / VL)
#define CS4 8
#define CS8 16
/* A group's sums a[NH] into out o[NH]; s: its 16 steps, then 16 bases (4-bit) or 16 scales (8-bit). */
#define POST4(s, a, xs, o) do { for (int h_ = 0; h_ < NH; h_++) {                                          \
        (o)[h_] = FMA(ld((s) + VL * h_), (a)[h_], (o)[h_]); (o)[h_] = FMA(ld((s) + 16 + VL * h_), bc(xs), (o)[h_]); } \
    } while (0)
#define POST8(s, a, xs, o) do { (void)(xs);                                                                \
        for (int h_ = 0; h_ < NH; h_++) (o)[h_] = FMA(ld((s) + VL * h_), (a)[h_], (o)[h_]); } while (0)

/* Where group g starts in a block of 16 outputs (AT_*), and its 16 steps then 16 bases (4-bit) or 16 scales
   (8-bit) (SC_*: in the blob, or worked out into t). Q4_K's are d * sub-scale and -(dmin * sub-min): exact in
   float32 (11-bit significands times 6 bits), so bitwise the steps and bases BLOB4 would hold for the same file. */
static inline long at_4(int g) { return (long)g * BLOB4; }
static inline long at_8(int g) { return (long)g * BLOB8; }
static inline long at_6(int g) { return (long)g * BLOB6; }
static inline long at_4k(int g) { return (long)(g / SB4K) * BLOB4K + HEAD4K + (long)(g % SB4K) * GRP4K; }
static inline const float *sc_4(const uint8_t *blk, int g, const uint8_t *wg, float *t) {
    (void)blk; (void)g; (void)t; return (const float *)(const void *)(wg + GROUP * CS4);
}
static inline const float *sc_8(const uint8_t *blk, int g, const uint8_t *wg, float *t) {
    (void)blk; (void)g; (void)t; return (const float *)(const void *)(wg + GROUP * CS8);
}
static inline const float *sc_6(const uint8_t *blk, int g, const uint8_t *wg, float *t) {
    (void)blk; (void)g; (void)t; return (const float *)(const void *)(wg + GROUP6 * CS8);
}
/* Q4_K group g's steps and bases for outputs VL*h.. (its block at blk, the group at wg) */
static inline void steps_4k(const uint8_t *blk, int g, const uint8_t *wg, int h, vw *step, vw *base) {
    const float *d = (const float *)(const void *)(blk + (long)(g / SB4K) * BLOB4K);
    const uint8_t *sc = wg + GROUP * CS4;
    *step = ld(d + VL * h) * CVTU8(sc + VL * h);
    *base = -(ld(d + 16 + VL * h) * CVTU8(sc + 16 + VL * h));
}
static inline const float *sc_4k(const uint8_t *blk, int g, const uint8_t *wg, float *t) {
    for (int h = 0; h < NH; h++) {
        vw step, base;
        steps_4k(blk, g, wg, h, &step, &base);
        st(t + VL * h, step);
        st(t + 16 + VL * h, base);
    }
    return t;
}

typedef struct {
    const float *x; long x_stride; const uint8_t *w; float *y; long y_stride;
    int M, K; const float *xsum; int b0, b1; float *scratch;
} job_t;

/* One row, NB blocks of 16 outputs at once (their sums in registers), weights decoded as they are used. */
#define DEFINE_ROW(NAME, NB, GK, AT, BLOB, CS, DEC, RPOST)                                                    \
static inline void NAME(const float *x, const uint8_t *w, long bbytes, int G, const float *xs, float *y) {  \
    vw o[NB][NH];                                                                                         \
    for (int j = 0; j < NB; j++) for (int h = 0; h < NH; h++) o[j][h] = bc(0.f);                          \
    for (int g = 0; g < G; g++) {                                                                         \
        vw a[NB][NH];                                                                                     \
        for (int j = 0; j < NB; j++) for (int h = 0; h < NH; h++) a[j][h] = bc(0.f);                      \
        const float *xg = x + g * GK;                                                                     \
        const uint8_t *wg = w + AT(g);                                                                    \
        for (int j = 0; j < NB; j++)  /* no fault past the end: a prefetch is a hint */                   \
            for (int l = 0; l < BLOB; l += 64) __builtin_prefetch(wg + j * bbytes + PREFETCH * BLOB + l);  \
        for (int k = 0; k < GK; k++) {                                                                    \
            const vw xb = bc(xg[k]);                                                                      \
            for (int j = 0; j < NB; j++) {                                                                \
                vw wk[NH];                                                                                \
                DEC(wg + j * bbytes + k * CS, wk);                                                        \
                for (int h = 0; h < NH; h++) a[j][h] = FMA(xb, wk[h], a[j][h]);                           \
            }                                                                                             \
        }                                                                                                 \
        for (int j = 0; j < NB; j++) {                                                                    \
            RPOST(w + j * bbytes, g, wg + j * bbytes, a[j], xs ? xs[g] : 0.f, o[j]);                      \
        }                                                                                                 \
    }                                                                                                     \
    for (int j = 0; j < NB; j++) for (int h = 0; h < NH; h++) st(y + 16 * j + VL * h, o[j][h]);           \
}

/* NQ rows (6, 3 or 1) over a group decoded into dq [32][16]: the same operations for each row as the one-row
   path's, their sums added into the chunk's ob. */
#define DEFINE_QROWS(NAME, GK, POST, HAS_XSUM)                                                                \
static inline __attribute__((always_inline)) void NAME(const job_t *J, const float *dq, const float *s, float *ob, \
                                                       int r0, int r, int g, int G, const int NQ) {        \
    const float *x0 = J->x + (long)(r0 + r) * J->x_stride + g * GK;                                       \
    vw a[6][NH];                                                                                          \
    for (int q = 0; q < NQ; q++) for (int h = 0; h < NH; h++) a[q][h] = bc(0.f);                          \
    for (int k = 0; k < GK; k++) {                                                                        \
        vw wk[NH];                                                                                        \
        for (int h = 0; h < NH; h++) wk[h] = ld(dq + 16 * k + VL * h);                                    \
        for (int q = 0; q < NQ; q++) {                                                                    \
            const vw xb = bc(x0[q * J->x_stride + k]);                                                    \
            for (int h = 0; h < NH; h++) a[q][h] = FMA(xb, wk[h], a[q][h]);                               \
        }                                                                                                 \
    }                                                                                                     \
    for (int q = 0; q < NQ; q++) {                                                                        \
        float *o = ob + 16 * (r + q);                                                                     \
        vw ov[NH];                                                                                        \
        for (int h = 0; h < NH; h++) ov[h] = ld(o + VL * h);                                              \
        POST(s, a[q], HAS_XSUM ? J->xsum[(long)(r0 + r + q) * G + g] : 0.f, ov);                          \
        for (int h = 0; h < NH; h++) st(o + VL * h, ov[h]);                                               \
    }                                                                                                     \
}

/* Rows in chunks; per chunk, block and group the weights are decoded once into buf [32][16], then 6, 3 and 1 rows
   at a time (DEFINE_QROWS) take the same operations as above. */
#define DEFINE_PART(NAME, GK, AT, CS, DEC, QROWS, ROW4, ROW1, HAS_XSUM, SC)                                  \
static void *NAME(void *arg) {                                                                            \
    const job_t *J = arg;                                                                                 \
    const int G = J->K / GK;                                                                              \
    const long bbytes = AT(G) - AT(0);                                                                    \
    float t_[32];                                                                                         \
    if (J->M < 4) {                                                                                       \
        for (int m = 0; m < J->M; m++) {                                                                  \
            const float *x = J->x + (long)m * J->x_stride;                                                \
            const float *xs = HAS_XSUM ? J->xsum + (long)m * G : 0;                                       \
            float *y = J->y + (long)m * J->y_stride;                                                      \
            int b = J->b0;                                                                                \
            for (; b + 4 <= J->b1; b += 4) ROW4(x, J->w + b * bbytes, bbytes, G, xs, y + 16 * b);         \
            for (; b < J->b1; b++) ROW1(x, J->w + b * bbytes, bbytes, G, xs, y + 16 * b);                 \
        }                                                                                                 \
        return 0;                                                                                         \
    }                                                                                                     \
    float *dq = J->scratch, *ob = J->scratch + GROUP * 16;  /* decoded group; the chunk's sums [RCHUNK][16] */    \
    for (int r0 = 0; r0 < J->M; r0 += RCHUNK) {                                                           \
        const int R = J->M - r0 < RCHUNK ? J->M - r0 : RCHUNK;                                            \
        for (int b = J->b0; b < J->b1; b++) {                                                             \
            for (int i = 0; i < R * 16; i++) ob[i] = 0.f;                                                 \
            for (int g = 0; g < G; g++) {                                                                 \
                const uint8_t *wg = J->w + b * bbytes + AT(g);                                            \
                for (int k = 0; k < GK; k++) {                                                            \
                    vw wk[NH];                                                                            \
                    DEC(wg + k * CS, wk);                                                                 \
                    for (int h = 0; h < NH; h++) st(dq + 16 * k + VL * h, wk[h]);                         \
                }                                                                                         \
                const float *s = SC(J->w + b * bbytes, g, wg, t_);                                        \
                int r = 0;                                                                                \
                for (; r + 6 <= R; r += 6) QROWS(J, dq, s, ob, r0, r, g, G, 6);                           \
                for (; r + 3 <= R; r += 3) QROWS(J, dq, s, ob, r0, r, g, G, 3);                           \
                for (; r < R; r++) QROWS(J, dq, s, ob, r0, r, g, G, 1);                                   \
            }                                                                                             \
            for (int r = 0; r < R; r++) memcpy(J->y + (long)(r0 + r) * J->y_stride + 16 * b, ob + 16 * r, 64); \
        }                                                                                                 \
    }                                                                                                     \
    return 0;                                                                                             \
}

/* The one-row path's end of a group (RPOST): its blob's steps (and bases); Q4_K's worked out in registers, the
   same products as sc_4k's (steps_4k). */
#define RP4(blk, g, wg, a, xs, o) POST4(sc_4(blk, g, wg, 0), a, xs, o)
#define RP8(blk, g, wg, a, xs, o) POST8(sc_8(blk, g, wg, 0), a, xs, o)
#define RP6(blk, g, wg, a, xs, o) POST8(sc_6(blk, g, wg, 0), a, xs, o)
#define RP4K(blk, g, wg, a, xs, o) do {                                                                   \
        for (int h_ = 0; h_ < NH; h_++) {                                                                 \
            vw st_, bs_;                                                                                  \
            steps_4k(blk, g, wg, h_, &st_, &bs_);                                                         \
            (o)[h_] = FMA(st_, (a)[h_], (o)[h_]); (o)[h_] = FMA(bs_, bc(xs), (o)[h_]);                    \
        }                                                                                                 \
    } while (0)
DEFINE_ROW(row4_4, 4, GROUP, at_4, BLOB4, CS4, DEC4, RP4)
DEFINE_ROW(row4_1, 1, GROUP, at_4, BLOB4, CS4, DEC4, RP4)
DEFINE_ROW(row4k_4, 4, GROUP, at_4k, GRP4K, CS4, DEC4, RP4K)
DEFINE_ROW(row4k_1, 1, GROUP, at_4k, GRP4K, CS4, DEC4, RP4K)
DEFINE_ROW(row8_4, 4, GROUP, at_8, BLOB8, CS8, DEC8, RP8)
DEFINE_ROW(row8_1, 1, GROUP, at_8, BLOB8, CS8, DEC8, RP8)
DEFINE_ROW(row6_4, 4, GROUP6, at_6, BLOB6, CS8, DEC8, RP6)
DEFINE_ROW(row6_1, 1, GROUP6, at_6, BLOB6, CS8, DEC8, RP6)
DEFINE_QROWS(qrows4, GROUP, POST4, 1)
DEFINE_QROWS(qrows8, GROUP, POST8, 0)
DEFINE_QROWS(qrows6, GROUP6, POST8, 0)
DEFINE_PART(part4, GROUP, at_4, CS4, DEC4, qrows4, row4_4, row4_1, 1, sc_4)
DEFINE_PART(part4k, GROUP, at_4k, CS4, DEC4, qrows4, row4k_4, row4k_1, 1, sc_4k)
DEFINE_PART(part8, GROUP, at_8, CS8, DEC8, qrows8, row8_4, row8_1, 0, sc_8)
DEFINE_PART(part6, GROUP6, at_6, CS8, DEC8, qrows6, row6_4, row6_1, 0, sc_6)

PRODUCT_RUN(float, float, const float, float)

/* Floats per thread for run's buffers: a decoded group and a chunk's sums. */
long simllm_vec_buffer_floats(void) { return GROUP * 16 + RCHUNK * 16; }

/* 4-bit weights, float32 in and out. Each row's group sums go first into xsum [M, K/32]: the group's 32 inputs
   in four vectors of 8, added in order, then the 8 lanes in a fixed tree. */
static void group_sums(const float *x, long x_stride, int M, int K, float *xsum) {
    const int G = K / GROUP;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const float *p = x + (long)m * x_stride + g * GROUP;
            const v8 s = ((ld8(p) + ld8(p + 8)) + ld8(p + 16)) + ld8(p + 24);
            xsum[(long)m * G + g] = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
        }
}

void simllm_vec_int4_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                        float *xsum, float *buf, long buf_per_thread, int nthreads) {
    group_sums(x, x_stride, M, K, xsum);
    run(part4, x, x_stride, w, y, y_stride, M, N, K, xsum, buf, buf_per_thread, nthreads);
}

/* GGUF Q4_K's own layout (BLOB4K: the codes of BLOB4, the sub-scales and sub-mins as bytes, d and dmin per
   super-block): the same operations as simllm_vec_int4_mm on the same numbers, so the same bits, from 4.75 bits
   a weight instead of 6 (a decode step streams every weight once: fewer bytes, faster). K in 256s. */
void simllm_vec_int4k_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N,
                         int K, float *xsum, float *buf, long buf_per_thread, int nthreads) {
    group_sums(x, x_stride, M, K, xsum);
    run(part4k, x, x_stride, w, y, y_stride, M, N, K, xsum, buf, buf_per_thread, nthreads);
}

/* 8-bit weights (one scale per group of 32): the LM head's logits. */
void simllm_vec_int8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                        float *buf, long buf_per_thread, int nthreads) {
    run(part8, x, x_stride, w, y, y_stride, M, N, K, 0, buf, buf_per_thread, nthreads);
}

/* The same, with the signature of simllm_vec_int4_mm (the group sums unused): the C layers call every format
   through one function pointer type. */
void simllm_vec_int8_mmx(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N,
                         int K, float *xsum, float *buf, long buf_per_thread, int nthreads) {
    (void)xsum;
    run(part8, x, x_stride, w, y, y_stride, M, N, K, 0, buf, buf_per_thread, nthreads);
}

/* 8-bit codes with a float32 scale per group of 16 inputs (GGUF's Q6_K: codes -32..31, scale = d * its int8
   sub-scale): per output, acc over the group's 16 inputs in order from zero, then out = fma(scale, acc, out),
   groups in order. The signature of simllm_vec_int4_mm (the group sums unused). */
void simllm_vec_int8g16_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N,
                           int K, float *xsum, float *buf, long buf_per_thread, int nthreads) {
    (void)xsum;
    run(part6, x, x_stride, w, y, y_stride, M, N, K, 0, buf, buf_per_thread, nthreads);
}

/* ---- Q4_K weights times 8-bit rows ("q4k8"): integer dot products, as llama.cpp multiplies Q4_K by Q8_K ----
   Each row's inputs are quantized per block of 256 (QBLK): scale dx = amax / 127, code = round-to-even of
   x * (127 / amax), clamped to -127..127 (NaN to 0). Per output and super-block of 256 inputs: isum_g = sum of
   code_w * code_x over group g's 32 inputs, acc = sum_g sub-scale_g * isum_g, ms = sum_g sub-min_g * xsum_g (xsum_g:
   the group's input codes added), all exact in int32 (at most 8 * 63 * 32 * 15 * 127 < 2^31); then
   out = fma(d * dx, (float)acc, out) and out = fma(-(dmin * dx), (float)ms, out), super-blocks in order from 0.
   Integer sums are exact in any order, so VNNI, AVX2, NEON's sdot and plain C compute the same bits; only the
   float steps above are fixed. Weights (BLOB4K bytes per 16 outputs x super-block, 4.75 bits a weight): the 16 d,
   16 dmin, then per group 4 chunks of 64 bytes (chunk p, byte 4j + i: output j's code of input 8p + i in the low
   nibble, of 8p + 4 + i in the high), 16 sub-scales, 16 sub-mins. */
#define QBLK 256
#define QROWS 4  /* rows at a time over a block's weights */

/* A row's quantized inputs: K codes, then K/256 float32 scales, then the codes' sums per 32 and per 16 (int32). */
static inline long qrow_bytes(int K) {
    return (long)K + (long)(K / QBLK) * 4 + (long)(K / GROUP) * 4 + (long)(K / 16) * 4;
}
static inline const float *qrow_scales(const uint8_t *row, int K) { return (const float *)(const void *)(row + K); }
static inline const int32_t *qrow_sums32(const uint8_t *row, int K) {
    return (const int32_t *)(const void *)(row + K + (long)(K / QBLK) * 4);
}
static inline const int32_t *qrow_sums16(const uint8_t *row, int K) { return qrow_sums32(row, K) + K / GROUP; }
long simllm_vec_qrow_bytes(int K) { return qrow_bytes(K); }

static void quantize_rows(const float *x, long x_stride, int M, int K, uint8_t *q) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (long)m * x_stride;
        uint8_t *row = q + (long)m * qrow_bytes(K);
        int8_t *c = (int8_t *)row;
        float *dx = (float *)(void *)(row + K);
        int32_t *bs = (int32_t *)(void *)(dx + K / QBLK);
        for (int b = 0; b < K / QBLK; b++) {
            const float *p = xr + b * QBLK;
            float amax = 0.f;
            for (int i = 0; i < QBLK; i++) {
                const float a = __builtin_fabsf(p[i]);
                amax = a > amax ? a : amax;
            }
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            dx[b] = amax / 127.f;
            for (int i = 0; i < QBLK; i++) {
                float f = p[i] * inv;
                f = f > 127.f ? 127.f : (f < -127.f ? -127.f : f);
                c[b * QBLK + i] = f == f ? (int8_t)__builtin_rintf(f) : 0;
            }
        }
        for (int g = 0; g < K / 16; g++) {
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += c[g * 16 + i];
            bs[K / GROUP + g] = s;
        }
        for (int g = 0; g < K / GROUP; g++) bs[g] = bs[K / GROUP + 2 * g] + bs[K / GROUP + 2 * g + 1];
    }
}

static inline int32_t rd32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

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
#if defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
#define DPB(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#else
#define DPB(acc, u, s) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), _mm512_set1_epi16(1)))
#endif
static inline void gdot(const uint8_t *c, const int8_t *xg, vi *is) {
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * p));
        is[0] = DPB(is[0], _mm512_and_si512(v, m4), _mm512_set1_epi32(rd32(xg + 8 * p)));
        is[0] = DPB(is[0], _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_set1_epi32(rd32(xg + 8 * p + 4)));
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
    for (int h = 0; h < 2; h++) {
        v8iq u = {is[h]};
        u.q[0] = vaddq_s32(u.q[0], a[2 * h]);
        u.q[1] = vaddq_s32(u.q[1], a[2 * h + 1]);
        is[h] = u.v;
    }
}
#define HAVE_GDOT
#endif
#endif
#if !defined(HAVE_GDOT)  /* plain C: the same integer sums */
static inline void gdot(const uint8_t *c, const int8_t *xg, vi *is) {
    int32_t t[16] = {0};
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 4; i++) {
                const int u = c[64 * p + 4 * j + i];
                t[j] += (u & 15) * xg[8 * p + i] + (u >> 4) * xg[8 * p + 4 + i];
            }
#if defined(__AVX512F__)
    is[0] = _mm512_add_epi32(is[0], _mm512_loadu_si512((const void *)t));
#else
    for (int h = 0; h < NH; h++)
        for (int l = 0; l < VL; l++) is[h][l] += t[VL * h + l];
#endif
}
#endif

/* NR rows (quantized, at xr[r]) times one block of 16 outputs over super-block s: their outputs o[r] updated. */
static inline __attribute__((always_inline)) void sb4k8(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    vi acc[QROWS][NH], ms[QROWS][NH];
    for (int r = 0; r < NR; r++) for (int h = 0; h < NH; h++) acc[r][h] = ms[r][h] = VI_ZERO;
    for (int g = 0; g < SB4K; g++) {
        const uint8_t *wg = blk + HEAD4K + g * GRP4K;
        vi scv[NH], mnv[NH];
        for (int h = 0; h < NH; h++) {
            scv[h] = VI_U8(wg + 256 + VL * h);
            mnv[h] = VI_U8(wg + 272 + VL * h);
        }
        for (int r = 0; r < NR; r++) {
            const int8_t *xg = (const int8_t *)xr[r] + (long)s * QBLK + g * GROUP;
            const int32_t *bs = qrow_sums32(xr[r], K);
            vi is[NH];
            for (int h = 0; h < NH; h++) is[h] = VI_ZERO;
            gdot(wg, xg, is);
            for (int h = 0; h < NH; h++) {
                acc[r][h] = VI_ADD(acc[r][h], VI_MUL(scv[h], is[h]));
                ms[r][h] = VI_ADD(ms[r][h], VI_MUL(mnv[h], VI_BC(bs[s * SB4K + g])));
            }
        }
    }
    const float *d = (const float *)(const void *)blk;
    for (int r = 0; r < NR; r++) {
        const float dx = qrow_scales(xr[r], K)[s];
        for (int h = 0; h < NH; h++) {
            const vw dd = ld(d + VL * h) * bc(dx), dm = -(ld(d + 16 + VL * h) * bc(dx));
            o[r][h] = FMA(dd, VI_F(acc[r][h]), o[r][h]);
            o[r][h] = FMA(dm, VI_F(ms[r][h]), o[r][h]);
        }
    }
}

/* Output blocks b0..b1-1 for every row: per block, rows in QROWS over its weights (which stay in cache); SB: a
   super-block's function (sb4k8, sb6k8), SBBYTES its bytes per 16 outputs. */
#define DEFINE_PART8(NAME, SB, SBBYTES)                                                                       \
static void *NAME(void *arg) {                                                                            \
    const job_t *J = arg;                                                                                 \
    const int S = J->K / QBLK;                                                                            \
    const long bbytes = (long)S * (SBBYTES), qb = qrow_bytes(J->K);                                       \
    const uint8_t *q = (const uint8_t *)(const void *)J->xsum;                                            \
    for (int b = J->b0; b < J->b1; b++) {                                                                 \
        const uint8_t *wb = J->w + b * bbytes;                                                            \
        for (int r0 = 0; r0 < J->M; r0 += QROWS) {                                                        \
            const int R = J->M - r0 < QROWS ? J->M - r0 : QROWS;                                          \
            const uint8_t *xr[QROWS];                                                                     \
            vw o[QROWS][NH];                                                                              \
            for (int r = 0; r < QROWS; r++) {                                                             \
                xr[r] = q + (long)(r0 + (r < R ? r : 0)) * qb;                                            \
                for (int h = 0; h < NH; h++) o[r][h] = bc(0.f);                                           \
            }                                                                                             \
            for (int s = 0; s < S; s++) {                                                                 \
                const uint8_t *blk = wb + (long)s * (SBBYTES);                                            \
                switch (R) {                                                                              \
                case 4: SB(blk, xr, s, J->K, o, 4); break;                                                \
                case 3: SB(blk, xr, s, J->K, o, 3); break;                                                \
                case 2: SB(blk, xr, s, J->K, o, 2); break;                                                \
                default: SB(blk, xr, s, J->K, o, 1); break;                                               \
                }                                                                                         \
            }                                                                                             \
            for (int r = 0; r < R; r++)                                                                   \
                for (int h = 0; h < NH; h++) st(J->y + (long)(r0 + r) * J->y_stride + 16 * b + VL * h, o[r][h]); \
        }                                                                                                 \
    }                                                                                                     \
    return 0;                                                                                             \
}
DEFINE_PART8(part4k8, sb4k8, BLOB4K)

/* Q4_K weights (layout above) times float32 rows quantized to 8 bits per 256 inputs; xsum: the rows' quantized
   inputs (simllm_vec_qrow_bytes(K) bytes each, 4-byte aligned). K in 256s. */
void simllm_vec_q4k8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                        float *xsum, float *buf, long buf_per_thread, int nthreads) {
    quantize_rows(x, x_stride, M, K, (uint8_t *)(void *)xsum);
    run(part4k8, x, x_stride, w, y, y_stride, M, N, K, xsum, buf, buf_per_thread, nthreads);
}

/* ---- Q6_K weights times 8-bit rows ("q6k8") ----
   The rows as for q4k8, with their group sums per 16 inputs too. Per output and super-block of 256 inputs: for each
   group g of 16, isum_g = sum of (code_w + 32) * code_x minus 32 * xsum16_g (the file's codes -32..31 stored as
   0..63), acc = sum_g sub-scale_g * isum_g (int8 sub-scales), exact in int32 (at most 16 * 127 * 16 * 95 * 127);
   then out = fma(d * dx, (float)acc, out), super-blocks in order from 0. Weights (BLOB6K bytes per 16 outputs x
   super-block, 8.625 bits a weight): the 16 d (float32), then per group 4 chunks of 64 bytes (chunk t, byte 4j + i:
   output j's code of input 4t + i, plus 32) and the 16 sub-scales. */
#define GRP6K 272
#define HEAD6K 64
#define BLOB6K (HEAD6K + 16 * GRP6K)

#if defined(__AVX512F__)
#define VI_I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#else
#define VI_I8(p) I8X8(p)
#endif

/* Adds a group of 16 inputs' sums into is[NH]: c its 256 code bytes (0..63), xg the row's 16 input codes. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline void gdot6(const uint8_t *c, const int8_t *xg, vi *is) {
    for (int t = 0; t < 4; t++)
        is[0] = DPB(is[0], _mm512_loadu_si512((const void *)(c + 64 * t)), _mm512_set1_epi32(rd32(xg + 4 * t)));
}
#elif !defined(__AVX512F__) && defined(__AVX2__)
static inline void gdot6(const uint8_t *c, const int8_t *xg, vi *is) {
    for (int h = 0; h < 2; h++)  /* int16 pair sums: at most 2 * 2 * 63 * 127 */
        for (int t = 0; t < 4; t += 2) {
            const __m256i a = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(c + 64 * t + 32 * h)),
                                                   _mm256_set1_epi32(rd32(xg + 4 * t)));
            const __m256i b = _mm256_maddubs_epi16(
                _mm256_loadu_si256((const __m256i *)(const void *)(c + 64 * (t + 1) + 32 * h)),
                _mm256_set1_epi32(rd32(xg + 4 * t + 4)));
            is[h] = (vi)_mm256_add_epi32((__m256i)is[h], _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1)));
        }
}
#elif !defined(__AVX512F__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
static inline void gdot6(const uint8_t *c, const int8_t *xg, vi *is) {
    int32x4_t a[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
    for (int t = 0; t < 4; t++) {
        const int8x16_t xa = vreinterpretq_s8_s32(vdupq_n_s32(rd32(xg + 4 * t)));
        for (int q = 0; q < 4; q++) a[q] = vdotq_s32(a[q], vreinterpretq_s8_u8(vld1q_u8(c + 64 * t + 16 * q)), xa);
    }
    for (int h = 0; h < 2; h++) {
        v8iq u = {is[h]};
        u.q[0] = vaddq_s32(u.q[0], a[2 * h]);
        u.q[1] = vaddq_s32(u.q[1], a[2 * h + 1]);
        is[h] = u.v;
    }
}
#else
static inline void gdot6(const uint8_t *c, const int8_t *xg, vi *is) {
    int32_t t[16] = {0};
    for (int q = 0; q < 4; q++)
        for (int j = 0; j < 16; j++)
            for (int i = 0; i < 4; i++) t[j] += c[64 * q + 4 * j + i] * xg[4 * q + i];
#if defined(__AVX512F__)
    is[0] = _mm512_add_epi32(is[0], _mm512_loadu_si512((const void *)t));
#else
    for (int h = 0; h < NH; h++)
        for (int l = 0; l < VL; l++) is[h][l] += t[VL * h + l];
#endif
}
#endif

static inline __attribute__((always_inline)) void sb6k8(const uint8_t *blk, const uint8_t *const *xr, int s, int K,
                                                         vw o[QROWS][NH], const int NR) {
    vi acc[QROWS][NH];
    for (int r = 0; r < NR; r++) for (int h = 0; h < NH; h++) acc[r][h] = VI_ZERO;
    for (int g = 0; g < 16; g++) {
        const uint8_t *wg = blk + HEAD6K + g * GRP6K;
        vi scv[NH];
        for (int h = 0; h < NH; h++) scv[h] = VI_I8(wg + 256 + VL * h);
        for (int r = 0; r < NR; r++) {
            const int8_t *xg = (const int8_t *)xr[r] + (long)s * QBLK + g * 16;
            vi is[NH];
            for (int h = 0; h < NH; h++) is[h] = VI_BC(-32 * qrow_sums16(xr[r], K)[s * 16 + g]);
            gdot6(wg, xg, is);
            for (int h = 0; h < NH; h++) acc[r][h] = VI_ADD(acc[r][h], VI_MUL(scv[h], is[h]));
        }
    }
    const float *d = (const float *)(const void *)blk;
    for (int r = 0; r < NR; r++) {
        const float dx = qrow_scales(xr[r], K)[s];
        for (int h = 0; h < NH; h++) o[r][h] = FMA(ld(d + VL * h) * bc(dx), VI_F(acc[r][h]), o[r][h]);
    }
}
DEFINE_PART8(part6k8, sb6k8, BLOB6K)

/* Q6_K weights (layout above) times float32 rows quantized as for simllm_vec_q4k8_mm. K in 256s. */
void simllm_vec_q6k8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                        float *xsum, float *buf, long buf_per_thread, int nthreads) {
    quantize_rows(x, x_stride, M, K, (uint8_t *)(void *)xsum);
    run(part6k8, x, x_stride, w, y, y_stride, M, N, K, xsum, buf, buf_per_thread, nthreads);
}
