"""The reference's cache types: CacheDesc, Cache, the cache keys, transfer
configs and CacheTask."""

import abc
import enum
import math
import struct

from .data_type import DataType
from .status import (LLMException, LLMStatusCode, raise_if_false, check_int,
                     check_ints, as_int)

_INVALID_ID = 2**64 - 1
_U64 = 2**64 - 1
_U32 = 2**32 - 1
_I64 = 2**63 - 1
_DT_SIZE = {0: 4, 1: 2, 2: 1, 3: 4, 4: 1, 6: 2, 7: 2, 8: 4, 9: 8, 10: 8, 11: 8, 12: 1, 27: 2}


class Placement(enum.IntEnum):
    HOST = 0
    DEVICE = 1      # host memory in this build (no accelerator memory)

    def __str__(self):
        return f"{self.__class__.__name__}.{self.name}"


class RegisterMemStatus(enum.Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(enum.Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class MemInfo:
    """A registered memory range, as remap_registered_memory takes it."""

    def __init__(self, mem_type, addr, size):
        if not isinstance(mem_type, Memtype):
            raise TypeError(f"mem_type only support ['Memtype'], but got {type(mem_type)}.")
        self._mem_type = mem_type
        self._addr = as_int("addr", addr)
        self._size = as_int("size", size)

    mem_type = property(lambda self: self._mem_type)
    addr = property(lambda self: self._addr)
    size = property(lambda self: self._size)

    def __repr__(self):
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"


class CacheDesc:
    """num_tensors tensors of one shape and data type; shape[batch_dim_index]
    is the batch size (or number of blocks)."""

    def __init__(self, num_tensors, shape, data_type, placement=Placement.DEVICE,
                 batch_dim_index=0, seq_len_dim_index=-1, kv_tensor_format=None):
        num_tensors = check_int("num_tensors", num_tensors, 0, _U32)
        shape = check_ints("shape", shape)
        for d in shape:
            check_int("shape", d, -2**63, _I64)
        batch_dim_index = as_int("batch_dim_index", batch_dim_index)
        if kv_tensor_format is not None and not isinstance(kv_tensor_format, str):
            raise TypeError("kv_tensor_format must be a str")
        seq_len_dim_index = check_int("seq_len_dim_index", seq_len_dim_index,
                                      -2**31, 2**31 - 1)
        if not isinstance(data_type, DataType):
            raise TypeError("data_type must be a DataType")
        if not isinstance(placement, Placement):
            raise TypeError("placement must be a Placement")
        raise_if_false(0 <= batch_dim_index < max(1, len(shape)),
                       f"batch_dim_index {batch_dim_index} out of range")
        raise_if_false(seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
                       f"seq_len_dim_index {seq_len_dim_index} is invalid")
        self._num_tensors = num_tensors
        self._shape = list(shape)
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    num_tensors = property(lambda self: self._num_tensors)
    shape = property(lambda self: self._shape)
    data_type = property(lambda self: self._data_type)
    placement = property(lambda self: self._placement)
    batch_dim = property(lambda self: self._batch_dim)
    seq_len_dim_index = property(lambda self: self._seq_len_dim_index)
    kv_tensor_format = property(lambda self: self._kv_tensor_format)

    @property
    def batch_size(self):
        return self._shape[self._batch_dim] if self._shape else 0

    @property
    def size(self):
        """Bytes in one tensor."""
        es = _DT_SIZE.get(self._data_type.value)
        if es is None or not self._shape:
            raise LLMException(f"Failed to calc tensor size, shape = {self._shape}, "
                               f"data_type = {self._data_type}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return math.prod(self._shape) * es

    def update_dim(self, dim_index, dim_value):
        self._shape[as_int("dim_index", dim_index)] = \
            check_int("dim_value", dim_value, -2**63, _I64)

    def _llmdd(self):
        import llmdd
        try:
            return llmdd.CacheDesc(self._num_tensors, tuple(self._shape),
                                   self._data_type.value, self._placement.value,
                                   self._batch_dim)
        except (TypeError, ValueError) as e:
            raise LLMException(f"invalid CacheDesc {self!r}: {e}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID) from None

    def __repr__(self):
        return (f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
                f"data_type={self._data_type}, placement={self._placement})")


class Cache:
    """A cache made by CacheManager.register_cache / allocate_cache, or a
    host cache from create_cpu_cache (cache_id -1, for swap_blocks)."""

    def __init__(self, cache_id, cache_desc, tensor_addrs, is_blocks_cache=False,
                 _handle=None):
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._is_blocks_cache = is_blocks_cache
        self._handle = _handle      # the llmdd.Cache behind it

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    tensor_addrs = property(lambda self: self._tensor_addrs)
    is_blocks_cache = property(lambda self: self._is_blocks_cache)

    @classmethod
    def create_cpu_cache(cls, cache_desc, addrs):
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError("cache_desc must be a CacheDesc")
        if not isinstance(addrs, list):
            raise TypeError("addrs must be a list of ints")
        addrs = check_ints("addrs", addrs)
        raise_if_false(cache_desc.placement == Placement.HOST,
                       "cache_desc placement must be HOST")
        raise_if_false(cache_desc.num_tensors == len(addrs),
                       f"cache_desc num_tensors:{cache_desc.num_tensors} not equal "
                       f"addrs num:{len(addrs)}")
        for a in addrs:
            raise_if_false(0 < a <= _U64, "addr can not be zero.")
        return cls(-1, cache_desc, addrs, True)

    def __repr__(self):
        return (f"Cache(cache_id = {self._cache_id}, tensor_addrs = {len(self._tensor_addrs)},"
                f" is_blocks_cache = {self._is_blocks_cache})")


class KvCache:
    """The V1 API's cache (KvCacheManager.allocate_cache): one list of tensor
    addresses per device; llmdd has one "device", the host, so one list.
    create_cpu_cache makes a host cache for swap_blocks."""

    def __init__(self, cache_id, cache_desc, per_device_tensor_addrs, kv_cache_manager=None,
                 _cache=None):
        self._cache_id = check_int("cache_id", cache_id, -2**63, _I64)
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError("cache_desc must be a CacheDesc")
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager
        self._cache = _cache        # the V2 Cache behind it (None: a cpu cache)
        self._valid = _cache is not None

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    per_device_tensor_addrs = property(lambda self: self._per_device_tensor_addrs)

    @classmethod
    def create_cpu_cache(cls, cache_desc, addrs):
        """addrs: one int address per tensor, or such a list per device."""
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError("cache_desc must be a CacheDesc")
        raise_if_false(cache_desc.placement == Placement.HOST,
                       "cache_desc placement must be HOST")
        if not isinstance(addrs, list):
            raise TypeError("addrs must be a list")
        raise_if_false(len(addrs) > 0, "addrs length should be bigger than zero.")
        nested = isinstance(addrs[0], list)
        per_device = []
        for a in (addrs if nested else [addrs]):
            if not isinstance(a, list):
                raise TypeError("addrs must hold all ints or all lists of ints")
            a = check_ints("addrs", a)
            raise_if_false(cache_desc.num_tensors == len(a),
                           f"cache_desc num_tensors:{cache_desc.num_tensors} should be "
                           f"equal to the number of addrs:{len(a)}")
            for x in a:
                raise_if_false(0 < x <= _U64, "addr can not be zero.")
            per_device.append(a)
        return cls(-1, cache_desc, per_device)

    def __repr__(self):
        return (f"KvCache(cache_id = {self._cache_id}, "
                f"num_devices = {len(self._per_device_tensor_addrs)})")


def _kwargs_key(args, kwargs, order, limit):
    raise_if_false(len(args) + len(kwargs) <= limit, "Param num is over limit")
    kw = dict(kwargs)
    for name, v in zip(order, args):
        kw[name] = v
    raise_if_false("prompt_cluster_id" in kw or "cluster_id" in kw,
                   "Param prompt_cluster_id or cluster_id is required")
    for k in kw:
        raise_if_false(k in ("prompt_cluster_id",) + tuple(order), f"Unsupported param:{k}")
    kw["cluster_id"] = kw.pop("cluster_id", kw.pop("prompt_cluster_id", None))
    return kw


class CacheKey:
    """Names one batch slot of a prompt's cache: (cluster_id, req_id,
    model_id=0, prefix_id=2**64-1). On the wire it is the key bytes of
    _key_bytes (docs/python.md)."""

    def __init__(self, *args, **kwargs):
        kw = _kwargs_key(args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id"), 4)
        raise_if_false("req_id" in kw, "Param req_id is required")
        self._cluster_id = kw["cluster_id"]
        self._req_id = kw["req_id"]
        self._model_id = kw.get("model_id", 0)
        self._prefix_id = kw.get("prefix_id", _INVALID_ID)
        for n in ("cluster_id", "req_id", "model_id", "prefix_id"):
            setattr(self, "_" + n, check_int(n, getattr(self, "_" + n), 0, _U64))

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = cluster_id
    req_id = property(lambda self: self._req_id)
    model_id = property(lambda self: self._model_id)
    prefix_id = property(lambda self: self._prefix_id)

    def _key_bytes(self):
        return b"llmdd.ck1" + struct.pack("<QQQ", self._req_id, self._prefix_id,
                                          self._model_id)

    def __repr__(self):
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
                f"prefix_id={self._prefix_id}, model_id={self._model_id})")


class BlocksCacheKey:
    """Names a prompt's blocks cache: (cluster_id, model_id=0)."""

    def __init__(self, *args, **kwargs):
        kw = _kwargs_key(args, kwargs, ("cluster_id", "model_id"), 2)
        self._cluster_id = kw["cluster_id"]
        self._model_id = kw.get("model_id", 0)
        self._cluster_id = check_int("cluster_id", self._cluster_id, 0, _U64)
        self._model_id = check_int("model_id", self._model_id, 0, _U64)

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = cluster_id
    model_id = property(lambda self: self._model_id)

    def _key_bytes(self):
        return b"llmdd.bk1" + struct.pack("<Q", self._model_id)

    def __repr__(self):
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"


class CacheKeyByIdAndIndex:
    """Names a remote cache directly: (cluster_id, cache_id, batch_index=0)."""

    def __init__(self, cluster_id, cache_id, batch_index=0):
        cluster_id = check_int("cluster_id", cluster_id, 0, _U64)
        cache_id = check_int("cache_id", cache_id, -2**63, _I64)
        batch_index = check_int("batch_index", batch_index, 0, _U32)
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index

    cluster_id = property(lambda self: self._cluster_id)
    cache_id = property(lambda self: self._cache_id)
    batch_index = property(lambda self: self._batch_index)

    def __repr__(self):
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, "
                f"cache_id={self._cache_id}, batch_index={self._batch_index})")


class LayerSynchronizer(abc.ABC):
    """transfer_cache_async calls synchronize_layer(i, timeout) for each layer
    i in order, from its own thread; True lets layer i move."""

    @abc.abstractmethod
    def synchronize_layer(self, layer_index, timeout_in_millis):
        """Blocks until layer layer_index is computed; True on success."""


def check_layer_range(name, r, allow_none=True):
    if r is None and allow_none:
        return
    if not isinstance(r, range):
        raise TypeError(f"{name} must be a range")
    raise_if_false(r.step == 1, f"check {name}.step == 1 failed")
    raise_if_false(0 <= r.start < r.stop,
                   f"check 0 <= range.start < range.stop failed, {name} = {r}")


def _checked(name, check):
    """A property whose setter checks (and may convert) the value."""
    attr = "_" + name

    def set_(self, v):
        setattr(self, attr, check(v))
    return property(lambda self: getattr(self, attr), set_)


def _layer_range(name):
    def check(r):
        check_layer_range(name, r)
        return r
    return check


def _addrs(v):
    if not isinstance(v, (list, tuple)):
        raise TypeError("dst_addrs must be a list or tuple of ints")
    out = check_ints("dst_addrs", v)
    for a in out:
        check_int("dst_addrs", a, 0, _U64)
    return out


class TransferConfig:
    """The reference's transfer to raw remote addresses. llmdd never writes a
    peer's memory by address, so transfer_cache_async refuses it with
    LLM_FEATURE_NOT_ENABLED; use TransferWithCacheKeyConfig."""

    dst_cluster_id = _checked("dst_cluster_id",
                              lambda v: check_int("dst_cluster_id", v, 0, _U64))
    dst_addrs = _checked("dst_addrs", _addrs)
    src_layer_range = _checked("src_layer_range", _layer_range("src_layer_range"))
    src_batch_index = _checked("src_batch_index",
                               lambda v: check_int("src_batch_index", v, 0, _U32))
    dst_layer_range = None

    def __init__(self, dst_cluster_id, dst_addrs, src_layer_range=None, src_batch_index=0):
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index

    def __repr__(self):
        return (f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, "
                f"dst_addrs={len(self._dst_addrs)}, src_layer_range={self._src_layer_range}, "
                f"src_batch_index={self._src_batch_index})")


class TransferWithCacheKeyConfig:
    """A layer-wise push into the peer's cache named by cache_key
    (CacheKeyByIdAndIndex: a batch slot; BlocksCacheKey: blocks)."""

    def __init__(self, cache_key, src_layer_range=None, dst_layer_range=None,
                 src_batch_index=0):
        self.cache_key = cache_key
        self.src_layer_range = src_layer_range
        self.dst_layer_range = dst_layer_range
        if src_layer_range is not None and dst_layer_range is not None:
            raise_if_false(len(src_layer_range) == len(dst_layer_range),
                           "src_layer_range size should be equal to dst_layer_range size")
        self.src_batch_index = src_batch_index

    src_layer_range = _checked("src_layer_range", _layer_range("src_layer_range"))
    dst_layer_range = _checked("dst_layer_range", _layer_range("dst_layer_range"))

    @property
    def cache_key(self):
        return self._cache_key

    @cache_key.setter
    def cache_key(self, v):
        if not isinstance(v, (BlocksCacheKey, CacheKeyByIdAndIndex)):
            raise TypeError("cache_key must be a BlocksCacheKey or CacheKeyByIdAndIndex")
        self._cache_key = v

    @property
    def src_batch_index(self):
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, v):
        v = check_int("src_batch_index", v, 0, _U32)
        raise_if_false(not (isinstance(self._cache_key, BlocksCacheKey) and v != 0),
                       "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self._src_batch_index = v

    @property
    def dst_cluster_id(self):
        return self._cache_key.cluster_id

    def __repr__(self):
        return (f"TransferWithCacheKeyConfig(cache_key={self._cache_key}, "
                f"src_layer_range={self._src_layer_range}, "
                f"dst_layer_range={self._dst_layer_range}, "
                f"src_batch_index={self._src_batch_index})")


class CacheTask:
    """The handle transfer_cache_async returns."""

    def __init__(self, requests, thread, state):
        self._requests = requests
        self._thread = thread
        self._state = state

    def _join(self, timeout_in_millis):
        if timeout_in_millis is not None:
            timeout_in_millis = check_int("timeout_in_millis", timeout_in_millis, 0, _U32)
        self._thread.join(None if timeout_in_millis is None else timeout_in_millis / 1000)
        return not self._thread.is_alive()

    def get_results(self, timeout_in_millis=None):
        """One LLMStatusCode per transfer config; LLM_WAIT_PROCESS_TIMEOUT
        for those still in flight at the timeout."""
        if not self._join(timeout_in_millis):
            return [LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT] * len(self._requests)
        return list(self._state["results"])

    def synchronize(self, timeout_in_millis=None):
        """LLM_SUCCESS when every transfer landed, else the first failure."""
        for st in self.get_results(timeout_in_millis):
            if st != LLMStatusCode.LLM_SUCCESS:
                return st
        return LLMStatusCode.LLM_SUCCESS
