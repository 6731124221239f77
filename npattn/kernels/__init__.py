"""Compiled loops: C-contiguous arrays of one float dtype in, results written into outputs the
caller allocated. No checks, no allocation of results, no Python objects. Every ``prange``
iteration owns the outputs it writes and reduces them in a fixed order, so results are bitwise
identical at any thread count."""
