"""The runner: the loaded model on its device, with Redline's kernels and torch.compile applied once.

- runner.py: Runner, the static-cache path (batch-1 fused decode, prefill, speculative steps) and CompiledStep;
- paged.py: PagedModel, the same model over a paged KV cache (the batching engine's steps and sampling);
- decode_graphs.py / prefill_graphs.py: the paged steps captured as CUDA graphs;
- load.py: a model and its runner from a checkpoint or from random weights, with the start-up log.

Nothing here knows tokenizers, text, requests or pages' owners: the engine (redline.engine) and LLM (generate.py)
sit on top.
"""
from redline.runner.runner import (CompiledStep, HostTokens, Runner, expert_bytes, model_bytes_per_token, sync,
                                   unread_expert_bytes)

__all__ = ["CompiledStep", "HostTokens", "Runner", "expert_bytes", "model_bytes_per_token", "sync",
           "unread_expert_bytes"]
