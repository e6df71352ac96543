/* What this machine's memory gives: a STREAM-like read and copy over buffers far larger than the caches, on 1..N
   threads, each thread its own slice. A decode step reads every weight once, so the read rate bounds it:
   simllm-bench decode_profile sets a model's bytes per token against it. Integer sums (no float reduction, which
   -ffp-contract=off and no -ffast-math would keep the compiler from vectorizing), so the loop runs at the speed of
   the loads. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include "membw_api.h"

typedef struct {
    const uint64_t *src;
    uint64_t *dst;
    long words;
    int reps;
    uint64_t sum;
} slice_t;

static void *read_slice(void *arg) {
    slice_t *s = arg;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int r = 0; r < s->reps; r++)
        for (long i = 0; i + 4 <= s->words; i += 4) {
            a0 += s->src[i];
            a1 += s->src[i + 1];
            a2 += s->src[i + 2];
            a3 += s->src[i + 3];
        }
    s->sum = a0 ^ a1 ^ a2 ^ a3;
    return 0;
}

static void *copy_slice(void *arg) {
    slice_t *s = arg;
    for (int r = 0; r < s->reps; r++) memcpy(s->dst, s->src, (size_t)s->words * 8);
    return 0;
}

/* GB/s (1e9 bytes) of `threads` threads reading (copy 0) or copying (copy 1: bytes read plus written, as STREAM
   counts) `bytes` of src (and dst) `reps` times; -1 where a thread could not start. */
double simllm_memory_rate(const void *src, void *dst, long bytes, int threads, int reps, int copy) {
    enum { MAXT = 64 };
    if (threads < 1) threads = 1;
    if (threads > MAXT) threads = MAXT;
    slice_t s[MAXT];
    pthread_t t[MAXT];
    const long words = bytes / 8 / threads / 4 * 4;
    for (int i = 0; i < threads; i++)
        s[i] = (slice_t){.src = (const uint64_t *)src + (long)i * words, .dst = (uint64_t *)dst + (long)i * words,
                         .words = words, .reps = reps};
    void *(*fn)(void *) = copy ? copy_slice : read_slice;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int started = 1;
    for (int i = 1; i < threads; i++)
        if (pthread_create(&t[i], 0, fn, &s[i]) != 0) { started = 0; threads = i; break; }
    fn(&s[0]);
    for (int i = 1; i < threads; i++) pthread_join(t[i], 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (!started) return -1.0;
    const double secs = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    volatile uint64_t keep = 0;
    for (int i = 0; i < threads; i++) keep ^= s[i].sum;
    (void)keep;
    return (double)words * 8 * threads * reps * (copy ? 2 : 1) / secs / 1e9;
}
