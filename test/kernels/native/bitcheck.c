/* Runs our kernels' float32 entry points on inputs from files and writes their outputs, so a test can compare a
   library built for another CPU (aarch64 under qemu-aarch64) with this machine's, bit for bit.
   usage: bitcheck <dir with the libraries> <case dir>; the case dir holds the inputs named below and receives the
   outputs. Products run at several row cuts and 1 and 2 threads (the kept worker pool), each written apart. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *slurp(const char *dir, const char *name, long *bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc(n > 0 ? n : 1);
    if (fread(p, 1, n, f) != (size_t)n) { fprintf(stderr, "short read %s\n", path); exit(2); }
    fclose(f);
    if (bytes) *bytes = n;
    return p;
}

static void spill(const char *dir, const char *name, const void *p, long bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != (size_t)bytes) { fprintf(stderr, "cannot write %s\n", path); exit(2); }
    fclose(f);
}

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) { fprintf(stderr, "missing %s: %s\n", name, dlerror()); exit(2); }
    return p;
}

static void *open_lib(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.so", dir, name);
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) { fprintf(stderr, "dlopen %s: %s\n", path, dlerror()); exit(2); }
    return lib;
}

typedef void (*mm4_fn)(const float *, long, const uint8_t *, float *, long, int, int, int, float *, float *, long,
                       int);
typedef void (*mm8_fn)(const float *, long, const uint8_t *, float *, long, int, int, int, float *, long, int);
typedef long (*floats_fn)(void);
typedef void (*norm32_fn)(const float *, long, const float *, float *, int, int, float);
typedef void (*norm16_fn)(const uint16_t *, long, const uint16_t *, uint16_t *, int, int, float);
typedef void (*silu_fn)(const float *, long, int, int, float *, long);
typedef void (*rope_fn)(const float *, long, int, int, int, int, const float *, const float *, float *);
typedef void (*attend_fn)(const float *, long, long, const float *, long, long, const float *, long, long, float *,
                          int, int, int, float, float, int, const int64_t *, int, const uint8_t *, int, float *, long,
                          int);

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: bitcheck <libdir> <casedir>\n"); return 2; }
    const char *libs = argv[1], *dir = argv[2];
    const int *shape = slurp(dir, "shape.i32", 0);  /* M, N, K, E, I, H, D */
    const int M = shape[0], N = shape[1], K = shape[2], E = shape[3], I = shape[4], H = shape[5], D = shape[6];

    void *vec = open_lib(libs, "int4_vector");
    mm8_fn mm8 = (mm8_fn)sym(vec, "simllm_vec_int8_mm");
    /* the products with simllm_vec_int4_mm's signature: name (PRODUCTS in test_numerics_contract), entry, weights */
    static const char *const prods[][3] = {
        {"mm4", "simllm_vec_int4_mm", "w4.u8"},
        {"mm6", "simllm_vec_int8g16_mm", "w6.u8"},      /* 8-bit codes, a scale per 16 inputs (Q6_K) */
        {"mm4k", "simllm_vec_int4k_mm", "w4k.u8"},      /* GGUF Q4_K's own layout */
        {"mm4k8", "simllm_vec_q4k8_mm", "w4k8.u8"},     /* Q4_K times rows quantized to 8 bits */
        {"mm5k8", "simllm_vec_q5k8_mm", "w5k8.u8"},     /* Q5_K times rows quantized to 8 bits */
        {"mm6k8", "simllm_vec_q6k8_mm", "w6k8.u8"},     /* Q6_K times rows quantized to 8 bits */
        {"mm8r", "simllm_vec_q8r_mm", "w8r.u8"},        /* Q8_0 times rows quantized to 8 bits per 32 */
        {"mm5r", "simllm_vec_q5r_mm", "w5r.u8"},        /* Q5_0 times rows quantized to 8 bits per 32 */
        {"mm4r", "simllm_vec_q4r_mm", "w4r.u8"},        /* Q4_0 times rows quantized to 8 bits per 32 */
        {"mm3k8", "simllm_vec_q3k8_mm", "w3k8.u8"},     /* Q3_K times rows quantized to 8 bits */
        {"mm51r", "simllm_vec_q51r_mm", "w51r.u8"},     /* Q5_1 times rows quantized to 8 bits per 32 */
        {"mmiq4r", "simllm_vec_iq4r_mm", "wiq4r.u8"},   /* IQ4_NL times rows quantized to 8 bits per 32 */
        {"mmiq4xs", "simllm_vec_iq4xs_mm", "wiq4xs.u8"}, /* IQ4_XS (sub-scales, d per 256) times the same rows */
    };
    enum { NPROD = sizeof prods / sizeof prods[0] };
    mm4_fn fns[NPROD];
    const uint8_t *ws[NPROD];
    for (int p = 0; p < NPROD; p++) {
        fns[p] = (mm4_fn)sym(vec, prods[p][1]);
        ws[p] = slurp(dir, prods[p][2], 0);
    }
    const long per_thread = ((floats_fn)sym(vec, "simllm_vec_buffer_floats"))();
    const float *x = slurp(dir, "x.f32", 0);
    const uint8_t *w8 = slurp(dir, "w8.u8", 0);
    float *y = calloc((size_t)M * N, 4), *xsum = calloc((size_t)M * (K / 4 + K / 8) + 1, 4);
    float *buf = calloc((size_t)per_thread * 2, 4);
    /* the whole (the buffered path of the float-row kernel), 1, 3, 7 and 2 rows (its register path) */
    static const int cuts[][2] = {{0, -1}, {0, 1}, {2, 5}, {3, 10}, {7, 8}, {5, 7}};
    for (int t = 1; t <= 2; t++)
        for (int c = 0; c < 6; c++) {
            const int r0 = cuts[c][0], r1 = cuts[c][1] < 0 ? M : cuts[c][1];
            char name[64];
            mm8(x + (long)r0 * K, K, w8, y, N, r1 - r0, N, K, buf, per_thread, t);
            snprintf(name, sizeof name, "mm8_t%d_%d_%d.f32", t, r0, r1);
            spill(dir, name, y, (long)(r1 - r0) * N * 4);
            for (int p = 0; p < NPROD; p++) {
                fns[p](x + (long)r0 * K, K, ws[p], y, N, r1 - r0, N, K, xsum, buf, per_thread, t);
                snprintf(name, sizeof name, "%s_t%d_%d_%d.f32", prods[p][0], t, r0, r1);
                spill(dir, name, y, (long)(r1 - r0) * N * 4);
            }
        }

    void *norm = open_lib(libs, "rmsnorm");
    const float *nx = slurp(dir, "nx.f32", 0), *nw = slurp(dir, "nw.f32", 0);
    float *ny = calloc((size_t)M * E, 4);
    ((norm32_fn)sym(norm, "simllm_rmsnorm_f32"))(nx, E, nw, ny, M, E, 1e-5f);
    spill(dir, "norm_f32.f32", ny, (long)M * E * 4);
    const uint16_t *bx = slurp(dir, "nx.bf16", 0), *bw = slurp(dir, "nw.bf16", 0);
    uint16_t *by = calloc((size_t)M * E, 2);
    ((norm16_fn)sym(norm, "simllm_rmsnorm_bf16"))(bx, E, bw, by, M, E, 1e-5f);
    spill(dir, "norm_bf16.bf16", by, (long)M * E * 2);

    void *layers = open_lib(libs, "layers");
    const float *gu = slurp(dir, "gu.f32", 0);
    float *a = calloc((size_t)M * I, 4);
    ((silu_fn)sym(layers, "simllm_silu_mul_f32"))(gu, 2L * I, M, I, a, I);
    spill(dir, "silu_f32.f32", a, (long)M * I * 4);
    ((silu_fn)sym(layers, "simllm_gelu_tanh_mul_f32"))(gu, 2L * I, M, I, a, I);  /* Gemma 3's GELU, same shape */
    spill(dir, "gelu_f32.f32", a, (long)M * I * 4);
    const float *rx = slurp(dir, "rx.f32", 0), *cs = slurp(dir, "cos.f32", 0), *sn = slurp(dir, "sin.f32", 0);
    float *ro = calloc((size_t)M * H * D, 4);
    ((rope_fn)sym(layers, "simllm_rope_f32"))(rx, (long)H * D, M, H, D, D, cs, sn, ro);
    spill(dir, "rope_f32.f32", ro, (long)M * H * D * 4);
    ((rope_fn)sym(layers, "simllm_rope_f32"))(rx, (long)H * D, M, H, D, D / 4 * 3, cs, sn, ro);  /* Phi-4-mini's */
    spill(dir, "rope_part_f32.f32", ro, (long)M * H * D * 4);

    /* attention (float32): H query heads on one KV head, M rows attending causally; in one pass and in two (rows
       0-4, then the rest over the keys the first wrote), scores plain and soft-capped (Gemma 2's), 1 and 2 threads */
    void *att = open_lib(libs, "attention");
    attend_fn attend = (attend_fn)sym(att, "simllm_attend_f32");
    const float *ak = slurp(dir, "ak.f32", 0), *av = slurp(dir, "av.f32", 0);
    float *kb = calloc((size_t)M * D, 4), *vb = calloc((size_t)M * D, 4), *ao = calloc((size_t)M * H * D, 4);
    const long astride = 8L * (M + 16);  /* ROW_BLOCK * (T + VEC) floats a thread */
    float *awork = calloc((size_t)astride * 2, 4);
    static const float caps[] = {0.0f, 1.5f};
    for (int c = 0; c < 2; c++)
        for (int t = 1; t <= 2; t++)
            for (int p = 0; p < 2; p++) {
                const int cut = p ? 5 : M;  /* the rows of the first pass */
                memset(kb, 0, (size_t)M * D * 4); memset(vb, 0, (size_t)M * D * 4);
                for (int start = 0, end = cut; start < M; start = end, end = M) {
                    const int64_t seq[14] = {0, end - start, start, (int64_t)(intptr_t)kb, (int64_t)(intptr_t)vb,
                                             (int64_t)M * D, (int64_t)M * D, D, (int64_t)M * D, (int64_t)M * D, D,
                                             0, 0, 0};
                    attend(rx + (long)start * H * D, (long)H * D, D, ak + (long)start * D, D, D, av + (long)start * D,
                           D, D, ao + (long)start * H * D, H, 1, D, 0.125f, caps[c], 1, seq, 0, NULL, 0, awork,
                           astride, t);
                }
                char name[64];
                snprintf(name, sizeof name, "att_c%d_t%d_p%d.f32", c, t, cut);
                spill(dir, name, ao, (long)M * H * D * 4);
            }
    puts("ok");
    return 0;
}
