"""The product kernels' kept worker threads (kernels/pool.h), lent to the attention kernel's passes.

Threads split a product's outputs (or attention's rows), never a sum, so a result's bits do not depend on how
many workers ran it.
"""


def lend_to_attention(pool_call: int) -> None:
    """Let attention_kernel's passes split on a product kernel's kept workers (`pool_call`: the address of its
    simllm_pool_call): the same bits, since threads split rows, never a sum."""
    from . import attention_kernel

    attention = attention_kernel.load()
    if attention is not None:
        attention.use_pool(pool_call)
