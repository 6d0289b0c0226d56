"""fastllm.models."""
