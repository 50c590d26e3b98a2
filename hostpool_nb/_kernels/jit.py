"""Numba options, the on-disk kernel cache, and how pools call kernels: the one place that sets them.

A kernel (:func:`kernel`) compiles from its explicit signature on its first
use, not at import: a process pays only for the kernels it calls, and a
warm cache turns each compile into a load. A helper that only kernels call
(:func:`callee`) is compiled with its callers instead. ``nogil`` lets other
threads run while a kernel works (the pool's lock already serialises state
changes), but for the twins compiled with ``nogil=False`` for calls too
short to be worth handing the GIL over (:func:`variant`). No ``fastmath``:
the kernels are integer code. No reference counting of arrays (numba's
NRT): see :func:`_njit`; kernels read the state's int32 and byte parts
through :func:`window`.

The cache is a speed-up, never a requirement, so no cache problem may stop
a pool from working:

* No writable cache directory (a read-only install with an unwritable HOME
  and no NUMBA_CACHE_DIR): numba raises "no locator available" while setting
  up the cache. The kernel is compiled in memory instead.
* A corrupt or truncated cache file: loading it raises whatever unpickling
  raises. The kernel's cache index is emptied and the kernel compiled again,
  which rewrites its files; only if that fails too is it compiled in memory.
* The cache cannot be written (disk full): the kernel, already compiled, is
  kept.

numba keys a kernel's cache entry to its own source file only, and freezes
the globals it reads (the layout constants of ``_kernels/layout.py``, say) into
the compiled code. A kernel module that reads another's constants would
then load stale code after the other file changed. So every kernel's cache
index is also stamped with the size and time of every kernel module of
the package (:data:`_PACKAGE_STAMP`): a change to any of them recompiles
them all.

Each fallback costs start-up time, so it is reported by one
:class:`KernelCacheWarning` per process that says how to get the cache back.
A compile that takes longer than :data:`NOTICE_AFTER_S` is announced once
per process on the ``hostpool_nb`` logger. Only these cache paths fall
back: a kernel that fails to compile, and ``MemoryError`` or
``KeyboardInterrupt`` anywhere, propagate. The private numba attributes used
for recovery are read with ``getattr`` fallbacks, so a numba change degrades
to compiling in memory, not to a failed pool.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
from numba import config as _numba_config
from numba import njit
from numba.core import event as _numba_event  # loaded with numba's dispatcher: no cost

from .._errors import KernelCacheWarning
from .._fork import hold as hold_across_forks
from . import MODULES

# The KernelCacheWarning's text; see _warn_once.
_Problem = str

# A kernel's Python function type. The compiled kernel is typed as that
# function: a dispatcher (and its entry point) takes the same arguments and
# returns the same values, numba's scalars boxed as Python ones.
_F = TypeVar("_F", bound=Callable[..., Any])

JIT_DISABLED = bool(getattr(_numba_config, "DISABLE_JIT", False))  # numba's config module sets it from the env

# A compile running longer than this says so, once per process.
NOTICE_AFTER_S = 1.0

_log = logging.getLogger("hostpool_nb")


class _Compiler:
    """One compile at a time, held across ``os.fork`` so a child never inherits one half done."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.warned = False  # the KernelCacheWarning is out
        self.announced = False  # the slow-compile notice is out


_COMPILER = _Compiler()
hold_across_forks(_COMPILER.lock)


