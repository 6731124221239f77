"""Every Numba option npattn uses, and the threading policy. Nothing else calls ``njit``.

Options
-------
``cache=True``           compiled kernels are written to disk (next to the module, or to the
                         user cache directory when the install is read-only) and reloaded,
                         under a key of npattn's own (see "The disk cache" below).
                         Where neither directory is writable, Numba would raise at import
                         ("no locator available"); npattn compiles without the disk cache
                         there instead (see :func:`_jit`): slower first calls, same results.
``nogil=True``           a kernel releases the GIL: other Python threads run meanwhile.
``error_model="numpy"``  division by zero gives inf/NaN as in NumPy instead of raising.
``fastmath=FASTMATH``    only ``contract`` (fused multiply-add) and ``reassoc`` (LLVM may
                         vectorise a reduction into partial sums, in an order fixed at compile
                         time, so results do not depend on the thread count). Never ``nnan`` or
                         ``ninf``: attention masks are -inf and NaN must propagate. Not ``arcp``,
                         ``nsz`` or ``afn`` either: together with ``reassoc`` they made a kernel
                         compiled in this process and the same kernel loaded from Numba's disk
                         cache give different bits (measured: log_softmax rows, 1 ulp) -- and
                         the same inputs must give the same outputs.
``pipeline_class=FullWidthCompiler``  every function carries ``"prefer-vector-width"="512"``
                         (see "Vector width" below).

The disk cache
--------------
Numba keys a kernel's cache entries on its source file: an index file named after the file,
the function and its line holds one entry per signature and CPU, and is valid while that one
file's contents are unchanged. That would serve wrong code twice over:

* A kernel has the serial kernels it calls compiled into it, from other files too (the exp of
  ``kernels/exp.py`` is in softmax's and attention's kernels). Edit the helper, and the cached
  kernels of the files not edited would still be served, with the old helper inside.
* One file may be loaded as several module instances: ``kernels/tiles.py`` loads ``gemm.py``
  once per register tile, as ``npattn.kernels.gemm[avx2-float32]`` and so on, each with its own
  MR and NR. Their kernels have the same file, name, line and signatures, so Numba would serve
  one instance's code to the others.

So every kernel gets a :class:`KeyedCache`, Numba's cache with two changes. Its directory is
the one Numba picks (``NUMBA_CACHE_DIR``, else ``__pycache__`` next to the module, else the
user cache directory) plus ``npattn-<digest>``, a digest of every source file under
``kernels/`` and of this one, whose options are compiled in too (:func:`sources_digest`, taken
in about a millisecond when the first kernel is decorated, once per process). An edit to any of
them moves every kernel to a new directory: coarse -- it recompiles them all -- but never
stale. And its file names start with the module's name where Numba puts the file's
(``npattn.kernels.gemm%5Bavx2-float32%5D.gemm_kernel-…`` for ``gemm.gemm_kernel-…``).
The directories of earlier sources are left behind (back to those sources, a process finds
its kernels there again); delete them when you like, ``rm -r npattn/kernels/__pycache__/npattn-*``
say: whatever is missing is compiled again.

The SLP vectoriser
------------------
LLVM's SLP (superword-level parallelism) vectoriser fuses rows of scalar operations into SIMD
instructions. Numba leaves it off by default; the lane maxima of softmax and attention keep
their running maxima in named scalars and are several times slower without it (the register
tiles are explicit vectors: kernels/vector_tile.py). So importing npattn turns it on for the process
(``numba.config.SLP_VECTORIZE = 1``) unless the environment says otherwise with
``NUMBA_SLP_VECTORIZE``. The setting is process-wide: Numba functions of your own compiled
afterwards get it too (it changes speed, not results beyond reassociation you allowed).

Numba's disk cache does not key on the setting, so a kernel compiled without SLP could later be
served, slow, to a process that has it. npattn guards the cache both ways: while SLP is off,
kernels are compiled without the cache (:class:`ThreadSafeKernel` keeps an uncached twin), so
an entry in the cache was always compiled with SLP.

Vector width
------------
LLVM's tuning for Intel's AVX-512 cores (``skylake-avx512`` … ``graniterapids``, ``x86-64-v4``;
AMD's Zen 4 and 5 do not have it) sets ``prefer-256-bit``: the loop and SLP vectorisers then
build 256-bit (ymm) vectors, half of what the CPU has. LLVM reads a function attribute first,
``"prefer-vector-width"="512"``, so every function of npattn's kernels carries it: the kernels
compile through :class:`FullWidthCompiler` (``pipeline_class`` in :data:`OPTIONS`), Numba's
compiler with one change -- its target context adds the attribute to each function it lowers
(``post_lowering``), the ``prange`` bodies Numba compiles apart included (they are lowered in a
copy of the same context). On a CPU without AVX-512 the attribute changes nothing (LLVM takes
the narrower of it and the registers); on AMD's it is already the default. It is part of the
compiled code, so the disk cache stays correct; the process's other Numba functions are not
touched. Measured on an Intel Xeon (Emerald Rapids, ``emeraldrapids``), the baby GPT's step
against PyTorch's in the same run: 0.85–0.89× with ymm loops, 0.92–0.95× with zmm (the GEMM's
packing and small products, GELU, layer norm and the embedding gained; attention and
cross-entropy did not move; docs/architecture.md §9.6).

llvmlite's IR builder takes only the attributes it knows (``FunctionAttributes.add`` refuses
this one), so it is added to the function's attribute set directly: llvmlite internals. If a
version of llvmlite or Numba no longer allows it, :data:`FULL_WIDTH` says why, the kernels
compile without it (narrower on Intel, the same results elsewhere) under a cache key of their
own, and ``npattn info`` says so.

Threading policy
----------------
Numba runs ``prange`` loops on one of three threading layers, picked at the first parallel
launch in the order tbb, omp, workqueue (or as ``NUMBA_THREADING_LAYER`` says). ``tbb`` and
``omp`` accept launches from several Python threads at once; ``workqueue`` (the fallback when
neither TBB nor an OpenMP runtime is found) aborts the whole process with "Concurrent access
has been detected". npattn is a library that other programs call from their own threads, so we
neither force a layer (that is the application's choice, and forcing ``tbb`` fails where it is
not installed) nor accept the abort: every parallel kernel is called through
:class:`ThreadSafeKernel`, which serialises launches under one lock while the layer is
``workqueue`` -- or not yet known, before the first launch -- and calls straight through
otherwise. Serialising costs nothing on one thread; with ``workqueue`` the kernels already use
all cores, so concurrent callers lose little. Note that GNU OpenMP (``omp``) is not fork-safe:
fork a child before the first parallel call, or use the ``spawn`` start method.
"""
import functools
import hashlib
import os
import threading
import urllib.parse

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import caching, compiler
from numba.extending import intrinsic

