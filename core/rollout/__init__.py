"""Rollout: the engines that generate, the batching and KV cache behind them, the
workflows and rewards that turn prompts into scored records, and the data they read."""
