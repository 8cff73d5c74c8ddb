"""A private redis-server on a free loopback port, without persistence: for tests and benchmarks of the
offload tier, which must never depend on a server somebody else left running."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


class LocalRedis:
    def __init__(self, startup_timeout: float = 10.0, password: str | None = None) -> None:
        """password: the server requires it (AUTH), and url carries it."""
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it: apt-get install redis-server)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.workdir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir.name, *(["--requirepass", password] if password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.workdir.cleanup()

    def __enter__(self) -> "LocalRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