try:        # Numba's own C fingerprint of argument types (private API: else _arg_key alone)
    from numba._dispatcher import compute_fingerprint
except ImportError:                                         # pragma: no cover
    compute_fingerprint = None

try:        # the thread pool's own count, without get_num_threads' two locks (private API)
    from numba.np.ufunc import parallel as _parallel
except ImportError:                                         # pragma: no cover
    _parallel = None


def thread_count():
    """``numba.get_num_threads()`` (the calling thread's count: set_num_threads is per
    thread), at an eighth of its cost once the pool is up: 0.3 against 2.1 µs on Zen 3, paid by
    every packed matrix product. Before the pool starts (the function it reads is bound at the
    launch), or if Numba's internals moved, it is get_num_threads itself."""
    pool_count = getattr(_parallel, "_get_num_threads", None)
    if pool_count is not None and getattr(_parallel, "_is_initialized", False):
        count = pool_count()
        if count > 0:
            return count
    return numba.get_num_threads()


if "NUMBA_SLP_VECTORIZE" not in os.environ:
    numba.config.SLP_VECTORIZE = 1

#: The function attribute that lifts LLVM's 256-bit preference (see "Vector width" above).
WIDTH_ATTRIBUTE = '"prefer-vector-width"="512"'


def _add_width_attribute(function):
    set.add(function.attributes, WIDTH_ATTRIBUTE)   # past FunctionAttributes.add's list


