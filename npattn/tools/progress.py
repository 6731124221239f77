"""What a command says while Numba compiles: one line per kernel that was not in the disk cache.

A kernel compiles on its first call in a process whose disk cache does not hold it for this CPU
(a fresh install, a new CPU, an edited kernel): 1-15 s each, about a minute for everything the
demo uses on 2 cores -- a silence that looks like a hang. The ``npattn`` commands therefore run
inside :func:`compile_progress`, which listens to Numba's ``numba:compile`` event. Numba raises
that event only when it really compiles (a kernel loaded from the disk cache raises none), so a
warm run prints nothing, and a cold one prints, on stderr::

    npattn: compiling the kernels this command needs that are not yet in the disk cache for
      this CPU (znver3), once: 1-15 s each; later runs load them in under a second
      [1] attention[avx2-float32].forward_kernel (float32) ... 11.4 s
      ...
    npattn: 9 kernels compiled in 58.1 s and written to the disk cache

Only the outermost compile of a chain is shown (compiling a parallel kernel compiles the serial
kernels it calls inside it). Library calls never print: the listener is installed by the
commands only, for the time they run.
"""
import sys
import time

import numba
from numba.core import event

from ..kernels import tiles

KIND = "numba:compile"
PREFIX = "npattn.kernels."


def kernel_name(dispatcher):
    """``module.function`` of a compiled function, short for npattn's kernels."""
    func = dispatcher.py_func
    module = func.__module__ or "?"
    return f"{module.removeprefix(PREFIX)}.{func.__qualname__}"


def float_dtypes(signature):
    """The float dtype names of a signature's array arguments, e.g. {"float32"}."""
    return {str(t.dtype) for t in signature
            if isinstance(t, numba.types.Array) and isinstance(t.dtype, numba.types.Float)}


class CompileProgress(event.Listener):
    """A ``numba:compile`` listener writing one line per outermost compile to ``stream``."""

    def __init__(self, stream=None, clock=time.perf_counter):
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock
        self.depth = 0          # compiles in progress (nested: a kernel compiling its callees)
        self.count = 0          # outermost compiles started
        self.seconds = 0.0      # their total time
        self._start = None

    def _say(self, text, end="\n"):
        print(text, end=end, file=self.stream, flush=True)

    def on_start(self, ev):
        self.depth += 1
        if self.depth > 1:
            return
        if self.count == 0:
            cpu = tiles.cpu_name()
            self._say("npattn: compiling the kernels this command needs that are not yet in the "
                      f"disk cache for\n  this CPU ({cpu}), once: 1-15 s each; later runs load "
                      "them in under a second")
        self.count += 1
        data = ev.data
        self._say(f"  [{self.count}] {kernel_name(data['dispatcher'])} "
                  f"({', '.join(sorted(float_dtypes(data['args']))) or 'no float arrays'}) ...",
                  end="")
        self._start = self.clock()

    def on_end(self, ev):
        self.depth -= 1
        if self.depth > 0:
            return
        seconds = self.clock() - self._start
        self.seconds += seconds
        self._say(f" {seconds:.1f} s")     # (a failed compile raises right after this line)

    def summary(self):
        """The closing line, or None when nothing compiled."""
        if self.count == 0:
            return None
        plural = "s" if self.count > 1 else ""
        return (f"npattn: {self.count} kernel{plural} compiled in {self.seconds:.1f} s and "
                "written to the disk cache")


class compile_progress:
    """``with compile_progress(): ...`` reports every kernel compiled inside the block (see the
    module docstring); ``as listener`` gives the :class:`CompileProgress`."""

    def __init__(self, stream=None):
        self.listener = CompileProgress(stream)

    def __enter__(self):
        event.register(KIND, self.listener)
        return self.listener

    def __exit__(self, *exc):
        event.unregister(KIND, self.listener)
        line = self.listener.summary()
        if line is not None:
            self.listener._say(line)
        return False
