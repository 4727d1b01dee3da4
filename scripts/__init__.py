"""Command-line tools: download, convert (HF, GGUF), the demo model, perplexity, trace summaries, check_targets."""
