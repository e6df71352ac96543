/* What libint4_vector exports: weight products on float32 rows with the CPU's vector units (int4_vector.c for
   float32 rows, int8_rows.h and int8_rows32.h for rows quantized to 8 bits), and the pool's entries.
   Every product takes y [M, N] float32 = x [M, K] times the packed weights w (kernels/vector_blobs.py), rows at
   x_stride and y_stride floats, xsum a work buffer of the rows (group sums or 8-bit codes), buf
   simllm_vec_buffer_floats() floats per thread, nthreads threads (1: the caller alone). The same arithmetic on
   every CPU (docs/kernels.md). One plain prototype per entry; kernels/abi.py checks the Python bindings. */
#ifndef SIMLLM_INT4_VECTOR_API_H
#define SIMLLM_INT4_VECTOR_API_H

#include <stdint.h>
#include "pool_api.h"

/* Floats per thread for a product's buf: a decoded group and a chunk of rows' sums */
long simllm_vec_buffer_floats(void);
/* 8-bit codes, a scale per 32 inputs: the LM head's logits (no xsum) */
void simllm_vec_int8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M, int N, int K,
                        float *buf, long buf_per_thread, int nthreads);
/* 4-bit codes, a step and base per 32 inputs (BLOB4); xsum gets the rows' group sums */
void simllm_vec_int4_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* GGUF Q4_K's own layout (BLOB4K): simllm_vec_int4_mm's operations on the same numbers */
void simllm_vec_int4k_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* 8-bit codes, a scale per 32 (simllm_vec_int8_mm) in this signature: what the C layers call */
void simllm_vec_int8_mmx(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* 8-bit codes, a scale per 16 inputs (GGUF Q6_K's codes on float32 rows; xsum unused) */
void simllm_vec_int8g16_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q4_K times rows quantized to 8 bits per 256 (into xsum): integer dot products */
void simllm_vec_q4k8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q5_K times 8-bit rows per 256 */
void simllm_vec_q5k8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q6_K times 8-bit rows per 256 */
void simllm_vec_q6k8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q3_K times 8-bit rows per 256 */
void simllm_vec_q3k8_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q8_0 times 8-bit rows per 32 */
void simllm_vec_q8r_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q5_0 times 8-bit rows per 32 */
void simllm_vec_q5r_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q5_1 times 8-bit rows per 32 */
void simllm_vec_q51r_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* Q4_0 times 8-bit rows per 32 */
void simllm_vec_q4r_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* IQ4_NL times 8-bit rows per 32 */
void simllm_vec_iq4r_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);
/* IQ4_XS times 8-bit rows per 32 (its sub-scales per 32, d per 256) */
void simllm_vec_iq4xs_mm(const float *x, long x_stride, const uint8_t *w, float *y, long y_stride, int M,
    int N, int K, float *xsum, float *buf, long buf_per_thread, int nthreads);

#endif
