"""The pool drawn for rviz: one sphere per cached task at a 3-D PCA of the fingerprints.

Why it exists: an operator can see topics (clusters), their size and their use at a glance; it is
visualisation, so it lives outside the engine, and it is plain numbers so the node only copies them
into visualization_msgs/Marker.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math

import numpy as np

MAX_SPHERES = 2000
MIN_DIAMETER = 0.03  # a sphere of an entry with no bytes is still visible
MAX_EXTRA_DIAMETER = 0.2  # the largest entry's sphere is MIN + this (area grows with bytes)


@dataclasses.dataclass(frozen=True)
class Sphere:
    namespace: str  # the cache scope's tag (scope_tag), or its name when no salt is given
    x: float
    y: float
    z: float
    diameter: float
    rgba: tuple[float, float, float, float]


def pca_3d(fingerprints: np.ndarray) -> np.ndarray:
    """[n, d] -> [n, 3] coordinates on the first three principal axes (zeros where n < 2 or d < 3)."""
    fps = np.asarray(fingerprints, dtype=np.float64)
    centred = fps - fps.mean(axis=0)
    if len(fps) >= 2:
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        xyz = centred @ vt[:3].T
    else:
        xyz = np.zeros((len(fps), 3))
    return np.pad(xyz, ((0, 0), (0, max(0, 3 - xyz.shape[1]))))


def heat_colour(t: float) -> tuple[float, float, float, float]:
    """0 -> cold blue, 1 -> hot red."""
    t = min(max(t, 0.0), 1.0)
    return (t, 0.25 * (1.0 - abs(2.0 * t - 1.0)), 1.0 - t, 0.85)


def scope_tag(scope: str, salt: bytes) -> str:
    """'scope-1f2e3d4c': the same for every entry of a scope, so rviz can colour or hide a scope by namespace,
    but not the scope's name. The salt is random per node process: a subscriber cannot test a guessed name
    against it, nor link tags across restarts."""
    return "scope-" + hmac.new(salt, (scope or "default").encode("utf-8"), hashlib.sha256).hexdigest()[:8]


def spheres(entries, salt: bytes | None = None) -> list[Sphere]:
    """Entries (with scope, bytes, hits, fingerprint) -> spheres sized by bytes and coloured by hits.
    With a salt (the node always passes one) the namespace is scope_tag(scope), never the name."""
    entries = list(entries)[:MAX_SPHERES]
    if not entries:
        return []
    xyz = pca_3d(np.stack([e.fingerprint for e in entries]))
    max_b = max(float(e.bytes) for e in entries) or 1.0
    max_h = max(max(int(e.hits), 0) for e in entries)
    out = []
    for p, e in zip(xyz, entries):
        d = MIN_DIAMETER + MAX_EXTRA_DIAMETER * math.sqrt(max(float(e.bytes), 0.0) / max_b)
        heat = math.log1p(max(int(e.hits), 0)) / math.log1p(max_h) if max_h > 0 else 0.0
        ns = scope_tag(e.scope, salt) if salt is not None else str(e.scope or "default")
        out.append(Sphere(ns, float(p[0]), float(p[1]), float(p[2]), d, heat_colour(heat)))
    return out


def namespaced_frame(frame: str, namespace: str) -> str:
    """A frame id prefixed by the node's namespace ('/robot1' -> 'robot1/simllm_cache'), tf2 style (no slash):
    robots in their own namespaces draw their pools in frames of their own."""
    ns = namespace.strip("/")
    return f"{ns}/{frame}" if ns else frame
