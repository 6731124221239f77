"""npattn's benchmark suite: cases × implementations (npattn, NumPy, PyTorch when importable)."""
