"""Building the csrc/ kernels (cpu_adam.cpp, exact_adam.cpp) with torch's extension builder, on
first use: compiled once per machine and cached by torch (a changed source or flag builds again).

A kernel that cannot be built (no compiler, no headers, ...) is not an error: each has a torch
path with the same results or rounding-close ones, so the caller falls back to it, and the reason
is logged once as a warning.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("zeroshard")

CSRC = os.path.join(os.path.dirname(__file__), "csrc")


def build(name: str, source: str, cflags: list[str], what: str, fallback: str, python_module: bool = True):
    """csrc/`source` built as extension `name` with `cflags` and OpenMP linked (at::parallel_for is
    an inline OpenMP region; the process has torch's libgomp already, so no second runtime comes
    in): the Python module (or, `python_module` False, True once its TORCH_LIBRARY ops are
    registered), or None where it cannot be built, logged as "`what` unavailable (the error);
    `fallback`"."""
    try:
        from torch.utils.cpp_extension import load
        out = load(name, [os.path.join(CSRC, source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                   is_python_module=python_module)
        return out if python_module else True
    except Exception as e:  # no compiler, no headers, ...: the caller's torch path is used
        log.warning("%s unavailable (%s: %s); %s", what, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                    fallback)
        return None
