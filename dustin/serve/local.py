"""`dustin serve` inside this process: uvicorn on a free port of 127.0.0.1, in a background thread.

Used by `dustin bench serve` (the load generator measures the real HTTP path) and by the live-server tests.
"""
from __future__ import annotations

import threading
import time

from dustin.errors import DustinError
from dustin.serve.app import create_app
from dustin.serve.async_engine import AsyncEngineCore


class LocalServer:
    def __init__(self, engine, name: str, start_timeout_s: float = 30.0) -> None:
        import uvicorn

        self.async_engine = AsyncEngineCore(engine)
        app = create_app(self.async_engine, name)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                self.async_engine.shutdown()
                raise DustinError("the local HTTP server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.async_engine.shutdown()

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
