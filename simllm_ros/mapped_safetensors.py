"""A safetensors file's tensors as views of one private memory map, read without copying.

Why: weights read this way stay the file's pages (shared between processes, evictable, and only the pages a
forward touches become resident: an embedding table's unused rows never do), where safetensors' own get_tensor
copies each tensor into the process. The format is a JSON header and raw bytes: nothing in it is executed.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

import numpy as np
import torch

DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 64 << 20


class MappedSafetensors:
    def __init__(self, path: str):
        """ValueError where the file is not a safetensors file that adds up (header past the end, bad JSON)."""
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER):
                raise ValueError("header size past the end")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"header is not JSON: {e}") from e
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            self.meta: dict = header.pop("__metadata__", None) or {}
            self.entries: dict[str, Any] = header  # as the file's JSON says: raw() and tensor() check it
            # copy-on-write: writable for torch, the file's pages unless written (nothing writes them)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
        self.data = np.frombuffer(self._map, dtype=np.uint8, offset=8 + n) if self._map is not None \
            else np.zeros(0, dtype=np.uint8)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes; ValueError if its dtype is unknown or its bytes do not fit the file."""
        t = self.entries[name]
        dtype, shape, (a, b) = DTYPES.get(t.get("dtype")), t.get("shape"), t.get("data_offsets")
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {t.get('dtype')} not read here")
        count = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        if not 0 <= a <= b <= self.data.size or b - a != count:
            raise ValueError(f"tensor {name} does not fit the file")
        return self.data[a:b]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a view of the mapping (no copy)."""
        t = self.entries[name]
        raw = self.raw(name)
        return torch.from_numpy(raw).view(DTYPES[t["dtype"]]).reshape(t["shape"])
