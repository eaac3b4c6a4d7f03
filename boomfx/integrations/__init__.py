"""boomfx inside other tools: the FX annotate pass, the torch.compile backend, the pytest plugin."""
