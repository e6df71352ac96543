#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "layers_api.h"
#include "exp_poly.h"
#include "layer_stack.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef uint16_t bf16;

typedef void (*norm_fn)(const bf16 *x, long x_stride, const bf16 *w, bf16 *y, int m, int e, float eps);
typedef void (*mm_fn)(const bf16 *x, long x_stride, const uint8_t *w, bf16 *y, long y_stride, int M, int N, int K,
                      float *xsum, uint8_t *scratch, long per_thread, int nthreads);
typedef void (*attend_fn)(const bf16 *q, long q_sn, long q_sh, const bf16 *kn, long kn_sn, long kn_sh,
                          const bf16 *vn, long vn_sn, long vn_sh, bf16 *out, int Hq, int Hkv, int D, float scale,
                          float softcap, int nseq, const int64_t *table, int layer, const uint8_t *blocked, int first,
                          float *work, long stride, int threads);

static inline __m512 ld(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* round to nearest even, as torch's bf16 ops do (a NaN stays a NaN) */
static inline __m512 rnd(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                              _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void st(bf16 *p, __m512 f) {  /* f already rounded */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16)));
}
/* 1 + exp(x), x clamped to [-87, 88]: one fused multiply-add after the polynomial (exp_poly.h) */
static inline __m512 one_plus_exp(__m512 x) {
    __m512 s;
    const __m512 y = exp_poly_parts(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)), &s);
    return _mm512_fmadd_ps(y, s, _mm512_set1_ps(1.0f));
}

/* out [M, H, D] = x * cos + roll(x, D/2) * sin of the first H heads of each row (sin's first half negated by
   the caller), each product and the sum rounded to bf16: torch's three bf16 ops. D a multiple of 32. */
void simllm_rope_bf16(const bf16 *x, long row_stride, int M, int H, int D, const bf16 *cos, const bf16 *sin,
                      bf16 *out) {
    const int half = D / 2;
    for (int m = 0; m < M; m++) {
        const bf16 *c = cos + (long)m * D, *s = sin + (long)m * D;
        for (int h = 0; h < H; h++) {
            const bf16 *xr = x + (long)m * row_stride + (long)h * D;
            bf16 *o = out + ((long)m * H + h) * D;
            for (int d = 0; d < D; d += 16) {
                const int other = d < half ? d + half : d - half;
                __m512 a = rnd(_mm512_mul_ps(ld(xr + d), ld(c + d)));
                __m512 b = rnd(_mm512_mul_ps(ld(xr + other), ld(s + d)));
                st(o + d, rnd(_mm512_add_ps(a, b)));
            }
        }
    }
}

