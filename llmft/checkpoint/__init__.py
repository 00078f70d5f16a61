"""Reading run directories and ZeRO checkpoints without DeepSpeed, and loading models from them."""
