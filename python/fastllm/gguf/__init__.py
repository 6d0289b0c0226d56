"""Running GGUF files: the model's config, tokenizer and weights read from one file."""