/* a [M, I] = bf16(silu(g)) * u, rounded, of gu [M, 2I] (g: the first I columns, u: the rest). I % 16 == 0. */
/* columns c0..c1-1 of it (multiples of 16): a step of few rows splits its columns over threads (glue_rows) */
static void silu_mul_bf16_cols(const bf16 *gu, long gu_stride, int M, int I, int c0, int c1, bf16 *a, long a_stride) {
    for (int m = 0; m < M; m++) {
        const bf16 *g = gu + (long)m * gu_stride, *u = g + I;
        bf16 *o = a + (long)m * a_stride;
        for (int j = c0; j < c1; j += 16) {
            __m512 x = ld(g + j);
            __m512 sl = rnd(_mm512_div_ps(x, one_plus_exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            st(o + j, rnd(_mm512_mul_ps(sl, ld(u + j))));
        }
    }
}
void simllm_silu_mul_bf16(const bf16 *gu, long gu_stride, int M, int I, bf16 *a, long a_stride) {
    silu_mul_bf16_cols(gu, gu_stride, M, I, 0, I, a, a_stride);
}

/* h [M, E] += t [M, E], rounded as torch's bf16 add. E % 16 == 0. */
static void add_rows(bf16 *h, const bf16 *t, long n) {
    for (long i = 0; i < n; i += 16) st(h + i, rnd(_mm512_add_ps(ld(h + i), ld(t + i))));
}

typedef void (*pool_fn)(void *(*)(void *), void *, long, int);
typedef struct simllm_pass {
    norm_fn norm; mm_fn mm; attend_fn attend;
    int E, Hq, Hkv, D, I;
    float scale, softcap;  /* softcap: the attention scores' (0: none) */
    int nseq; const int64_t *table; float *awork; long astride; int athreads;   /* the pass's attention */
    float *xsum; uint8_t *scratch; long per_thread; int threads; long thread_min_macs;  /* the products' */
    pool_fn pool; int glue_min_rows;  /* the 4-bit kernel's kept workers (or 0), for the steps between products */
    int wnseq; const int64_t *wtable; float *wawork; long wastride; int wathreads;  /* unused here: pass32_t's */
    int act;                                                                          /* layout is _Pass's too */
    int rot;                                                                          /* unused here */
    double *prof;  /* where a profiled pass adds its steps' nanoseconds (layer_stack.h's PROF_*), or 0 */
} pass_t;

/* The steps between products (norms, residual adds, RoPE, SiLU; layer_stack.h) are per row. */
typedef struct {
    const pass_t *P; int op, M, n, i, cols;  /* cols: job i of n takes a share of the columns of every row */
    bf16 *h; const bf16 *t; const bf16 *w; bf16 *x; float eps;  /* G_NORM: x = norm(h); G_ADD_NORM: h += t first
                                                                     (no norm where w is 0) */
    const bf16 *src; bf16 *dst; const bf16 *cos, *sin;            /* G_ROPE: qkv -> qk; G_SILU: gu -> a */
} glue_t;

static void *glue_rows(void *arg) {
    const glue_t *G = arg;
    const pass_t *P = G->P;
    if (G->cols) {  /* G_SILU over few rows: columns in 16s (layer_stack.h's GLUE_COLS) */
        const int blocks = P->I / 16, c0 = 16 * (blocks * G->i / G->n), c1 = 16 * (blocks * (G->i + 1) / G->n);
        silu_mul_bf16_cols(G->src, 2 * P->I, G->M, P->I, c0, c1, G->dst, P->I);
        return 0;
    }
    const int m0 = (int)((long)G->M * G->i / G->n), m1 = (int)((long)G->M * (G->i + 1) / G->n), m = m1 - m0;
    const int E = P->E, D = P->D, H = P->Hq + 2 * P->Hkv, I = P->I;
    if (m <= 0) return 0;
    switch (G->op) {
    case G_ADD_NORM:
        add_rows(G->h + (long)m0 * E, G->t + (long)m0 * E, (long)m * E);
        if (!G->w) break;
        /* fall through */
    case G_NORM:
        P->norm(G->h + (long)m0 * E, E, G->w, G->x + (long)m0 * E, m, E, G->eps);
        break;
    case G_ROPE:
        simllm_rope_bf16(G->src + (long)m0 * H * D, (long)H * D, m, P->Hq + P->Hkv, D, G->cos + (long)m0 * D,
                         G->sin + (long)m0 * D, G->dst + (long)m0 * (P->Hq + P->Hkv) * D);
        break;
    case G_SILU:
        simllm_silu_mul_bf16(G->src + (long)m0 * 2 * I, 2 * I, m, I, G->dst + (long)m0 * I, I);
        break;
    }
    return 0;
}

DEFINE_GLUE(glue, pass_t, glue_t, glue_rows)

static void product(const pass_t *P, const bf16 *x, int64_t w, bf16 *y, int M, int N, int K) {
    int threads = (long)M * N * K >= P->thread_min_macs ? P->threads : 1;
    P->mm(x, K, (const uint8_t *)(intptr_t)w, y, N, M, N, K, P->xsum, P->scratch, P->per_thread, threads);
}

/* Layers first..last-1 over h [M, E] (in place). weights [L][6]: ln1, ln2 (bf16 [E]), then the 4-bit blobs of
   qkv, o, gate_up and down; eps [L][2]. ws: bf16 workspace of M * (2E + 2Nqkv + Hq*D + 3I) elements. */
#define ROPE_EXTRA_NONE(W, eps, li)
#define ZERO(W) 0  /* one RoPE table, no windowed layers */
#define NO_POST_NORM(W, eps, li, which)
DEFINE_STACK(simllm_layers_bf16, bf16, pass_t, glue_t, glue, product, 6, 2, ROPE_EXTRA_NONE, ZERO, ZERO, NO_POST_NORM)
int simllm_layers_available(void) { return 1; }
#else
int simllm_layers_available(void) { return 0; }
#endif

/* Greedy's pick over a vocabulary's logits, 16 lanes at a time where AVX-512 is: each lane keeps its largest and the
   first index of it (a strictly greater value replaces), then the smallest index among the lanes that hold the
   largest value. Any NaN: the first NaN (torch.argmax counts NaN as the largest). No arithmetic on the values, so
   the answer is torch's exactly; a serial part of every decode step. */
static long argmax_from(const float *x, long from, long n, long best, float m) {
    for (long j = from; j < n; j++) {
        if (x[j] != x[j]) return j;
        if (x[j] > m) { m = x[j]; best = j; }
    }
    return best;
}
long simllm_argmax_f32(const float *x, long n) {
    if (n <= 0) return -1;
#if defined(__AVX512F__)
    if (n >= 16 && n < 0x7fffffffL) {
        __m512 best = _mm512_loadu_ps(x);
        __m512i bidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = bidx;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        long i = 16;
        for (; !nan && i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            idx = _mm512_add_epi32(idx, step);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
        }
        if (nan) return argmax_from(x, 0, n, 0, x[0]);  /* the first NaN, wherever it is */
        const float m = _mm512_reduce_max_ps(best);
        const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
        const long first = _mm512_mask_reduce_min_epi32(at, bidx);
        return argmax_from(x, i, n, first, m);
    }
#endif
    return x[0] != x[0] ? 0 : argmax_from(x, 1, n, 0, x[0]);
}

/* float32 layers (the 4-bit float32 runner: int4_vector_kernel's products, the norm kernel's float32 rows, the
   attention kernel's float32 entry), portable C for any CPU. RoPE and the residual adds as torch's float32 ops
   compute them: each product and sum rounded on its own (no fused multiply-add; the build turns contraction
   off). SiLU is ours: x / (1 + exp(-x)) with exp_poly.h's polynomial and the same fused 1 + y * s as the bf16
   path, not libm's expf (whose bits may differ between C libraries); the Python layers use it too
   (silu_mul_f32). Per row, like the rest. */
typedef void (*norm32_fn)(const float *x, long x_stride, const float *w, float *y, int m, int e, float eps);
typedef void (*mm32_fn)(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                        float *xsum, float *buf, long per_thread, int nthreads);
typedef void (*attend32_fn)(const float *q, long q_sn, long q_sh, const float *kn, long kn_sn, long kn_sh,
                            const float *vn, long vn_sn, long vn_sh, float *out, int Hq, int Hkv, int D, float scale,
                            float softcap, int nseq, const int64_t *table, int layer, const uint8_t *blocked, int first,
                            float *work, long stride, int threads);
typedef void (*pool32_fn)(void *(*)(void *), void *, long, int);
typedef struct simllm_pass32 {  /* the layout of pass_t (the _Pass structure), float32 entry points */
    norm32_fn norm; mm32_fn mm; attend32_fn attend;
    int E, Hq, Hkv, D, I;
    float scale, softcap;  /* softcap: the attention scores' (0: none) */
    int nseq; const int64_t *table; float *awork; long astride; int athreads;
    float *xsum; float *buf; long per_thread; int threads; long thread_min_macs;
    pool32_fn pool; int glue_min_rows;
    int wnseq; const int64_t *wtable; float *wawork; long wastride; int wathreads;  /* sliding layers' attention */
    int act;  /* the MLP's activation: ACT_SILU or ACT_GELU_TANH */
    int rot;  /* RoPE's rotated dimensions of a head (D; Phi-4-mini's 96 of 128) */
    double *prof;  /* where a profiled pass adds its steps' nanoseconds (layer_stack.h's PROF_*), or 0 */
} pass32_t;
enum { ACT_SILU, ACT_GELU_TANH };

void simllm_rope_f32(const float *x, long row_stride, int M, int H, int D, int rot, const float *cos,
                     const float *sin, float *out) {
    const int half = rot / 2;  /* dimensions d < rot turn in pairs (d, d + rot / 2); the rest (cos 1, sin 0) stay */
    for (int m = 0; m < M; m++) {
        const float *c = cos + (long)m * D, *s = sin + (long)m * D;
        for (int h = 0; h < H; h++) {
            const float *xr = x + (long)m * row_stride + (long)h * D;
            float *o = out + ((long)m * H + h) * D;
            for (int d = 0; d < D; d++) {
                const int other = d >= rot ? d : (d < half ? d + half : d - half);
                const float a = xr[d] * c[d], b = xr[other] * s[d];
                o[d] = a + b;
            }
        }
    }
}

/* x / (1 + exp(e)), e clamped to [-87, 88]: SiLU's and GELU's shared form */
static inline float over_one_plus_exp(float x, float e) {
    float s;
    const float t = e < -87.0f ? -87.0f : (e > 88.0f ? 88.0f : e);
    const float y = exp_poly1_parts(t, &s);
    return x / fmaf(y, s, 1.0f);
}

#if defined(__AVX512F__)
/* over_one_plus_exp on 16 lanes, the same operations (exp_poly.h's 16-lane form): the clamp's max and min take the
   value second, so a NaN stays NaN as through the scalar's compares (the bf16 path's one_plus_exp clamps a NaN to
   -87, which is why it is not this one's denominator); negation flips the sign bit as unary minus.
   The scalar loop did not vectorize (3.4 ns an element: a 1.5B model's MLP activation took 1.5% of a decode step
   and 4% of an 8-row one). */
static inline __m512 over_one_plus_exp16(__m512 x, __m512 e) {
    const __m512 t = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), e));
    __m512 s;
    const __m512 y = exp_poly_parts(t, &s);
    return _mm512_div_ps(x, _mm512_fmadd_ps(y, s, _mm512_set1_ps(1.0f)));
}
static inline __m512 neg16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}
#endif

