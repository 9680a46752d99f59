"""Memory from Python objects: an address and a length, checked before use.

Accepted, in this order:
- an object with ``data_ptr()`` (a torch tensor, duck-typed: torch is never
  imported): CPU device, contiguous, non-empty;
- an object with the buffer protocol (numpy array, bytearray, memoryview,
  array.array, mmap): writable and C-contiguous, non-empty;
- an int address (> 0): the caller vouches for its size.

``Memory.keep`` holds what keeps the memory alive (and, for buffer-protocol
objects, the exported buffer, so that a bytearray cannot be resized under a
peer's transfer).
"""

import ctypes

U64_MAX = 2**64 - 1

# numpy dtype names and torch dtype names -> llmdd_data_type values
_DTYPE_BY_NAME = {
    "float32": 0, "float": 0, "float16": 1, "half": 1, "int8": 2, "int32": 3,
    "uint8": 4, "int16": 6, "uint16": 7, "uint32": 8, "int64": 9, "uint64": 10,
    "float64": 11, "double": 11, "bool": 12, "bfloat16": 27,
}


class Memory:
    __slots__ = ("addr", "nbytes", "keep", "shape", "dtype")

    def __init__(self, addr, nbytes, keep, shape=None, dtype=None):
        self.addr = addr
        self.nbytes = nbytes      # None for a bare int address
        self.keep = keep
        self.shape = shape        # tuple or None
        self.dtype = dtype        # llmdd_data_type value or None


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _torch_like(obj):
    dev = getattr(obj, "device", None)
    dev_type = getattr(dev, "type", dev)
    if dev_type is not None and str(dev_type) != "cpu":
        raise ValueError(f"tensor on device {dev!s}: only CPU memory is supported "
                         "in this build")
    is_contig = getattr(obj, "is_contiguous", None)
    if is_contig is None or not is_contig():
        raise ValueError("tensor must be contiguous (call .contiguous())")
    try:
        numel = int(obj.numel())
        elsize = int(obj.element_size())
        addr = int(obj.data_ptr())
    except AttributeError as e:
        raise TypeError(f"tensor-like object lacks {e.name or 'numel/element_size'}") from None
    if numel <= 0 or elsize <= 0 or addr <= 0:
        raise ValueError("tensor is empty")
    shape = tuple(int(d) for d in getattr(obj, "shape", ()) or ())
    dtype = _DTYPE_BY_NAME.get(str(getattr(obj, "dtype", "")).replace("torch.", ""))
    return Memory(addr, numel * elsize, obj, shape or None, dtype)


def _buffer(obj):
    mv = memoryview(obj)
    if mv.readonly:
        raise ValueError(f"{type(obj).__name__} is read-only: registered memory "
                         "must be writable")
    if not mv.c_contiguous:
        raise ValueError(f"{type(obj).__name__} is not C-contiguous")
    if mv.nbytes <= 0:
        raise ValueError(f"{type(obj).__name__} is empty")
    # from_buffer exports the buffer for as long as the ctypes array lives.
    arr = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    shape = None
    dtype = None
    np_dtype = getattr(obj, "dtype", None)
    if np_dtype is not None and hasattr(obj, "shape"):
        shape = tuple(int(d) for d in obj.shape)
        dtype = _DTYPE_BY_NAME.get(str(np_dtype))
    return Memory(ctypes.addressof(arr), mv.nbytes, (obj, mv, arr), shape, dtype)


def memory_of(obj, what="memory"):
    """Returns a Memory for obj, or raises TypeError/ValueError."""
    if obj is None or isinstance(obj, bool):
        raise TypeError(f"{what}: expected a tensor, a buffer or an int address, "
                        f"got {type(obj).__name__}")
    if _is_int(obj):
        if obj <= 0 or obj > U64_MAX:
            raise ValueError(f"{what}: address {obj:#x} out of range")
        return Memory(obj, None, None)
    if hasattr(obj, "data_ptr") and callable(obj.data_ptr):
        return _torch_like(obj)
    try:
        return _buffer(obj)
    except TypeError:
        raise TypeError(f"{what}: {type(obj).__name__} has neither data_ptr() nor "
                        "the buffer protocol, and is not an int address") from None
