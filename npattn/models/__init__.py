"""Whole models built from ``npattn.nn`` modules and ``npattn.functional`` ops, each with its
backward written out: ``GPT`` (nanoGPT's model, ``npattn/models/gpt.py``).

    >>> import numpy as np
    >>> from npattn.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=4), rng=0)
    >>> logits, loss = model(np.zeros((1, 3), np.int64), targets=np.ones((1, 3), np.int64))
    >>> logits.shape
    (1, 3, 11)
"""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
