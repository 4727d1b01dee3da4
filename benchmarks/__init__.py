"""Benchmarks: decode and batch speed, kernels, prefill, speculative decoding and tensor parallel (bench.py is the
entry point); their JSON results are in results/."""
