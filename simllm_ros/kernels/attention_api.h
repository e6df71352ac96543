/* What libattention exports: one layer's attention for a pass of query rows over their own KV buffers
   (attention.c; its comment above DEFINE_ENTRY says what each argument holds). Row-invariant: a row's bits do
   not depend on the rows or threads beside it. One plain prototype per entry; kernels/abi.py checks the Python
   bindings against them. A [tag] opens the comment of an entry that only some builds define (docs/kernels.md). */
#ifndef SIMLLM_ATTENTION_API_H
#define SIMLLM_ATTENTION_API_H

#include <stdint.h>

/* bf16 rows: the vector code (AVX-512, else portable C with the same operations) */
void simllm_attend_bf16(const uint16_t *q, long q_sn, long q_sh, const uint16_t *knew, long kn_sn, long kn_sh,
                        const uint16_t *vnew, long vn_sn, long vn_sh, uint16_t *out, int Hq, int Hkv, int D,
                        float scale, float softcap, int nseq, const int64_t *seqs, int layer, const uint8_t *blocked,
                        int first, float *work, long work_stride, int nthreads);
/* float32 rows (the float32 runner), the same operations */
void simllm_attend_f32(const float *q, long q_sn, long q_sh, const float *knew, long kn_sn, long kn_sh,
                       const float *vnew, long vn_sn, long vn_sh, float *out, int Hq, int Hkv, int D, float scale,
                       float softcap, int nseq, const int64_t *seqs, int layer, const uint8_t *blocked, int first,
                       float *work, long work_stride, int nthreads);
/* [amx] bf16 rows on AMX tiles, 16 query rows at a time: its own roundings, the same row invariance */
void simllm_attend_amx_bf16(const uint16_t *q, long q_sn, long q_sh, const uint16_t *knew, long kn_sn, long kn_sh,
                            const uint16_t *vnew, long vn_sn, long vn_sh, uint16_t *out, int Hq, int Hkv, int D,
                            float scale, float softcap, int nseq, const int64_t *seqs, int layer,
                            const uint8_t *blocked, int first, float *work, long work_stride, int nthreads);
/* Ask Linux for the AMX tile state: 0 where simllm_attend_amx_bf16 may run, -1 where not (or not built) */
int simllm_attend_amx_init(void);
/* Split passes on kept workers: fn is a product library's simllm_pool_call, 0 starts threads per pass again */
void simllm_attend_set_pool(void *fn);
/* The arithmetic's version: bumped where a change gives other bits by design */
int simllm_attend_version(void);

#endif
