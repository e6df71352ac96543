#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include "int4_amx_api.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#define SIMLLM_AMX 1
#include "amx_common.h"

typedef uint16_t bf16;
#define GROUP 32
#define BLOB 320
#define TROWS 16
#define PREFETCH 12  /* groups ahead: the weights stream from memory while tiles work */


typedef struct {
    const bf16 *x; long x_stride; const uint8_t *w; void *y; long y_stride;
    int M, K; const float *xsum; int b0, b1; uint8_t *scratch;
    int nb;  /* the product's blocks in all (product_run.h sets it) */
} job_t;

static inline __m512 ld16_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Once per product: blocks of `rows` rows in tiles 0-5 and a last block of `tail` rows (0: none) in tiles 6-7,
   so that a product of 17 or 33 rows does not reconfigure the tiles twice per 16 outputs. */
static void config(int rows, int tail) {
    tilecfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
    c.rows[0] = rows; c.colsb[0] = 64;  /* C: rows x 16 fp32 */
    c.rows[1] = rows; c.colsb[1] = 64;  /* A: rows x 32 bf16 (one group) */
    c.rows[2] = 16;   c.colsb[2] = 64;  /* B: 16 input pairs x 16 outputs x 2 */
    c.rows[3] = rows; c.colsb[3] = 64; c.rows[4] = rows; c.colsb[4] = 64; c.rows[5] = 16; c.colsb[5] = 64;
    if (tail) { c.rows[6] = tail; c.colsb[6] = 64; c.rows[7] = tail; c.colsb[7] = 64; }  /* C, A of the tail */
    _tile_loadconfig(&c);
}

#define DEQUANT(gg, dst) do {                                                                           \
        const char *ahead_ = (const char *)(blob + (long)((gg) + PREFETCH) * BLOB);                         \
        for (int l_ = 0; l_ < BLOB; l_ += 64) _mm_prefetch(ahead_ + l_, _MM_HINT_T0);                        \
        for (int t = 0; t < 8; t++) {                                                                      \
            __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blob + (long)(gg) * BLOB + 32 * t))); \
            _mm512_store_si512((dst) + 128 * t, _mm512_permutexvar_epi16(_mm512_and_si512(c, lo4), table));      \
            _mm512_store_si512((dst) + 128 * t + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 4), table));  \
        }                                                                                                  \
    } while (0)
#define BUF(gg) (stream ? bbuf + ((gg) & 3) * 1024 : bbuf + (long)(gg) * 1024)
#define POST(gg, cb) do {                                                                               \
        const bf16 *sz_ = (const bf16 *)(blob + (long)(gg) * BLOB + 256);                                   \
        const __m512 step_ = ld16_bf16(sz_), zero_ = ld16_bf16(sz_ + 16);                                  \
        const float *xs_ = J->xsum + (long)r0 * G + (gg);                                                   \
        for (int m = 0; m < R; m++) {                                                                      \
            out[m] = _mm512_fmadd_ps(step_, _mm512_load_ps((cb) + 16 * m), out[m]);                        \
            out[m] = _mm512_fmadd_ps(zero_, _mm512_set1_ps(xs_[(long)m * G]), out[m]);                     \
        }                                                                                                  \
    } while (0)

/* Group gg alone for the row block at r0: its product in tile TC (inputs in TA), scaled into out. */
#define ONE(gg, TC, TA, DEQF, POSTF) do {                                                                     \
        if (jit) DEQF(gg, BUF(gg));                                                                        \
        _tile_zero(TC);                                                                                    \
        _tile_loadd(TA, J->x + (long)r0 * J->x_stride + (gg) * GROUP, J->x_stride * 2);                    \
        _tile_loadd(2, BUF(gg), 64);                                                                       \
        _tile_dpbf16ps(TC, TA, 2);                                                                         \
        _tile_stored(TC, cbuf, 64);                                                                        \
        POSTF(gg, cbuf);                                                                                   \
    } while (0)

/* The products of groups gg, gg + 1 for the row block at r0, into tiles 0 and 3. */
#define PAIR(gg) do {                                                                                   \
        _tile_zero(0); _tile_zero(3);                                                                      \
        _tile_loadd(1, J->x + (long)r0 * J->x_stride + (gg) * GROUP, J->x_stride * 2);                     \
        _tile_loadd(2, BUF(gg), 64);                                                                       \
        _tile_loadd(4, J->x + (long)r0 * J->x_stride + ((gg) + 1) * GROUP, J->x_stride * 2);               \
        _tile_loadd(5, BUF((gg) + 1), 64);                                                                 \
        _tile_dpbf16ps(0, 1, 2);                                                                           \
        _tile_dpbf16ps(3, 4, 5);                                                                           \
    } while (0)

