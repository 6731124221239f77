"""``python -m benchmarks``: the speed suite (see ``benchmarks/run.py``)."""
import sys

from .run import main

sys.exit(main())
