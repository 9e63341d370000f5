"""The `zeroshard` command (the console script calls `main`): `commands.py` holds the three commands,
`args.py` the argument types, `model.py` the MODEL and the target, `plan.py` `estimate` and `plan`."""
from .args import bandwidth, rate, size
from .commands import main

__all__ = ["main", "size", "bandwidth", "rate"]
