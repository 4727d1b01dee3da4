"""Running the server in tests: uvicorn in a background thread on a free loopback port."""
from __future__ import annotations

import threading
import time

import uvicorn


class ServerThread:
    """`with ServerThread(app) as url:` serves `app` on 127.0.0.1 at a free port until the block ends."""

    def __init__(self, app, grace_s: int = 5) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=grace_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-server", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
