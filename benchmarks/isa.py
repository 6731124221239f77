"""The instruction set a benchmark compiles for: this CPU's own, or AVX2 only.

``--isa avx2`` (``python -m benchmarks`` and ``python -m benchmarks.micro_kernel``) runs every
implementation as it would run on an AVX2-only CPU (AMD Zen 2/3, most Intel client parts),
on this CPU's cores: Numba compiles for a Haswell-class target with AVX-512 off (so npattn
picks its ``avx2`` tiles by itself), OpenBLAS takes its ``Haswell`` kernel, and PyTorch's own
kernels, MKL and oneDNN are capped at AVX2. The execution units stay this CPU's -- on AMD's
Zen 4 two 256-bit FMA pipes per core, as on Zen 3 -- and so do its caches and clock: a proxy for
an AVX2 machine, not one. No module is imported here: the suite reads this before NumPy loads.
"""

#: Numba's target for AVX2 code: Haswell's features, AVX-512 off.
AVX2_FEATURES = ("+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+popcnt,+sse4.2,+sse4.1,+ssse3,"
                 "+sse3,+sse2,+sse,+cx16,+movbe,+xsave,+aes,+pclmul,"
                 "-avx512f,-avx512vl,-avx512bw,-avx512dq,-avx512cd")

#: The environment of ``--isa avx2``, for every implementation, and why each variable is set.
AVX2_ENV = {
    "NUMBA_CPU_NAME": ("haswell", "Numba (npattn) compiles AVX2 code: npattn's avx2 tiles"),
    "NUMBA_CPU_FEATURES": (AVX2_FEATURES, "with AVX-512 off"),
    "OPENBLAS_CORETYPE": ("Haswell", "OpenBLAS (NumPy) runs its AVX2 kernel"),
    "ATEN_CPU_CAPABILITY": ("avx2", "PyTorch's own vectorised kernels use AVX2"),
    "MKL_ENABLE_INSTRUCTIONS": ("AVX2", "MKL (PyTorch's matrix products) stops at AVX2"),
    "ONEDNN_MAX_CPU_ISA": ("AVX2", "oneDNN (PyTorch) stops at AVX2"),
}
ISAS = ("native", "avx2")
