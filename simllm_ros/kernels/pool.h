/* Kept worker threads for our C kernels (included by both 4-bit product kernels).
   Why kept: a decode step makes ~120 small products, and starting threads per product costs more than it saves.
   Threads split a product's outputs (or attention's rows), never a sum, so a result's bits do not depend on how
   many workers ran it, or on whether they were busy and the caller computed alone. The including source supplies
   nothing; it gets `pool_start`, `pool_run` (with the `pool_use` lock held) and the exported `simllm_pool_call`,
   which attention passes use through its address (AttentionKernel.use_pool).
   Work is claimed, not assigned: a dispatch is a number of chunks, and the caller and each worker take the next
   chunk until none is left. A worker that is asleep, late to wake or slowed by another tenant of its core (a VM's
   steal time, a smaller core) then costs what it did not take, not the whole product: with fixed shares the
   caller waited for the slowest share every product. Which thread computes a chunk changes no bit. */
#ifndef SIMLLM_POOL_H
#define SIMLLM_POOL_H

#include <pthread.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void pool_relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static inline void pool_relax(void) { __asm__ __volatile__("yield"); }
#else
static inline void pool_relax(void) { }
#endif
/* Worker threads kept for the process: a decode step makes ~120 small products, and starting threads per
   product costs more than it saves. Between products a worker spins for a set time (simllm_pool_tune; 200 us by
   default: the next product of a step comes sooner, and a futex wake-up costs tens of us on a VM or an ARM core),
   then sleeps on a condition variable. The spin is timed, not counted: a pause lasts ~140 cycles on a recent Xeon,
   a yield ~1 on ARM, so a count meant 100 us on one and a few on the other. One caller at a time uses them
   (trylock); another caller meanwhile computes alone: threads split outputs, never a sum, so the bits are the
   same either way. simllm_pool_pin puts worker i on a CPU of a list; simllm_pool_stop ends them (an engine's
   unload), and the next product starts them again. After fork() the child starts without workers. */
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MAXT 64
static pthread_mutex_t pool_use = PTHREAD_MUTEX_INITIALIZER, pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_go = PTHREAD_COND_INITIALIZER;
static int pool_size, pool_sleepers, pool_atfork;
static int pool_quit, pool_alive;  /* simllm_pool_stop: workers leave at their next wake-up; those still running */
static int pool_born[MAXT];  /* the generation a worker was started in: it waits for the next */
/* The dispatch in progress: task(ctx, chunk, tid) for chunk 0..chunks-1, tid the thread's index (0: the caller).
   claim is (dispatch number << 32) | next chunk, claimed by compare-and-swap: a worker late for one dispatch finds
   another number there and takes nothing of the next. done counts finished chunks, each thread adding its count
   once, when it finds none left. Three cache lines: the dispatch (written once by the caller, then read by every
   thread; gen, what idle workers spin on, last), the claim and the done count (written by every thread). On one
   line, each claim and count made the other threads' next read of the dispatch miss: a one-row product of ~1M
   multiply-adds (a 0.5B model's q or o, tens of us) pays each such miss, and did not get faster at 2 threads. */
#define POOL_LINE 64
static struct {
    void (*task)(void *ctx, int chunk, int tid);
    void *ctx;
    int chunks, active, gen;
} pool_d __attribute__((aligned(POOL_LINE)));
static unsigned long pool_claim __attribute__((aligned(POOL_LINE)));
static int pool_done __attribute__((aligned(POOL_LINE)));
static unsigned pool_number __attribute__((aligned(POOL_LINE)));
static long pool_spin_ns = 200000;
/* simllm_pool_pin: worker i runs on pool_cpus[i % pool_ncpus] (none: where the OS puts it); pool_pins counts
   changes, so a worker moves at its next wake-up */
static int pool_cpus[MAXT], pool_ncpus, pool_pins;
/* simllm_pool_profile: while on, [0] dispatches, [1] of them finding a worker asleep (a futex wake-up before it
   starts), [2] nanoseconds the caller waited for workers after its own job, [3] products computed alone because
   another caller held the workers. Read by simllm-bench decode_profile; off, a test of an int. */