def _full_width_status():
    """None if functions can carry :data:`WIDTH_ATTRIBUTE` here, else why not: checked on a
    function built and parsed now (llvmlite prints it, LLVM reads it back)."""
    try:
        module = ir.Module("npattn_width_probe")
        function = ir.Function(module, ir.FunctionType(ir.VoidType(), []), "probe")
        _add_width_attribute(function)
        ir.IRBuilder(function.append_basic_block()).ret_void()
        text = str(module)
        if WIDTH_ATTRIBUTE not in text:
            return "llvmlite does not print the attribute"
        llvm.parse_assembly(text).verify()
    except Exception as error:                       # any change in llvmlite's internals
        return f"{type(error).__name__}: {error}"
    return None


#: None when every kernel function carries WIDTH_ATTRIBUTE; else the reason it cannot.
FULL_WIDTH = _full_width_status()

_wide_contexts = {}


def _wide_context_class(base):
    """``base`` (Numba's CPU target context class) whose ``post_lowering`` also gives every
    function defined in the lowered module :data:`WIDTH_ATTRIBUTE`."""
    wide = _wide_contexts.get(base)
    if wide is None:
        def post_lowering(self, module, library):
            base.post_lowering(self, module, library)
            for function in module.functions:
                if not function.is_declaration:
                    _add_width_attribute(function)
        wide = _wide_contexts[base] = type(f"FullWidth{base.__name__}", (base,),
                                           {"post_lowering": post_lowering,
                                            "__module__": __name__})
    return wide


class FullWidthCompiler(compiler.Compiler):
    """Numba's compiler for npattn's kernels: the target context it lowers in (a copy Numba
    makes for each compilation: ``_make_subtarget``) is given :func:`_wide_context_class`, so
    the functions it lowers -- the ``prange`` bodies too, compiled in a copy of this context --
    carry :data:`WIDTH_ATTRIBUTE`. Without :data:`FULL_WIDTH` it is Numba's compiler."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        context = getattr(self.state, "targetctx", None)
        if FULL_WIDTH is None and hasattr(context, "post_lowering"):
            context.__class__ = _wide_context_class(type(context))


FASTMATH = {"contract", "reassoc"}
OPTIONS = dict(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy",
               pipeline_class=FullWidthCompiler)


PACKAGE = os.path.dirname(os.path.abspath(__file__))


def sources_digest(package=PACKAGE):
    """16 hex digits of the SHA-256 of the sources compiled into the kernels: every ``*.py``
    under ``package``'s ``kernels/``, recursively, and its ``_jit.py``. Each file counts with
    its path relative to ``package``, in the order of those paths, so that a renamed or moved
    file changes the digest too."""
    paths = [os.path.join(package, "_jit.py")]
    for directory, subdirectories, names in os.walk(os.path.join(package, "kernels")):
        subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]  # (the cache)
        paths += [os.path.join(directory, name) for name in names if name.endswith(".py")]
    digest = hashlib.sha256()
    for relative, path in sorted((os.path.relpath(p, package).replace(os.sep, "/"), p)
                                 for p in paths):
        with open(path, "rb") as source:
            data = source.read()
        # the path ends at a NUL (no path has one) and the contents are counted: the bytes
        # hashed split back into files one way only
        digest.update(b"%s\0%d\0" % (relative.encode(), len(data)))
        digest.update(data)
    return digest.hexdigest()[:16]


@functools.cache
def cache_key():
    """The directory npattn's kernels cache in, inside the one Numba picks for them:
    ``npattn-`` and :func:`sources_digest`, computed when the first kernel is decorated, and
    ``-narrow`` where the kernels compile without :data:`WIDTH_ATTRIBUTE` (:data:`FULL_WIDTH`)."""
    return f"npattn-{sources_digest()}" + ("" if FULL_WIDTH is None else "-narrow")


class _KeyedLocator:
    """Mixed into a cache locator of Numba's (:func:`_keyed`): its directory, plus
    :func:`cache_key`. Numba asks the locator where to read, to write and to create the
    directory (``ensure_cache_path``), so all three agree."""

    def get_cache_path(self):
        return os.path.join(super().get_cache_path(), cache_key())


@functools.cache
def _keyed(locator_class):
    """``locator_class`` with :class:`_KeyedLocator` mixed in, under the same name (it picks
    the directory as Numba's does, so ``npattn info`` names it as Numba's)."""
    return type(locator_class.__name__, (_KeyedLocator, locator_class), {"__module__": __name__})


class _KeyedCacheImpl(caching.CompileResultCacheImpl):
    """What :class:`KeyedCache` changes in Numba's: the locators and the file names."""

    # tried in Numba's order, the first whose directory is writable wins
    _locator_classes = [_keyed(c) for c in caching.CompileResultCacheImpl._locator_classes]

    suffix = ""   # after the function's name: the serial twin's files are apart

    def __init__(self, py_func):
        # Numba starts the file names with the source file's name ("gemm.gemm_kernel-57...");
        # the module's instead, %-escaped: a file name's characters, and no two names alike
        module = urllib.parse.quote(str(py_func.__module__), safe="")
        self._fullname = f"{module}.{py_func.__qualname__}{self.suffix}"
        super().__init__(py_func)
        if not isinstance(self.locator, _KeyedLocator):
            # NUMBA_CACHE_LOCATOR_CLASSES replaced the list above: key Numba's choice too
            self._locator.__class__ = _keyed(type(self._locator))
            try:
                self._locator.ensure_cache_path()
            except OSError as error:            # as if no locator were available
                raise RuntimeError(f"cannot cache {py_func.__qualname__}: "
                                   f"{self._locator.get_cache_path()} is not writable") from error

    def get_filename_base(self, fullname, abiflags):
        return super().get_filename_base(self._fullname, abiflags)


