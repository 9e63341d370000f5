"""Floor 8, what a run reports: per-step statistics and model-state bytes (stats.py) and the memory
timeline (timeline.py)."""
