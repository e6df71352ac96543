"""4-bit weight products on Intel AMX for the CPU runner: row-invariant like ATen's int4 kernel, ~2-4x faster
from a few rows up.

Why our own: a pass of several rows (a verification block of drafts, a batched step of several requests, a
prefill) multiplies every 4-bit weight by each row. ATen's CPU kernel (`_weight_int4pack_mm_for_cpu`) does that
with AVX-512 bf16 dot products and tops out at ~80 GFLOP/s on one core here from 4 rows on, so a pass of four
flights costs ~4x one in its products. AMX tiles multiply a 16-row block by a 32x16 weight block in one
instruction; dequantizing the weights once per pass is then what a pass costs.

Arithmetic, per output row and 16 outputs, group by group of 32 inputs (the grid of the 4-bit codes): the tile
product of the row's bf16 inputs with the codes minus 8 (exact in bf16) in float32, then
out = fma(step, product, out) and out = fma(zero, sum of the group's inputs, out); the result rounded to bf16
once. A row's bits depend on nothing but its own inputs: the tile computes each row on its own, whatever the
rows with it, and rows are cut into blocks of 16, a tile's height; threads split the outputs, not the sum.
ModelBackend.invariance_probe checks the whole model at load as before. It rounds differently from ATen's
kernel (~1 element in 10^6 differs), so the numerics digest differs and pool snapshots of the ATen path are
refused once. Built like attention_kernel (system C compiler, ~/.cache/simllm_ros/kernels); used only where the
compiler targets AMX-BF16 and the kernel grants the tile state; `SIMLLM_INT4=aten` keeps ATen's kernel.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from . import attention_kernel, compute_threads, kernel_pool

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#define SIMLLM_AMX 1
/*AMX_COMMON*/

typedef uint16_t bf16;
#define GROUP 32
#define BLOB 320
#define TROWS 16
#define PREFETCH 12  /* groups ahead: the weights stream from memory while tiles work */


typedef struct {
    const bf16 *x; long x_stride; const uint8_t *w; void *y; long y_stride;
    int M, N, K; const float *xsum; int b0, b1; uint8_t *scratch;
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

/*POOL*/
static job_t pool_jobs[MAXT];
static void run(void *(*part)(void *), const bf16 *x, long x_stride, const uint8_t *w, void *y, long y_stride,
                int M, int N, int K, float *xsum, uint8_t *scratch, long scratch_per_thread, int nthreads) {
    int nb = N / 16;
    if (nthreads > nb) nthreads = nb;
    if (nthreads > MAXT) nthreads = MAXT;
    if (nthreads > 1 && pthread_mutex_trylock(&pool_use) != 0) nthreads = 1;  /* busy: compute alone */
    if (nthreads < 1) nthreads = 1;
    job_t alone[1];
    job_t *jobs = nthreads > 1 ? pool_jobs : alone;
    for (int i = 0; i < nthreads; i++)
        jobs[i] = (job_t){x, x_stride, w, y, y_stride, M, N, K, xsum, (int)((long)nb * i / nthreads),
                          (int)((long)nb * (i + 1) / nthreads), scratch + i * scratch_per_thread};
    if (nthreads == 1) { part(&jobs[0]); return; }
    if (!pool_start(nthreads)) {  /* could not start workers: alone, the same bits */
        job_t one = jobs[0]; one.b1 = nb;
        part(&one);
        pthread_mutex_unlock(&pool_use);
        return;
    }
    pool_dispatch(part, jobs, sizeof(job_t), nthreads);
}

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
int simllm_int4_init(void) { return -1; }
void simllm_int4_mm(const void *x, long xs, const void *w, void *y, long ys, int M, int N, int K, float *xsum,
                    void *scratch, long per_thread, int nthreads) { (void)x; }
void simllm_int8_mm(const void *x, long xs, const void *w, void *y, long ys, int M, int N, int K,
                    void *scratch, long per_thread, int nthreads) { (void)x; }
void simllm_pool_call(void *(*fn)(void *), void *args, long size, int n) {
    for (int i = 0; i < n; i++) fn((char *)args + i * size);
}
#endif
""".replace("/*AMX_COMMON*/", attention_kernel.AMX_COMMON).replace("/*POOL*/", kernel_pool.POOL)