class KeyedCache(caching.FunctionCache):
    """Numba's disk cache of one kernel, keyed on the kernels' sources and on the kernel's
    module instance (see "The disk cache" in the module docstring)."""

    _impl_class = _KeyedCacheImpl


class _SerialCacheImpl(_KeyedCacheImpl):
    suffix = ".serial"


class SerialKeyedCache(KeyedCache):
    """The cache of a parallel kernel's serial twin (:meth:`ThreadSafeKernel.serial`): files of
    its own, since Numba's names would be the parallel kernel's (same function, same line)."""

    _impl_class = _SerialCacheImpl


def _jit(options, cache_class=KeyedCache):
    """``njit(**options)`` as a decorator, with npattn's disk cache (:class:`KeyedCache`) for
    Numba's, and except that a function no cache directory can hold compiles without the disk
    cache instead of failing.

    Numba looks for a writable directory when the decorator runs (at import): ``__pycache__``
    next to the module, then the user cache directory (``~/.cache/numba``); with neither (a
    read-only install run by a user without a writable home) ``njit(cache=True)`` raises
    RuntimeError and the import fails. Here the dispatcher is built without the cache and its
    cache installed afterwards, where it can be, as Numba's decorator does
    (``enable_caching``) -- but a KeyedCache, not Numba's FunctionCache.

    With the SLP vectoriser off when npattn is imported (``NUMBA_SLP_VECTORIZE=0``) no kernel
    gets the cache: a serial kernel compiled then -- the micro-kernel, say, compiled with the
    parallel kernel that calls it -- would otherwise be written to the cache and linked, slow,
    into kernels compiled later by processes that have SLP.
    """
    options = dict(options)
    cache = options.pop("cache", False)

    def decorate(func):
        if numba.config.DISABLE_JIT:
            return _plain(func)
        dispatcher = njit(**options)(func)
        if cache and slp_enabled() and hasattr(dispatcher, "enable_caching"):   # (not under NUMBA_DISABLE_JIT)
            try:
                dispatcher._cache = cache_class(dispatcher.py_func)
            except RuntimeError:      # no locator: no writable cache directory for this file
                pass                  # the dispatcher keeps its NullCache: compiled per process
        return dispatcher
    return decorate


def _plain(func):
    """A kernel under ``NUMBA_DISABLE_JIT=1``: the Python function, run with NumPy's warnings
    off, as the compiled kernel runs (``error_model="numpy"``: 1/0 is inf without a word; uint64
    arithmetic wraps, as the random streams of kernels/random.py mean it to). A breakpoint in
    ``func`` stops there; ``py_func`` is ``func``, as on a dispatcher."""
    @functools.wraps(func)
    def plain(*args):
        with np.errstate(all="ignore"):
            return func(*args)
    plain.py_func = func
    return plain


#: For ``numba.extending.overload``: a kernel whose form is picked by its argument types when
#: the caller compiles (kernels/exp.py). Its body only calls other kernels.
OVERLOAD_OPTIONS = {"nogil": True, "error_model": "numpy"}

#: A serial kernel; may also be called from other kernels.
kernel = _jit(OPTIONS)

