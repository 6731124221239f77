"""The key of npattn's disk cache (npattn/_jit.py, "The disk cache").

Numba keys a kernel's cache entries on its own source file alone, which would serve two kinds
of wrong code: a kernel that inlined a helper of another file, after that file was edited, and
the kernel of one module instance to another instance of the same file. Each test runs fresh
interpreters over a copy of the package (the edits stay in the copy) with a ``NUMBA_CACHE_DIR``
of its own (the repository's ``__pycache__`` is untouched), and compiles only small kernels.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numba
import pytest

import npattn
from npattn import _jit

PACKAGE = os.path.dirname(os.path.abspath(npattn.__file__))

pytestmark = pytest.mark.skipif(
    not _jit.slp_enabled() or numba.config.DISABLE_JIT,
    reason="no kernel gets the disk cache with the SLP vectoriser off or the JIT disabled")

#: Run first in every child: ``report(name, dispatcher, **more)`` adds a dispatcher's cache
#: statistics to the results, and ``done()`` prints them as the JSON last line of output.
PRELUDE = """
import json, os, sys
import npattn
results = {"package": os.path.dirname(npattn.__file__)}
def report(name, dispatcher, **more):
    stats = dispatcher.stats
    results[name] = dict(path=stats.cache_path, hits=sum(stats.cache_hits.values()),
                         misses=sum(stats.cache_misses.values()), **more)
def done():
    print(json.dumps(results))
"""


@pytest.fixture
def site(tmp_path):
    """A directory holding a copy of the package, without its caches."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "npattn", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def run_child(site, cache, code, *args, **env):
    """Run PRELUDE and ``code`` with ``args`` (and ``env`` added to the environment) in a fresh
    interpreter that imports the copy in ``site`` and caches in ``cache``; returns what it
    reported. (The working directory is ``site``: ``python -c`` puts it first on the path,
    ahead of PYTHONPATH.)"""
    env = {**os.environ, "PYTHONPATH": str(site), "NUMBA_CACHE_DIR": str(cache), **env}
    source = PRELUDE + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", source, *args], cwd=site, capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    results = json.loads(proc.stdout.splitlines()[-1])
    assert results.pop("package") == str(site / "npattn"), "not the copy"
    return results


# --------------------------------------------------------- an edited helper of another file

SOFTMAX = """
import numpy as np
from npattn.kernels.softmax import softmax_forward_kernel
out = npattn.softmax(np.array([[0.0, -2.0]]), dim=-1)
report("softmax", softmax_forward_kernel.dispatcher, out=out.tolist())
done()
"""


def test_an_edited_helper_invalidates_the_cached_kernels_that_inlined_it(site, tmp_path):
    """npattn.softmax in float64: softmax.py's kernel inlines exp.py's exp_nonpositive. With
    exp.py edited and softmax.py not, the cached softmax kernel (the old exp) must not be
    served; with exp.py restored, the first entry is found again."""
    cache = tmp_path / "cache"
    first = run_child(site, cache, SOFTMAX)["softmax"]
    assert (first["misses"], first["hits"]) == (1, 0), first
    assert first["out"][0] == pytest.approx([0.8807970779778823, 0.11920292202211755])

    exp = site / "npattn" / "kernels" / "exp.py"
    original = exp.read_text()
    assert original.count("\nUNDERFLOW = -708.0 ") == 1        # the line this test edits
    exp.write_text(original.replace("\nUNDERFLOW = -708.0 ", "\nUNDERFLOW = -1.0 "))
    edited = run_child(site, cache, SOFTMAX)["softmax"]         # exp(-2) is now 0
    assert edited["out"] == [[1.0, 0.0]], edited
    assert (edited["misses"], edited["hits"]) == (1, 0), edited
    assert edited["path"] != first["path"]

    exp.write_text(original)
    again = run_child(site, cache, SOFTMAX)["softmax"]
    assert (again["misses"], again["hits"]) == (0, 1), again
    assert again["out"] == first["out"] and again["path"] == first["path"]


# ------------------------------------------------------ two module instances of one file

PROBE = '''"""Written by tests/test_cache_key.py: one file, loaded as two module instances whose
SCALE differs (as kernels/tiles.py loads an engine module once per register tile)."""
from .._jit import kernel

SCALE = {"npattn.kernels._probe_instance[x]": 2.0,
         "npattn.kernels._probe_instance[y]": 3.0}[__name__]


@kernel
def scaled(v):
    return v * SCALE
'''

