#include <stdint.h>
#include <string.h>
#include "int4_vector_api.h"
#include "product_run.h"
#include "vector_product.h"

#define BLOB4 384  /* 16 outputs x one group: inputs 2i and 2i + 1 in 16 bytes at 16i (byte j: output j's code of
                      input 2i in the low nibble, of 2i + 1 in the high), then 16 steps and 16 bases, float32 */
#define BLOB8 576  /* input k's 16 signed codes at 16k, then 16 scales */
#define GROUP6 16  /* inputs per group of the 16-input 8-bit format (GGUF's Q6_K: a scale per 16 weights) */
#define BLOB6 320  /* 16 outputs x one group of 16: input k's 16 signed codes at 16k, then 16 scales */
#define HEAD4K 128 /* a super-block's head for 16 outputs: 16 d, then 16 dmin, float32 */
#define GRP4K 288  /* a Q4_K group for 16 outputs: BLOB4's 256 bytes of codes, then 16 sub-scales and 16 sub-mins */
#define BLOB4K (HEAD4K + SB4K * GRP4K)  /* 2432 bytes per 16 outputs x super-block: 4.75 bits a weight (BLOB4: 6) */
#define RCHUNK 36  /* rows per chunk in the buffered path: their inputs stay in L2 while the blocks pass */
#define PREFETCH 8  /* groups ahead in the one-row path: the weights stream from memory while it computes */
/* Fewer rows than ROWS_AT_ONCE take the register path, 6 or 3 at a time (then 2 or 1), each block's weights decoded
   once for them; more take the buffered path (a group decoded into a buffer, then 6 rows at a time, in chunks whose
   inputs stay in L2 while a large matrix streams). The register path is faster up to 11 rows and about even with
   the buffered path at 12 and, for a matrix that fits L2, beyond (benchmark/results/verified_decoding_notes.md).
   NB2, NB3, NB6: blocks of 16 outputs at once with 2, 3 and 6 rows (their sums stay in registers: fewer with AVX2's
   two vectors per block). */
#define ROWS_AT_ONCE 12
#if defined(__AVX512F__)
#define NB2 4
#define NB3 4
#define NB6 2
#else
#define NB2 2
#define NB3 2
#define NB6 1
#endif

#include "vector_isa.h"
#define CS4 8   /* code bytes per input */
#define CS8 16
#define KS4 2   /* inputs per decode */
#define KS8 1
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


/* NR rows (1-3), NB blocks of 16 outputs at once (their sums in registers), weights decoded as they are used:
   once for all NR rows, each row taking the same operations as it does alone (x: row r at x + r * xst, its group
   sums at xs + r * G, its outputs at y + r * yst). */
