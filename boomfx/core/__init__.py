"""The core: the Program, devices, errors, units and layer naming. Imports nothing else of boomfx."""
