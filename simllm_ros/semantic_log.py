"""A rotating JSON Lines log of every reuse decision, so a wrong answer can be traced to the cached task it came from."""
from __future__ import annotations

import json
import logging
import logging.handlers
import os
import time


class SemanticLog:
    def __init__(self, path: str, max_bytes: int = 5 * 2**20, backups: int = 3):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._logger = logging.Logger(f"simllm_ros.semantic_log.{id(self)}")
        self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                             encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)

    def write(self, record: dict) -> None:
        self._logger.info(json.dumps({"time": round(time.time(), 3), **record}, ensure_ascii=False))

    def close(self) -> None:
        self._handler.close()
        self._logger.removeHandler(self._handler)
