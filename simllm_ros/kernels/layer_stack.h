/* The layer loop and the row-split dispatch of the steps between products, written once for the bf16 and the
   float32 layers (layers.c): each instantiation runs the same steps in the same order on its own types. */
#ifndef SIMLLM_LAYER_STACK_H
#define SIMLLM_LAYER_STACK_H

#include <time.h>

/* The steps between products (norms, residual adds, RoPE, SiLU or GELU), per row */
enum { G_NORM, G_ADD_NORM, G_ROPE, G_SILU };

/* A profiled pass (PASS's `prof` not 0) adds each step's wall nanoseconds to prof[slot]: where a decode step's time
   goes (simllm-bench decode_profile). Two clock reads a step where asked, one test of a pointer where not. */
enum { PROF_QKV, PROF_ATTEND, PROF_O, PROF_GATE_UP, PROF_DOWN, PROF_NORM, PROF_ROPE, PROF_ACT, PROF_SLOTS };
static inline double stack_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}
#define PROFILED(P, SLOT, STMT)                                                                               \
    do {                                                                                                      \
        double *prof_ = (P)->prof;                                                                            \
        const double t0_ = prof_ ? stack_now_ns() : 0.0;                                                      \
        STMT;                                                                                                 \
        if (prof_) prof_[SLOT] += stack_now_ns() - t0_;                                                       \
    } while (0)

/* NAME(P, g): ROWS over g.M rows, split by rows over the pass's kept workers from glue_min_rows rows (a row's bits
   do not depend on which thread computes it), at most 64 parts. Below that, the MLP's activation of a wide layer
   (GLUE_COLS columns or more: a serial part of a 1.5B decode step) is split by columns instead: elementwise,
   so no bit changes either. */
#define GLUE_COLS 1024
#define DEFINE_GLUE(NAME, PASS, GLUE, ROWS)                                                                   \
static void NAME(const PASS *P, GLUE g) {                                                                 \
    const int cols = P->pool && P->threads > 1 && g.M < P->glue_min_rows && g.op == G_SILU && P->I >= GLUE_COLS; \
    int n = cols ? P->threads : P->pool && g.M >= P->glue_min_rows ? P->threads : 1;                      \
    if (!cols && n > g.M) n = g.M;                                                                        \
    if (n > 64) n = 64;                                                                                   \
    g.P = P;                                                                                              \
    g.cols = cols && n > 1;                                                                               \
    if (n <= 1) { g.n = 1; g.i = 0; ROWS(&g); return; }                                                   \
    GLUE jobs[64];                                                                                        \
    for (int i = 0; i < n; i++) { jobs[i] = g; jobs[i].n = n; jobs[i].i = i; }                            \
    P->pool(ROWS, jobs, sizeof(GLUE), n);                                                                 \
}

/* Layers first..last-1 over h [M, E] (in place), the order of LlamaRunner.forward's layer loop. weights [L][NW]:
   ln1, ln2, then the projections qkv, o, gate_up, down (as PRODUCT takes them), then ROPE_EXTRA's; eps [L][NE]:
   ln1's, ln2's, then ROPE_EXTRA's. ws: M * (2E + 2Nqkv + Hq*D + 3I) elements of T. ROPE_EXTRA(W, eps, li): more
   fields of the RoPE step (", .name = value, ..."; empty for none). Per layer (Gemma 3): ROPE_TABLE(W) which of the
   RoPE tables cos, sin [tables][M][D] it rotates by; WINDOWED(W) whether it attends with the pass's window plan
   (PASS's w* fields) instead of its causal one; POST_NORM(W, eps, li, which) more fields of the residual adds (a
   norm of the attention output, which 0, or of the MLP's, which 1, before it is added; empty for none). */
#define DEFINE_STACK(NAME, T, PASS, GLUE_T, GLUE, PRODUCT, NW, NE, ROPE_EXTRA, ROPE_TABLE, WINDOWED, POST_NORM)  \
void NAME(const PASS *P, T *h, int M, int first, int last, const int64_t *weights, const float *eps,         \
          const T *cos, const T *sin, T *ws) {                                                              \
    const int E = P->E, D = P->D, Hq = P->Hq, Hkv = P->Hkv, I = P->I, Nqkv = (Hq + 2 * Hkv) * D,            \
              Nqk = (Hq + Hkv) * D;                                                                         \
    T *x = ws, *qkv = x + (long)M * E, *qk = qkv + (long)M * Nqkv, *o = qk + (long)M * Nqk,                 \
      *t = o + (long)M * Hq * D, *gu = t + (long)M * E, *a = gu + (long)M * 2 * I;                          \
    if (first < last)                                                                                     \
        PROFILED(P, PROF_NORM, GLUE(P, (GLUE_T){.op = G_NORM, .M = M, .h = h,                              \
                                                .w = (const T *)(intptr_t)weights[(long)first * NW],       \
                                                .x = x, .eps = eps[NE * first]}));                         \
    for (int li = first; li < last; li++) {                                                               \
        const int64_t *W = weights + (long)li * NW;                                                       \
        const long table = (long)(ROPE_TABLE(W)) * M * D;                                                 \
        const int win = WINDOWED(W);                                                                      \
        PROFILED(P, PROF_QKV, PRODUCT(P, x, W[2], qkv, M, Nqkv, E));                                      \
        PROFILED(P, PROF_ROPE, GLUE(P, (GLUE_T){.op = G_ROPE, .M = M, .src = qkv, .dst = qk, .cos = cos + table, \
                                                .sin = sin + table ROPE_EXTRA(W, eps, li)}));              \
        PROFILED(P, PROF_ATTEND,                                                                          \
                 P->attend(qk, Nqk, D, qk + (long)Hq * D, Nqk, D, qkv + Nqk, Nqkv, D, o, Hq, Hkv, D, P->scale, \
                           P->softcap, win ? P->wnseq : P->nseq, win ? P->wtable : P->table, li, 0, 0,    \
                           win ? P->wawork : P->awork, win ? P->wastride : P->astride,                    \
                           win ? P->wathreads : P->athreads));                                            \
        PROFILED(P, PROF_O, PRODUCT(P, o, W[3], t, M, E, Hq * D));                                        \
        PROFILED(P, PROF_NORM, GLUE(P, (GLUE_T){.op = G_ADD_NORM, .M = M, .h = h, .t = t,                 \
                                                .w = (const T *)(intptr_t)W[1], .x = x,                    \
                                                .eps = eps[NE * li + 1] POST_NORM(W, eps, li, 0)}));       \
        PROFILED(P, PROF_GATE_UP, PRODUCT(P, x, W[4], gu, M, 2 * I, E));                                  \
        PROFILED(P, PROF_ACT, GLUE(P, (GLUE_T){.op = G_SILU, .M = M, .src = gu, .dst = a}));              \
        PROFILED(P, PROF_DOWN, PRODUCT(P, a, W[5], t, M, E, I));                                          \
        /* the residual add, and the next layer's input norm (the same rows, the same ops as at its top) */ \
        const int more = li + 1 < last;                                                                   \
        PROFILED(P, PROF_NORM, GLUE(P, (GLUE_T){.op = G_ADD_NORM, .M = M, .h = h, .t = t,                 \
                                                .w = more ? (const T *)(intptr_t)weights[(long)(li + 1) * NW] : 0, \
                                                .x = x, .eps = more ? eps[NE * (li + 1)] : 0.f            \
                                                POST_NORM(W, eps, li, 1)}));                               \
    }                                                                                                     \
}

#endif