#define DEFINE_ROW(NAME, NB, NR, GK, AT, BLOB, CS, KS, DEC, RPOST)                                            \
static inline void NAME(const float *x, long xst, const uint8_t *w, long bbytes, int G, const float *xs,   \
                        float *y, long yst) {                                                             \
    vw o[NR][NB][NH];                                                                                     \
    for (int r = 0; r < NR; r++) for (int j = 0; j < NB; j++) for (int h = 0; h < NH; h++) o[r][j][h] = bc(0.f); \
    for (int g = 0; g < G; g++) {                                                                         \
        vw a[NR][NB][NH];                                                                                 \
        for (int r = 0; r < NR; r++) for (int j = 0; j < NB; j++) for (int h = 0; h < NH; h++) a[r][j][h] = bc(0.f); \
        const uint8_t *wg = w + AT(g);                                                                    \
        for (int j = 0; j < NB; j++)  /* no fault past the end: a prefetch is a hint */                   \
            for (int l = 0; l < BLOB; l += 64) __builtin_prefetch(wg + j * bbytes + PREFETCH * BLOB + l);  \
        for (int k = 0; k < GK; k += KS) {                                                                \
            for (int j = 0; j < NB; j++) {                                                                \
                vw wk[KS][NH];                                                                            \
                DEC(wg + j * bbytes + k * CS, wk);                                                        \
                for (int r = 0; r < NR; r++) {                                                            \
                    const float *xg = x + r * xst + g * GK;                                               \
                    for (int t = 0; t < KS; t++)                                                          \
                        for (int h = 0; h < NH; h++) a[r][j][h] = FMA(bc(xg[k + t]), wk[t][h], a[r][j][h]); \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < NR; r++)                                                                      \
            for (int j = 0; j < NB; j++)                                                                  \
                RPOST(w + j * bbytes, g, wg + j * bbytes, a[r][j], xs ? xs[r * G + g] : 0.f, o[r][j]);    \
    }                                                                                                     \
    for (int r = 0; r < NR; r++)                                                                          \
        for (int j = 0; j < NB; j++) for (int h = 0; h < NH; h++) st(y + r * yst + 16 * j + VL * h, o[r][j][h]); \
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
#define DEFINE_PART(NAME, GK, AT, CS, KS, DEC, QROWS, ROW, HAS_XSUM, SC)                              \
static void *NAME(void *arg) {                                                                            \
    const job_t *J = arg;                                                                                 \
    const int G = J->K / GK;                                                                              \
    const long bbytes = AT(G) - AT(0);                                                                    \
    float t_[32];                                                                                         \
    if (J->M < ROWS_AT_ONCE) {  /* rows 6 or 3, then 2 or 1, at a time, the weights decoded once for them */ \
        for (int m = 0; m < J->M;) {                                                                      \
            const int nr = J->M - m >= 6 ? 6 : J->M - m >= 3 ? 3 : J->M - m;                              \
            const float *x = J->x + (long)m * J->x_stride;                                                \
            const float *xs = HAS_XSUM ? J->xsum + (long)m * G : 0;                                       \
            float *y = J->y + (long)m * J->y_stride;                                                      \
            const long xst = J->x_stride, yst = J->y_stride;                                              \
            int b = J->b0;                                                                                \
            if (nr == 6) {                                                                                \
                for (; b + NB6 <= J->b1; b += NB6) ROW##_6(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
                for (; b < J->b1; b++) ROW##_6x1(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
            } else if (nr == 3) {                                                                         \
                for (; b + NB3 <= J->b1; b += NB3) ROW##_3(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
                for (; b < J->b1; b++) ROW##_3x1(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
            } else if (nr == 2) {                                                                         \
                for (; b + NB2 <= J->b1; b += NB2) ROW##_2(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
                for (; b < J->b1; b++) ROW##_2x1(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
            } else {                                                                                      \
                for (; b + 4 <= J->b1; b += 4) ROW##_1(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
                for (; b < J->b1; b++) ROW##_1x1(x, xst, J->w + b * bbytes, bbytes, G, xs, y + 16 * b, yst); \
            }                                                                                             \
            m += nr;                                                                                      \
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
                for (int k = 0; k < GK; k += KS) {                                                        \
                    vw wk[KS][NH];                                                                        \
                    DEC(wg + k * CS, wk);                                                                 \
                    for (int t = 0; t < KS; t++)                                                          \
                        for (int h = 0; h < NH; h++) st(dq + 16 * (k + t) + VL * h, wk[t][h]);            \
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
/* Per format: 1, 2, 3 and 6 rows over 4, NB2, NB3 and NB6 blocks at once, and over one block (the rest of a
   thread's). */
#define DEFINE_ROWS(NAME, GK, AT, BLOB, CS, KS, DEC, RPOST)                                                 \
    DEFINE_ROW(NAME##_1, 4, 1, GK, AT, BLOB, CS, KS, DEC, RPOST)                                          \
    DEFINE_ROW(NAME##_1x1, 1, 1, GK, AT, BLOB, CS, KS, DEC, RPOST)                                        \
    DEFINE_ROW(NAME##_2, NB2, 2, GK, AT, BLOB, CS, KS, DEC, RPOST)                                        \
    DEFINE_ROW(NAME##_2x1, 1, 2, GK, AT, BLOB, CS, KS, DEC, RPOST)                                        \
    DEFINE_ROW(NAME##_3, NB3, 3, GK, AT, BLOB, CS, KS, DEC, RPOST)                                        \
    DEFINE_ROW(NAME##_3x1, 1, 3, GK, AT, BLOB, CS, KS, DEC, RPOST)                                        \
    DEFINE_ROW(NAME##_6, NB6, 6, GK, AT, BLOB, CS, KS, DEC, RPOST)                                        \
    DEFINE_ROW(NAME##_6x1, 1, 6, GK, AT, BLOB, CS, KS, DEC, RPOST)
DEFINE_ROWS(row4, GROUP, at_4, BLOB4, CS4, KS4, DEC4, RP4)
DEFINE_ROWS(row4k, GROUP, at_4k, GRP4K, CS4, KS4, DEC4, RP4K)
DEFINE_ROWS(row8, GROUP, at_8, BLOB8, CS8, KS8, DEC8, RP8)
DEFINE_ROWS(row6, GROUP6, at_6, BLOB6, CS8, KS8, DEC8, RP6)
DEFINE_QROWS(qrows4, GROUP, POST4, 1)
DEFINE_QROWS(qrows8, GROUP, POST8, 0)
DEFINE_QROWS(qrows6, GROUP6, POST8, 0)
DEFINE_PART(part4, GROUP, at_4, CS4, KS4, DEC4, qrows4, row4, 1, sc_4)
DEFINE_PART(part4k, GROUP, at_4k, CS4, KS4, DEC4, qrows4, row4k, 1, sc_4k)
DEFINE_PART(part8, GROUP, at_8, CS8, KS8, DEC8, qrows8, row8, 0, sc_8)
DEFINE_PART(part6, GROUP6, at_6, CS8, KS8, DEC8, qrows6, row6, 0, sc_6)

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

/* The K-quants' and the 32-input formats' products on rows quantized to 8 bits: their parts in int8_rows.h and
   int8_rows32.h, the entries here. */
#include "int8_rows32.h"

/* Q6_K weights (layout: int8_rows.h) times float32 rows quantized as for simllm_vec_q4k8_mm. K in 256s. */
DEFINE_MM8(simllm_vec_q6k8_mm, part6k8, QBLK)
/* Q3_K weights (layout: int8_rows.h) times float32 rows quantized as for simllm_vec_q4k8_mm. K in 256s. */
DEFINE_MM8(simllm_vec_q3k8_mm, part3k8, QBLK)
/* Q4_K weights (layout: int8_rows.h) times float32 rows quantized to 8 bits per 256 inputs; xsum: the rows' quantized
   inputs (qrow_bytes each, 4-byte aligned). K in 256s. */
DEFINE_MM8(simllm_vec_q4k8_mm, part4k8, QBLK)
/* Q5_K weights (layout: int8_rows.h) times float32 rows quantized as for simllm_vec_q4k8_mm. K in 256s. */
DEFINE_MM8(simllm_vec_q5k8_mm, part5k8, QBLK)
/* 8-bit codes with a scale per 32 (layout: int8_rows32.h) times float32 rows quantized to 8 bits per 32 inputs. */
DEFINE_MM8(simllm_vec_q8r_mm, part8r, GROUP)
/* Q5_0 weights (layout: int8_rows32.h) times float32 rows quantized to 8 bits per 32 inputs. */
DEFINE_MM8(simllm_vec_q5r_mm, part5r, GROUP)
/* Q5_1 weights (BLOB51R: Q5_0's layout, then the mins) times rows quantized as for simllm_vec_q5r_mm. */
DEFINE_MM8(simllm_vec_q51r_mm, part51r, GROUP)
/* Q4_0 weights (BLOB4R: Q5_0's layout without the top bits) times rows quantized as for simllm_vec_q5r_mm. */
DEFINE_MM8(simllm_vec_q4r_mm, part4r, GROUP)
/* IQ4_NL weights (layout: int8_rows32.h) times float32 rows quantized to 8 bits per 32 inputs. */
DEFINE_MM8(simllm_vec_iq4r_mm, partiq4, GROUP)
/* IQ4_XS weights (layout: int8_rows32.h) times float32 rows quantized to 8 bits per 32 inputs. K in 256s. */
DEFINE_MM8(simllm_vec_iq4xs_mm, partiq4xs, GROUP)