INSTANCES = """
import importlib.util
import npattn.kernels
path = os.path.join(npattn.kernels.__path__[0], "_probe_instance.py")
for tag in sys.argv[1:]:                 # each instance loaded from the file under its own name
    name = f"npattn.kernels._probe_instance[{tag}]"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    report(tag, module.scaled, value=module.scaled(1.0))
done()
"""


def test_two_module_instances_of_one_file_get_separate_cache_entries(site, tmp_path):
    """Same file, qualname, line and signature; different module-level constants. With the
    cache warm for instance x, a process that loads x, then y, must give y its own code (3.0,
    not x's 2.0, which a cache keyed on the file alone serves without a word)."""
    (site / "npattn" / "kernels" / "_probe_instance.py").write_text(PROBE)
    cache = tmp_path / "cache"
    warm = run_child(site, cache, INSTANCES, "x")
    assert warm["x"]["value"] == 2.0 and warm["x"]["misses"] == 1, warm
    both = run_child(site, cache, INSTANCES, "x", "y")
    assert both["x"]["value"] == 2.0, both
    assert (both["x"]["misses"], both["x"]["hits"]) == (0, 1), both
    assert both["y"]["value"] == 3.0, both
    assert (both["y"]["misses"], both["y"]["hits"]) == (1, 0), both


# ------------------------------------------------------------------------- the key itself

def test_the_digest_covers_the_kernel_sources_and_this_policy_and_nothing_else(site):
    package = site / "npattn"
    kernels = package / "kernels"
    seen = {_jit.sources_digest(package)}

    def changes(why):
        digest = _jit.sources_digest(package)
        assert digest not in seen, why
        seen.add(digest)

    def keeps(why):
        assert _jit.sources_digest(package) in seen, why

    exp = kernels / "exp.py"
    exp.write_text(exp.read_text() + "# a comment\n")
    changes("an edited kernel file")
    (kernels / "sub").mkdir()
    (kernels / "sub" / "helper.py").write_text("X = 1\n")
    changes("a file in a subdirectory")
    (kernels / "sub" / "helper.py").rename(kernels / "sub" / "other.py")
    changes("a renamed file, same bytes")
    (package / "_jit.py").write_text((package / "_jit.py").read_text() + "# a comment\n")
    changes("_jit.py: the options every kernel is compiled with")
    (kernels / "__pycache__").mkdir()
    (kernels / "__pycache__" / "cached.py").write_text("X = 1\n")
    (kernels / "notes.txt").write_text("not a source\n")
    (package / "functional" / "softmax.py").write_text("# not a kernel\n")
    keeps("the cache, other files, and sources outside kernels/")


def test_a_kernel_caches_under_the_key_in_files_named_after_its_module():
    from npattn.kernels import softmax
    cache = softmax.softmax_forward_kernel.dispatcher._cache
    assert isinstance(cache, _jit.KeyedCache)
    assert os.path.basename(cache.cache_path) == _jit.cache_key()
    assert _jit.cache_key() == f"npattn-{_jit.sources_digest()}"
    assert cache._impl.filename_base.startswith(
        "npattn.kernels.softmax.softmax_forward_kernel-"), cache._impl.filename_base


def test_locators_named_in_the_environment_are_keyed_too(site, tmp_path):
    """NUMBA_CACHE_LOCATOR_CLASSES replaces Numba's list of locators, ours included: the one
    it picks is keyed all the same. (Nothing is compiled.)"""
    code = """
        from npattn import _jit
        from npattn.kernels.softmax import softmax_forward_kernel
        locator = softmax_forward_kernel.dispatcher._cache._impl.locator
        report("softmax", softmax_forward_kernel.dispatcher, key=_jit.cache_key(),
               locator=type(locator).__name__, keyed=isinstance(locator, _jit._KeyedLocator))
        done()
    """
    cache = tmp_path / "cache"
    got = run_child(site, cache, code,
                    NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator")["softmax"]
    assert got["keyed"] and got["locator"] == "UserProvidedCacheLocator", got
    assert got["path"].startswith(str(cache)) and os.path.basename(got["path"]) == got["key"]
