"""The npattn command (the console script and ``python -m npattn``): dispatch to the subcommands,
exit statuses, and ``npattn info``'s report against the facts it claims to report.

Subprocess tests are few: each starts Python and imports Numba (~1-2 s) before doing anything.
"""
import configparser
import importlib
import importlib.metadata
import importlib.util
import io
import os
import pathlib
import platform
import re
import subprocess
import sys
import types

import llvmlite
import llvmlite.binding
import numba
import numpy as np
import pytest

import npattn
import npattn.kernels.softmax
from npattn import _jit
from npattn.tools import cli, info, progress

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python(*args):
    """Run ``python *args`` from the checkout, as a user would; returns the CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=900)


def field(text, label):
    """What follows ``label`` (and spaces) on the report's line that starts with it."""
    match = re.search(rf"^\s*{re.escape(label)}\s+(.*)$", text, re.MULTILINE)
    assert match, f"no line starting with {label!r} in:\n{text}"
    return match.group(1).strip()


# ------------------------------------------------------------------------- the command

def test_python_m_npattn_help_lists_every_command():
    done = python("-m", "npattn", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m npattn")
    for name in cli.COMMANDS:
        assert re.search(rf"^\s+{name}\s+\S", done.stdout, re.MULTILINE), name


def test_python_m_npattn_explain_runs_and_passes():
    done = python("-m", "npattn", "explain")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "Step 6 ·" in done.stdout and "checks agree" in done.stdout
    assert "\n    MISMATCH  " not in done.stdout


def test_info_imports_neither_torch_nor_the_demo():
    code = ("import sys; from npattn.tools.cli import main; status = main(['info']); "
            "print('imported:', 'torch' in sys.modules, 'npattn.tools.demo' in sys.modules); "
            "sys.exit(status)")
    done = python("-c", code)
    assert done.returncode == 0, done.stderr
    assert "imported: False False" in done.stdout
    assert field(done.stdout, "Numba") == numba.__version__


def test_no_command_prints_the_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage:" in out and all(name in out for name in cli.COMMANDS)


@pytest.mark.parametrize("argv", [["bogus"], ["--bogus"], ["--seed", "3"], ["Explain"]])
def test_an_unknown_command_or_option_exits_nonzero(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert "error" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert npattn.__version__ in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_a_command_gets_every_argument_after_its_name(monkeypatch, command):
    calls = []
    stub = types.ModuleType(cli.COMMANDS[command][0])
    stub.main = lambda argv=None: calls.append(argv) or 7     # the lead's demo: no prog=
    monkeypatch.setitem(sys.modules, cli.COMMANDS[command][0], stub)
    argv = ["--steps", "3", "--help", "-x", "--seed=1", "word"]
    assert cli.main([command] + argv) == 7                     # its status is the exit status
    assert calls == [argv]


def test_a_command_that_takes_prog_gets_its_full_name(monkeypatch):
    calls = []
    stub = types.ModuleType("npattn.tools.demo")
    stub.main = lambda argv=None, prog=None: calls.append((argv, prog)) or 0
    monkeypatch.setitem(sys.modules, "npattn.tools.demo", stub)
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/npattn"])
    assert cli.main(["demo"]) == 0
    assert calls == [([], "npattn demo")]


def test_a_missing_command_module_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "npattn.tools.demo", None)      # import fails as if absent
    assert cli.main(["demo"]) == 2
    assert "npattn.tools.demo" in capsys.readouterr().err


# --------------------------------------------------------- what a cold run says while compiling

def _fresh_kernels():
    """(outer, inner): two new njit functions, outer calling inner, in no disk cache."""
    @numba.njit
    def inner(x):
        return x * 2

    @numba.njit
    def outer(x):
        return inner(x) + 1
    return outer, inner


def test_compile_progress_names_each_outermost_compile_once_and_warm_calls_say_nothing():
    outer, _ = _fresh_kernels()
    out = io.StringIO()
    with progress.compile_progress(out) as listener:
        outer(np.ones(3, np.float32))                # compiles outer, and inner inside it
        first = out.getvalue()
        outer(np.ones(3, np.float32))                # compiled: no event, no line
        assert out.getvalue() == first
    text = out.getvalue()
    lines = [line for line in text.splitlines() if re.match(r"\s+\[\d+\]", line)]
    assert len(lines) == 1 and listener.count == 1, text
    assert "outer" in lines[0] and "(float32)" in lines[0], lines
    assert re.search(r"\.\.\. \d+\.\d s$", lines[0]), lines     # its time, on its own line
    assert text.startswith("npattn: compiling")
    assert text.splitlines()[-1].startswith("npattn: 1 kernel compiled in ")


def test_library_calls_never_print_while_compiling(capfd):
    outer, _ = _fresh_kernels()
    outer(np.ones(3, np.float64))                    # outside compile_progress: silent
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def test_a_command_reports_the_kernels_it_compiles(monkeypatch, capsys):
    outer, _ = _fresh_kernels()
    stub = types.ModuleType("npattn.tools.demo")
    stub.main = lambda argv=None: int(outer(np.ones(2, np.float64))[0]) - 3    # 2·1 + 1 - 3
    monkeypatch.setitem(sys.modules, "npattn.tools.demo", stub)
    assert cli.main(["demo"]) == 0
    err = capsys.readouterr().err
    assert "npattn: compiling" in err and "outer" in err and "(float64)" in err, err
    assert cli.main(["demo"]) == 0                   # warm: nothing to say
    assert capsys.readouterr().err == ""


def test_info_counts_the_kernels_cached_for_this_cpu(tmp_path):
    """In an empty cache nothing is cached; after one float32 softmax its kernel is, for this
    CPU, and no float64 kernel is."""
    code = ("import numpy as np, npattn\n"
            "from npattn.tools import info\n"
            "before = info.cached_kernels()\n"
            "npattn.softmax(np.ones((2, 8), np.float32))\n"
            "after = info.cached_kernels()\n"
            "print(before, after)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=600,
                          env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    before, after = (eval(part) for part in re.findall(r"\{[^}]*\}", done.stdout))
    assert all(n == 0 and of > 0 for n, of in before.values()), before
    assert after["float32"][0] == 1 and after["float64"][0] == 0, after
    assert after["float32"][1] == before["float32"][1]


@pytest.mark.parametrize("ok", [True, False])
def test_explain_options_reach_explain(monkeypatch, ok):
    from npattn.tools import explain
    calls = []
    monkeypatch.setattr(explain, "run", lambda *args, **kwargs: calls.append((args, kwargs))
                        or {"ok": ok})
    assert cli.main(["explain", "--dtype", "float64", "--seed", "2"]) == (0 if ok else 1)
    (args, kwargs), = calls
    assert args[:2] == (2, np.float64) and kwargs.get("strict") is False


def test_console_script_is_declared_and_resolves():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = [line.strip() for line in
               config["options.entry_points"]["console_scripts"].strip().splitlines()]
    assert "npattn = npattn.tools.cli:main" in scripts
    target = next(line for line in scripts if line.startswith("npattn ")).split("=", 1)[1]
    module, attr = target.strip().split(":")
    assert getattr(importlib.import_module(module), attr) is cli.main
    main_source = (ROOT / "npattn" / "__main__.py").read_text()
    assert "from .tools.cli import main" in main_source and "SystemExit(main())" in main_source


# ------------------------------------------------------------------------- npattn info

@pytest.fixture(scope="module")
def report():
    """``npattn info``'s facts, and its printed report, from this process."""
    facts = info.collect()
    out = io.StringIO()
    info.report(facts, out)
    return facts, out.getvalue()


def _reported(facts, **sections):
    """The report for ``facts`` with some sections replaced."""
    out = io.StringIO()
    info.report({**facts, **sections}, out)
    return out.getvalue()


def test_info_versions(report):
    _, text = report
    assert field(text, "npattn") == npattn.__version__
    assert field(text, "NumPy").split()[0] == np.__version__
    assert field(text, "Numba") == numba.__version__
    assert field(text, "llvmlite") == llvmlite.__version__
    assert field(text, "Python").split()[0] == platform.python_version()
    assert field(text, "platform") == platform.platform()


def test_info_threads(report):
    facts, text = report
    layer = numba.threading_layer()                  # known now: collect() launched a kernel
    assert field(text, "threading layer").split()[0] == layer == _jit.threading_layer()
    assert f"numba.get_num_threads() = {numba.get_num_threads()} of NUMBA_NUM_THREADS = " \
           f"{numba.config.NUMBA_NUM_THREADS}" in text
    assert "npattn.softmax on a" in text
    assert facts["threads"]["concurrent"] == (layer != "workqueue")


def test_info_slp_line_is_the_setting_in_force(report, monkeypatch):
    facts, text = report
    assert field(text, "SLP vectoriser").split()[0] == ("on" if _jit.slp_enabled() else "off")
    monkeypatch.setattr(numba.config, "SLP_VECTORIZE", 0)     # as NUMBA_SLP_VECTORIZE=0 does
    monkeypatch.setenv("NUMBA_SLP_VECTORIZE", "0")
    text = _reported(facts, settings=info.settings())
    assert field(text, "SLP vectoriser").startswith("off  (NUMBA_SLP_VECTORIZE=0 overrides")
    assert field(text, "cache=True").startswith("off")      # npattn skips the cache then


def test_info_fastmath_and_cache_options(report):
    _, text = report
    dispatcher = npattn.kernels.softmax.softmax_forward_kernel.dispatcher
    assert dispatcher.targetoptions["fastmath"] == _jit.FASTMATH
    flags = "{" + ", ".join(sorted(_jit.FASTMATH)) + "}"
    assert field(text, "fastmath").startswith(flags)
    assert "nnan" not in _jit.FASTMATH and "ninf" not in _jit.FASTMATH
    assert _jit.OPTIONS["cache"] is True
    assert field(text, "cache=True").split()[0] == ("on" if _jit.slp_enabled() else "off")


def test_info_cache_directory_follows_numbas_rule(report):
    _, text = report
    kernels = os.path.dirname(os.path.abspath(npattn.kernels.softmax.__file__))
    directory, chosen = field(text, "directory"), field(text, "chosen by")
    if numba.config.CACHE_DIR:                                  # NUMBA_CACHE_DIR wins
        assert directory.startswith(os.path.join(numba.config.CACHE_DIR, "kernels_"))
        assert os.path.basename(directory) == _jit.cache_key()
        assert "UserProvidedCacheLocator" in chosen
    elif os.access(kernels, os.W_OK):                           # then __pycache__ beside the code
        # (inside it, npattn's key: _jit, "The disk cache")
        assert directory == os.path.join(kernels, "__pycache__", _jit.cache_key())
        assert "InTreeCacheLocator" in chosen
    else:                                                       # then ~/.cache/numba
        assert os.path.basename(os.path.dirname(directory)).startswith("kernels_")
        assert "UserWideCacheLocator" in chosen
    assert field(text, "writable") == ("yes" if os.access(directory, os.W_OK) else "no")


def test_info_cpu(report):
    _, text = report
    assert field(text, "host CPU").split()[0] == llvmlite.binding.get_host_cpu_name()
    features = llvmlite.binding.get_host_cpu_features()
    present = field(text, "SIMD present").split()
    absent = field(text, "SIMD absent").split()
    for name in info.SIMD_FEATURES:
        if name in features:
            assert (name in present) == features[name] and (name in absent) != features[name]
    assert "avx2" not in features or ("avx2" in present) == features["avx2"]


def test_info_openblas_environment(report, monkeypatch):
    facts, text = report
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    text = _reported(facts, environment=info.environment())
    assert "OPENBLAS_CORETYPE=Haswell" in text and "pins OpenBLAS's kernels" in text
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    text = _reported(facts, environment=info.environment())
    assert "OPENBLAS_CORETYPE" in field(text, "unset:")


def test_info_torch_without_importing_it(report):
    facts, text = report
    spec = importlib.util.find_spec("torch")
    assert facts["torch"]["installed"] == (spec is not None)
    if spec is None:
        assert field(text, "PyTorch").startswith("not installed")
    else:
        assert field(text, "PyTorch").split()[0] == importlib.metadata.version("torch")
