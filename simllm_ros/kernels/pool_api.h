/* The kept worker pool's entries (pool.h), exported by both product libraries (int4_amx, int4_vector).
   One plain prototype per entry, its why in the comment above: kernels/abi.py reads these to check the
   Python bindings, so keep each a single declaration of the form `ret name(type name, ...);`. */
#ifndef SIMLLM_POOL_API_H
#define SIMLLM_POOL_API_H

/* Run fn on n argument records of `size` bytes at args, split over the kept workers: attention's address for it */
void simllm_pool_call(void *(*fn)(void *), void *args, long size, int n);
/* Count dispatches, sleeping wake-ups, waits and lone products while `on`; out[4] gets them since the last call */
void simllm_pool_profile(int on, double *out);
/* End the kept workers (an engine's unload); the next threaded product starts them again */
void simllm_pool_stop(void);
/* How long an idle worker spins before it sleeps, in nanoseconds */
void simllm_pool_tune(long spin_ns);
/* Worker i on cpus[i % n]; n = 0 leaves them where the OS puts them */
void simllm_pool_pin(const int *cpus, int n);
/* How many kept workers run now */
int simllm_pool_workers(void);

#endif
