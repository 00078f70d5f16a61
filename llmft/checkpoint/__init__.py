"""Reading run directories and ZeRO checkpoints without DeepSpeed, and loading models from them.

Writing one is the training layer's (llmft/training/checkpoint_*.py); docs/development.md, "A checkpoint's life",
follows a checkpoint from its save to its reading."""
