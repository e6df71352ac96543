"""Every benchmark of simllm_ros, one home: `simllm-bench` (simllm_ros/cli/bench.py) runs them.

The comparison against the alternatives (`simllm-bench [--smoke ...]`): systems (ours and the peers), runner (one
run), metrics, report. The others, one module each with a main(argv), run as `simllm-bench <name> [args]`:
concurrency, verified_decoding, fidelity, gguf_models, gguf_formats, gemma3_270m, chat_turns, semantic_ttft,
layer_passes, matcher, delta_storage, idle_cpu, fleet_store, error_bound. What they share (the checkout, test helpers,
the bulletin, the simllm_ros and llama.cpp systems, report writing, the matcher at a size) is shared.py.
Workloads and reports live under benchmark/ (workloads/, results/, concurrency/).
"""
