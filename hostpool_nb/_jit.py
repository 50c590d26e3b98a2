"""Numba options and the on-disk kernel cache: the one place that sets them.

Every kernel compiles at import from an explicit signature (or loads from
the cache); a helper that only kernels call compiles with them instead
(:func:`callee`). ``nogil`` lets
other threads run while a kernel works (the pool's lock already serialises
state changes), but for the twins compiled with ``nogil=False`` for calls
too short to be worth handing the GIL over (see ``_kernels.py``).
``cache`` turns the seconds of compiling on every start into a cache load.
No ``fastmath``: the kernels are integer code. No reference counting of
arrays (numba's NRT), but in the kernels that return a view: see
:func:`_njit`.

The cache is a speed-up, never a requirement, so no cache problem may stop
``import hostpool_nb``:

* No writable cache directory (a read-only install with an unwritable HOME
  and no NUMBA_CACHE_DIR): numba raises "no locator available" while setting
  up the cache. The kernel is compiled in memory instead.
* A corrupt or truncated cache file: loading it raises whatever unpickling
  raises. The kernel's cache index is emptied and the kernel compiled again,
  which rewrites its files; only if that fails too is it compiled in memory.
* The cache cannot be written (disk full): the kernel, already compiled, is
  kept.

numba keys a kernel's cache entry to its own source file only, and freezes
the globals it reads (the layout constants of ``_layout.py``, say) into
the compiled code. A kernel module that reads another's constants would
then load stale code after the other file changed. So every kernel's cache
index is also stamped with the size and time of every kernel module of
the package (:data:`_PACKAGE_STAMP`): a change to any of them recompiles
them all.

Each fallback costs start-up time, so it is reported by one
:class:`KernelCacheWarning` per process that says how to get the cache back.
Only these cache paths fall back: a kernel that fails to compile, and
``MemoryError`` or ``KeyboardInterrupt`` anywhere, propagate. The private
numba attributes used for recovery are read with ``getattr`` fallbacks, so a
numba change degrades to compiling in memory, not to a failed import.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
from numba import njit

from ._errors import KernelCacheWarning

# (reason, remedy) for the warning; see _warn_once.
_Problem = tuple[str, str]

# A kernel's Python function type. The compiled kernel is typed as that
# function: a dispatcher (and its entry point) takes the same arguments and
# returns the same values, numba's scalars boxed as Python ones.
_F = TypeVar("_F", bound=Callable[..., Any])

# Set once the warning is out: one per process for all kernels. Kernels are
# compiled while their module is imported, which the import lock serialises.
_warned = False


# Every module whose code or constants kernels compile in.
KERNEL_MODULES = ("_jit.py", "_layout.py", "_kernels.py", "_paged_kernels.py", "_host_kernels.py")


def _package_stamp() -> tuple[tuple[str, int, int], ...]:
    """Name, size and modification time of every module that defines or feeds kernels."""
    here = Path(__file__).resolve().parent
    stamp = []
    for name in KERNEL_MODULES:
        try:
            st = (here / name).stat()
        except OSError:
            continue
        stamp.append((name, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


_PACKAGE_STAMP = _package_stamp()


def kernel(signature: str | tuple[str, ...], *, nogil: bool = True, views: bool = False) -> Callable[[_F], _F]:
    """Decorator: compile a kernel for ``signature``, cached on disk if possible.

    A tuple of signatures compiles one specialisation for each; the
    kernels that the pool calls from Python have exactly one, for
    :func:`_kernels.entry_point`. A function that only kernels call is a
    :func:`callee` instead.

    ``nogil=False`` compiles a kernel that keeps the GIL while it runs.
    ``views=True`` is for a kernel that returns a view of its argument,
    which needs numba's reference counting (see :func:`_njit`).

    Returns numba's dispatcher, or the function itself under
    ``NUMBA_DISABLE_JIT=1``. See the module docstring for the fallbacks.
    The Python annotations are for type checkers only: numba compiles from
    ``signature`` and never reads them.
    """

    def decorate(func: _F) -> _F:
        compiled, problem = _compile(func, signature, nogil=nogil, views=views)
        if problem is not None:
            _warn_once(*problem)
        return cast("_F", compiled)

    return decorate


def callee(*, views: bool = False) -> Callable[[_F], _F]:
    """Decorator for a function that only kernels call: compiled with its callers, never loaded alone.

    A kernel's cached code contains the functions it calls, so a callee
    needs code of its own only while a kernel that calls it compiles (a
    cache miss). It is therefore compiled then, in memory, for the
    argument types that kernel passes, and never loaded from the cache on
    its own, which would cost every start. The Python annotations document
    the types. Where they say
    ``int``, a caller may pass an int32 page id read from the ring; numba
    does integer arithmetic in int64 at least, so the results are the
    same. ``views=True`` as for :func:`kernel`. Returns numba's dispatcher,
    or the function itself under ``NUMBA_DISABLE_JIT=1``.
    """

    def decorate(func: _F) -> _F:
        dispatcher = _njit(None, cache=False, views=views)(func)
        if dispatcher is not func:  # not NUMBA_DISABLE_JIT=1
            dispatcher.compiled_with_callers = True  # what is_callee reads
        return cast("_F", dispatcher)

    return decorate


def is_callee(obj: object) -> bool:
    """Whether ``obj`` was made by :func:`callee`: compiled with its callers, never cached on its own."""
    return getattr(obj, "compiled_with_callers", False) is True


def twin(func: _F, signature: str, *, name: str, nogil: bool) -> _F:
    """Compile a kernel's Python function a second time, as ``name``, with other options.

    For a kernel wanted both with and without ``nogil``. A twin is compiled
    from the same source, not as a kernel calling the other: such a call
    passes its arrays across a function boundary, whose reference counting
    costs more than a one-page alloc's work. numba names
    a kernel's cache files after its qualified name, so the twin gets its
    own (the index key, the bytecode's hash, cannot tell the two apart).
    ``func`` is the kernel's dispatcher, or the plain function under
    ``NUMBA_DISABLE_JIT=1``.
    """
    py_func: Callable[..., Any] = getattr(func, "py_func", func)
    copy = types.FunctionType(py_func.__code__, py_func.__globals__, name, py_func.__defaults__, py_func.__closure__)
    copy.__qualname__ = name
    copy.__module__ = py_func.__module__
    copy.__doc__ = py_func.__doc__
    copy.__annotations__ = dict(py_func.__annotations__)
    return kernel(signature, nogil=nogil)(cast("_F", copy))


def _compile(
    func: Callable[..., Any], signature: str | tuple[str, ...], *, nogil: bool = True, views: bool = False
) -> tuple[Any, _Problem | None]:
    """Compile ``func`` through the cache; return it and the cache problem, if any."""
    try:
        # No signature yet: this only creates the dispatcher and sets up its
        # cache, which is where numba fails when it has nowhere to write.
        dispatcher = _njit(None, cache=True, nogil=nogil, views=views)(func)
    except (RuntimeError, OSError) as exc:
        # A non-cache error raises again from the in-memory compile.
        return _in_memory(func, signature, nogil=nogil, views=views), (
            f"numba has no writable cache directory ({exc})",
            "set NUMBA_CACHE_DIR to a writable directory",
        )
    if dispatcher is func:  # NUMBA_DISABLE_JIT=1: njit hands the function back
        return func, None
    _stamp_with_package(dispatcher)

    error = _try_compile(dispatcher, signature)
    if error is not None and not _compiled(dispatcher, signature) and _forget_index(dispatcher):
        # Loading failed. With the index empty, this compiles and rewrites
        # the kernel's cache files.
        error = _try_compile(dispatcher, signature)
    if error is None:
        dispatcher.disable_compile()  # as njit(signature) does: no lazy compiles
        return dispatcher, None

    where = _cache_dir(dispatcher)
    if _compiled(dispatcher, signature):  # compiled, then failed to save: usable
        dispatcher.disable_compile()
        return dispatcher, (
            f"numba could not write its cache in {where} ({error!r})",
            f"make {where} writable or set NUMBA_CACHE_DIR to a writable directory",
        )
    return _in_memory(func, signature, nogil=nogil, views=views), (
        f"the numba cache in {where} is corrupt and could not be rebuilt ({error!r})",
        f"delete the directory {where}",
    )


def _try_compile(dispatcher: Any, signature: str | tuple[str, ...]) -> Exception | None:
    """Compile each signature; return the error if the cache failed, raise if the compiler did.

    numba counts a cache miss just before compiling and adds the compiled
    overload just before saving it to the cache. So an error with no miss
    counted came from loading the cache, and one with the overload in place
    from saving it; an error in between is the compiler's and propagates.
    """
    saved: Exception | None = None
    for one in _signatures(signature):
        stats = getattr(dispatcher, "stats", None)
        misses = sum(getattr(stats, "cache_misses", {}).values())
        held = len(getattr(dispatcher, "overloads", ()))
        try:
            dispatcher.compile(one)
        except MemoryError:
            raise
        except Exception as exc:
            # Judged for this signature alone: the overloads grew if only the
            # save failed (the next signature still compiles), a miss counted
            # without them growing is the compiler's error.
            if len(getattr(dispatcher, "overloads", ())) > held:
                saved = saved or exc
                continue
            if sum(getattr(stats, "cache_misses", {}).values()) > misses:
                raise
            return exc
    return saved


def _signatures(signature: str | tuple[str, ...]) -> tuple[str, ...]:
    """One signature or several, as a tuple."""
    return (signature,) if isinstance(signature, str) else signature


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


def _compiled(dispatcher: Any, signature: str | tuple[str, ...]) -> bool:
    """Whether the dispatcher holds compiled code for every one of its signatures."""
    return len(getattr(dispatcher, "overloads", ())) >= len(_signatures(signature))


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


def _in_memory(
    func: Callable[..., Any], signature: str | tuple[str, ...], *, nogil: bool = True, views: bool = False
) -> Any:
    """Compile without the on-disk cache."""
    return _njit(list(_signatures(signature)), cache=False, nogil=nogil, views=views)(func)


def _njit(
    signature: list[str] | None, *, cache: bool, nogil: bool = True, views: bool = False
) -> Callable[[Callable[..., Any]], Any]:
    """numba's ``njit`` with the package's options, set here and nowhere else.

    ``signature=None`` gives a dispatcher that compiles nothing until asked.

    Kernels compile without numba's reference counting of arrays (its NRT,
    off with the ``_nrt=False`` option that numba's own tests use): they
    never allocate an array, only read and write the caller's and views of
    them, so there is nothing to count, and the counting (an object per
    array argument, an atomic increment and decrement per view taken) cost
    each call more than a one-page alloc's work. A kernel that allocated
    would fail to compile. Only a kernel that returns a view of its argument
    (``views=True``) keeps the counting: numba refuses to return one
    without it. It is safe to call from the others, whose arrays carry no
    count to change.
    """
    counting: dict[str, Any] = {"_nrt": views}  # numba's type stubs omit this private option
    return njit(signature, nogil=nogil, cache=cache, **counting)


def _warn_once(reason: str, remedy: str) -> None:
    """Emit the process's one :class:`KernelCacheWarning`; later calls do nothing."""
    global _warned  # noqa: PLW0603 - one flag per process, by design (see its definition)
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"hostpool_nb: numba kernels are compiled in memory on every start (about 10 s) "
        f"because {reason}. To enable the on-disk cache, {remedy}.",
        KernelCacheWarning,
        stacklevel=3,  # the kernel's definition
    )


