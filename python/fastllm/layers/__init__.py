"""fastllm.layers."""
