/* What libmembw exports: this machine's memory read and copy rate (membw.c), for simllm-bench decode_profile.
   One plain prototype per entry; kernels/abi.py checks the Python binding against it. */
#ifndef SIMLLM_MEMBW_API_H
#define SIMLLM_MEMBW_API_H

/* GB/s of `threads` threads reading (copy 0) or copying (1) `bytes` of src (to dst) `reps` times; -1: no threads */
double simllm_memory_rate(const void *src, void *dst, long bytes, int threads, int reps, int copy);

#endif
