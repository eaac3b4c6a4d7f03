"""The Report dataclasses and their renderers (text, JSON, Chrome trace, memory_viz snapshot).
Renderers read the Report (and the timeline/replay of the same point) and nothing else."""
