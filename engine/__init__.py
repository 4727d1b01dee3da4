"""The batching engine: a core that batches token-id requests over the runner's paged model (core.py, in this
process or its own: process.py), and the front end that turns its outputs into text (client.py)."""
from redline.engine.client import Engine, EngineClient
from redline.engine.core import EngineCore, EngineSettings
from redline.engine.requests import EngineFull, EngineStats, RequestHandle, RequestOutput

__all__ = ["Engine", "EngineClient", "EngineCore", "EngineFull", "EngineSettings", "EngineStats", "RequestHandle",
           "RequestOutput"]
