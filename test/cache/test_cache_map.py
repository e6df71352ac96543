"""cache_map.spheres: the rviz picture of the pool, as plain numbers."""
import dataclasses

import numpy as np

from simllm_ros.cache.cache_map import MAX_EXTRA_DIAMETER, MIN_DIAMETER, spheres


@dataclasses.dataclass
class E:
    scope: str
    bytes: int
    hits: int
    fingerprint: np.ndarray


def test_clusters_stay_apart_and_size_and_colour_follow_bytes_and_hits():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(16), rng.standard_normal(16)
    entries = [E("kiosk", 1000, 0, a + 0.01 * rng.standard_normal(16)) for _ in range(3)]
    entries += [E("", 4000, 9, b + 0.01 * rng.standard_normal(16)) for _ in range(3)]
    s = spheres(entries)
    xyz = np.array([[p.x, p.y, p.z] for p in s])
    within = max(np.linalg.norm(xyz[0] - xyz[1]), np.linalg.norm(xyz[3] - xyz[4]))
    assert np.linalg.norm(xyz[0] - xyz[3]) > 10 * within
    assert [p.namespace for p in s] == ["kiosk"] * 3 + ["default"] * 3
    assert s[3].diameter == MIN_DIAMETER + MAX_EXTRA_DIAMETER and s[0].diameter < s[3].diameter
    assert s[0].rgba[:3] == (0.0, 0.0, 1.0) and s[3].rgba[:3] == (1.0, 0.0, 0.0)  # unused blue, most used red


def test_empty_and_single_entry():
    assert spheres([]) == []
    (only,) = spheres([E("s", 10, 1, np.ones(8))])
    assert (only.x, only.y, only.z) == (0.0, 0.0, 0.0)


def test_with_a_salt_namespaces_are_tags_not_scope_names():
    """What every subscriber of ~/cache_map sees: one stable tag per scope, no scope name; another salt
    (another node process) gives other tags."""
    import os
    rng = np.random.default_rng(1)
    entries = [E(sc, 100, 1, rng.standard_normal(8)) for sc in ("kiosk-3", "kiosk-3", "secret_lab", "")]
    salt = os.urandom(16)
    tags = [p.namespace for p in spheres(entries, salt=salt)]
    assert tags[0] == tags[1] and len(set(tags)) == 3 and all(t.startswith("scope-") for t in tags)
    assert not any(name in t for t in tags for name in ("kiosk", "secret", "default"))
    assert [p.namespace for p in spheres(entries, salt=os.urandom(16))] != tags


def test_frames_are_prefixed_by_the_namespace_tf2_style():
    from simllm_ros.cache.cache_map import namespaced_frame
    assert namespaced_frame("simllm_cache", "/robot1") == "robot1/simllm_cache"
    assert namespaced_frame("simllm_cache", "/") == "simllm_cache"
    assert namespaced_frame("map", "/fleet/robot2/") == "fleet/robot2/map"
