"""Picking a free ROS_DOMAIN_ID, so tests and tools on one host never see each other's DDS traffic.

Imports nothing from ROS: it must run before rclpy.init reads the environment.
"""
from __future__ import annotations

import socket


def domain_in_use(domain: int) -> bool:
    """True if a DDS participant on this host already holds the domain's Fast DDS discovery ports."""
    base = 7400 + 250 * domain
    for port in [base] + [base + 10 + 2 * i for i in range(4)]:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
        finally:
            s.close()
    return False


def pick_domain(seed: int, exclude=()) -> int:
    """A ROS_DOMAIN_ID in 1..200 derived from seed (e.g. the pid), skipping domains in use on this host."""
    for k in range(200):
        d = 1 + (seed + k) % 200
        if d not in exclude and not domain_in_use(d):
            return d
    return 1 + seed % 200
