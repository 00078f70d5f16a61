"""Training: the pieces `llmft train` is built from."""