/* columns c0..c1-1 of it: a step of few rows splits its columns over threads (glue32_rows) */
static void silu_mul_f32_cols(const float *gu, long gu_stride, int M, int I, int c0, int c1, float *a,
                              long a_stride) {
    for (int m = 0; m < M; m++) {
        const float *g = gu + (long)m * gu_stride, *u = g + I;
        float *o = a + (long)m * a_stride;
        int j = c0;
#if defined(__AVX512F__)
        for (; j + 16 <= c1; j += 16) {
            const __m512 x = _mm512_loadu_ps(g + j);
            _mm512_storeu_ps(o + j, _mm512_mul_ps(over_one_plus_exp16(x, neg16(x)), _mm512_loadu_ps(u + j)));
        }
#endif
        for (; j < c1; j++) o[j] = over_one_plus_exp(g[j], -g[j]) * u[j];
    }
}
void simllm_silu_mul_f32(const float *gu, long gu_stride, int M, int I, float *a, long a_stride) {
    silu_mul_f32_cols(gu, gu_stride, M, I, 0, I, a, a_stride);
}

/* a [M, I] = gelu(g) * u with tanh's approximation, gelu(x) = 0.5 x (1 + tanh(c (x + 0.044715 x^3))) written as
   x / (1 + exp(-2 c (x + 0.044715 x^3))) (the same function: 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2z))), with
   exp_poly.h's polynomial and SiLU's clamp and fused 1 + y * s: ours, not torch's or libm's tanh, so its bits are
   the same on every CPU and C library; the Python layers use it too where the C layers run (Gemma 3's MLP). */
