"""The soak script (scripts/soak.py) end to end, short: 60 requests through a real node in a subprocess.

The full soak is a separate command (a few thousand requests, ~10 min):
    .venv/bin/python scripts/soak.py --requests 2000
Here only the machinery is checked (every request answered once, pool within budget, exit status 0);
60 requests are too few for RSS to settle, so the RSS limit is loose.
"""
import os
import subprocess
import sys

import pytest

from conftest import REPO, pick_domain


def test_soak_script_short_run():
    pytest.importorskip("rclpy")  # the script asks a node over DDS
    env = dict(os.environ)
    env["ROS_DOMAIN_ID"] = str(pick_domain(os.getpid() + 7, exclude={int(os.environ["ROS_DOMAIN_ID"])}))
    env["PYTHONUNBUFFERED"] = "1"
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "soak.py"), "--requests", "60",
                        "--sample-every", "10", "--max-rss-growth", "0.5"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    print("\n" + "\n".join(line for line in p.stdout.splitlines() if line.startswith("soak:")))
    assert p.returncode == 0, out[-4000:]
    assert "soak: PASS" in p.stdout
    assert "lost 0, duplicates 0" in p.stdout and "internal errors 0" in p.stdout
    assert "0 over budget; consistency ok" in p.stdout
