#include <stdint.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "attention_api.h"
#include "exp_poly.h"

#define ROW_BLOCK 8
#define NCOL 14  /* columns of the sequence table */
/* the slot of token i of a sequence: its own (column 13: an int64 array) or start + i */
#define SLOT(sq, i) ((sq)[13] ? ((const int64_t *)(intptr_t)(sq)[13])[i] : (sq)[2] + (i))
#define MAXD 256

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 b) { uint32_t u = ((uint32_t)b) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline bf16 f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* Every per-key result below is a function of that key's data alone, computed by the same instructions
   whatever T, R or the block: vector loops run over whole groups of 16 (the score buffer is padded), never
   a scalar tail that would round differently. */
#ifdef __AVX512F__
#define VEC 16
typedef __m512 vf;
static inline vf ld_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf ld_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline float hsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vexp_nonpos(vf x) { return exp_poly(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))); }  /* x <= 0 */
#define VZERO _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VSET1(x) _mm512_set1_ps(x)
#define VLOADF(p) _mm512_loadu_ps(p)
#define VSTOREF(p, a) _mm512_storeu_ps(p, a)
#else  /* portable: 16 lanes in a struct, the same order everywhere */
#define VEC 16
typedef struct { float v[16]; } vf;
static inline vf ld_bf16(const bf16 *p) { vf r; for (int l = 0; l < 16; l++) r.v[l] = bf16_to_f32(p[l]); return r; }
static inline vf ld_f32(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
static inline float hsum(vf a) {
    for (int w = 8; w >= 1; w /= 2) for (int l = 0; l < w; l++) a.v[l] += a.v[l + w];
    return a.v[0];
}
static inline vf vexp_nonpos(vf x) {  /* the same operations as the AVX-512 form, lane by lane (exp_poly.h) */
    vf o;
    for (int l = 0; l < 16; l++) o.v[l] = exp_poly1(x.v[l] < -87.0f ? -87.0f : x.v[l]);
    return o;
}
static inline vf VZERO_fn(void) { vf r; memset(&r, 0, sizeof r); return r; }
static inline vf VFMA_fn(vf a, vf b, vf c) { for (int l = 0; l < 16; l++) c.v[l] = fmaf(a.v[l], b.v[l], c.v[l]); return c; }
static inline vf VADD_fn(vf a, vf b) { for (int l = 0; l < 16; l++) a.v[l] += b.v[l]; return a; }
static inline vf VMUL_fn(vf a, vf b) { for (int l = 0; l < 16; l++) a.v[l] *= b.v[l]; return a; }
static inline vf VSET1_fn(float x) { vf r; for (int l = 0; l < 16; l++) r.v[l] = x; return r; }
#define VZERO VZERO_fn()
#define VFMA(a, b, c) VFMA_fn(a, b, c)
#define VADD(a, b) VADD_fn(a, b)
#define VMUL(a, b) VMUL_fn(a, b)
#define VSET1(x) VSET1_fn(x)
#define VLOADF(p) ld_f32(p)
#define VSTOREF(p, a) memcpy(p, (a).v, sizeof (a).v)
#endif

/* A row's softmax weights over its scores sc[0..lim), unnormalised, in place: keys refused by `blocked` (row
   `tok`'s mask over keys first..T-1) weigh 0, sc[lim..] up to a whole vector is zeroed. Returns their sum. */
static inline float softmax_row(float *sc, int lim, const uint8_t *blocked, int tok, long T, int first) {
    const uint8_t *blk = blocked ? blocked + (long)tok * (T - first) - first : NULL;
    float mx = -INFINITY;
    for (int j = 0; j < lim; j++)
        if (!(blk && j >= first && blk[j]) && sc[j] > mx) mx = sc[j];
    int padded = ((lim + VEC - 1) / VEC) * VEC;
    for (int j = lim; j < padded; j++) sc[j] = mx;
    for (int j = 0; j < padded; j += VEC)
        VSTOREF(sc + j, vexp_nonpos(VADD(VLOADF(sc + j), VSET1(-mx))));
    for (int j = lim; j < padded; j++) sc[j] = 0.0f;
    if (blk) for (int j = first; j < lim; j++) if (blk[j]) sc[j] = 0.0f;
    vf sum = VZERO;
    for (int j = 0; j < padded; j += VEC) sum = VADD(sum, VLOADF(sc + j));
    return hsum(sum);
}

/* One layer's attention for a pass of N query rows from one or more sequences, each over its own KV buffer.
   q: row n, query head hq at q[n*q_sn + hq*q_sh + d]; knew/vnew: the rows' new keys/values [n, kv head] at
   n*kn_sn + h*kn_sh (and vn_*), written here into each sequence's buffer before attending; out [N, Hq, D].
   seqs [nseq][14] int64: row0, m, start, k_base, v_base, k_sl, k_sh, k_sj, v_sl, v_sh, v_sj (pointers and
   element strides of [L, Hkv, C, D] buffers), lead, P: slots [0, P) of this sequence's buffers hold the same bits
   as those of sequence `lead` (lead <= s; lead == s and P == 0: nothing shared), which the AMX code then reads
   once for all of them (the vector code reads each sequence's own: the same bits either way), and a pointer to
   the tokens' own slots (int64 [m], non-decreasing, the last = start + m - 1) or 0. Token i of a sequence sits at
   slot SLOT(i) (start + i unless its own are given) and attends slots <= SLOT(i); with `blocked` (one sequence
   only) [m, T - first] instead: slot j is refused when j >= first and blocked[i * (T - first) + j - first],
   T = start + m. Query head hq reads KV head hq / (Hq / Hkv). softcap > 0: each score s (scaled) becomes
   softcap * tanh(s / softcap) before the softmax (Gemma 2's; exp_poly.h's softcap1, the same bits on every path).
   work: ROW_BLOCK * (T + VEC) floats for the longest T, per thread (nthreads: 1 runs in the caller's thread).
   Rows are split between threads in whole blocks, each computed exactly as alone: threads change no bit. */
typedef struct {
    const void *q, *knew, *vnew; void *out;
    long q_sn, q_sh, kn_sn, kn_sh, vn_sn, vn_sh, work_stride;
    int Hq, Hkv, D, nseq, layer, first, nthreads; float scale, softcap;
    const int64_t *seqs; const uint8_t *blocked; float *work;
} pass_t;
typedef struct { const pass_t *p; int tid; void (*part)(const pass_t *, int); } job_t;
static void *run_job(void *arg) { job_t *j = (job_t *)arg; j->part(j->p, j->tid); return NULL; }
/* Kept worker threads to split a pass on (the 4-bit kernel's simllm_pool_call, set from Python): a row block is
   handed to a waiting thread in microseconds, where starting threads per pass costs ~100 us. 0: started here. */
typedef void (*pool_call_t)(void *(*)(void *), void *, long, int);
static pool_call_t pool_call;
void simllm_attend_set_pool(void *fn) { pool_call = (pool_call_t)fn; }
static void run_threads(const pass_t *p, void (*part)(const pass_t *, int)) {
    pthread_t th[64]; job_t jobs[64]; int started = 0, n = p->nthreads > 64 ? 64 : p->nthreads;
    if (pool_call) {
        for (int t = 0; t < n; t++) { jobs[t].p = p; jobs[t].tid = t; jobs[t].part = part; }
        pool_call(run_job, jobs, sizeof(job_t), n);
        return;
    }
    for (int t = 1; t < n; t++) {
        jobs[t].p = p; jobs[t].tid = t; jobs[t].part = part;
        if (pthread_create(&th[t], NULL, run_job, &jobs[t]) != 0) break;
        started = t;
    }
    if (started < n - 1) {  /* could not start them all: the caller does the rest, same blocks, same bits */
        for (int t = started + 1; t < n; t++) part(p, t);
    }
    part(p, 0);
    for (int t = 1; t <= started; t++) pthread_join(th[t], NULL);
}

/* The entry point of a pass: the new KV first (every thread then reads finished buffers), then PART's row
   blocks in this thread or split between threads. */
#define DEFINE_ENTRY(NAME, TYPE, PART)                                                                      \
void NAME(const TYPE *q, long q_sn, long q_sh, const TYPE *knew, long kn_sn, long kn_sh,                    \
          const TYPE *vnew, long vn_sn, long vn_sh, TYPE *out, int Hq, int Hkv, int D, float scale,          \
          float softcap,                                                                                     \
          int nseq, const int64_t *seqs, int layer, const uint8_t *blocked, int first, float *work,          \
          long work_stride, int nthreads) {                                                                 \
    for (int s = 0; s < nseq; s++) {                                                                        \
        const int64_t *sq = seqs + NCOL * s;                                                                  \
        const long row0 = sq[0], m = sq[1];                                                                 \
        TYPE *kb = (TYPE *)(intptr_t)sq[3] + layer * sq[5], *vb = (TYPE *)(intptr_t)sq[4] + layer * sq[8];  \
        for (long i = 0; i < m; i++)                                                                        \
            for (int h = 0; h < Hkv; h++) {                                                                 \
                memcpy(kb + h * sq[6] + SLOT(sq, i) * sq[7], knew + (row0 + i) * kn_sn + h * kn_sh, D * sizeof(TYPE)); \
                memcpy(vb + h * sq[9] + SLOT(sq, i) * sq[10], vnew + (row0 + i) * vn_sn + h * vn_sh, D * sizeof(TYPE)); \
            }                                                                                               \
    }                                                                                                       \
    pass_t P = {q, knew, vnew, out, q_sn, q_sh, kn_sn, kn_sh, vn_sn, vn_sh, work_stride,                    \
                Hq, Hkv, D, nseq, layer, first, nthreads < 1 ? 1 : nthreads, scale, softcap, seqs, blocked, work}; \
    if (P.nthreads == 1) PART(&P, 0);                                                                       \
    else run_threads(&P, PART);                                                                             \
}

#define DEFINE_ATTEND(NAME, TYPE, LD, STORE)                                                                \
static void NAME##_part(const pass_t *P, int tid) {                                                         \
    const TYPE *q = (const TYPE *)P->q; TYPE *out = (TYPE *)P->out;                                         \
    const int Hq = P->Hq, Hkv = P->Hkv, D = P->D, C = D / VEC, G = Hq / Hkv, nt = P->nthreads;              \
    const uint8_t *blocked = P->blocked; const int first = P->first;                                        \
    float *work = P->work + tid * P->work_stride;                                                           \
    vf qv[ROW_BLOCK][MAXD / VEC], acc[ROW_BLOCK][MAXD / VEC], kv[MAXD / VEC];                               \
    int lim[ROW_BLOCK], tok[ROW_BLOCK];                                                                     \
    float total[ROW_BLOCK], tmp[VEC];                                                                       \
    long unit = 0;                                                                                          \
    for (int s = 0; s < P->nseq; s++) {                                                                     \
        const int64_t *sq = P->seqs + NCOL * s;                                                               \
        const long row0 = sq[0], m = sq[1], start = sq[2], T = start + m;                                   \
        const TYPE *kb = (const TYPE *)(intptr_t)sq[3] + P->layer * sq[5];                                  \
        const TYPE *vb = (const TYPE *)(intptr_t)sq[4] + P->layer * sq[8];                                  \
        const long k_sh = sq[6], k_sj = sq[7], v_sh = sq[9], v_sj = sq[10];                                 \
        const long W = ((T + VEC - 1) / VEC) * VEC;                                                         \
        for (int h = 0; h < Hkv; h++) {                                                                     \
            const TYPE *kh = kb + h * k_sh, *vh = vb + h * v_sh;                                            \
            /* rows of this KV head: (token i, group member g), token-major, in blocks */                   \
            for (long r0 = 0; r0 < m * G; r0 += ROW_BLOCK) {                                                \
                if (unit++ % nt != tid) continue;  /* interleaved: early (short) and late rows mix */       \
                int nb = m * G - r0 < ROW_BLOCK ? (int)(m * G - r0) : ROW_BLOCK, jmax = 0;                   \
                for (int b = 0; b < nb; b++) {                                                              \
                    long i = (r0 + b) / G; int hq = h * G + (int)((r0 + b) % G);                            \
                    const TYPE *qr = q + (row0 + i) * P->q_sn + hq * P->q_sh;                               \
                    for (int c = 0; c < C; c++) qv[b][c] = VMUL(LD(qr + c * VEC), VSET1(P->scale));         \
                    tok[b] = (int)i;                                                                        \
                    lim[b] = blocked ? (int)T : (int)(SLOT(sq, i) + 1);  /* a mask decides alone */            \
                    if (lim[b] > jmax) jmax = lim[b];                                                       \
                }                                                                                           \
                /* scores: each key read once for the block's rows; one dot product = C fused steps + hsum */\
                for (int j = 0; j < jmax; j++) {                                                            \
                    const TYPE *kj = kh + (long)j * k_sj;                                                   \
                    for (int c = 0; c < C; c++) kv[c] = LD(kj + c * VEC);                                   \
                    for (int b = 0; b < nb; b++) {                                                          \
                        if (j >= lim[b]) continue;                                                          \
                        vf a = VZERO;                                                                       \
                        for (int c = 0; c < C; c++) a = VFMA(qv[b][c], kv[c], a);                           \
                        const float sc = hsum(a);                                                           \
                        work[b * W + j] = P->softcap > 0.0f ? softcap1(sc, P->softcap) : sc;                \
                    }                                                                                       \
                }                                                                                           \
                /* softmax weights, unnormalised; refused keys weigh 0 and are skipped below */             \
                for (int b = 0; b < nb; b++) {                                                              \
                    total[b] = softmax_row(work + b * W, lim[b], blocked, tok[b], T, first);                \
                    for (int c = 0; c < C; c++) acc[b][c] = VZERO;                                          \
                }                                                                                           \
                /* weighted sum of values in key order: each value read once for the block's rows */        \
                for (int j = 0; j < jmax; j++) {                                                            \
                    const TYPE *vj = vh + (long)j * v_sj;                                                   \
                    for (int c = 0; c < C; c++) kv[c] = LD(vj + c * VEC);                                   \
                    for (int b = 0; b < nb; b++) {                                                          \
                        if (j >= lim[b]) continue;                                                          \
                        float w = work[b * W + j];                                                          \
                        if (w == 0.0f) continue;                                                            \
                        vf wv = VSET1(w);                                                                   \
                        for (int c = 0; c < C; c++) acc[b][c] = VFMA(wv, kv[c], acc[b][c]);                 \
                    }                                                                                       \
                }                                                                                           \
                for (int b = 0; b < nb; b++) {                                                              \
                    int hq = h * G + (int)((r0 + b) % G);                                                   \
                    TYPE *o = out + ((row0 + tok[b]) * Hq + hq) * (long)D;                                   \
                    float inv = total[b] > 0.0f ? 1.0f / total[b] : 0.0f;                                   \
                    for (int c = 0; c < C; c++) {                                                           \
                        VSTOREF(tmp, acc[b][c]);                                                            \
                        for (int l = 0; l < VEC; l++) o[c * VEC + l] = STORE(tmp[l] * inv);                 \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
}                                                                                                           \
DEFINE_ENTRY(NAME, TYPE, NAME##_part)

#define STORE_BF16(x) f32_to_bf16(x)
#define STORE_F32(x) (x)
DEFINE_ATTEND(simllm_attend_bf16, bf16, ld_bf16, STORE_BF16)
DEFINE_ATTEND(simllm_attend_f32, float, ld_f32, STORE_F32)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__linux__)
#include "amx_common.h"
/* bf16 on AMX tiles, 16 query rows at a time: the scores S^T = K Q^T of 16 keys in one tile (keys read in place,
   a row per lane), the softmax of the 16 rows at once across lanes (float32, sums in key order), then O = P V
   with P split into two bf16 parts (hi = bf16(w), lo = bf16(w - hi): ~16 bits of each weight) against the
   values paired for the tile (VNNI), accumulated in float32 tiles. Sequences that share their first slots (a
   lead and its members: one context, several requests) run their rows in common blocks: the shared keys and
   values are read once, each member's own after them (its rows only; the others' enter as zero weights).
   A row's bits depend on its own query and keys only: a tile and a lane compute each element on its own, rows
   beyond the block and keys beyond a row's limit enter with zero weight (keys past the sequence as zeros), and
   the chunks of 32 keys are summed in the same order shared or not. work per thread (floats): 49 Wm (scores,
   P's two parts, a member's copy of them, key masks; Wm = the longest T rounded up to 32) + the most paired
   values a group needs (its members' slots rounded up to 32, times D / 2) + 32 D + 2 nseq + 320. Needs D a
   multiple of 64. */

static inline void transpose16(__m512i r[16]) {  /* r[i] lane j -> r[j] lane i, 32-bit lanes */
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88); t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88); r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* The keys of one sequence for a 16-row block: scores of keys [j0, j1) from its buffer kh into SK for the lanes
   in `lanes` (all 16: stored in place; else blended in). Keys past `lmax` are never read. */
static inline void amx_scores(const bf16 *kh, long k_sj, long j0, long j1, long lmax, const bf16 *QT, bf16 *KZ,
                              float *ST, float *SK, int D, __mmask16 lanes) {
    for (; j0 < j1; j0 += 16) {
        const bf16 *kp = kh + j0 * k_sj; long kst = k_sj * 2;
        if (j0 + 16 > lmax) {  /* a last, partial block: copied, zero beyond */
            memset(KZ, 0, 16 * D * sizeof(bf16));
            for (long jj = 0; jj < lmax - j0; jj++) memcpy(KZ + jj * D, kp + jj * k_sj, D * sizeof(bf16));
            kp = KZ; kst = D * 2;
        }
        _tile_zero(0);
        for (int c = 0; c < D / 32; c++) {
            _tile_loadd(1, kp + c * 32, kst);
            _tile_loadd(2, QT + c * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        if (lanes == 0xffff) { _tile_stored(0, SK + j0 * 16, 64); continue; }
        _tile_stored(0, ST, 64);
        for (int k = 0; k < 16; k++)
            _mm512_storeu_ps(SK + (j0 + k) * 16, _mm512_mask_mov_ps(_mm512_loadu_ps(SK + (j0 + k) * 16), lanes,
                                                                     _mm512_loadu_ps(ST + k * 16)));
    }
}

/* Values of keys [*done, upto) paired for the tile (VNNI: a0 b0 a1 b1 ...), zero past T. */
static inline void amx_pair_values(const bf16 *vh, long v_sj, long *done, long upto, long T, bf16 *VV, int D,
                                   __m512i pair_lo, __m512i pair_hi) {
    const int DO = D / 16;
    for (long j = *done; j < upto; j += 2) {
        for (int c = 0; c < D / 32; c++) {
            __m512i a = j < T ? _mm512_loadu_si512(vh + j * v_sj + c * 32) : _mm512_setzero_si512();
            __m512i e = j + 1 < T ? _mm512_loadu_si512(vh + (j + 1) * v_sj + c * 32) : _mm512_setzero_si512();
            bf16 *dst = VV + ((j / 2) * DO + 2 * c) * 32;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, pair_lo, e));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, pair_hi, e));
        }
    }
    if (upto > *done) *done = upto;
}

/* C tiles 0-3 (64 outputs) += weights (A rows of PH, PL: the block's rows) x paired values, chunks [k0, k1). */
static inline void amx_weighted_values(const bf16 *PH, const bf16 *PL, long Wp, const bf16 *VV, int D, int d0,
                                       long k0, long k1) {
    const int DO = D / 16;
    for (long kc = k0; kc < k1; kc++) {
        const bf16 *vc = VV + (kc * 16 * DO + d0 / 16) * 32;
        _tile_loadd(4, PH + kc * 32, Wp * 2);
        _tile_loadd(5, PL + kc * 32, Wp * 2);
        _tile_loadd(6, vc, DO * 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 6);
        _tile_loadd(7, vc + 32, DO * 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(6, vc + 64, DO * 64); _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, vc + 96, DO * 64); _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7);
    }
}

static void amx_part(const pass_t *P, int tid) {
    const bf16 *q = (const bf16 *)P->q; bf16 *out = (bf16 *)P->out;
    const int Hq = P->Hq, Hkv = P->Hkv, D = P->D, G = Hq / Hkv, nt = P->nthreads, DC = D / 32, ns = P->nseq;
    const uint8_t *blocked = P->blocked; const int first = P->first;
    int lim[16], tok[16], hqs[16], who[16];
    float total[16];
    const uint8_t *blk[16];
    tilecfg_t cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    __m512i pair_lo, pair_hi, lanes2;  /* a0 b0 a1 b1 ...: two keys' values (lo: elements 0-15, hi: 16-31); two
                                          keys' weights of each row (lanes2) */
    { uint16_t il[32], ih[32], i2[32];
      for (int k = 0; k < 32; k++) {
          il[k] = (k & 1 ? 32 : 0) + k / 2; ih[k] = (k & 1 ? 48 : 16) + k / 2; i2[k] = (k & 1 ? 16 : 0) + k / 2; }
      pair_lo = _mm512_loadu_si512(il); pair_hi = _mm512_loadu_si512(ih); lanes2 = _mm512_loadu_si512(i2); }
    const __m512 scale = _mm512_set1_ps(P->scale);
    /* this thread's work (floats; the Python side sizes it the same way) */
    long Wm = 0, vv_total = 0;  /* the longest sequence; the most paired values a group needs */
    for (int s = 0; s < ns; s++) {
        const int64_t *L = P->seqs + NCOL * s;
        long Wp = ((L[2] + L[1] + 31) / 32) * 32, group = 0;
        if (Wp > Wm) Wm = Wp;
        if (L[11] != s) continue;
        for (int t = s; t < ns; t++)
            if (P->seqs[NCOL * t + 11] == s) group += ((P->seqs[NCOL * t + 2] + P->seqs[NCOL * t + 1] + 31) / 32) * 32 * D;
        if (group > vv_total) vv_total = group;
    }
    float *SK = P->work + tid * P->work_stride;          /* [Wm keys][16 rows] scores, then weights */
    bf16 *PH = (bf16 *)(SK + 16 * Wm), *PL = PH + 16 * Wm;   /* [16 rows][Wm] weights, two parts */
    bf16 *PHm = PL + 16 * Wm, *PLm = PHm + 16 * Wm;      /* the same for one sequence's rows of a shared block */
    bf16 *VV = PLm + 16 * Wm;                            /* per sequence [Wp / 2 key pairs][D / 16][32] */
    bf16 *QT = VV + vv_total;                            /* [D / 32][16 pairs of dims][16 rows x 2] */
    bf16 *KZ = QT + 16 * D;                              /* [16 keys][D]: a last, partial block of keys */
    float *ST = (float *)(KZ + 16 * D), *OT = ST + 256;  /* [16 keys][16 rows], [16 rows][D] */
    __mmask16 *live = (__mmask16 *)(OT + 16 * D);        /* [Wm]: the rows that attend key j */
    long *vv_done = (long *)(live + Wm + 64);            /* [ns]: keys paired so far, per sequence (this head) */
    long unit = 0;
    for (int s = 0; s < ns; s++) {
        const int64_t *L = P->seqs + NCOL * s;
        if (L[11] != s) continue;  /* its rows run with its lead's */
        const long Pg = L[12];
        int mem[64], nm = 0; long rows_before[65];
        rows_before[0] = 0;
        for (int t = s; t < ns && nm < 64; t++)
            if (P->seqs[NCOL * t + 11] == s) { mem[nm] = t; rows_before[nm + 1] = rows_before[nm] + P->seqs[NCOL * t + 1] * G; nm++; }
        for (int h = 0; h < Hkv; h++) {
            for (int y = 0; y < nm; y++) vv_done[mem[y]] = y ? Pg : 0;  /* members pair theirs past the shared keys */
            for (long r0 = 0; r0 < rows_before[nm]; r0 += 16) {
                if (unit++ % nt != tid) continue;
                int nb = rows_before[nm] - r0 < 16 ? (int)(rows_before[nm] - r0) : 16; long jmax = 0;
                memset(QT, 0, 16 * D * sizeof(bf16));
                int x = 0;
                for (int b = 0; b < 16; b++) {
                    lim[b] = 0; blk[b] = NULL; who[b] = -1;
                    if (b >= nb) continue;
                    while (r0 + b >= rows_before[x + 1]) x++;
                    const int64_t *U = P->seqs + NCOL * mem[x];
                    long i = (r0 + b - rows_before[x]) / G; hqs[b] = h * G + (int)((r0 + b - rows_before[x]) % G);
                    const bf16 *qr = q + (U[0] + i) * P->q_sn + hqs[b] * P->q_sh;
                    for (int c = 0; c < DC; c++)
                        for (int r = 0; r < 16; r++) memcpy(QT + ((c * 16 + r) * 16 + b) * 2, qr + c * 32 + 2 * r, 4);
                    who[b] = x; tok[b] = (int)(U[0] + i);
                    lim[b] = blocked ? (int)(U[2] + U[1]) : (int)(SLOT(U, i) + 1);
                    if (blocked) blk[b] = blocked + i * (U[2] + U[1] - first) - first;
                    if (lim[b] > jmax) jmax = lim[b];
                }
                /* each member of the block: its lanes and the most keys they attend */
                __mmask16 lanes[64]; long lmax[64]; int x0 = who[0], x1 = who[nb - 1];
                for (int y = x0; y <= x1; y++) { lanes[y] = 0; lmax[y] = 0; }
                for (int b = 0; b < nb; b++) { lanes[who[b]] |= (__mmask16)(1u << b); if (lim[b] > lmax[who[b]]) lmax[who[b]] = lim[b]; }
                const int one = x0 == x1;
                /* scores: the shared keys once from the lead's buffer, then each member's own */
                const bf16 *k_lead = (const bf16 *)(intptr_t)L[3] + P->layer * L[5] + h * L[6];
                amx_scores(k_lead, L[7], 0, Pg, Pg, QT, KZ, ST, SK, D, 0xffff);
                for (int y = x0; y <= x1; y++) {
                    const int64_t *U = P->seqs + NCOL * mem[y];
                    const bf16 *kh = (const bf16 *)(intptr_t)U[3] + P->layer * U[5] + h * U[6];
                    amx_scores(kh, U[7], Pg, lmax[y], lmax[y], QT, KZ, ST, SK, D, one ? 0xffff : lanes[y]);
                }
                /* softmax across lanes: the maximum over each row's keys, then weights and their sum in key order */
                const __m512i vlim = _mm512_loadu_si512(lim);
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (long j = 0; j < jmax; j++) {
                    __mmask16 ok = _mm512_cmpgt_epi32_mask(vlim, _mm512_set1_epi32((int)j));
                    if (blocked && j >= first)
                        for (int b = 0; b < nb; b++) if (blk[b][j]) ok &= (__mmask16)~(1u << b);
                    live[j] = ok;
                    __m512 sc = _mm512_mul_ps(_mm512_loadu_ps(SK + j * 16), scale);
                    if (P->softcap > 0.0f) sc = softcap16(sc, _mm512_set1_ps(P->softcap));
                    _mm512_storeu_ps(SK + j * 16, sc);
                    mx = _mm512_mask_max_ps(mx, ok, mx, sc);
                }
                const long jp = ((jmax + 31) / 32) * 32;
                __m512 sum = _mm512_setzero_ps();
                __m512i uh[16], ul[16];
                for (long j = 0; j < jp; j += 2) {
                    __m256i h2[2], l2[2];
                    for (int t = 0; t < 2; t++) {
                        __m512 w = _mm512_setzero_ps();
                        if (j + t < jmax)
                            w = _mm512_maskz_mov_ps(live[j + t], vexp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(SK + (j + t) * 16), mx)));
                        sum = _mm512_add_ps(sum, w);
                        h2[t] = (__m256i)_mm512_cvtneps_pbh(w);
                        __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h2[t]), 16));
                        l2[t] = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(w, hf));
                    }
                    int r = (int)((j / 2) % 16);
                    uh[r] = _mm512_permutexvar_epi16(lanes2, _mm512_inserti64x4(_mm512_castsi256_si512(h2[0]), h2[1], 1));
                    ul[r] = _mm512_permutexvar_epi16(lanes2, _mm512_inserti64x4(_mm512_castsi256_si512(l2[0]), l2[1], 1));
                    if (r == 15) {  /* 32 keys: rows of P from the pairs' lanes */
                        long k0 = j - 30;
                        transpose16(uh); transpose16(ul);
                        for (int b = 0; b < 16; b++) {
                            _mm512_storeu_si512(PH + b * Wm + k0, uh[b]);
                            _mm512_storeu_si512(PL + b * Wm + k0, ul[b]);
                        }
                    }
                }
                _mm512_storeu_ps(total, sum);
                /* values: the shared chunks from the lead's pairs, then each member's own chunks (its rows only
                   where the block holds several members: the others' rows enter as zeros) */
                long off = 0; bf16 *vv_of[64];
                for (int y = 0; y < nm; y++) {
                    const int64_t *U = P->seqs + NCOL * mem[y];
                    vv_of[y] = VV + off;
                    off += ((U[2] + U[1] + 31) / 32) * 32 * D;
                }
                const bf16 *v_lead = (const bf16 *)(intptr_t)L[4] + P->layer * L[8] + h * L[9];
                amx_pair_values(v_lead, L[10], &vv_done[s], Pg, L[2] + L[1], vv_of[0], D, pair_lo, pair_hi);
                for (int y = x0; y <= x1; y++) {
                    const int64_t *U = P->seqs + NCOL * mem[y];
                    const bf16 *vh = (const bf16 *)(intptr_t)U[4] + P->layer * U[8] + h * U[9];
                    amx_pair_values(vh, U[10], &vv_done[mem[y]], ((lmax[y] + 31) / 32) * 32, U[2] + U[1], vv_of[y], D,
                                    pair_lo, pair_hi);
                }
                for (int d0 = 0; d0 < D; d0 += 64) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    amx_weighted_values(PH, PL, Wm, vv_of[0], D, d0, 0, Pg / 32);
                    for (int y = x0; y <= x1; y++) {
                        long k0 = Pg / 32, k1 = (lmax[y] + 31) / 32;
                        if (one) { amx_weighted_values(PH, PL, Wm, vv_of[y], D, d0, k0, k1); continue; }
                        for (int b = 0; b < 16; b++) {
                            int mine = (lanes[y] >> b) & 1;
                            for (long j = k0 * 32; j < k1 * 32; j += 32) {
                                _mm512_storeu_si512(PHm + b * Wm + j, mine ? _mm512_loadu_si512(PH + b * Wm + j) : _mm512_setzero_si512());
                                _mm512_storeu_si512(PLm + b * Wm + j, mine ? _mm512_loadu_si512(PL + b * Wm + j) : _mm512_setzero_si512());
                            }
                        }
                        amx_weighted_values(PHm, PLm, Wm, vv_of[y], D, d0, k0, k1);
                    }
                    _tile_stored(0, OT + d0, D * 4); _tile_stored(1, OT + d0 + 16, D * 4);
                    _tile_stored(2, OT + d0 + 32, D * 4); _tile_stored(3, OT + d0 + 48, D * 4);
                }
                for (int b = 0; b < nb; b++) {
                    bf16 *o = out + ((long)tok[b] * Hq + hqs[b]) * (long)D;
                    float inv = total[b] > 0.0f ? 1.0f / total[b] : 0.0f;
                    for (int d = 0; d < D; d++) o[d] = f32_to_bf16(OT[b * D + d] * inv);
                }
            }
        }
    }
    _tile_release();
}

DEFINE_ENTRY(simllm_attend_amx_bf16, bf16, amx_part)
int simllm_attend_amx_init(void) { return amx_request(); }
#else
int simllm_attend_amx_init(void) { return -1; }
#endif

int simllm_attend_version(void) { return 6; }