static void gelu_tanh_mul_f32_cols(const float *gu, long gu_stride, int M, int I, int c0, int c1, float *a,
                                   long a_stride) {
    for (int m = 0; m < M; m++) {
        const float *g = gu + (long)m * gu_stride, *u = g + I;
        float *o = a + (long)m * a_stride;
        int j = c0;
#if defined(__AVX512F__)
        for (; j + 16 <= c1; j += 16) {  /* the same operations on 16 lanes */
            const __m512 x = _mm512_loadu_ps(g + j);
            const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                           _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(0.044715f), x3)));
            const __m512 e = _mm512_mul_ps(_mm512_set1_ps(-2.0f), z);
            _mm512_storeu_ps(o + j, _mm512_mul_ps(over_one_plus_exp16(x, e), _mm512_loadu_ps(u + j)));
        }
#endif
        for (; j < c1; j++) {
            const float x = g[j], z = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
            o[j] = over_one_plus_exp(x, -2.0f * z) * u[j];
        }
    }
}
void simllm_gelu_tanh_mul_f32(const float *gu, long gu_stride, int M, int I, float *a, long a_stride) {
    gelu_tanh_mul_f32_cols(gu, gu_stride, M, I, 0, I, a, a_stride);
}

typedef struct {
    const pass32_t *P; int op, M, n, i, cols;  /* cols: job i of n takes a share of the columns of every row */
    float *h; float *t; const float *w; float *x; float eps;
    const float *pw; float peps;  /* G_ADD_NORM: a norm of t (in place) before it is added (Gemma 3), or 0 */
    float *src; float *dst; const float *cos, *sin;
    const float *bias, *qn, *kn; float qk_eps;  /* G_ROPE: Qwen2's q/k/v biases, Qwen3's per-head norms (or 0) */
} glue32_t;

