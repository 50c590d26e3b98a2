"""Argument conversion shared by the pool and its torch adapter.

These helpers raise ``TypeError`` for values of the wrong kind and return
plain Python ints or C-contiguous int64 arrays, the only types the kernels
accept.
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._errors import HostPoolError, SlotRangeError

# The hot paths' test for an array the kernels take as it is: ``type(a) is
# ndarray and a.dtype is INT64 and a.strides == STRIDES_1D`` (builtin dtypes
# are singletons; strides of (8,) mean 1-D and contiguous in one compare).
INT64 = np.dtype(np.int64)
STRIDES_1D = (8,)
_INT64 = INT64
_STRIDES_1D = STRIDES_1D
_min = np.minimum.reduce
_BOOLS = frozenset((bool, np.bool_))
_SHORT_BATCH = 32  # numbers a batch call's arguments hold, below which a scan for a 0 or a 1 beats numpy's min
_INT64_MAX = int(np.iinfo(np.int64).max)
_EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_EMPTY_SLOTS.flags.writeable = False


# Protocols that make an object an array (numpy, torch, JAX, CuPy, ...). Many
# such arrays also define ``__index__`` for one-element contents, so
# ``operator.index`` alone would read ``tensor([[16]])`` as 16.
_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__array_struct__", "__dlpack__", "__cuda_array_interface__")


def is_array_like(value: Any) -> bool:
    """Whether ``value`` is an array of any library (numpy scalars excluded)."""
    if isinstance(value, np.generic):
        return False
    cls = type(value)
    return isinstance(value, np.ndarray) or any(hasattr(cls, attr) for attr in _ARRAY_PROTOCOLS)


def as_count(value: Any, name: str) -> int:
    """Return ``value`` as a Python int, or raise ``TypeError`` naming ``name``.

    Accepts ``int``, numpy integer scalars and other objects with
    ``__index__``; rejects ``bool`` (an int subclass that is almost always a
    bug here), floats, strings, ``None`` and arrays of every library,
    including 0-d and one-element ones, whatever their ``__index__`` says.
    """
    if type(value) is int:  # the hot path
        return value
    if isinstance(value, (bool, np.bool_)):  # "bool" for numpy's too, whose name numpy 1 spells "bool_"
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    if isinstance(value, np.integer):
        return int(value)
    if is_array_like(value):
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}; "
            "pass a Python int (e.g. int(x)) for a count held in an array"
        )
    try:
        return operator.index(value)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - TypeError, or whatever a broken __index__ raises: all become TypeError
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def shown(value: int) -> str:
    """An integer as an error message gives it: whole, or its size where it is too long to print (Python refuses
    to make a ``str`` of more than 4,300 digits; a message must not fail)."""
    if value.bit_length() <= _PRINTED_BITS:
        return str(value)
    return f"{'-' if value < 0 else ''}a {value.bit_length():,}-bit integer"


_PRINTED_BITS = 256  # some 77 digits: beyond, the size says as much as the digits


def pool_shape(size: Any, page_size: Any) -> tuple[int, int]:
    """A pool's ``size`` and ``page_size`` as ints, checked as every pool's constructor checks them."""
    size = as_count(size, "size")
    page_size = as_count(page_size, "page_size")
    if page_size < 1:
        raise HostPoolError(f"page_size must be at least 1, got page_size={shown(page_size)}")
    if size < 0:
        raise HostPoolError(f"size must be non-negative, got size={shown(size)}")
    for name, value in (("size", size), ("page_size", page_size)):
        if value > _INT64_MAX:  # the kernels compute slot ids in int64
            raise HostPoolError(f"{name} must fit in int64, got {name}={shown(value)}")
    return size, page_size


def holds_bool(values: list[Any] | tuple[Any, ...], name: str = "values") -> bool:
    """Whether a list or tuple (nested ones too) holds a ``bool``.

    numpy reads ``[5, True]`` as the int64 array ``[5, 1]`` (only a list of
    nothing but bools becomes a bool array), so a stray ``True`` would be
    slot 1. A flat sequence with no element equal to 0 or 1 is cleared by
    two scans in C; otherwise the elements' types are looked at. An element
    that is not an integer and whose ``==`` raises is a ``TypeError`` naming
    ``name``: no integer's does.
    """
    if not values:
        return False
    if type(values[0]) not in (list, tuple, np.ndarray):
        try:
            if True not in values and False not in values:
                return False
        except (TypeError, ValueError):  # an element whose == has no single truth value
            pass
        except Exception:  # noqa: BLE001 - whatever a caller's __eq__ raises: not an integer
            odd = next((v for v in values if type(v) is not int and not isinstance(v, np.integer)), values[0])
            raise TypeError(f"{name} must hold integers, got {type(odd).__name__} (comparing it raised)") from None
    types = set(map(type, values))
    if bool in types or np.bool_ in types:
        return True
    if types <= _INT_TYPES:
        return False
    return any(holds_bool(v, name) if type(v) is list or type(v) is tuple else _bool_typed(v) for v in values)


_INT_TYPES = {int, np.int64, np.int32}


def _bool_typed(value: Any) -> bool:
    """Whether ``value`` is an array or tensor of bools (a 0-d one too: numpy reads it as 1 inside a list)."""
    dtype = getattr(value, "dtype", None)
    if isinstance(dtype, np.dtype):
        return dtype.kind == "b"
    return dtype is not None and str(dtype) == "torch.bool"


def own_slots(indices: Any, name: str = "indices") -> NDArray[np.int64]:
    """:func:`as_slots`, always a new array: for Python code that reads the slots more than once.

    A check and then an index must see the same values: a caller's thread
    writing its array in between could otherwise make a checked slot
    negative, which numpy reads as a wrapped index.
    """
    slots = as_slots(indices, name)
    return slots.copy() if slots is indices else slots


def as_slots(indices: Any, name: str = "indices") -> NDArray[np.int64]:
    """Flatten ``indices`` (C order) into a C-contiguous int64 array.

    Accepts numpy arrays and anything ``np.asarray`` understands (lists,
    tuples, objects with ``__array__``) holding integers of any width; input
    that is already 1-D C-contiguous native int64 is returned as is, without
    a copy. An empty list or tuple is accepted whatever numpy guesses for its
    dtype. Raises ``TypeError`` for scalars and for float, bool, complex,
    object and string data, and for a list or tuple with a bool among its
    integers.
    """
    if type(indices) is np.ndarray:
        arr = indices
        if arr.dtype == _INT64 and arr.ndim == 1 and arr.flags.c_contiguous:
            return arr  # the hot path: no copy
    elif isinstance(indices, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be an array of integer slot ids, got {type(indices).__name__}")
    else:
        _reject_masked(indices, name)
        try:
            arr = np.asarray(indices)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - ragged lists, an __array__ that raises: all become TypeError
            raise TypeError(
                f"{name} must be an array of integer slot ids, got {type(indices).__name__}: {exc}"
            ) from None
        if arr.size == 0 and isinstance(indices, (list, tuple)):
            return _EMPTY_SLOTS
    if arr.ndim == 0:
        raise TypeError(f"{name} must be an array of integer slot ids, got a scalar {indices!r}; wrap it in a list")
    if arr.dtype.kind in "fO" and arr is not indices:
        # numpy stores Python ints beyond int64 as objects, or as floats when
        # mixed with negative ones: look at the values the caller gave.
        _raise_if_big_ints(np.asarray(indices, dtype=object), name)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must hold integers, got dtype {arr.dtype}; "
            "convert with .astype(np.int64) if the values are whole slot ids"
        )
    if isinstance(indices, (list, tuple)) and holds_bool(indices, name):
        raise TypeError(f"{name} must hold integers, got a bool among them (numpy would read True as slot 1)")
    flat = arr.reshape(-1)
    if arr.dtype.kind == "u" and flat.size and int(flat.max()) > _INT64_MAX:
        pos = int(np.argmax(flat > _INT64_MAX))
        raise SlotRangeError(
            f"free got slot {shown(int(flat[pos]))} at {name}[{pos}] (flattened), outside the int64 range"
        )
    return np.ascontiguousarray(flat, dtype=np.int64)


def _reject_masked(values: Any, name: str) -> None:
    """Refuse masked arrays: ``np.asarray`` would use their masked entries too.

    ``numpy.ma`` is looked up in ``sys.modules`` rather than imported: a
    masked array can only exist once it has been imported.
    """
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(values, ma.MaskedArray):
        use = "its masked entries would count" if name == "sizes" else "free would also free its masked entries"
        raise TypeError(
            f"{name} must not be a masked array: {use}; pass {name}.compressed() to use only the unmasked ones"
        )


def _raise_if_big_ints(arr: NDArray[np.object_], name: str) -> None:
    """Report Python ints too large for int64 as the range errors they are.

    ``arr`` holds the caller's values as objects. Without this check such
    ints would be reported as a dtype problem, hiding the real one (a slot
    out of range).
    """
    flat = arr.reshape(-1)
    values = flat.tolist()
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        return
    for pos, v in enumerate(values):
        if not -_INT64_MAX - 1 <= int(v) <= _INT64_MAX:
            raise SlotRangeError(f"free got slot {shown(int(v))} at {name}[{pos}] (flattened), outside the int64 range")


def as_sizes(sizes: Any) -> NDArray[np.int64] | list[int]:
    """``alloc_many``'s sizes as a fresh 1-D int64 array the pool owns.

    Accepts a list or tuple of ints (numpy integer scalars too) and any
    1-D integer array or array-like; the result is always a copy, so a
    caller's thread writing its array cannot change the batch between its
    checks and its allocation. Each element must be an integer, as for
    ``alloc``: a bool, float or other element is a ``TypeError`` naming its
    position. Integers beyond int64 cannot be held in the array: the sizes
    are then returned as a list of Python ints, for the caller's slow path.
    """
    if isinstance(sizes, (list, tuple, range)):
        if set(map(type, sizes)) <= {int}:  # the common case, checked in C
            try:
                return np.array(sizes, dtype=np.int64)
            except OverflowError:
                return list(sizes)
        # Numpy scalars or something else: each element as alloc reads its count.
        values = [as_count(value, f"sizes[{pos}]") for pos, value in enumerate(sizes)]
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            return values
    if isinstance(sizes, (str, bytes, bytearray)) or not is_array_like(sizes):
        raise TypeError(
            f"sizes must be a 1-D sequence or array of integers, got {type(sizes).__name__} {sizes!r}"
            + ("; wrap a single size in a list" if isinstance(sizes, (int, np.integer)) else "")
        )
    _reject_masked(sizes, "sizes")
    arr = _one_d(sizes, "sizes", "a 1-D array of integers", np.asarray, shape_of="an array")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"sizes must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        return [int(v) for v in arr.tolist()]
    return np.array(arr, dtype=np.int64, copy=True)


def pack_ints(values: list[Any] | tuple[Any, ...], name: str, beyond_ok: bool = False) -> NDArray[np.int64] | None:
    """A list or tuple of ints as a fresh int64 array; None when numpy must say what is wrong.

    An int beyond int64 is a ``HostPoolError``, or with ``beyond_ok`` a
    ``None`` for the caller to handle.

    sglang-jax passes Python lists. struct packs them into the fresh array
    in C, faster than numpy's type inference, and refuses floats, strings
    and ints beyond int64 itself. A bool is an int to struct and numpy alike
    (packed as 0 or 1), so the elements' types are looked at only when some
    value is 0 or 1: a full scan would cost more than the packing.
    """
    fresh = np.empty(len(values), dtype=np.int64)
    try:
        struct.pack_into(f"{len(values)}q", fresh, 0, *values)  # type: ignore[arg-type]  # ndarray is a buffer; its stubs say so only on 3.12+
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - struct.error, or whatever an element's __index__ raises
        packed = False
    else:
        packed = True
        if not fresh.shape[0] or _min(fresh) > 1:
            return fresh
    if holds_bool(values, name):
        raise TypeError(f"{name} must hold integers, got dtype bool (a bool among the integers)")
    if packed:
        return fresh
    try:
        array("q", values)  # why struct refused: a non-integer, or an int beyond int64?
    except OverflowError:
        if beyond_ok:
            return None
        raise HostPoolError(f"{name} holds a value beyond the int64 range") from None
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - a non-integer element (or a raising __index__): numpy's conversion names it
        return None
    return None


def as_int_vector(values: Any, name: str) -> NDArray[np.int64]:
    """A batch argument (list, tuple or 1-D integer array) as a fresh int64 array.

    A copy the allocator owns, so a caller's thread cannot change it between
    its checks and its use. numpy reads a list of ints straight into int64;
    a float or string element makes numpy pick another dtype, which is a
    ``TypeError`` naming ``name``, and so is a bool (numpy would read it as
    0 or 1).
    """
    if type(values) is np.ndarray and values.dtype is _INT64 and values.strides == _STRIDES_1D:
        fresh: NDArray[np.int64] = values.copy()
        return fresh
    if type(values) is list or type(values) is tuple:
        packed = pack_ints(values, name)
        if packed is not None:
            return packed
    if isinstance(values, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a 1-D sequence or array of integers, got {type(values).__name__}")
    # np.array makes the one copy; for a list of ints it is already int64.
    arr = _one_d(values, name, "a 1-D sequence or array of integers", np.array)
    if arr.dtype is _INT64:
        return arr
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        raise HostPoolError(f"{name} holds {int(arr.max())}, beyond the int64 range")
    return arr.astype(np.int64)


def as_int_vectors(values: tuple[Any, ...], names: tuple[str, ...]) -> tuple[NDArray[np.int64], ...]:
    """:func:`as_int_vector` of each of a batch call's per-request arguments, in order.

    sglang-jax passes them as lists: then one fresh buffer, one ``struct``
    pack and one look for a bool serve them all, each argument a view of
    its part (a buffer, pack and minimum per argument cost a twentieth of
    a 256-request decode). Anything else, or a pack
    that fails, converts argument by argument, so the error is the one
    :func:`as_int_vector` gives for the first bad argument.
    """
    flat: list[Any] = []
    for v in values:
        if type(v) is not list and type(v) is not tuple:
            return tuple(as_int_vector(v, name) for v, name in zip(values, names, strict=True))
        flat += v  # in C; a list unpacks into the pack's arguments faster than any iterator
    total = len(flat)
    fresh = np.empty(total, dtype=np.int64)
    try:
        struct.pack_into(f"{total}q", fresh, 0, *flat)  # type: ignore[arg-type]  # ndarray is a buffer
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - struct.error, or an element's __index__: each argument says which
        return tuple(as_int_vector(v, name) for v, name in zip(values, names, strict=True))
    # A 0 or a 1 may have been a bool. numpy's minimum has a fixed cost: a short batch is scanned instead.
    if total > _SHORT_BATCH and _min(fresh) > 1:
        suspects: Any = ()
    else:
        suspects = zip(values, names, strict=True)
    for v, name in suspects:
        try:  # packed, so flat: an argument with a 0 or a 1 is looked at, its types once each
            mixed = (True in v or False in v) and not _BOOLS.isdisjoint(map(type, v))
        except Exception:  # noqa: BLE001 - an element whose == raises: holds_bool says what it is
            mixed = holds_bool(v, name)
        if mixed:
            raise TypeError(f"{name} must hold integers, got dtype bool (a bool among the integers)")
    views, start = [], 0
    for v in values:
        end = start + len(v)
        views.append(fresh[start:end])
        start = end
    return tuple(views)


def as_page_ids(values: Any, name: str) -> tuple[NDArray[np.int64], dict[int, int]]:
    """A 1-D sequence of page ids as an int64 array the kernels read once; ``(array, beyond)``.

    Takes a list, a tuple, a 1-D integer array of any width (or array-like),
    or any other iterable of integers. A C-contiguous int64 array is
    returned as it is; anything else becomes a fresh array. Integers beyond
    int64 cannot be held: each is stored as -1 (out of range, in its place
    in the order of checks) and ``beyond`` maps its position to the value,
    for the error message. A bool, a float or any other non-integer is a
    ``TypeError`` naming ``name``.
    """
    if type(values) is np.ndarray and values.dtype is INT64 and values.strides == STRIDES_1D:
        return values, {}
    if isinstance(values, (str, bytes, bytearray, int, np.integer)):
        raise TypeError(
            f"{name} must be a sequence or 1-D array of page ids, got {type(values).__name__} {values!r}"
            + ("; wrap a single page in a list" if isinstance(values, (int, np.integer)) else "")
        )
    if not isinstance(values, (list, tuple)) and not is_array_like(values):
        try:
            values = list(values)
        except TypeError:
            raise TypeError(
                f"{name} must be a sequence or 1-D array of page ids, got {type(values).__name__}"
            ) from None
    if isinstance(values, (list, tuple)):
        found = _page_list(values, name)
        if found is not None:
            return found
    return _page_array(values, name)


def _page_list(values: list[Any] | tuple[Any, ...], name: str) -> tuple[NDArray[np.int64], dict[int, int]] | None:
    """A list of ints as page ids (ints beyond int64 as -1); ``None`` if it holds a non-integer."""
    packed = pack_ints(values, name, beyond_ok=True)
    if packed is not None:
        return packed, {}
    if not values or not all(type(v) is int or isinstance(v, np.integer) for v in values):
        return None
    beyond = {i: int(v) for i, v in enumerate(values) if not -_INT64_MAX - 1 <= int(v) <= _INT64_MAX}
    return np.array([-1 if i in beyond else int(v) for i, v in enumerate(values)], dtype=np.int64), beyond


def _one_d(
    values: Any, name: str, what: str, convert: Callable[[Any], NDArray[Any]], shape_of: str | None = None
) -> NDArray[Any]:
    """``convert(values)`` (``np.array``, ``np.asarray``) if 1-D; else a ``TypeError`` naming ``name``.

    A shape that is not 1-D is said to be ``shape_of``'s, by default that of ``values``'s type.
    """
    try:
        arr = convert(values)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to convert is the argument's fault
        raise TypeError(f"{name} must be {what}, got {type(values).__name__}: {exc}") from None
    if arr.ndim != 1:
        raise TypeError(f"{name} must be 1-D, got {shape_of or type(values).__name__} of shape {arr.shape}")
    return arr


def _page_array(values: Any, name: str) -> tuple[NDArray[np.int64], dict[int, int]]:
    """An array or array-like as page ids; numpy says what is wrong with anything else."""
    _reject_masked(values, name)
    arr = _one_d(values, name, "a sequence or 1-D array of page ids", np.asarray)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64), {}
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > _INT64_MAX:
        over = arr > _INT64_MAX
        beyond = {int(i): int(arr[i]) for i in np.flatnonzero(over)}
        ids = arr.astype(np.int64)  # wraps; the wrapped entries are overwritten next
        ids[over] = -1
        return ids, beyond
    return np.array(arr, dtype=np.int64), {}
