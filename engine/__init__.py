"""Continuous batching of distinct requests over a paged KV cache (see engine.py)."""
from redline.engine.engine import Engine, EngineFull, EngineStats, RequestHandle, RequestOutput

__all__ = ["Engine", "EngineFull", "EngineStats", "RequestHandle", "RequestOutput"]