static void *glue32_rows(void *arg) {
    const glue32_t *G = arg;
    const pass32_t *P = G->P;
    if (G->cols) {  /* G_SILU over few rows: columns in 16s (layer_stack.h's GLUE_COLS) */
        const int blocks = P->I / 16, c0 = 16 * (blocks * G->i / G->n), c1 = 16 * (blocks * (G->i + 1) / G->n);
        (P->act == ACT_GELU_TANH ? gelu_tanh_mul_f32_cols : silu_mul_f32_cols)(G->src, 2 * P->I, G->M, P->I, c0, c1,
                                                                             G->dst, P->I);
        return 0;
    }
    const int m0 = (int)((long)G->M * G->i / G->n), m1 = (int)((long)G->M * (G->i + 1) / G->n), m = m1 - m0;
    const int E = P->E, D = P->D, H = P->Hq + 2 * P->Hkv, I = P->I;
    if (m <= 0) return 0;
    switch (G->op) {
    case G_ADD_NORM: {
        float *h = G->h + (long)m0 * E, *t = G->t + (long)m0 * E;
        if (G->pw) P->norm(t, E, G->pw, t, m, E, G->peps);
        for (long j = 0; j < (long)m * E; j++) h[j] = h[j] + t[j];
        if (!G->w) break;
    }
        /* fall through */
    case G_NORM:
        P->norm(G->h + (long)m0 * E, E, G->w, G->x + (long)m0 * E, m, E, G->eps);
        break;
    case G_ROPE:
        /* the bias as torch adds it (y + b, one rounding), then each head's norm in place (rows of D), then RoPE:
           the Python layers' order (runner_weights.Proj, LayerSteps.rotated_rows) */
        for (int r = m0; r < m1; r++) {
            float *row = G->src + (long)r * H * D;
            if (G->bias)
                for (long j = 0; j < (long)H * D; j++) row[j] = row[j] + G->bias[j];
            if (G->qn) {
                P->norm(row, D, G->qn, row, P->Hq, D, G->qk_eps);
                P->norm(row + (long)P->Hq * D, D, G->kn, row + (long)P->Hq * D, P->Hkv, D, G->qk_eps);
            }
        }
        simllm_rope_f32(G->src + (long)m0 * H * D, (long)H * D, m, P->Hq + P->Hkv, D, P->rot, G->cos + (long)m0 * D,
                        G->sin + (long)m0 * D, G->dst + (long)m0 * (P->Hq + P->Hkv) * D);
        break;
    case G_SILU:
        (P->act == ACT_GELU_TANH ? simllm_gelu_tanh_mul_f32 : simllm_silu_mul_f32)(
            G->src + (long)m0 * 2 * I, 2 * I, m, I, G->dst + (long)m0 * I, I);
        break;
    }
    return 0;
}

DEFINE_GLUE(glue32, pass32_t, glue32_t, glue32_rows)

/* A projection of N outputs as parts of consecutive outputs, each its own weight format (a GGUF file's Q4_K_M keeps
   attn_v in Q6_K beside Q4_K q and k): int64 [parts, then per part its product (mm32_fn), blob, outputs]. Each
   part writes its columns of y; every output's operations are its part's kernel's, whatever parts are beside it. */
static void product32(const pass32_t *P, const float *x, int64_t parts, float *y, int M, int N, int K) {
    const int64_t *proj = (const int64_t *)(intptr_t)parts;
    long col = 0;
    for (int64_t i = 0; i < proj[0]; i++) {
        const mm32_fn mm = (mm32_fn)(intptr_t)proj[1 + 3 * i];
        const int n = (int)proj[3 + 3 * i];
        int threads = (long)M * n * K >= P->thread_min_macs ? P->threads : 1;
        mm(x, K, (const uint8_t *)(intptr_t)proj[2 + 3 * i], y + col, N, M, n, K, P->xsum, P->buf, P->per_thread,
           threads);
        col += n;
    }
}

/* simllm_layers_bf16's steps in the same order, in float32; weights [L][13]: the two norms, the projections as
   product32's part lists, then the qkv bias, q norm and k norm (0 where the model has none), the RoPE table's index,
   the norms of the attention and the MLP outputs (Gemma 3's; 0 for none) and whether the layer attends a sliding
   window; eps [L][5] (the two norms', the q/k norms', the two output norms'). ws: M * (2E + 2Nqkv + Hq*D + 3I)
   floats. */
#define ROPE_EXTRA_F32(W, eps, li) , .bias = (const float *)(intptr_t)(W)[6], .qn = (const float *)(intptr_t)(W)[7], \
    .kn = (const float *)(intptr_t)(W)[8], .qk_eps = (eps)[5 * (li) + 2]
#define TABLE_F32(W) ((W)[9])
#define WINDOWED_F32(W) ((W)[12] != 0)
#define POST_NORM_F32(W, eps, li, which) , .pw = (const float *)(intptr_t)(W)[10 + (which)], \
    .peps = (eps)[5 * (li) + 3 + (which)]
DEFINE_STACK(simllm_layers_f32, float, pass32_t, glue32_t, glue32, product32, 13, 5, ROPE_EXTRA_F32, TABLE_F32,
             WINDOWED_F32, POST_NORM_F32)
