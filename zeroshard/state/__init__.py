"""Floor 7, training state in and out: checkpoints saved (checkpoint.py) and loaded
(checkpoint_load.py), pretrained weights in and `save_pretrained` out (pretrained.py), and a
checkpoint exported as safetensors (export.py)."""
