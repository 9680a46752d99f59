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


class Placement(enum.Enum):
    HOST = 0
    DEVICE = 1      # host memory in this build (no accelerator memory)


class RegisterMemStatus(enum.Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


class CacheDesc:
    """num_tensors tensors of one shape and data type; shape[batch_dim_index]
    is the batch size (or number of blocks)."""

    def __init__(self, num_tensors, shape, data_type, placement=Placement.DEVICE,
                 batch_dim_index=0, seq_len_dim_index=-1, kv_tensor_format=None):
        num_tensors = check_int("num_tensors", num_tensors, 0, _U32)
        shape = check_ints("shape", shape)
        batch_dim_index = as_int("batch_dim_index", batch_dim_index)
        seq_len_dim_index = check_int("seq_len_dim_index", seq_len_dim_index,
                                      -2**31, 2**31 - 1)
        if not isinstance(data_type, DataType):
            raise TypeError("data_type must be a DataType")
        if not isinstance(placement, Placement):
            raise TypeError("placement must be a Placement")
        raise_if_false(0 <= batch_dim_index < max(1, len(shape)),
                       f"batch_dim_index {batch_dim_index} out of range")
        raise_if_false(batch_dim_index == 0,
                       "llmdd supports batch_dim_index 0 only (shape[0] is the batch)",
                       LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
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
        self._shape[dim_index] = dim_value

    def _llmdd(self):
        import llmdd
        try:
            return llmdd.CacheDesc(self._num_tensors, tuple(self._shape),
                                   self._data_type.value, self._placement.value)
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


class TransferConfig:
    """The reference's transfer to raw remote addresses. llmdd never writes a
    peer's memory by address, so transfer_cache_async refuses it with
    LLM_FEATURE_NOT_ENABLED; use TransferWithCacheKeyConfig."""

    def __init__(self, dst_cluster_id, dst_addrs, src_layer_range=None, src_batch_index=0):
        dst_cluster_id = check_int("dst_cluster_id", dst_cluster_id, 0, _U64)
        if not isinstance(dst_addrs, (list, tuple)):
            raise TypeError("dst_addrs must be a list of ints")
        check_layer_range("src_layer_range", src_layer_range)
        src_batch_index = check_int("src_batch_index", src_batch_index, 0, _U32)
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = list(dst_addrs)
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range = None


class TransferWithCacheKeyConfig:
    """A layer-wise push into the peer's cache named by cache_key
    (CacheKeyByIdAndIndex: a batch slot; BlocksCacheKey: blocks)."""

    def __init__(self, cache_key, src_layer_range=None, dst_layer_range=None,
                 src_batch_index=0):
        if not isinstance(cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex)):
            raise TypeError("cache_key must be a BlocksCacheKey or CacheKeyByIdAndIndex")
        check_layer_range("src_layer_range", src_layer_range)
        check_layer_range("dst_layer_range", dst_layer_range)
        if src_layer_range is not None and dst_layer_range is not None:
            raise_if_false(len(src_layer_range) == len(dst_layer_range),
                           "src_layer_range size should be equal to dst_layer_range size")
        src_batch_index = check_int("src_batch_index", src_batch_index, 0, _U32)
        raise_if_false(not (isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0),
                       "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self.cache_key = cache_key
        self.src_layer_range = src_layer_range
        self.dst_layer_range = dst_layer_range
        self.src_batch_index = src_batch_index
        self.dst_cluster_id = cache_key.cluster_id


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
