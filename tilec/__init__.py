"""tilec: compile PyTorch decode steps to tile instruction streams for one persistent kernel."""
__version__ = "0.1.0"
