"""A real redis-server for tests: Debian's binary on a free 127.0.0.1 port, with its files in a temp
dir. Started, killed and restarted by the tests themselves; never a mock."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS = shutil.which("redis-server")
NO_REDIS = "redis-server not found: install Debian's redis-server (.ci/run installs it)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; `args` are extra config directives (`--maxmemory 8mb` ...)."""

    def __init__(self, directory: Path, *args: str, password: str | None = None):
        if REDIS is None:
            pytest.skip(NO_REDIS)
        self.dir, self.args, self.password = directory, args, password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        cmd += ["--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log"), *self.args]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            if self._answers():
                return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer within 20 s")

    def _answers(self) -> bool:
        """PING answered (PONG, or NOAUTH when a password is set: it is up all the same) and the
        data set loaded."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no fsync beyond what its config does anyway."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)