GROUP = 32  # inputs per 4-bit group (INT4_GROUP in llama_runner)
BLOB = 320  # bytes per 16 outputs x one group: 256 of codes, 16 steps and 16 zeros in bf16
BLOB8 = 576  # 8-bit: 512 bytes of codes, 16 float32 scales
# Below this many multiply-adds a product runs in the caller's thread alone; above it, on torch's thread count
# (the kernel's own workers, kept between products). Measured at 2 threads, one row: 3072x576 57 vs 117 us,
# 576x1536 33 vs 50 us, 960x576 21 vs 32 us (threads vs alone).
THREAD_MIN_MACS = 250_000
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int

_loaded: "Int4Kernel | None" = None
_why_not: str | None = None


class Int4Kernel:
    """The compiled kernel, called on torch tensors: `pack` once per weight, `mm` per product."""

    kind = "amx"
    dtype = torch.bfloat16

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self.path = path
        self._mm = lib.simllm_int4_mm
        self._mm.argtypes = [_P, _L, _P, _P, _L, _I, _I, _I, _P, _P, _L, _I]
        self._mm.restype = None
        self.pool_call = ctypes.cast(lib.simllm_pool_call, ctypes.c_void_p).value  # for AttentionKernel.use_pool
        self._mm8 = lib.simllm_int8_mm
        self._mm8.argtypes = [_P, _L, _P, _P, _L, _I, _I, _I, _P, _L, _I]
        self._mm8.restype = None
        self._init = lib.simllm_int4_init
        self._init.restype = _I
        self._scratch = threading.local()

    def granted(self) -> bool:
        """Whether this process may use AMX (asks Linux once; harmless to repeat)."""
        return self._init() == 0

    @staticmethod
    def pack(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (0..15) and scales_and_zeros [K/32, N, 2] (step, zero; bf16) -> the kernel's weight blob
        [N/16, K/32, 320] uint8: per 16 outputs and group, byte t*32 + 2*lane + e holds the codes of inputs
        4t + e (low nibble) and 4t + 2 + e (high nibble) of output `lane`, then the 16 steps and 16 zeros."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int4 kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        q = codes.to(torch.uint8).reshape(n // 16, 16, g, 8, 2, 2)  # block, lane, group, t, high?, e
        byte = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 256)
        sz = scales_and_zeros.to(torch.bfloat16)
        step = sz[..., 0].t().reshape(n // 16, 16, g).permute(0, 2, 1)
        zero = sz[..., 1].t().reshape(n // 16, 16, g).permute(0, 2, 1)
        sb = torch.cat([step, zero], dim=-1).contiguous().view(torch.uint8)  # [blocks, groups, 64]
        return torch.cat([byte, sb], dim=-1).contiguous()

    @staticmethod
    def pack8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (-127..127) and scales [N, K/32] (float32) -> [N/16, K/32, 576] uint8: per 16 outputs and
        group, byte 32j + 2*lane + e holds the code of input 2j + e of output `lane`, then the 16 scales."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int8 kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        q = codes.to(torch.int8).reshape(n // 16, 16, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 512)
        d = scales.float().reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, g, 64]
        return torch.cat([q.view(torch.uint8), d], dim=-1).contiguous()

    def mm8(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous) times 8-bit weights packed by pack8 -> [M, n] float32."""
        m, k, threads, per_thread, _, aligned = self._prepare(x, blob, n, BLOB8, "int8")
        y = torch.empty((m, n), dtype=torch.float32)
        self._mm8(x.data_ptr(), x.stride(0), blob.data_ptr(), y.data_ptr(), n, m, n, k, aligned, per_thread, threads)
        return y

    def buffers(self, m: int, k: int) -> tuple[int, int, int, int]:
        """(group sums buffer, 64-byte aligned tile scratch, scratch bytes per thread, threads) for products of
        m rows and up to k inputs called from C (layer_kernel), kept per calling thread like `mm`'s."""
        threads = compute_threads.kernel_threads()
        work, aligned, per_thread = self._buffers(m, k, threads)
        return work.data_ptr(), aligned, per_thread, threads

    def _buffers(self, m: int, k: int, threads: int) -> tuple[torch.Tensor, int, int]:
        """This thread's group sums buffer and aligned tile scratch, grown to fit (the call runs without the GIL)."""
        per_thread = max(k // GROUP, 4) * 1024 + 4096  # the C source's bbuf and cbuf
        s = self._scratch
        if getattr(s, "work", None) is None or s.work.numel() < m * (k // GROUP) or \
                s.tiles.numel() < threads * per_thread + 64:
            s.work = torch.empty(max(m * (k // GROUP), 4096), dtype=torch.float32)
            s.tiles = torch.empty(max(threads * per_thread, 2 * per_thread) + 64, dtype=torch.uint8)
        return s.work, (s.tiles.data_ptr() + 63) // 64 * 64, per_thread

    def _prepare(self, x: torch.Tensor, blob: torch.Tensor, n: int, blob_bytes: int, what: str):
        """The checks and buffers of a product: (M, K, threads, scratch bytes per thread, group sums buffer,
        64-byte aligned tile scratch); bad input raises ValueError."""
        m, k = x.shape
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or blob.shape != (n // 16, k // GROUP, blob_bytes):
            raise ValueError(f"{what} kernel: bf16 rows [M, K] with contiguous inputs, and weights packed for them")
        threads = compute_threads.kernel_threads() if m * n * k >= THREAD_MIN_MACS else 1
        work, aligned, per_thread = self._buffers(m, k, threads)
        return m, k, threads, per_thread, work, aligned

    def mm(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous) times the packed weights -> [M, n] bf16."""
        m, k, threads, per_thread, work, aligned = self._prepare(x, blob, n, BLOB, "int4")
        y = torch.empty((m, n), dtype=torch.bfloat16)
        self._mm(x.data_ptr(), x.stride(0), blob.data_ptr(), y.data_ptr(), n, m, n, k, work.data_ptr(), aligned,
                 per_thread, threads)
        return y


def load() -> "Int4Kernel | None":
    """The kernel for this process (built on first use), or None with `why_not()` saying why."""
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return _loaded
    kernel, _why_not = attention_kernel.load_kernel("SIMLLM_INT4", "aten", "int4", SOURCE, Int4Kernel)
    if kernel is None:
        return None
    if not kernel.granted():
        _why_not = "no AMX-BF16 here (CPU, compiler target or kernel permission)"
        return None
    err = _self_check(kernel)
    if err:
        _why_not = err
        return None
    _loaded = kernel
    kernel_pool.lend_to_attention(kernel.pool_call)
    return _loaded


def _self_check(kernel: Int4Kernel) -> str | None:
    """None if the kernel computes what 4-bit weights say (against a float32 product of the same weights, 1 and
    19 rows), else why not: a new CPU or compiler should fall back, not answer wrongly."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 96), generator=g, dtype=torch.int32)
    sz = (torch.rand(3, 48, 2, generator=g) * torch.tensor([0.1, 1.0]) - torch.tensor([0.0, 0.5])).to(torch.bfloat16)
    step, zero = sz[..., 0].float().t(), sz[..., 1].float().t()  # [N, K/32]
    w = ((codes.float().reshape(48, 3, GROUP) - 8) * step[..., None] + zero[..., None]).reshape(48, 96)
    x = torch.randn(19, 96, generator=g).to(torch.bfloat16)
    blob = kernel.pack(codes, sz)
    got = kernel.mm(x, blob, 48).float()
    want = x.float() @ w.t()
    err = (got - want).abs().max().item()
    bound = 0.02 * want.abs().max().item() + 1e-3
    if err > bound or not torch.equal(kernel.mm(x[3:4], blob, 48).float(), got[3:4]):
        return f"the int4 kernel is off by {err:.3g} (allowed {bound:.3g}) or not row-invariant here"
    return None


def why_not() -> str | None:
    return _why_not
