"""``python -m benchmarks.native_profile``: samples named function by function.

The names come from gdb's ``info symbol`` answers, in the two forms gdb gives for Numba's code
(demangled, and Itanium-mangled when it cannot demangle an argument type): each answer below is
one this tool got from a running GPT step, shortened in the argument list only. Planted once:
undoing every ``_xx`` escape (not only those of the module's brackets and dash) turned
``gelu.normal_forward_block_f32`` into ``gelu.normal_forward_blockó2`` (as a first version
printed) and failed ``test_a_kernel_name_keeps_its_own_underscores`` and, through
``attention_backward_kernel``'s ``_ba``, ``test_kernel_names_are_module_and_function``. The
whole tool runs on the machine's perf and gdb when both are there (the child's workload is
gpt_profile's --quick step); without them it must stop with a message naming what is missing.
"""
import re
import shutil
import subprocess

import pytest

from benchmarks import native_profile
from benchmarks.native_profile import category, function_name, tally

SECTION = " in section .ltext of <in-memory@0x55e01848ac20>"
DEMANGLED = ("npattn::kernels::attention_5bavx512_2dfloat32_5d::finish_rows[abi:v42][abi:c8tJTIeF]"
             "(Array<float, 2, C, mutable, aligned>, long long) + 2912" + SECTION)
MANGLED = ("_ZN6npattn7kernels31attention_5bavx512_2dfloat32_5d25attention_backward_kernel"
           "B3v79B156c8tJTC_2fWQAliW1xhDEoY6EEMEUx419Inputs_28array_29 + 8691" + SECTION)
WRAPPER = "_ZN7cpython" + MANGLED[3:]
PARFOR = ("__gufunc__._ZN13_3cdynamic_3e36__numba_parfor_gufunc_0x7fbb652a9f10B3v76B42c8tJTC"
          "E5ArrayIxLi1E1C7mutable7alignedE + 40" + SECTION)
JIT = "/tmp/perf-30404.map"
GOMP = "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"


def test_kernel_names_are_module_and_function():
    assert function_name(DEMANGLED) == "attention.finish_rows"
    assert function_name(MANGLED) == "attention.attention_backward_kernel"
    assert function_name(WRAPPER) == "attention.attention_backward_kernel"


def test_a_kernel_name_keeps_its_own_underscores():
    answer = ("npattn::kernels::gelu::normal_forward_block_f32[abi:v80](Array<float, 1, C, "
              "mutable, aligned>) + 5" + SECTION)
    assert function_name(answer) == "gelu.normal_forward_block_f32"
    mangled = "_ZN6npattn7kernels4gelu25normal_backward_block_f32B3v80E + 1" + SECTION
    assert function_name(mangled) == "gelu.normal_backward_block_f32"


def test_other_symbols_keep_their_names_and_none_is_none():
    assert function_name("NRT_incref + 9" + SECTION) == "NRT_incref"
    assert function_name(PARFOR).startswith("parallel loop body")
    assert function_name("No symbol matches 0x7f7579d6c622.") is None
    assert function_name("_ZN5numba2np8arrayobj7getitemB2v1E + 3" + SECTION) == \
        "numba: numba.np.arrayobj.getitem"


def test_categories():
    assert category("gemm.block_product", JIT) == "npattn kernels"
    assert category("NRT_decref", JIT) == "Numba's reference counting"
    assert category("parallel loop body (a prange kernel's own loop)", JIT) == \
        "Numba's parallel launch"
    assert category("unnamed code in libgomp.so.1.0.0", GOMP).startswith("OpenMP runtime")
    assert category("_PyEval_EvalFrameDefault", "/usr/lib/libpython3.11.so.1.0") == \
        "Python interpreter"
    assert category("clear_page_erms", "[kernel.kallsyms]").startswith("operating system")
    assert category("numba: numba.np.arrayobj.getitem", JIT) == "Numba's own helpers"


def test_tally_counts_every_sample_once():
    samples = ([("a1", "[unknown]", JIT)] * 6 + [("a2", "[unknown]", JIT)] * 2
               + [("g1", "[unknown]", GOMP)] * 3 + [("p1", "_PyEval_EvalFrameDefault",
                                                      "/usr/lib/libpython3.11.so.1.0")])
    names = {"a1": "gemm.block_product", "a2": "gemm.block_product", "g1": None}
    rows, total = tally(samples, names)
    assert total == 12
    assert rows[0] == (8 / 12, "gemm.block_product", "npattn kernels")
    assert (3 / 12, "unnamed code in libgomp.so.1.0.0",
            "OpenMP runtime (threads waiting or meeting)") in rows
    assert sum(share for share, _, _ in rows) == pytest.approx(1.0)


def _perf_works():
    if shutil.which("perf") is None or shutil.which("gdb") is None:
        return False
    probe = subprocess.run(["perf", "record", "-q", "-o", "/dev/null", "--", "true"],
                           capture_output=True)
    return probe.returncode == 0


def test_the_whole_tool_names_the_gemm_kernel_or_says_what_is_missing(capsys, monkeypatch):
    if not _perf_works():        # this machine cannot sample: the tool must say why and stop
        monkeypatch.setattr(shutil, "which", lambda tool: None)
        with pytest.raises(SystemExit, match="needs perf and gdb"):
            native_profile.main(["--quick", "--seconds", "1"])
        return
    native_profile.main(["--quick", "--seconds", "2", "--top", "1000"])
    out = capsys.readouterr().out
    kernels = re.findall(r"^\| (\w+)\.(\w+) \| npattn kernels \|", out, re.M)
    assert {"gemm", "attention", "layer_norm"} <= {module for module, _ in kernels}, out
    assert "| npattn kernels |" in out.split("| function |")[0]
