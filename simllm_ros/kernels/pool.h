/* Kept worker threads for our C kernels (included by both 4-bit product kernels).
   Why kept: a decode step makes ~120 small products, and starting threads per product costs more than it saves.
   Threads split a product's outputs (or attention's rows), never a sum, so a result's bits do not depend on how
   many workers ran it, or on whether they were busy and the caller computed alone. The including source supplies
   nothing; it gets `pool_start`, `pool_dispatch` (with the `pool_use` lock held) and the exported
   `simllm_pool_call`, which attention passes use through its address (AttentionKernel.use_pool). */
#ifndef SIMLLM_POOL_H
#define SIMLLM_POOL_H

#include <pthread.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void pool_relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static inline void pool_relax(void) { __asm__ __volatile__("yield"); }
#else
static inline void pool_relax(void) { }
#endif
/* Worker threads kept for the process: a decode step makes ~120 small products, and starting threads per
   product costs more than it saves. Between products a worker spins briefly (~100 us: the next product of a
   step comes sooner), then sleeps on a condition variable. One caller at a time uses them (trylock); another
   caller meanwhile computes alone: threads split outputs, never a sum, so the bits are the same either way.
   After fork() the child starts without workers. */
#define MAXT 64
#define SPIN 2000
static pthread_mutex_t pool_use = PTHREAD_MUTEX_INITIALIZER, pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_go = PTHREAD_COND_INITIALIZER;
static int pool_size, pool_gen, pool_pending, pool_active, pool_sleepers, pool_atfork;
static int pool_born[MAXT];  /* the generation a worker was started in: it waits for the next */
static void *(*pool_fn)(void *);
static char *pool_args;  /* worker i runs pool_fn(pool_args + i * pool_arg_size) */
static long pool_arg_size;

static void *worker(void *arg) {
    const int i = (int)(long)arg;
    int seen = pool_born[i];
    for (;;) {
        int g = seen;
        for (int s = 0; s < SPIN && g == seen; s++) { pool_relax(); g = __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE); }
        if (g == seen) {
            pthread_mutex_lock(&pool_mu);
            pool_sleepers++;
            while ((g = __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&pool_go, &pool_mu);
            pool_sleepers--;
            pthread_mutex_unlock(&pool_mu);
        }
        seen = g;
        if (i < __atomic_load_n(&pool_active, __ATOMIC_ACQUIRE)) {  /* jobs 1..active-1 of this product */
            pool_fn(pool_args + i * pool_arg_size);
            __atomic_sub_fetch(&pool_pending, 1, __ATOMIC_RELEASE);
        }
    }
    return 0;
}

static void pool_after_fork(void) {  /* the child has none of the parent's threads */
    pool_size = 0; pool_gen = 0; pool_pending = 0; pool_active = 0; pool_sleepers = 0;
    pthread_mutex_init(&pool_use, 0); pthread_mutex_init(&pool_mu, 0); pthread_cond_init(&pool_go, 0);
}

/* Workers 1..n-1 started (the caller holds pool_use); 0 where they could not be. */
static int pool_start(int n) {
    if (!pool_atfork) { pthread_atfork(0, 0, pool_after_fork); pool_atfork = 1; }
    while (pool_size < n - 1) {  /* worker i computes job i (1..) */
        pthread_t t;
        pool_born[pool_size + 1] = __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE);
        if (pthread_create(&t, 0, worker, (void *)(long)(pool_size + 1)) != 0) break;
        pthread_detach(t);
        pool_size++;
    }
    return pool_size >= n - 1;
}
/* fn(args + i * size) for i < n: job 0 in the caller, the others on the workers; returns when all are done and
   releases pool_use (held by the caller, the workers started). */
static void pool_dispatch(void *(*fn)(void *), void *args, long size, int n) {
    pool_fn = fn; pool_args = (char *)args; pool_arg_size = size;
    __atomic_store_n(&pool_active, n, __ATOMIC_RELEASE);
    __atomic_store_n(&pool_pending, n - 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool_mu);
    __atomic_add_fetch(&pool_gen, 1, __ATOMIC_ACQ_REL);
    if (pool_sleepers) pthread_cond_broadcast(&pool_go);
    pthread_mutex_unlock(&pool_mu);
    fn(args);
    while (__atomic_load_n(&pool_pending, __ATOMIC_ACQUIRE)) pool_relax();
    pthread_mutex_unlock(&pool_use);
}
/* The same for other kernels' jobs (attention_kernel's row blocks): where the workers are busy (another caller's
   product) or cannot start, every job runs in the caller, one after the other. Jobs must not depend on which
   thread runs them. */
void simllm_pool_call(void *(*fn)(void *), void *args, long size, int n) {
    if (n > MAXT) n = MAXT;
    if (n > 1 && pthread_mutex_trylock(&pool_use) == 0) {
        if (pool_start(n)) { pool_dispatch(fn, args, size, n); return; }
        pthread_mutex_unlock(&pool_use);
    }
    for (int i = 0; i < n; i++) fn((char *)args + i * size);
}
#endif
