"""pipetrain: a pipeline- and tensor-parallel LLM trainer on PyTorch."""
__version__ = "0.1.0"
