"""gguf_models' per-mapping memory figures (resident_parts): a file mapped and read counts under the model's files,
and the parts add up to the process's resident set."""
from __future__ import annotations

import mmap

from simllm_ros.bench.gguf_models import resident_parts


def _vmrss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_mapped_model_file_counts_as_model_files_and_the_parts_add_up(tmp_path):
    path = tmp_path / "model.gguf"
    size = 24 << 20
    path.write_bytes(b"\x01" * size)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, size, mmap.PAGESIZE)) == size // mmap.PAGESIZE  # every page touched
        named = resident_parts(str(path))
        other = resident_parts(str(tmp_path / "another.gguf"))
        rss = _vmrss_mb()
        # the 24 MiB read through the map count as the model's files only where that file is named (a test worker
        # may hold other models' packed blocks: in both)
        assert named["model files"] - other["model files"] >= 23.9
        assert other["other files"] - named["other files"] >= 23.9
        assert abs(sum(named.values()) - rss) < 0.05 * rss + 2  # smaps' sum is the resident set
