"""The C kernels and their Python side: the .c/.h sources beside this file, build.py (compiles them with the system
compiler and keeps the libraries by content), one ctypes wrapper per kernel (attention, 4-bit products on AMX and on
vector units, whole decoder layers, RMSNorm, the product kernels' shared worker pool) and compute_threads (who gets
the cores while they run). Imports nothing else of simllm_ros: everything above may use it, it uses nothing above."""
