"""llmft: DeepSpeed-centric LLM fine-tuning on Slurm clusters."""

__version__ = "0.1.0"
