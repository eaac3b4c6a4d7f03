"""boomfx: predict iteration time and GPU memory of a PyTorch model from its torch.export graph."""
__version__ = "0.1.0"
