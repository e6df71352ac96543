"""The request pipeline: request -> fingerprint -> match -> plan reuse -> run model -> update pool -> respond.

Two phases so that the ROS node can overlap them in different callback groups:
`prepare()` (validate, fingerprint, match; cheap, thread-safe) and `execute()`
(plan reuse, run the model, update the pool; one at a time).
"""
from __future__ import annotations

# API contract (implementation follows in this module):
#
# class Engine:
#     def __init__(self, settings: Settings, log: logging.Logger | None = None)
#     def load(self, progress: Callable[[str], None] | None = None) -> None
#         Loads tokenizer, model, embedder; restores the persisted pool; runs warm-up.
#         Raises EngineLoadError(message) on any failure and leaves nothing loaded.
#     def prepare(self, req: QueryRequest) -> Prepared | QueryResult
#         Validates and fingerprints; returns a QueryResult (success=False) for bad input.
#     def prepare_batch(self, reqs: list[QueryRequest]) -> list[Prepared | QueryResult]
#     def execute(self, prepared: Prepared) -> QueryResult
#         Never raises for a request's own fault: returns success=False with an error.
#     def handle(self, req: QueryRequest) -> QueryResult    # prepare + execute
#     def apply_settings(self, changes: dict) -> None        # live parameters; raises SettingError
#     def stats(self) -> dict                                # see CacheStats.msg fields
#     def cache_map(self) -> list[dict]                      # {x, y, z, bytes, hits, scope}
#     def save(self) -> str | None                           # persist pool; returns path
#     def unload(self) -> None                               # release model memory
#     thermal_level: set by the node from the thermal monitor ('ok', 'warn', 'critical')