#: Fused multiply-add and nothing else, for kernels whose order of operations is the point:
#: the polynomials of ``kernels/exp.py`` and ``kernels/tanh.py`` (with ``reassoc`` LLVM may
#: rewrite an order that was chosen: docs/architecture.md, section 9.2).
fma_kernel = _jit({**OPTIONS, "fastmath": {"contract"}})

#: IEEE arithmetic as written: no fused multiply-add, no reassociation. For element-wise code
#: whose copies must agree bit for bit however LLVM optimises each one (Adam's update). A
#: serial kernel that a kernel calls is compiled twice: on its own, and again inside the
#: caller's library, where LLVM optimises it once more; which copy runs depends on whether the
#: standalone one was in the process first (compiled here: yes; loaded from the disk cache: no).
#: With ``contract`` the two copies may fuse different multiply-adds (measured: Adam's
#: ``v·β2 + (1-β2)·g·g``), so results would depend on compiled-here versus cached.
exact_kernel = _jit({**OPTIONS, "fastmath": False})

_launch_lock = threading.Lock()
_layer_is_concurrent = None  # None until the first parallel launch tells us the layer


def _launches_may_overlap():
    """True once we know the threading layer accepts concurrent launches."""
    global _layer_is_concurrent
    if _layer_is_concurrent is None:
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel launch yet: the layer is not chosen
            return False
        _layer_is_concurrent = layer != "workqueue"
    return _layer_is_concurrent


def slp_enabled():
    """Whether kernels compiled now get LLVM's SLP vectoriser (see the module docstring)."""
    return bool(numba.config.SLP_VECTORIZE)


class ThreadSafeKernel:
    """A parallel Numba dispatcher, called under a lock when the threading layer needs one,
    and compiled without the disk cache while the SLP vectoriser is off.

    Attribute access (``signatures``, ``py_func``, ``compile``...) goes to the cached dispatcher.
    """

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._uncached = None
        self._serial = None
        self.twin = False          # declared with parallel_kernel(twin=True): .serial allowed
        # under NUMBA_DISABLE_JIT njit returns the Python function itself: it is its own py_func
        self.py_func = getattr(dispatcher, "py_func", dispatcher)
        functools.update_wrapper(self, self.py_func)

    def _target(self):
        if slp_enabled():
            return self.dispatcher
        if self._uncached is None:
            self._uncached = njit(parallel=True, **{**OPTIONS, "cache": False})(self.py_func)
        return self._uncached

    @property
    def serial_signatures(self):
        """The signatures the serial twin has compiled (or loaded) in this process."""
        return [] if self._serial is None else list(self._serial.signatures)

    def serial(self, *args):
        """The kernel's serial twin: the same source compiled without ``parallel``, its
        ``prange`` loops plain loops on the calling thread. For work too small to pay for a
        launch of the thread pool (2-3 µs: more than a decoded token's layer norm takes).
        Callers choose it by the shapes; tests/test_jit.py checks that twin and kernel give
        the same bits for the twins in use, so the choice never shows in a result.

        After the first call the twin is this instance's ``serial`` attribute itself, so later
        calls go straight to its dispatcher (a decoded token makes dozens of such calls).
        :class:`ItemKernel` overrides this method and keeps it."""
        twin = self._serial_twin()
        self.serial = twin                      # shadows this method from now on
        return twin(*args)

    def _serial_twin(self):
        if self._serial is None:
            if not self.twin:
                raise TypeError(f"{self.__name__} has no serial twin: declare it with "
                                f"@parallel_kernel(twin=True)")
            if slp_enabled():
                self._serial = _jit(OPTIONS, SerialKeyedCache)(self.py_func)
            else:                               # (see _target)
                self._serial = njit(**{**OPTIONS, "cache": False})(self.py_func)
        return self._serial

    def __call__(self, *args):
        target = self._target()
        if _launches_may_overlap():
            return target(*args)
        with _launch_lock:
            return target(*args)

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)

    def __repr__(self):
        return f"<npattn parallel kernel {self.__name__}>"


