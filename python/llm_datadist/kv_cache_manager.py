"""KvCacheManager: the reference's V1 cache API (LLMDataDist.kv_cache_manager),
which connectors written for the older API use. Each call is the V2
CacheManager's on the same instance; a KvCache wraps the V2 Cache."""

from .cache_manager import CacheManager
from .llm_types import Cache, KvCache
from .status import LLMException, LLMStatusCode, raise_if_false, check_int

_NOT_ENABLED = LLMStatusCode.LLM_FEATURE_NOT_ENABLED


class KvCacheManager:
    """Reach it through LLMDataDist.kv_cache_manager."""

    def __init__(self, cache_manager):
        if not isinstance(cache_manager, CacheManager):
            raise TypeError("KvCacheManager is made by LLMDataDist.kv_cache_manager")
        self._cm = cache_manager
        self._initialized = True

    def is_initialized(self):
        return self._initialized

    def _live(self):
        raise_if_false(self._initialized, "LLMDataDist is finalized",
                       LLMStatusCode.LLM_FAILED)
        return self._cm

    @staticmethod
    def _v2(cache, name="cache"):
        """The V2 Cache behind a KvCache of this manager."""
        if not isinstance(cache, KvCache):
            raise TypeError(f"{name} must be a KvCache")
        raise_if_false(cache._cache is not None, f"{name}: only support device cache")
        raise_if_false(cache._valid, f"{name} (cache_id {cache.cache_id}) is deallocated",
                       LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        return cache._cache

    @staticmethod
    def _swap_side(cache, name):
        # swap_blocks also takes create_cpu_cache's host caches.
        if isinstance(cache, KvCache) and cache._cache is None:
            return Cache(-1, cache.cache_desc, cache.per_device_tensor_addrs[0], True)
        return KvCacheManager._v2(cache, name)

    def _wrap(self, c):
        return KvCache(c.cache_id, c.cache_desc, [list(c.tensor_addrs)], self, c)

    # ------------------------------------------------------------ caches
    def allocate_cache(self, cache_desc, cache_keys=()):
        """A zeroed cache; cache_keys[i] names its slot i for the peer's
        pull_cache (a key with req_id 2**64-1 holds a slot's place)."""
        return self._wrap(self._live().allocate_cache(cache_desc, cache_keys))

    def allocate_blocks_cache(self, cache_desc, blocks_cache_key=None):
        return self._wrap(self._live().allocate_blocks_cache(cache_desc, blocks_cache_key))

    def deallocate_cache(self, cache):
        """Frees the cache (blocks or not); a second call does nothing."""
        if not isinstance(cache, KvCache):
            raise TypeError("cache must be a KvCache")
        raise_if_false(cache._cache is not None, "cache: only support device cache")
        if not cache._valid:
            return
        cm = self._live()
        if cache._cache.is_blocks_cache:
            cm.deallocate_blocks_cache(cache._cache)
        else:
            cm.deallocate_cache(cache._cache)
        cache._valid = False
        cache._per_device_tensor_addrs = []

    def remove_cache_key(self, cache_key):
        self._live().remove_cache_key(cache_key)

    def get_cache_tensors(self, cache, tensor_index=0):
        """Tensor index tensor_index of the cache, one per device (here one),
        as a Tensor over the cache's memory."""
        import ctypes
        import numpy as np
        from .tensor import Tensor, TensorDesc, _NP
        c = self._v2(cache)
        tensor_index = check_int("tensor_index", tensor_index, -2**31, 2**31 - 1)
        desc = cache.cache_desc
        raise_if_false(0 <= tensor_index < desc.num_tensors,
                       f"tensor_index ({tensor_index}) out of range, [0, {desc.num_tensors})")
        dt = _NP.get(desc.data_type)
        raise_if_false(dt is not None, f"data_type {desc.data_type} has no host form")
        raw = (ctypes.c_uint8 * desc.size).from_address(c.tensor_addrs[tensor_index])
        arr = np.frombuffer(raw, dtype=dt).reshape(desc.shape)
        return [Tensor(arr, TensorDesc(desc.data_type, desc.shape))]

    # ------------------------------------------------------------ transfers
    def pull_cache(self, cache_key, kv_cache, batch_index=0, size=-1, **kwargs):
        """Pulls the remote slot cache_key names (CacheKey or
        CacheKeyByIdAndIndex) into slot batch_index of kv_cache; kwargs:
        src_layer_range, dst_layer_range, tensor_num_per_layer."""
        for k in ("src_cache_offset", "dst_cache_offset"):
            v = kwargs.pop(k, None)
            if v is not None and v != -1:
                raise LLMException(f"[pull_cache] {k}: a pull at an offset into the "
                                   "cache is not in llmdd (pull with size from slot "
                                   "start)", status_code=_NOT_ENABLED)
        self._live().pull_cache(cache_key, self._v2(kv_cache, "kv_cache"), batch_index,
                                size, **kwargs)

    def pull_blocks(self, prompt_cache_key, decoder_kv_cache, prompt_blocks, decoder_blocks,
                    **kwargs):
        self._live().pull_blocks(prompt_cache_key, self._v2(decoder_kv_cache,
                                                            "decoder_kv_cache"),
                                 prompt_blocks, decoder_blocks, **kwargs)

    def copy_cache(self, dst, src, dst_batch_index=0, src_batch_index=0, offset=0, size=-1,
                   req_id=None):
        self._live().copy_cache(self._v2(dst, "dst"), self._v2(src, "src"), dst_batch_index,
                                src_batch_index, offset, size, req_id)

    def copy_blocks(self, cache, copy_block_info):
        self._live().copy_blocks(self._v2(cache), copy_block_info)

    def swap_blocks(self, src, dst, src_to_dst):
        self._live().swap_blocks(self._swap_side(src, "src"), self._swap_side(dst, "dst"),
                                 src_to_dst)

    def transfer_cache_async(self, src_cache, layer_synchronizer, transfer_configs,
                             src_block_indices=None, dst_block_indices=None,
                             dst_block_memory_size=None):
        return self._live().transfer_cache_async(
            self._v2(src_cache, "src_cache"), layer_synchronizer, transfer_configs,
            src_block_indices, dst_block_indices, dst_block_memory_size)
