"""Floor 3, bytes on disk: pretrained weights read from safetensors (weight_files.py), checkpoint
folders with their versions, leases and atomic commits (checkpoint_dirs.py), and the adapters between
zeroshard's state and torch.distributed.checkpoint with checksums (checkpoint_files.py)."""
