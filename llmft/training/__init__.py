"""What a training process needs around TRL's SFTTrainer: flags, model files, callbacks, metrics, saving checks."""
