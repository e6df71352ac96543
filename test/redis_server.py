"""A real redis-server for a test: its own free localhost port and temp folder, no persistence; it can be killed,
paused (SIGSTOP), resumed and restarted on the same port. Tests that need it skip, saying why, when Debian's
redis-server is not installed (scripts/setup.sh installs it where it can)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, extra: tuple[str, ...] = ()):
        self.binary = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                                        else None)
        if self.binary is None:
            pytest.skip("redis-server is not installed (scripts/setup.sh installs Debian's redis-server with "
                        "apt-get where it runs as root; or: apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="simllm-redis-")
        self.port = _free_port()
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                                      "--save", "", "--appendonly", "no", *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)  # a paused server must be able to die
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_server():
    """A redis-server for the test module (import this name into the module to use it)."""
    server = RedisServer()
    yield server
    server.close()