static int pool_prof;
static double pool_stat[4];
static inline double pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* The next chunk of dispatch `number`, or -1 when it has none left (or is over). */
static int pool_take(unsigned number) {
    unsigned long v = __atomic_load_n(&pool_claim, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((unsigned)(v >> 32) != number || (int)(v & 0xffffffffUL) >= pool_d.chunks) return -1;
        if (__atomic_compare_exchange_n(&pool_claim, &v, v + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return (int)(v & 0xffffffffUL);
    }
}
/* Chunks of dispatch `number` until none is left, as thread `tid`. */
static void pool_work(unsigned number, int tid) {
    int c, n = 0;
    while ((c = pool_take(number)) >= 0) {
        pool_d.task(pool_d.ctx, c, tid);  /* read after the claim: the dispatch cannot end before this chunk does */
        n++;
    }
    if (n) __atomic_add_fetch(&pool_done, n, __ATOMIC_RELEASE);
}

/* The calling thread on one CPU (the raw system call: no _GNU_SOURCE needed for cpu_set_t); 0 where it is. */
static int pool_bind_self(int cpu) {
    unsigned long mask[16] = {0};  /* 1024 CPUs */
    if (cpu < 0 || cpu >= 1024) return -1;
    mask[cpu / (8 * (int)sizeof(long))] = 1UL << (cpu % (8 * (int)sizeof(long)));
    return (int)syscall(SYS_sched_setaffinity, 0, sizeof mask, mask);
}

static void *worker(void *arg) {
    const int i = (int)(long)arg;
    int seen = pool_born[i], pinned = -1;
    prctl(PR_SET_NAME, "simllm-pool", 0, 0, 0);
    for (;;) {
        const int pins = __atomic_load_n(&pool_pins, __ATOMIC_ACQUIRE);
        if (pins != pinned) {
            pinned = pins;
            if (pool_ncpus > 0) pool_bind_self(pool_cpus[i % pool_ncpus]);
        }
        int g = seen;
        const long spin = __atomic_load_n(&pool_spin_ns, __ATOMIC_RELAXED);
        if (spin > 0) {
            const double t0 = pool_now_ns();
            for (int s = 1; g == seen; s++) {
                pool_relax();
                g = __atomic_load_n(&pool_d.gen, __ATOMIC_ACQUIRE);
                if ((s & 63) == 0 && pool_now_ns() - t0 > (double)spin) break;
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&pool_mu);
            pool_sleepers++;
            while ((g = __atomic_load_n(&pool_d.gen, __ATOMIC_ACQUIRE)) == seen) pthread_cond_wait(&pool_go, &pool_mu);
            pool_sleepers--;
            pthread_mutex_unlock(&pool_mu);
        }
        seen = g;
        if (__atomic_load_n(&pool_quit, __ATOMIC_ACQUIRE)) {
            __atomic_sub_fetch(&pool_alive, 1, __ATOMIC_RELEASE);
            return 0;
        }
        if (i < __atomic_load_n(&pool_d.active, __ATOMIC_ACQUIRE))  /* threads 1..active-1 of this dispatch */
            pool_work((unsigned)(__atomic_load_n(&pool_claim, __ATOMIC_ACQUIRE) >> 32), i);
    }
    return 0;
}

static void pool_after_fork(void) {  /* the child has none of the parent's threads */
    pool_size = 0; pool_d.gen = 0; pool_d.active = 0; pool_sleepers = 0; pool_alive = 0;
    pool_quit = 0;
    pthread_mutex_init(&pool_use, 0); pthread_mutex_init(&pool_mu, 0); pthread_cond_init(&pool_go, 0);
}

/* Workers 1..n-1 started (the caller holds pool_use); 0 where they could not be. */
static int pool_start(int n) {
    if (!pool_atfork) { pthread_atfork(0, 0, pool_after_fork); pool_atfork = 1; }
    while (pool_size < n - 1) {  /* worker i computes job i (1..) */
        pthread_t t;
        pool_born[pool_size + 1] = __atomic_load_n(&pool_d.gen, __ATOMIC_ACQUIRE);
        __atomic_add_fetch(&pool_alive, 1, __ATOMIC_ACQ_REL);
        if (pthread_create(&t, 0, worker, (void *)(long)(pool_size + 1)) != 0) {
            __atomic_sub_fetch(&pool_alive, 1, __ATOMIC_ACQ_REL);
            break;
        }
        pthread_detach(t);
        pool_size++;
    }
    return pool_size >= n - 1;
}

/* Ends every worker (they leave at once, asleep or spinning) and returns when none is left; a later product starts
   them again. Waits for a product in progress to finish first. */
void simllm_pool_stop(void) {
    pthread_mutex_lock(&pool_use);
    if (pool_size > 0) {
        __atomic_store_n(&pool_d.active, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&pool_quit, 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&pool_mu);
        __atomic_add_fetch(&pool_d.gen, 1, __ATOMIC_ACQ_REL);
        pthread_cond_broadcast(&pool_go);
        pthread_mutex_unlock(&pool_mu);
        while (__atomic_load_n(&pool_alive, __ATOMIC_ACQUIRE) > 0) sched_yield();
        __atomic_store_n(&pool_quit, 0, __ATOMIC_RELEASE);
        pool_size = 0;
    }
    pthread_mutex_unlock(&pool_use);
}
/* How long an idle worker spins before it sleeps (ns; 0: it sleeps at once). */
void simllm_pool_tune(long spin_ns) { __atomic_store_n(&pool_spin_ns, spin_ns < 0 ? 0 : spin_ns, __ATOMIC_RELAXED); }
/* Worker i (1..) on cpus[i % n] from its next wake-up; n 0 leaves them where they are (no longer pinned for new
   ones). The bits do not depend on where a worker runs. */
void simllm_pool_pin(const int *cpus, int n) {
    pthread_mutex_lock(&pool_use);
    if (n > MAXT) n = MAXT;
    for (int i = 0; i < n; i++) pool_cpus[i] = cpus[i];
    pool_ncpus = n < 0 ? 0 : n;
    __atomic_add_fetch(&pool_pins, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&pool_use);
}
/* Workers running now (started, not ended): what a test of the engine's cleanup reads. */
int simllm_pool_workers(void) { return __atomic_load_n(&pool_alive, __ATOMIC_ACQUIRE); }
/* task(ctx, chunk, tid) for every chunk < chunks, on the caller (tid 0) and workers 1..threads-1, each taking the
   next chunk until none is left; returns when all are done and releases pool_use (held by the caller, the workers
   started). */
static void pool_run(void (*task)(void *, int, int), void *ctx, int chunks, int threads) {
    pool_d.task = task; pool_d.ctx = ctx; pool_d.chunks = chunks;
    __atomic_store_n(&pool_done, 0, __ATOMIC_RELAXED);
    const unsigned number = ++pool_number;
    __atomic_store_n(&pool_d.active, threads, __ATOMIC_RELEASE);
    __atomic_store_n(&pool_claim, (unsigned long)number << 32, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool_mu);
    __atomic_add_fetch(&pool_d.gen, 1, __ATOMIC_ACQ_REL);
    if (pool_prof) { pool_stat[0] += 1; pool_stat[1] += pool_sleepers > 0; }
    if (pool_sleepers) pthread_cond_broadcast(&pool_go);
    pthread_mutex_unlock(&pool_mu);
    pool_work(number, 0);
    const double waited = pool_prof ? pool_now_ns() : 0.0;
    while (__atomic_load_n(&pool_done, __ATOMIC_ACQUIRE) < chunks) pool_relax();
    if (pool_prof) pool_stat[2] += pool_now_ns() - waited;
    pthread_mutex_unlock(&pool_use);
}
/* out[4] (or 0) <- the counts since the last call (see pool_stat), which start again from zero; counting on or off. */
void simllm_pool_profile(int on, double *out) {
    if (out) memcpy(out, pool_stat, sizeof pool_stat);
    memset(pool_stat, 0, sizeof pool_stat);
    pool_prof = on;
}
/* Other kernels' jobs (attention_kernel's row blocks): fn(args + i * size) for i < n, each job on whichever thread
   claims it; where the workers are busy (another caller's product) or cannot start, every job runs in the caller,
   one after the other. Jobs must not depend on which thread runs them. */
typedef struct { void *(*fn)(void *); char *args; long size; } pool_jobs_t;
static void pool_job(void *ctx, int chunk, int tid) {
    const pool_jobs_t *j = ctx;
    (void)tid;
    j->fn(j->args + chunk * j->size);
}
void simllm_pool_call(void *(*fn)(void *), void *args, long size, int n) {
    if (n > MAXT) n = MAXT;
    if (n > 1 && pthread_mutex_trylock(&pool_use) == 0) {
        if (pool_start(n)) {
            pool_jobs_t jobs = {fn, (char *)args, size};
            pool_run(pool_job, &jobs, n, n);
            return;
        }
        pthread_mutex_unlock(&pool_use);
    } else if (n > 1 && pool_prof) {
        pool_stat[3] += 1;
    }
    for (int i = 0; i < n; i++) fn((char *)args + i * size);
}
#endif
