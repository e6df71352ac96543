"""What runs the model: model_backend (a causal LM behind the few operations the engine needs), the files it loads
(model_files, gguf_weights) and the checks made at load (load_checks, kernel_paths), the lean Llama-family runner
(llama_runner with runner_layers, runner_weights, kv_buffer), decoding with verified drafts (decoding,
draft_proposer) and structured output (structured_output, schema_check). Uses kernels/ and, for the KV block
shape only, cache/block_store; never serving/ or ros/."""
