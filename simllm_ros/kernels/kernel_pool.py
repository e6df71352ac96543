"""The product kernels' kept worker threads (kernels/pool.h), lent to the attention kernel's passes.

Threads split a product's outputs (or attention's rows), never a sum, so a result's bits do not depend on how
many workers ran it.
"""
from . import attention_kernel


def lend_to_attention(pool_call: int) -> None:
    """Let attention_kernel's passes split on a product kernel's kept workers (`pool_call`: the address of its
    simllm_pool_call): the same bits, since threads split rows, never a sum."""
    attention = attention_kernel.load()
    if attention is not None:
        attention.use_pool(pool_call)


def _product_kernels() -> list:
    """The product kernels this process has loaded (each has its own kept workers)."""
    # local: both import product_kernel, which imports this module (a cycle among the bindings)
    from . import int4_kernel, int4_vector_kernel

    return [k for k in (int4_vector_kernel.loaded(), int4_kernel.loaded()) if k is not None]


def stop_workers() -> None:
    """End every product kernel's kept workers (an engine's unload: no thread of ours outlives the model); the next
    threaded product starts them again."""
    for kernel in _product_kernels():
        kernel.stop_workers()


def workers() -> int:
    """Kept workers running now, all product kernels together."""
    return sum(kernel.workers() for kernel in _product_kernels())


def pin_workers(cpus: list[int]) -> None:
    """Worker i of each product kernel on cpus[i % len(cpus)] from its next wake-up ([]: where the OS puts them)."""
    for kernel in _product_kernels():
        kernel.pin_workers(cpus)
