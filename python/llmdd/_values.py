"""Values and argument checks of the binding: enums, CacheDesc, CacheIndex,
ClusterInfo and the converters to the C structures (_ffi)."""

import collections
import ctypes
import enum
import math
import operator

from . import _ffi
from ._memory import U64_MAX
from ._status import Status

_WAIT = int(Status.LLM_WAIT_PROC_TIMEOUT)
_I32_MAX = 2**31 - 1
_I64_MAX = 2**63 - 1
_U32_MAX = 2**32 - 1


class Role(enum.IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(enum.IntEnum):
    HOST = 0
    DEVICE = 1


class DataType(enum.IntEnum):
    FLOAT = 0
    FLOAT16 = 1
    INT8 = 2
    INT32 = 3
    UINT8 = 4
    INT16 = 6
    UINT16 = 7
    UINT32 = 8
    INT64 = 9
    UINT64 = 10
    DOUBLE = 11
    BOOL = 12
    BF16 = 27
    UNDEFINED = 28


# Bytes of one element of each type with a known size, from the library.
DTYPE_SIZE = {int(t): _ffi.lib.llmdd_data_type_size(int(t)) for t in DataType
              if _ffi.lib.llmdd_data_type_size(int(t)) > 0}


# ----------------------------------------------------------------- checks

_BOOL_DTYPES = ("bool", "torch.bool")


def as_int(name, v):
    """The binding's one rule for an integer argument: v as a Python int.
    Python ints (and int enums), numpy integer scalars and 0-d torch or
    numpy integer tensors are integers; floats, strings, bools (Python,
    numpy or torch: operator.index alone would take them as 0 and 1) and
    anything else raise TypeError. A float block index computed by a
    division would otherwise name the wrong block without an error."""
    if type(v) is int:
        return v
    if (not isinstance(v, bool) and getattr(v, "ndim", 0) == 0
            and str(getattr(v, "dtype", "")) not in _BOOL_DTYPES):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an integer, got {type(v).__name__}")


def as_ints(name, seq):
    """A sequence of integers as a list of Python ints, by as_int's rule: a
    list or tuple element by element, a 1-d numpy array or torch tensor by
    its dtype (an integer one, not bool)."""
    dt = getattr(seq, "dtype", None)
    if dt is not None and hasattr(seq, "tolist"):
        if getattr(seq, "ndim", None) != 1:
            raise TypeError(f"{name} must be one-dimensional")
        kind = getattr(dt, "kind", None)        # numpy; torch dtypes have none
        integer = kind in ("i", "u") if kind is not None else not (
            dt.is_floating_point or dt.is_complex or str(dt) in _BOOL_DTYPES)
        if not integer:
            raise TypeError(f"{name} must hold integers, got dtype {dt}")
        return seq.tolist()
    if isinstance(seq, (str, bytes, bytearray)) or not hasattr(seq, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integers, got "
                        f"{type(seq).__name__}")
    return [as_int(f"{name}[{i}]", b) for i, b in enumerate(seq)]


def _int(name, v, lo, hi):
    v = as_int(name, v)
    if not lo <= v <= hi:
        raise ValueError(f"{name}={v} out of range [{lo}, {hi}]")
    return v


# The fast paths (an int in range) come first: these run on every transfer.
def _u64(name, v):
    if type(v) is int and 0 <= v <= U64_MAX:
        return v
    return _int(name, v, 0, U64_MAX)


def _u32(name, v):
    if type(v) is int and 0 <= v <= _U32_MAX:
        return v
    return _int(name, v, 0, _U32_MAX)


def _timeout(name, v, allow_none=True):
    if v is None and allow_none:
        return -1
    return _int(name, v, 0, _I32_MAX)


def _bytes(name, v, lo, hi):
    if isinstance(v, str):
        v = v.encode()
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be bytes or str, got {type(v).__name__}")
    v = bytes(v)
    if not lo <= len(v) <= hi:
        raise ValueError(f"{name}: {len(v)} bytes, expected {lo}..{hi}")
    return v


def _options(options):
    """dict -> (array of llmdd_option, keepalive)."""
    if options is None:
        return None, 0, None
    if not isinstance(options, dict):
        raise TypeError("options must be a dict of str to str")
    items = []
    for k, v in options.items():
        if not isinstance(k, str):
            raise TypeError(f"option key {k!r} must be a str")
        if isinstance(v, bool):
            v = "1" if v else "0"
        if not isinstance(v, (str, int)):
            raise TypeError(f"option {k}: value must be a str or an int")
        items.append((k.encode(), str(v).encode()))
    arr = (_ffi.OptionC * max(1, len(items)))()
    for i, (k, v) in enumerate(items):
        arr[i].key, arr[i].value = k, v
    return arr, len(items), items


def _layer_range(name, r):
    """A half-open Python range -> the C inclusive pair; None = all layers."""
    if r is None:
        return -1, -1
    if not isinstance(r, range):
        raise TypeError(f"{name} must be a range (half-open) or None")
    if r.step != 1 or r.start < 0 or r.stop <= r.start or r.stop - 1 > _I32_MAX:
        raise ValueError(f"{name}={r!r}: need step 1 and 0 <= start < stop")
    return r.start, r.stop - 1


def _ext(src_layers, dst_layers, tensor_num_per_layer):
    e = _ffi.KvExtParamC()
    e.src_layer_range.first, e.src_layer_range.second = _layer_range("src_layers", src_layers)
    e.dst_layer_range.first, e.dst_layer_range.second = _layer_range("dst_layers", dst_layers)
    # Checked by the library, and only where used (a range, a layer-wise push).
    e.tensor_num_per_layer = _int("tensor_num_per_layer", tensor_num_per_layer, 0, _U32_MAX)
    return e


def _ext_ref(src_layers, dst_layers, tensor_num_per_layer):
    """The ext argument of a transfer: None (NULL, the library's default)
    for the defaults, else a checked structure."""
    if (src_layers is None and dst_layers is None and type(tensor_num_per_layer) is int
            and tensor_num_per_layer == 2):
        return None
    return _ext(src_layers, dst_layers, tensor_num_per_layer)


_U64_ARRAY = ctypes.c_uint64 * 1


def _blocks(name, blocks):
    # Fast path: a ctypes uint64 array or a numpy uint64 vector is passed as
    # is (the library checks every index against the cache).
    if isinstance(blocks, ctypes.Array) and blocks._type_ is ctypes.c_uint64:
        if len(blocks) == 0:
            raise ValueError(f"{name} is empty")
        return blocks, len(blocks)
    dt = getattr(blocks, "dtype", None)
    if dt is not None and str(dt) == "uint64" and getattr(blocks, "ndim", 0) == 1:
        m = memoryview(blocks)
        if m.c_contiguous and m.nbytes:
            arr = (ctypes.c_uint64 * len(blocks)).from_buffer(blocks) if not m.readonly \
                else (ctypes.c_uint64 * len(blocks)).from_buffer_copy(m)
            return arr, len(blocks)
    vals = as_ints(name, blocks)
    n = len(vals)
    if n == 0:
        raise ValueError(f"{name} is empty")
    for i, b in enumerate(vals):
        if not 0 <= b <= U64_MAX:
            raise ValueError(f"{name}[{i}]={b} out of range [0, {U64_MAX}]")
    return (ctypes.c_uint64 * n)(*vals), n


# ----------------------------------------------------------------- values

class CacheDesc:
    """A cache's description: num_tensors tensors of one shape and type.
    shape[batch_dim] is the batch size (shape[0], the number of blocks, for
    a block cache); a slot is the sub-tensor at one index of that dim
    (docs/model.md, "The batch dimension")."""

    __slots__ = ("num_tensors", "shape", "data_type", "placement", "batch_dim")

    def __init__(self, num_tensors, shape, data_type=DataType.UINT8,
                 placement=Placement.HOST, batch_dim=0):
        num_tensors = _int("num_tensors", num_tensors, 1, _U32_MAX)
        if not isinstance(shape, (tuple, list)) and getattr(shape, "ndim", 0) == 0:
            shape = (shape,)            # one dimension, checked below
        shape = as_ints("shape", shape)
        if not 1 <= len(shape) <= _ffi.MAX_DIMS:
            raise TypeError(f"shape must be a tuple of 1..{_ffi.MAX_DIMS} ints")
        for i, d in enumerate(shape):
            _int(f"shape[{i}]", d, 1, _I64_MAX)
        data_type = _enum(DataType, "data_type", data_type)
        placement = _enum(Placement, "placement", placement)
        batch_dim = _int("batch_dim", batch_dim, 0, len(shape) - 1)
        self.num_tensors = num_tensors
        self.shape = tuple(shape)
        self.data_type = data_type
        self.placement = placement
        self.batch_dim = batch_dim

    @property
    def tensor_size(self):
        """Bytes in one tensor (prod(shape) * element size); None when the
        data type has no size."""
        es = DTYPE_SIZE.get(int(self.data_type))
        return None if es is None else math.prod(self.shape) * es

    @property
    def stride(self):
        """Bytes in one slot."""
        ts = self.tensor_size
        return None if ts is None else ts // self.shape[self.batch_dim]

    def _c(self):
        d = _ffi.CacheDescC()
        d.placement = int(self.placement)
        d.num_tensors = self.num_tensors
        d.data_type = int(self.data_type)
        d.num_dims = len(self.shape)
        for i, s in enumerate(self.shape):
            d.shape[i] = s
        return d

    def __repr__(self):
        bd = f", batch_dim={self.batch_dim}" if self.batch_dim else ""
        return (f"CacheDesc(num_tensors={self.num_tensors}, shape={self.shape}, "
                f"data_type={self.data_type.name}, placement={self.placement.name}{bd})")


CacheIndex = collections.namedtuple("CacheIndex", "cluster_id cache_id batch_index",
                                    defaults=(0,))
CacheIndex.__doc__ = "Names a remote cache's batch slot: (cluster_id, cache_id, batch_index=0)."


def _index_ints(v):
    """(cluster_id, cache_id, batch_index) of a CacheIndex, or of a plain
    (cluster_id, cache_id[, batch_index]) tuple, whose fields are ints in
    range; None otherwise (_index then decides). Instance._fast_slot makes
    the same checks inline, without a call."""
    t = type(v)
    if t is CacheIndex or (t is tuple and len(v) == 3):
        a, b, c = v
    elif t is tuple and len(v) == 2:
        (a, b), c = v, 0
    else:
        return None
    if (type(a) is int and type(b) is int and type(c) is int and 0 <= a <= U64_MAX
            and -2**63 <= b <= _I64_MAX and 0 <= c <= _U32_MAX):
        return (a, b, c)
    return None


def _index(v, name="src"):
    t = _index_ints(v)          # the common case, checked inline
    if t is not None:
        return _ffi.CacheIndexC(*t)
    if getattr(v, "_is_local_cache", False):     # an llmdd.Cache
        raise TypeError(f"{name} must name a remote cache: CacheIndex(cluster_id, "
                        "cache_id, batch_index)")
    if not isinstance(v, tuple) or len(v) not in (2, 3):
        raise TypeError(f"{name} must be a CacheIndex or (cluster_id, cache_id[, batch_index])")
    ci = CacheIndex(*v)
    c = _ffi.CacheIndexC()
    c.cluster_id = _u64(f"{name}.cluster_id", ci.cluster_id)
    c.cache_id = _int(f"{name}.cache_id", ci.cache_id, -2**63, _I64_MAX)
    c.batch_index = _u32(f"{name}.batch_index", ci.batch_index)
    return c


class ClusterInfo:
    """One peer to link: its cluster id and its address (host:port,
    "[v6]:port" or a (host, port) pair)."""

    def __init__(self, remote_cluster_id, remote_addr=None, local_addrs=(),
                 remote_role_type=0):
        self.remote_cluster_id = _u64("remote_cluster_id", remote_cluster_id)
        self.remote_addrs = [] if remote_addr is None else [_addr(remote_addr)]
        self.local_addrs = [_addr(a) for a in local_addrs]
        self.remote_role_type = _int("remote_role_type", remote_role_type, -2**31, _I32_MAX)

    def __repr__(self):
        return f"ClusterInfo({self.remote_cluster_id}, {self.remote_addrs})"


def _addr(a):
    if isinstance(a, str):
        host, sep, port = a.rpartition(":")
        if not sep:
            raise ValueError(f"address {a!r}: expected host:port")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            port = int(port)
        except ValueError:
            raise ValueError(f"address {a!r}: bad port") from None
        a = (host, port)
    if not isinstance(a, tuple) or len(a) != 2 or not isinstance(a[0], str):
        raise TypeError("an address is 'host:port' or (host, port)")
    host, port = a
    port = _int("port", port, 0, 65535)
    if not 0 < len(host.encode()) < _ffi.IP_LEN:
        raise ValueError(f"address host {host!r}: 1..{_ffi.IP_LEN - 1} bytes")
    return host, port


def _ip_array(addrs):
    if not addrs:
        return None, 0
    arr = (_ffi.IpInfoC * len(addrs))()
    for i, (h, p) in enumerate(addrs):
        arr[i].ip = h.encode()
        arr[i].port = p
    return arr, len(addrs)



def _enum(cls, name, v):
    """A member of the int enum cls, by as_int's rule: Role(1.0) and
    Role(True) would otherwise both be PROMPT."""
    if type(v) is cls:
        return v
    try:
        return cls(as_int(name, v))
    except ValueError:
        raise ValueError(f"{name}: {v!r} is not one of "
                         f"{', '.join(m.name for m in cls)}") from None


def _role(role):
    return _enum(Role, "role", role)


def _size(size):
    if type(size) is int and (size == -1 or 0 < size <= _I64_MAX):
        return size
    size = _int("size", size, -1, _I64_MAX)
    if size == 0:
        raise ValueError("size must be -1 (whole slot) or > 0")
    return size


def _bad_cache(name):
    raise TypeError(f"{name} must be a llmdd.Cache of this instance")