def parallel_kernel(func=None, *, twin=False):
    """A ``prange`` kernel, compiled lazily on its first call and safe to call from any thread.
    ``@parallel_kernel(twin=True)``: callers may also run its serial twin (``.serial``), which
    ``npattn warmup`` then compiles too."""
    if func is None:
        return functools.partial(parallel_kernel, twin=twin)
    wrapped = ThreadSafeKernel(_jit({**OPTIONS, "parallel": True})(func))
    wrapped.twin = twin
    return wrapped


def _arg_key(value):
    """What decides the Numba type of a kernel argument, cheaply: for an array (or NumPy
    scalar) its dtype, rank, layout, writability and alignment; for a tuple (a record of
    kernel state, a namedtuple) its class and the key of each field, recursively -- the class
    alone would serve code compiled for other field types (measured: an int64 body reading a
    float64 field's bits); else its Python type. (An int past int64, whose type would differ,
    is refused by Numba's dispatcher anyway.)"""
    flags = getattr(value, "flags", None)
    if flags is None:
        if isinstance(value, tuple):
            return (type(value),) + tuple(map(_arg_key, value))
        return type(value)
    return (type(value), value.dtype, value.ndim, flags.c_contiguous, flags.f_contiguous,
            flags.writeable, flags.aligned)


@intrinsic
def _call_at(typingctx, address, args):
    """Numba's side of :func:`call_body`: a C call through ``address`` with the items of the
    tuple ``args``, the way Numba calls a first-class function value whose code it did not
    link (the body's C wrapper, ``void(*args)``)."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None

    def codegen(context, builder, signature, values):
        prototype = types.FunctionType(types.void(*args.types)).ftype
        pointer = builder.inttoptr(values[0], context.get_value_type(prototype))
        builder.call(pointer, [builder.extract_value(values[1], i)
                               for i in range(len(args.types))])
        return context.get_dummy_value()
    return types.void(address, args), codegen


def call_body(body, args):
    """Inside a :func:`parallel_items` loop: run the work item ``body`` (the int64 address the
    loop was given for it) on the tuple ``args`` -- ``call_body(item, (np.int64(w), q, k))``.
    Under ``NUMBA_DISABLE_JIT`` ``body`` is the item's Python function, called as such."""
    body(*args)


if not numba.config.DISABLE_JIT:
    call_body = _call_at        # noqa: F811  (compiled code calls the intrinsic)


