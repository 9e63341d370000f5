"""`python -m zeroshard.cli ...` runs the `zeroshard` command."""
import sys

from .commands import main

sys.exit(main())
