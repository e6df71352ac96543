"""Console commands: simllm-edge (run the node), simllm-query (ask it), simllm_node (launch target)."""
