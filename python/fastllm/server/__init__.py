"""fastllm.server."""
