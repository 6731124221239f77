"""The ``npattn`` command and its subcommands: the tools built on the library, not part of it.

``cli`` dispatches ``npattn <command>`` (and ``python -m npattn``); ``demo`` is the main job
(trains a small attention model), ``explain`` runs the seed article's walkthrough on the
kernels, ``info`` reports what npattn runs on, ``warmup`` compiles every kernel ahead of time.
Nothing in the library imports from here; ``tests/test_layering.py`` holds that rule.
"""
