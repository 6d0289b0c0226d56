"""fastllm.engine."""