#define DEFINE_PART(NAME, BLOBSZ, DEQ, POST, STORE)  \
static void *NAME(void *arg) {                                                                                      \
    const job_t *J = arg;                                                                                           \
    const int G = J->K / GROUP;                                                                                     \
    const __m512i table = _mm512_set_epi16(                                                                         \
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,                                             \
        0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100,                                             \
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,                                             \
        0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100);                                            \
    const __m512i lo4 = _mm512_set1_epi16(0x0f);                                                                    \
    (void)table; (void)lo4;  /* the 8-bit part dequantizes no 4-bit codes */                                         \
    uint8_t *bbuf = J->scratch;                    /* [max(G, 4)][16][64] dequantized codes */                      \
    float *cbuf = (float *)(J->scratch + (long)(G > 4 ? G : 4) * 1024);   /* [4][16][16] */                         \
    const int stream = J->M <= TROWS;  /* one row block: dequantize each group just before its product */           \
    const int full = J->M < TROWS ? J->M : TROWS, tail = J->M > TROWS ? J->M % TROWS : 0;                          \
    config(full, tail);                                                                                             \
    for (int b = J->b0; b < J->b1; b++) {                                                                           \
        const uint8_t *blob = J->w + (long)b * G * BLOBSZ;                                                          \
        for (int r0 = 0; r0 < J->M; r0 += TROWS) {                                                                  \
            int R = J->M - r0 < TROWS ? J->M - r0 : TROWS;                                                          \
            /* the first row block dequantizes each group just before its product, while earlier products run \
               (one row block: into a ring of 4; several: kept, for the blocks after it) */                      \
            const int jit = stream || r0 == 0;                                                                      \
            __m512 out[TROWS];                                                                                      \
            for (int m = 0; m < R; m++) out[m] = _mm512_setzero_ps();                                               \
            int g = 0;                                                                                              \
            if (R != full)  /* the tail block, in tiles 6-7: the same products, one group at a time */             \
                for (; g < G; g++) ONE(g, 6, 7, DEQ, POST);                                                         \
            /* two groups in flight (their tiles do not wait on each other), and the next pair's products run  \
               while this pair's results are scaled: the same products and the same order of additions */        \
            if (g + 1 < G) {                                                                                        \
                if (jit) { DEQ(g, BUF(g)); DEQ(g + 1, BUF(g + 1)); }                                                \
                PAIR(g);                                                                                            \
                for (;; g += 2) {                                                                                   \
                    float *cb = cbuf + ((g >> 1) & 1) * 512;                                                        \
                    _tile_stored(0, cb, 64);                                                                        \
                    _tile_stored(3, cb + 256, 64);                                                                  \
                    const int next = g + 3 < G;                                                                     \
                    if (next) {                                                                                     \
                        if (jit) { DEQ(g + 2, BUF(g + 2)); DEQ(g + 3, BUF(g + 3)); }                                \
                        PAIR(g + 2);                                                                                \
                    }                                                                                               \
                    POST(g, cb);                                                                                    \
                    POST(g + 1, cb + 256);                                                                          \
                    if (!next) { g += 2; break; }                                                                   \
                }                                                                                                   \
            }                                                                                                       \
            for (; g < G; g++) ONE(g, 0, 1, DEQ, POST);  /* an odd group left */                                    \
            for (int m = 0; m < R; m++) STORE(m);                                                                   \
        }                                                                                                           \
    }                                                                                                               \
    _tile_release();                                                                                                \
    return 0;                                                                                                       \
}                                                                                                                   \

#define STORE4(m) _mm256_storeu_si256((__m256i *)((bf16 *)J->y + (long)(r0 + (m)) * J->y_stride + 16 * b),             \
                                      (__m256i)_mm512_cvtneps_pbh(out[m]))
/* 8-bit codes (the LM head: GGUF's Q8_0 groups of 32, one scale each): 512 bytes of codes, row j of the B
   tile (input pair j) at byte 32j as output lane n, element e at 2n + e; then 16 float32 scales. */
