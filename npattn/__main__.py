"""``python -m npattn``: the ``npattn`` command (demo, explain, info, warmup); see npattn.tools.cli."""
from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
