"""The batching engine, paced for tests that must catch a request while it runs (a client hanging up mid-stream,
a stop button): each step waits `piece_delay_s` first. Everything else is redline.engine.Engine itself."""
from __future__ import annotations

import time

from redline.engine import Engine


class PacedEngine(Engine):
    piece_delay_s = 0.0

    def _step(self) -> None:
        if self.piece_delay_s:
            time.sleep(self.piece_delay_s)
        super()._step()