def _python_ints(func: _F) -> _F:
    """``func`` with a numpy integer result returned as a Python int."""

    @functools.wraps(func)
    def call(*args: Any) -> Any:
        result = func(*args)
        return int(result) if isinstance(result, np.integer) else result

    return cast("_F", call)


def entry_point(kernel: _F) -> _F:
    """Return the fastest callable for a kernel compiled from one signature.

    numba's dispatcher resolves argument types on every call, which costs
    more than a small kernel's work. The compiled entry point skips that, but
    it trusts its arguments: callers must pass exactly the signature's types
    (C-contiguous int64 arrays), which every pool class guarantees. This is
    how every pool calls every kernel. Falls back to
    the dispatcher itself when numba offers no single entry point. Under
    ``NUMBA_DISABLE_JIT=1``, gives the plain function wrapped so that its
    integer results are Python ints, as the compiled kernels' are (a plain
    kernel computes them from array elements, numpy integers): so the
    pool's hot paths need no ``int()`` of their own.
    """
    overloads = getattr(kernel, "overloads", None)
    if overloads is None:  # NUMBA_DISABLE_JIT=1
        return _python_ints(kernel)
    if len(overloads) != 1:
        return kernel
    (compiled,) = overloads.values()
    return cast("_F", getattr(compiled, "entry_point", kernel))
