"""Files on disk: cache locations, atomic writes and checkpoints."""
