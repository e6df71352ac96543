"""What holds and finds cached work: the semantic KV pool (kv_pool over block_pool, block_store, kv_quant,
eviction), the matcher with its coarse index and the fingerprints it compares, the reuse planner and the ANSWER
tier's guard, the exact-answer memo, the error bound on approximate answers, snapshots and checkpoints of the pool
(persistence, checkpoint), the fleet store shared through Redis (fleet_store, its wire fleet_link, fleet_blob), and
what the pool reports (cache_stats, cache_map, semantic_log). Uses kernels/ and the shared top-level modules;
never model/, serving/ or ros/."""