def _package_stamp() -> tuple[tuple[str, int, int], ...]:
    """Name, size and modification time of every module that defines or feeds kernels."""
    here = Path(__file__).resolve().parent
    stamp = []
    for module in MODULES:  # every module whose code or constants kernels compile in
        name = f"{module}.py"
        try:
            st = (here / name).stat()
        except OSError:
            continue
        stamp.append((name, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


_PACKAGE_STAMP = _package_stamp()

# Every kernel made by kernel() and variant(), in definition order: what warmup compiles.
KERNELS: list[Kernel] = []


class Kernel:
    """A numba kernel compiled from its signature on first use: :attr:`dispatcher` compiles it.

    Calling the kernel calls numba's dispatcher (which checks the argument
    types); pools call :func:`entry_point` or :func:`fast` instead. Nothing
    else compiles it: reading its attributes, listing the module's kernels
    or asking :func:`is_callee` does not.
    """

    def __init__(self, func: Callable[..., Any], signature: str, *, nogil: bool) -> None:
        self.py_func = func
        self.signature = signature
        self.nogil = nogil
        self.__name__ = func.__name__
        self.__qualname__ = func.__qualname__
        self.__module__ = func.__module__
        self.__doc__ = func.__doc__
        self._dispatcher: Any = None

    @property
    def compiled(self) -> bool:
        """Whether the kernel has been compiled (or loaded from the cache) in this process."""
        return self._dispatcher is not None

    @property
    def dispatcher(self) -> Any:
        """numba's dispatcher, compiled for the signature (or loaded from the cache) on first access."""
        compiled = self._dispatcher
        if compiled is None:
            with _COMPILER.lock:
                compiled = self._dispatcher
                if compiled is None:
                    compiled = self._dispatcher = _announced(self)
        return compiled

    def __call__(self, *args: Any) -> Any:
        return self.dispatcher(*args)

    def __repr__(self) -> str:
        state = "compiled" if self.compiled else "not compiled yet"
        return f"<hostpool_nb kernel {self.__module__}.{self.__qualname__} {self.signature!r}, {state}>"


def kernel(signature: str, *, nogil: bool = True) -> Callable[[_F], _F]:
    """Decorator: a kernel for ``signature``, compiled on first use, cached on disk if possible.

    One explicit signature (``"i8(i8[::1], i8[::1])"``): the pools call the
    kernel's single compiled entry point (:func:`entry_point`), and numba
    before 0.68 does not reload a kernel of several signatures from a
    rebuilt cache. A function that only kernels call is a :func:`callee`
    instead.

    ``nogil=False`` compiles a kernel that keeps the GIL while it runs.

    Returns a :class:`Kernel`, or the function itself under
    ``NUMBA_DISABLE_JIT=1``. See the module docstring for the fallbacks.
    The Python annotations are for type checkers only: numba compiles from
    ``signature`` and never reads them.
    """

    if not isinstance(signature, str):
        raise TypeError(f"a kernel takes one signature string, got {signature!r}")

    def decorate(func: _F) -> _F:
        if JIT_DISABLED:
            return func
        made = Kernel(func, signature, nogil=nogil)
        KERNELS.append(made)
        return cast("_F", made)

    return decorate


def callee() -> Callable[[_F], _F]:
    """Decorator for a function that only kernels call: compiled with its callers, never loaded alone.

    A kernel's cached code contains the functions it calls, so a callee
    needs code of its own only while a kernel that calls it compiles (a
    cache miss). It is therefore compiled then, in memory, for the
    argument types that kernel passes, and never loaded from the cache on
    its own. It gets no Python or C wrapper (nothing outside a kernel calls
    it), and its constant and integer arguments are typed as int64
    (:func:`_type_constants_plainly`), so calls with ``0``, a variable or
    an int32 share one compile. The Python
    annotations document the types. Where they say ``int``, a caller may
    pass an int32 page id read from the ring; numba does integer
    arithmetic in int64 at least, so the results are the same. A callee
    returns scalars: an array it returned would need numba's reference
    counting (kernels take views with :func:`window`). Returns numba's dispatcher, or the
    function itself under ``NUMBA_DISABLE_JIT=1``; tests call one from
    Python through :func:`callable_from_python`.
    """

    def decorate(func: _F) -> _F:
        if JIT_DISABLED:
            return func
        dispatcher = _njit(None, cache=False, wrappers=False)(func)
        dispatcher.compiled_with_callers = True  # what is_callee reads
        _type_constants_plainly(dispatcher)
        _refuse_python_calls(dispatcher)
        return cast("_F", dispatcher)

    return decorate


def _type_constants_plainly(dispatcher: Any) -> None:
    """Type a callee's constant and integer arguments plainly: ``Literal[int](0)`` and int32 as int64.

    numba compiles a called function once per distinct literal argument
    and per integer width: ``fail(E_RANGE, 0)`` and ``fail(E_SHORT, 0)``
    were two compiles of a one-line function, and a flag test of a page id
    read from the int32 ring another than of one computed in int64. Such
    duplicates were a fifth of the package's compile time. Every integer
    argument of a callee here is a count, a position or an id, so widening
    it to int64 changes no result (unsigned 64-bit values are left as they
    are). ``get_call_template`` is where a caller's typing asks for the
    callee's signature; without it (a numba change) calls are typed as
    numba types them.
    """
    original = getattr(dispatcher, "get_call_template", None)
    if original is None:
        return
    from numba.core import types as nb  # noqa: PLC0415 - numba's typing, needed only with the JIT on

    unliteral: Callable[[Any], Any] = nb.unliteral

    def plain(t: Any) -> Any:
        t = unliteral(t)
        # numba's type stubs omit Integer's fields; getattr keeps the typing honest.
        if isinstance(t, nb.Integer) and (getattr(t, "signed", False) or getattr(t, "bitwidth", 64) < _WORD_BITS):
            return nb.int64
        return t

    def get_call_template(args: Any, kws: Any) -> Any:
        return original(tuple(plain(a) for a in args), {k: plain(v) for k, v in kws.items()})

    dispatcher.get_call_template = get_call_template


def _refuse_python_calls(dispatcher: Any) -> None:
    """Make a call of the callee from Python a ``TypeError``: without a Python wrapper it would crash."""
    base = type(dispatcher)
    guarded = _GUARDED.get(base)
    if guarded is None:

        def __call__(self: Any, *args: Any, **kws: Any) -> Any:
            raise TypeError(
                f"{self.py_func.__qualname__} is compiled into the kernels that call it and has no Python "
                "entry point; call it through hostpool_nb._kernels.jit.callable_from_python"
            )

        guarded = _GUARDED[base] = type(f"Callee{base.__name__}", (base,), {"__call__": __call__})
    dispatcher.__class__ = guarded


_GUARDED: dict[type, type] = {}
_WORD_BITS = 64


def is_callee(obj: object) -> bool:
    """Whether ``obj`` was made by :func:`callee`: compiled with its callers, never cached on its own."""
    return getattr(obj, "compiled_with_callers", False) is True


def callable_from_python(func: _F) -> _F:
    """A callee (which has no Python wrapper) compiled inside a kernel that Python can call: for tests.

    Under ``NUMBA_DISABLE_JIT=1``, the function itself.
    """
    if not is_callee(func):
        return func
    made = _TRAMPOLINES.get(func)
    if made is None:

        def call(*args: Any) -> Any:
            return func(*args)

        made = _TRAMPOLINES[func] = _njit(None, cache=False)(call)
    return cast("_F", made)


_TRAMPOLINES: dict[Any, Any] = {}


def window(dtype: type[np.generic], where: Callable[..., tuple[int, int]]) -> Callable[..., Any]:
    """A typed window on an int64 state array, for kernels: ``owner_view = window(np.uint8, where)``.

    ``where(st)`` is the layout's formula in plain Python: ``(first word,
    number of elements)``. In a kernel, ``owner_view(st)`` is a 1-D
    C-contiguous ``dtype`` array over those words of ``st``, made in place
    by an intrinsic, with no copy and no function boundary: a view returned
    by a function needs numba's reference counting, and numba's ``.view``
    compiles a helper per dtype and a function per window, which together
    took a quarter of a cold start (docs/architecture.md). ``where`` is
    compiled once per process, into the kernels that use the window.
    Under ``NUMBA_DISABLE_JIT=1``, numpy makes the same view.
    """
    np_dtype = np.dtype(dtype)
    if JIT_DISABLED:

        def view(st: Any) -> Any:
            start, count = where(st)
            return st[start:].view(np_dtype)[:count]

        view.__name__ = view.__qualname__ = where.__name__.lstrip("_").removesuffix("_at") + "_view"
        return view
    return _window_intrinsic(np_dtype, where)


def _window_intrinsic(np_dtype: np.dtype[Any], where: Callable[..., tuple[int, int]]) -> Callable[..., Any]:
    """:func:`window`'s intrinsic: an array struct over ``st``'s words, built in the kernel's own code."""
    # numba's typing, needed only with the JIT on (its functions are untyped).
    from numba.core import types as _types  # noqa: PLC0415
    from numba.extending import intrinsic  # noqa: PLC0415
    from numba.np.numpy_support import from_dtype  # noqa: PLC0415

    types: Any = _types

    element = from_dtype(np_dtype)
    result = types.Array(element, 1, "C")
    place = types.UniTuple(types.int64, 2)
    words = types.Array(types.int64, 1, "C")

    def typer(typingctx: Any, st: Any) -> Any:
        if st != words:
            return None  # numba's typing error names the call
        return result(st), codegen

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        # numba's code generation: imported at the first compile, not at import, where a warm start would pay.
        from numba.core import cgutils as _cgutils  # noqa: PLC0415
        from numba.np import arrayobj as _arrayobj  # noqa: PLC0415

        cgutils: Any = _cgutils
        make_array: Any = _arrayobj.make_array
        populate_array: Any = _arrayobj.populate_array
        located = context.compile_internal(builder, where, place(sig.args[0]), args)
        start, count = cgutils.unpack_tuple(builder, located, 2)
        state = make_array(sig.args[0])(context, builder, args[0])
        out = make_array(result)(context, builder)
        data = builder.bitcast(builder.gep(state.data, [start]), context.get_data_type(element).as_pointer())
        step = context.get_constant(types.intp, np_dtype.itemsize)
        populate_array(
            out,
            data=data,
            shape=cgutils.pack_array(builder, [count]),
            strides=cgutils.pack_array(builder, [step]),
            itemsize=step,
            meminfo=None,
        )
        return out._getvalue()

    typer.__name__ = typer.__qualname__ = where.__name__.lstrip("_").removesuffix("_at") + "_view"
    return cast("Callable[..., Any]", intrinsic(typer))


def _bit_intrinsic(name: str, emit: Callable[[Any, Any, Any], Any]) -> Callable[[int], int]:
    """An int64 function for kernels whose code is one LLVM instruction, ``emit(context, builder, value)``.

    An intrinsic is inlined where a kernel calls it: nothing of its own to
    compile, as a callee would have.
    """
    from numba.core import types as _types  # noqa: PLC0415
    from numba.extending import intrinsic  # noqa: PLC0415

    types: Any = _types

    def typer(typingctx: Any, x: Any) -> Any:
        if not isinstance(x, types.Integer):
            return None  # numba's typing error names the call

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return emit(context, builder, context.cast(builder, args[0], sig.args[0], types.int64))

        return types.int64(x), codegen

    typer.__name__ = typer.__qualname__ = name
    return cast("Callable[[int], int]", intrinsic(typer))


def _trailing_zeros_in_python(x: int) -> int:
    """The number of zero bits below the lowest set bit of a nonzero int64 (plain Python, for the JIT off)."""
    x = int(x) & ((1 << 64) - 1)
    return (x & -x).bit_length() - 1


def _cttz(context: Any, builder: Any, value: Any) -> Any:
    """LLVM's ``cttz``, told that 0 is never asked (which lets it emit one instruction)."""
    from numba.core import types  # noqa: PLC0415

    return builder.cttz(value, context.get_constant(types.boolean, True))


def _popcount_in_python(x: int) -> int:
    """The number of set bits of an int64, its two's complement (plain Python, for the JIT off)."""
    return (int(x) & ((1 << 64) - 1)).bit_count()


# The index of the lowest set bit of a nonzero int64: how far a run's slots count up, from a
# mask of the slots that do not (kernels build one per 64 slots).
trailing_zeros: Callable[[int], int] = (
    _trailing_zeros_in_python if JIT_DISABLED else _bit_intrinsic("trailing_zeros", _cttz)
)
# The number of set bits of an int64 (LLVM's ``ctpop``): how many of eight owner flags a word's
# bit-per-flag mask holds (a sorted merge counts the free pages that way).
popcount: Callable[[int], int] = (
    _popcount_in_python
    if JIT_DISABLED
    else _bit_intrinsic("popcount", lambda context, builder, value: builder.ctpop(value))
)


def variant(
    func: _F,
    *,
    name: str | None = None,
    constants: dict[str, Any] | None = None,
    signature: str | None = None,
    nogil: bool = True,
) -> _F:
    """A variant of a kernel's or callee's one definition: how the package makes every one but the flat pair.

    ``func``'s Python function, copied as ``name`` with ``constants`` read
    for the module globals of those names, compiled as a kernel for
    ``signature`` (releasing the GIL if ``nogil``) or, without one, as a
    :func:`callee`. numba compiles a global in as a constant, so a branch
    on a flag the copy reads (``TRACKED``, ``_PAGE_SIZE_1_LOOP``) is
    dropped before typing, and a callee named by a global (a paged kernel
    the sliding-window kernels call) is swapped for another. A kernel
    variant gets cache files of its own: numba names them after the
    qualified name, and its index key (the bytecode's hash) cannot tell
    two copies apart. ``func`` is a :class:`Kernel`, a callee, or a plain
    function.
    """
    py_func: Callable[..., Any] = getattr(func, "py_func", func)
    name = name or py_func.__name__
    copy = types.FunctionType(
        py_func.__code__, {**py_func.__globals__, **(constants or {})}, name, py_func.__defaults__, py_func.__closure__
    )
    copy.__qualname__ = name
    copy.__module__ = py_func.__module__
    copy.__doc__ = py_func.__doc__
    copy.__annotations__ = dict(py_func.__annotations__)
    if signature is None:
        return callee()(cast("_F", copy))
    return kernel(signature, nogil=nogil)(cast("_F", copy))


def entry_point(kernel: _F) -> _F:
    """How a module calls a kernel it binds to a global: ``_alloc = entry_point(_kernels.alloc)``.

    Returns a stand-in that, on its first call, compiles the kernel (or
    loads it) and rebinds every global of the calling module that holds
    the stand-in to the kernel's compiled entry point (:func:`fast`); from
    then on a call costs nothing extra. Under ``NUMBA_DISABLE_JIT=1``, the
    plain function as :func:`fast` gives it.
    """
    if not isinstance(kernel, Kernel):
        return fast(kernel)
    module_globals = sys._getframe(1).f_globals
    made = kernel

    def first_call(*args: Any) -> Any:
        compiled = fast(cast("_F", made))
        for name, value in list(module_globals.items()):
            if value is first_call:
                module_globals[name] = compiled
        return compiled(*args)

    first_call.__qualname__ = first_call.__name__ = f"first_call_of_{kernel.__name__}"
    return cast("_F", first_call)


def fast(kernel: _F) -> _F:
    """The fastest callable for a kernel compiled from one signature, compiling it now if need be.

    numba's dispatcher resolves argument types on every call, which costs
    more than a small kernel's work. The compiled entry point skips that, but
    it trusts its arguments: callers must pass exactly the signature's types
    (C-contiguous int64 arrays), which every pool class guarantees. Falls
    back to the dispatcher itself when numba offers no single entry point.
    Under ``NUMBA_DISABLE_JIT=1``, gives the plain function wrapped so that
    its integer results are Python ints, as the compiled kernels' are (a
    plain kernel computes them from array elements, numpy integers): so the
    pool's hot paths need no ``int()`` of their own.
    """
    if not isinstance(kernel, Kernel):
        return _python_ints(kernel)
    dispatcher = kernel.dispatcher
    overloads = getattr(dispatcher, "overloads", {})
    if len(overloads) != 1:
        return cast("_F", dispatcher)
    (compiled,) = overloads.values()
    return cast("_F", getattr(compiled, "entry_point", dispatcher))


class Entries:
    """The :func:`fast` entry points of a named tuple of kernels, each compiled on its first access.

    ``Entries(kernels).alloc`` compiles ``kernels.alloc`` (or loads it) the
    first time and is a plain attribute from then on: a pool reads the
    kernels of its page-size class through one of these without paying for
    the classes it does not use.
    """

    def __init__(self, kernels: Any) -> None:
        self._kernels = kernels

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        entry = fast(getattr(self._kernels, name))
        setattr(self, name, entry)
        return entry


def _python_ints(func: _F) -> _F:
    """``func`` with a numpy integer result returned as a Python int."""

    @functools.wraps(func)
    def call(*args: Any) -> Any:
        result = func(*args)
        return int(result) if isinstance(result, np.integer) else result

    return cast("_F", call)


# -- compiling ----------------------------------------------------------------------


def _announced(made: Kernel) -> Any:
    """Compile ``made`` (see :func:`_compile`), saying so once per process if numba compiles for long.

    Loading from the cache is not compiling: the notice's timer starts at
    numba's own "numba:compile" event, which it raises only when it really
    compiles (after a cache miss, or in memory), so a slow cache load on a
    busy machine announces nothing.
    """
    watch = None if _COMPILER.announced else _CompileWatch()
    try:
        if watch is None:
            dispatcher, problem = _compile(made.py_func, made.signature, nogil=made.nogil)
        else:
            with _numba_event.install_listener("numba:compile", watch):
                dispatcher, problem = _compile(made.py_func, made.signature, nogil=made.nogil, watch=watch)
    finally:
        if watch is not None:
            watch.stop()
    if problem is not None:
        _warn_once(problem)
    return dispatcher


class _CompileWatch(_numba_event.Listener):
    """A numba event listener: when numba starts compiling, a timer that announces a compile still going on.

    ``where`` is the cache directory the compile writes to, for the notice
    (``None``: compiled in memory, not cached).
    """

    def __init__(self) -> None:
        self.timer: Any = None
        self.where: str | None = None

    def on_start(self, event: Any) -> None:
        if self.timer is None:
            self.timer = threading.Timer(NOTICE_AFTER_S, _announce, (self,))
            self.timer.daemon = True
            self.timer.start()

    def on_end(self, event: Any) -> None:
        """The compile's end: the timer is stopped when the kernel is ready (a kernel may compile callees)."""

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _announce(watch: _CompileWatch) -> None:
    if _COMPILER.announced:
        return
    _COMPILER.announced = True
    where = watch.where
    if where is None:
        _log.warning(
            "hostpool_nb: compiling numba kernels on their first use, in memory: they cannot be cached "
            "(see the KernelCacheWarning), so every start compiles them again."
        )
        return
    _log.warning(
        "hostpool_nb: compiling numba kernels on their first use; each is cached in %s and loads in "
        "milliseconds from then on. `python -m hostpool_nb.warmup` compiles them all ahead of time.",
        where,
    )


def _compile(
    func: Callable[..., Any], signature: str, *, nogil: bool = True, watch: _CompileWatch | None = None
) -> tuple[Any, _Problem | None]:
    """Compile ``func`` through the cache; return it and the cache problem, if any."""
    try:
        # No signature yet: this only creates the dispatcher and sets up its
        # cache, which is where numba fails when it has nowhere to write.
        dispatcher = _njit(None, cache=True, nogil=nogil)(func)
    except (RuntimeError, OSError) as exc:
        # A non-cache error raises again from the in-memory compile.
        return _in_memory(func, signature, nogil=nogil), _in_memory_because(
            f"numba has no writable cache directory ({exc})",
            "set NUMBA_CACHE_DIR to a writable directory",
        )
    _stamp_with_package(dispatcher)
    where = _cache_dir(dispatcher)
    if watch is not None:
        watch.where = where
    ignored = _ignored_cache_dir(where)

    if _load_cached(dispatcher, signature):
        dispatcher.disable_compile()
        return dispatcher, ignored
    error = _try_compile(dispatcher, signature)
    if error is not None and not _compiled(dispatcher) and _forget_index(dispatcher):
        # Loading failed. With the index empty, this compiles and rewrites
        # the kernel's cache files.
        error = _try_compile(dispatcher, signature)
    if error is None:
        dispatcher.disable_compile()  # as njit(signature) does: no lazy compiles
        return dispatcher, ignored

    if _compiled(dispatcher):  # compiled, then failed to save: usable
        dispatcher.disable_compile()
        return dispatcher, _in_memory_because(
            f"numba could not write its cache in {where} ({error!r})",
            f"make {where} writable or set NUMBA_CACHE_DIR to a writable directory",
        )
    return _in_memory(func, signature, nogil=nogil), _in_memory_because(
        f"the numba cache in {where} is corrupt and could not be rebuilt ({error!r})",
        f"delete the directory {where}",
    )


def _in_memory_because(reason: str, remedy: str) -> _Problem:
    return (
        f"hostpool_nb: numba kernels are compiled in memory on every start (seconds) "
        f"because {reason}. To enable the on-disk cache, {remedy}."
    )


def _ignored_cache_dir(where: str) -> _Problem | None:
    """The warning for a ``NUMBA_CACHE_DIR`` numba cannot use (a file, an unwritable folder), which it skips.

    numba then caches where it would without the setting (``__pycache__``
    beside the package, or the user's cache), without a word: ``where``,
    the kernel's real cache directory, is outside the one asked for.
    """
    wanted = os.environ.get("NUMBA_CACHE_DIR")
    if not wanted or where == "numba's cache directory":
        return None
    try:
        inside = os.path.commonpath([os.path.realpath(wanted), os.path.realpath(where)]) == os.path.realpath(wanted)
    except ValueError:  # different drives
        inside = False
    if inside:
        return None
    return (
        f"hostpool_nb: NUMBA_CACHE_DIR={wanted} is not a directory numba can write to (a file? no permission?), "
        f"so numba ignores it and caches the kernels in {where} instead. Point NUMBA_CACHE_DIR to a writable "
        "directory, or unset it."
    )


def _load_cached(dispatcher: Any, signature: str) -> bool:
    """Load the kernel from its cache files without numba's refresh of its compiler; whether it did.

    numba's own load first refreshes the target context, importing and
    installing every typing and lowering registry (once per
    process), which only a compile needs: a cached kernel is object code
    and a wrapper. So a load skips it, and anything unusual (no such
    private attribute, a miss, a stale or broken file) is left to
    :func:`_try_compile`, numba's own path.
    """
    load = getattr(getattr(dispatcher, "_cache", None), "_load_overload", None)
    if load is None or getattr(dispatcher, "_can_compile", None) is not True:
        return False
    from numba.core.compiler_lock import global_compiler_lock  # noqa: PLC0415 - loaded with numba's dispatcher

    try:
        with global_compiler_lock:
            target = dispatcher.targetctx
            cres = load(signature, target)
            if cres is None or cres.objectmode:
                return False
            target.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
            dispatcher.add_overload(cres)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - numba's own path tries again, and handles what it finds
        return False
    hits = getattr(dispatcher, "_cache_hits", None)
    if hits is not None:
        hits[signature] += 1
    return True


def _try_compile(dispatcher: Any, signature: str) -> Exception | None:
    """Compile the signature; return the error if the cache failed, raise if the compiler did.

    numba counts a cache miss just before compiling and adds the compiled
    overload just before saving it to the cache. So an error with no miss
    counted came from loading the cache, and one with the overload in place
    from saving it; an error in between is the compiler's and propagates.
    """
    stats = getattr(dispatcher, "stats", None)
    misses = sum(getattr(stats, "cache_misses", {}).values())
    try:
        dispatcher.compile(signature)
    except MemoryError:
        raise
    except Exception as exc:
        if _compiled(dispatcher):  # compiled, then the save failed: usable
            return exc
        if sum(getattr(stats, "cache_misses", {}).values()) > misses:
            raise  # a miss counted and nothing compiled: the compiler's error
        return exc
    return None


def _stamp_with_package(dispatcher: Any) -> None:
    """Make the kernel's cache index stale whenever any kernel module of the package changes.

    numba compares its index's stamp with the kernel's own source file's;
    adding the package's stamp to it (the private ``_cache._cache_file``,
    read defensively) extends that comparison to the modules whose
    constants the kernel compiled in. Without those attributes the cache
    works as numba's own.
    """
    cache_file: Any = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    own = getattr(cache_file, "_source_stamp", None)
    if own is not None:
        cache_file._source_stamp = (own, _PACKAGE_STAMP)


def _compiled(dispatcher: Any) -> bool:
    """Whether the dispatcher holds compiled code for its signature."""
    return len(getattr(dispatcher, "overloads", ())) >= 1


def _forget_index(dispatcher: Any) -> bool:
    """Empty the kernel's cache index so the next compile ignores its broken files.

    numba's ``Cache.flush`` (reached through the private ``_cache``) writes
    an empty index; the compile that follows then misses, compiles and
    overwrites the data file. Returns False if that was not possible.
    """
    flush = getattr(getattr(dispatcher, "_cache", None), "flush", None)
    if not callable(flush):
        return False
    try:
        flush()
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - whatever stops the rewrite, recovery is off
        return False
    return True


def _cache_dir(dispatcher: Any) -> str:
    """The directory holding the kernel's cache files, for the warning."""
    path = getattr(getattr(dispatcher, "stats", None), "cache_path", None)
    return str(path) if path else "numba's cache directory"


def _in_memory(func: Callable[..., Any], signature: str, *, nogil: bool = True) -> Any:
    """Compile without the on-disk cache."""
    return _njit([signature], cache=False, nogil=nogil)(func)


def _njit(
    signature: list[str] | None, *, cache: bool, nogil: bool = True, wrappers: bool = True
) -> Callable[[Callable[..., Any]], Any]:
    """numba's ``njit`` with the package's options, set here and nowhere else.

    ``signature=None`` gives a dispatcher that compiles nothing until asked.

    Nothing compiles with numba's reference counting of arrays (its NRT,
    off with the ``_nrt=False`` option that numba's own tests use): kernels
    never allocate an array, only read and write the caller's and windows
    of the state (:func:`window`), so there is nothing to count, and the
    counting (an object per array argument, an atomic increment and
    decrement per view taken) cost each call more than a one-page alloc's
    work. A kernel that allocated would fail to compile. ``wrappers=False``
    (callees) skips the Python entry point too, which only a call from
    outside numba needs.
    """
    # _nrt: numba's type stubs omit this private option. No C entry point
    # (a cfunc wrapper): nothing here calls a kernel through one.
    options: dict[str, Any] = {"_nrt": False, "no_cfunc_wrapper": True}
    if not wrappers:
        options["no_cpython_wrapper"] = True
    return njit(signature, nogil=nogil, cache=cache, **options)


def _warn_once(message: str) -> None:
    """Emit the process's one :class:`KernelCacheWarning`; later calls do nothing."""
    if _COMPILER.warned:
        return
    _COMPILER.warned = True
    warnings.warn(message, KernelCacheWarning, stacklevel=_outside_the_package())


def _outside_the_package() -> int:
    """The ``stacklevel`` of the first frame outside hostpool_nb: the caller whose call compiled."""
    package = __name__.partition(".")[0]
    level = 1
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != package and not name.startswith(package + "."):
            return level
        frame = frame.f_back
        level += 1
    return 1
