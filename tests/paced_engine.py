"""The batching engine, paced for tests that must catch a request while it runs (a client hanging up mid-stream,
a stop button): each step waits `piece_delay_s` first (the core's min_step_s). Everything else is
redline.engine.Engine itself."""
from __future__ import annotations

from redline.engine import Engine


class PacedEngine(Engine):
    @property
    def piece_delay_s(self) -> float:
        return self.core.min_step_s

    @piece_delay_s.setter
    def piece_delay_s(self, seconds: float) -> None:
        self.core.min_step_s = seconds