class ItemKernel(ThreadSafeKernel):
    """A parallel loop over work items whose bodies are serial kernels compiled apart and
    called through their addresses; called as ``kernel(*args)`` (the addresses are put first).

    Why: Numba links the code of every serial kernel a kernel calls into the caller's library
    and runs LLVM's whole O3 pipeline over it again there -- and a ``prange`` kernel is two
    such libraries (its gufunc and the wrapper that launches it). For the attention kernels
    that re-optimisation was about half of their 25-29 s compile. A function called through
    its address is not linked: the loop compiles in ~1 s, each body once, into its own cached
    library. The results are the same bits (tested), and the attention backward came out
    faster (its item is optimised as a function of its own).

    How: for each new combination of argument types, each body is compiled (or loaded from
    the disk cache) for ``void(int64, *argument types)`` -- or with ``indices`` int64s first:
    a work item and, say, the K block the loop is at -- and the loop for ``(int64 address of
    each body, *argument types)``, from the one tuple of types, so the loop's calls pass
    exactly the types each body was compiled for. The addresses (of the bodies' C wrappers)
    are kept per :func:`_arg_key` of the arguments, with the compile results that own the
    code, so that a call costs a dictionary look-up and a launch whose arguments are all
    arrays and numbers. (An earlier version passed each body as a first-class function value:
    Numba then unboxes it through two Python calls that unpickle its signature, at every
    call: tens of µs, most of a small product's time; docs/architecture.md §8.2.) The loop calls a body with
    :func:`call_body`.
    """

    def __init__(self, dispatcher, items, indices=1):
        super().__init__(dispatcher)
        self.items = items
        self.indices = indices     # the int64s each body takes before the arguments
        self._uncached_items = None
        self._bodies = {}          # (loop, argument keys) -> (addresses, compile results)

    def _targets(self):
        loop = self._target()
        if loop is self.dispatcher:
            return loop, self.items
        if self._uncached_items is None:  # SLP off: the bodies must not reach the cache either
            self._uncached_items = tuple(njit(**{**OPTIONS, "cache": False})(item.py_func)
                                         for item in self.items)
        return loop, self._uncached_items

    def _bodies_for(self, loop, items, args):
        """Each body compiled (or loaded from the disk cache) for these arguments' types, and
        the loop for the same types after one address per body; returns the addresses and the
        compile results (which keep the code they point into alive)."""
        arg_types = tuple(loop.typeof_pyval(a) for a in args)
        signature = types.void(*(types.int64,) * self.indices, *arg_types)
        results = []
        for item in items:
            item.compile(signature)
            results.append(item.overloads[signature.args])
        loop.compile((types.int64,) * len(items) + arg_types)
        addresses = tuple(types.CompileResultWAP(r).__wrapper_address__() for r in results)
        return addresses, tuple(results)

    def _addresses(self, loop, items, args):
        # the key: Numba's own fingerprint of the argument types (what its dispatcher keys its
        # type look-up on: dtype, rank, layout, writability; a tuple's class name and fields),
        # 0.2 µs for a product's 11 arguments against 2.5 for _arg_key's, which serves where
        # Numba has no fingerprint (an object it types the slow way)
        try:
            key = (loop, compute_fingerprint(args))
        except (NotImplementedError, ValueError, TypeError):
            key = (loop,) + tuple(map(_arg_key, args))
        bodies = self._bodies.get(key)
        if bodies is None:
            bodies = self._bodies[key] = self._bodies_for(loop, items, args)
        return bodies[0]

    def serial(self, *args):
        """The serial twin (:meth:`ThreadSafeKernel.serial`): the loop compiled without
        ``parallel``, calling the same bodies (compiled apart) on the calling thread."""
        loop = self._serial_twin()
        items = self._targets()[1]
        if not hasattr(loop, "compile"):                  # NUMBA_DISABLE_JIT: plain Python
            return loop(*items, *args)
        return loop(*self._addresses(loop, items, args), *args)

    def __call__(self, *args):
        loop, items = self._targets()
        if not hasattr(loop, "compile"):                  # NUMBA_DISABLE_JIT: plain Python
            return loop(*items, *args)
        addresses = self._addresses(loop, items, args)
        if _launches_may_overlap():
            return loop(*addresses, *args)
        with _launch_lock:
            return loop(*addresses, *args)


def parallel_items(*items, indices=1, twin=False):
    """A ``prange`` kernel whose loop bodies are the serial kernels ``items``: see
    :class:`ItemKernel`. The decorated function takes the items as its first parameters and
    calls each as ``call_body(item, (np.int64(w), *the other parameters))`` -- or with
    ``indices`` int64s before them, ``call_body(item, (np.int64(w), np.int64(kb), ...))``;
    callers pass only the others. ``twin=True``: callers may also run its serial twin
    (``.serial``), as for :func:`parallel_kernel`."""
    def decorate(loop):
        kernel = ItemKernel(_jit({**OPTIONS, "parallel": True})(loop), items, indices)
        kernel.twin = twin
        return kernel
    return decorate


def _axpy(a, x, y):
    for i in range(y.shape[0]):
        y[i] += a * x[i]


def loop_vector_register(npattns=True):
    """"zmm", "ymm" or "xmm": the registers LLVM's vectorisers choose for a plain loop (a
    float32 a·x + y compiled now, without the cache) on the CPU Numba compiles for -- one of
    npattn's, through :class:`FullWidthCompiler`, or with ``npattns=False`` through Numba's own
    compiler, as any other Numba function in the process; None if the loop was not vectorised.
    npattn's: zmm on every AVX-512 CPU while :data:`FULL_WIDTH` holds. Numba's: ymm on Intel's
    (LLVM's ``prefer-256-bit`` tuning). For ``npattn info``."""
    import re
    if numba.config.DISABLE_JIT:
        return None
    options = {"pipeline_class": FullWidthCompiler} if npattns else {}
    probe = njit(fastmath={"contract"}, **options)(_axpy)
    probe.compile("(float32, float32[::1], float32[::1])")
    fmas = re.findall(r"vfmadd\w+\s+([^\n]*)", probe.inspect_asm(probe.signatures[0]))
    return next((r for r in ("zmm", "ymm", "xmm") if any(r in f for f in fmas)), None)


def threading_layer():
    """The threading layer in use, or ``None`` before the first parallel launch."""
    try:
        return numba.threading_layer()
    except ValueError:
        return None
