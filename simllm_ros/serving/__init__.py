"""Serving requests without ROS: the engine (load, settings, pool and model together), one request's pipeline and
continuous batching (request_pipeline, batching, request_memory), running SEMANTIC plans and gating approximate
answers (semantic_reuse, approx_gate), following an answer as it streams (streaming), a warm start from the pool
snapshot (warm_start), admission and the generation worker (request_server), and the node's health and thermal state
(health, thermal). Uses cache/, model/, kernels/ and the shared top-level modules; ros/ is the only part above it."""