#define BLOB8 576
#define DEQUANT8(gg, dst) do {                                                                          \
        const char *ahead_ = (const char *)(blob + (long)((gg) + PREFETCH) * BLOB8);                       \
        for (int l_ = 0; l_ < BLOB8; l_ += 64) _mm_prefetch(ahead_ + l_, _MM_HINT_T0);                      \
        for (int t = 0; t < 16; t++) {                                                                    \
            const uint8_t *c_ = blob + (long)(gg) * BLOB8 + 32 * t;                                        \
            __m512 f0_ = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c_)));      \
            __m512 f1_ = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c_ + 16)))); \
            _mm512_store_si512((dst) + 64 * t, (__m512i)_mm512_cvtne2ps_pbh(f1_, f0_));                     \
        }                                                                                                 \
    } while (0)
#define POST8(gg, cb) do {                                                                              \
        const __m512 d_ = _mm512_loadu_ps((const float *)(blob + (long)(gg) * BLOB8 + 512));              \
        for (int m = 0; m < R; m++) out[m] = _mm512_fmadd_ps(d_, _mm512_load_ps((cb) + 16 * m), out[m]);  \
    } while (0)
#define STORE8(m) _mm512_storeu_ps((float *)J->y + (long)(r0 + (m)) * J->y_stride + 16 * b, out[m])
DEFINE_PART(part4, BLOB, DEQUANT, POST, STORE4)
DEFINE_PART(part8, BLOB8, DEQUANT8, POST8, STORE8)

int simllm_int4_init(void) { return amx_request(); }

#include "product_run.h"
PRODUCT_RUN(bf16, void, float, uint8_t)

/* 4-bit weights, bf16 out. The group sums of x (each in input order, 16 groups to a vector) go first into
   xsum [M, K/32]. */
void simllm_int4_mm(const bf16 *x, long x_stride, const uint8_t *w, bf16 *y, long y_stride, int M, int N, int K,
                    float *xsum, uint8_t *scratch, long scratch_per_thread, int nthreads) {
    const int G = K / GROUP;
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(GROUP * 2));  /* byte offsets of 16 groups */
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int m = 0; m < M; m++) {
        const bf16 *row = x + (long)m * x_stride;
        int g = 0;
        for (; g + 16 <= G; g += 16) {  /* 16 groups at once, a lane each, added in the order of the loop below */
            __m512 s = _mm512_setzero_ps();
            for (int k = 0; k < GROUP; k += 2) {  /* inputs k (low half) and k + 1 (high half) of each group */
                const __m512i w = _mm512_i32gather_epi32(at, (const void *)(row + g * GROUP + k), 1);
                s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
                s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
            }
            _mm512_storeu_ps(xsum + (long)m * G + g, s);
        }
        for (; g < G; g++) {
            float s = 0.f;
            const bf16 *p = row + g * GROUP;
            for (int k = 0; k < GROUP; k++) { uint32_t u = (uint32_t)p[k] << 16; float f; memcpy(&f, &u, 4); s += f; }
            xsum[(long)m * G + g] = s;
        }
    }
    run(part4, x, x_stride, w, y, y_stride, M, N, K, xsum, scratch, scratch_per_thread, nthreads);
}

/* 8-bit weights (one scale per group), float32 out: the LM head's logits. */
void simllm_int8_mm(const bf16 *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                    uint8_t *scratch, long scratch_per_thread, int nthreads) {
    run(part8, x, x_stride, w, y, y_stride, M, N, K, 0, scratch, scratch_per_thread, nthreads);
}
#else  /* no AMX for this compiler target: the runner keeps ATen's kernel */
#pragma GCC diagnostic ignored "-Wunused-parameter"  /* stubs: the same signatures, nothing to compute */
int simllm_int4_init(void) { return -1; }
void simllm_int4_mm(const uint16_t *x, long xs, const uint8_t *w, uint16_t *y, long ys, int M, int N, int K,
                    float *xsum, uint8_t *scratch, long per_thread, int nthreads) { (void)x; }
void simllm_int8_mm(const uint16_t *x, long xs, const uint8_t *w, float *y, long ys, int M, int N, int K,
                    uint8_t *scratch, long per_thread, int nthreads) { (void)x; }
void simllm_pool_call(void *(*fn)(void *), void *args, long size, int n) {
    for (int i = 0; i < n; i++) fn((char *)args + i * size);
}
/* pool.h's other entries: no workers here */
void simllm_pool_profile(int on, double *out) { if (out) memset(out, 0, 4 * sizeof(double)); }
void simllm_pool_stop(void) {}
void simllm_pool_tune(long spin_ns) {}
void simllm_pool_pin(const int *cpus, int n) {}
int simllm_pool_workers(void) { return 0; }
#endif
