"""CacheManager: the reference's V2 cache API over an llmdd.Instance.

Keys (docs/python.md): a CacheKey names one batch slot of a prompt's cache
through llmdd_set_cache_key, a BlocksCacheKey a whole blocks cache (slot 0);
the key bytes are the canonical encoding in llm_types (_key_bytes). The
decoder resolves a key with llmdd_lookup_remote_key and then transfers by
id. CacheKeyByIdAndIndex maps onto ids directly.
"""

import ctypes
import threading

import llmdd

from .llm_types import (BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex,
                        LayerSynchronizer, Placement, TransferConfig,
                        TransferWithCacheKeyConfig, CacheTask, MemInfo, check_layer_range,
                        _INVALID_ID)
from .status import (LLMException, LLMStatusCode, code_2_status, raise_if_false, translate,
                     check_int, check_ints, as_int)

_NUM_TENSORS_PER_LAYER = 2
_NOT_ENABLED = LLMStatusCode.LLM_FEATURE_NOT_ENABLED


def _check_tnpl(tnpl):
    tnpl = as_int("tensor_num_per_layer", tnpl)
    raise_if_false(0 < tnpl <= 2**32 - 1,
                   f"tensor_num_per_layer ({tnpl}) is invalid, should be > 0")
    return tnpl


def _check_size(what, size):
    size = as_int("size", size)
    raise_if_false(size == -1 or size > 0,
                   f"{what} size ({size}) is invalid, should be = -1 or > 0")
    return size


class CacheManager:
    """Reach it through LLMDataDist.cache_manager."""

    def __init__(self, datadist, dd, sync_timeout_ms):
        self._datadist = datadist
        self._dd = dd
        self._sync_timeout_ms = sync_timeout_ms
        self._handles = {}          # cache_id -> llmdd.Cache
        self._blocks_keys = {}      # (cluster_id, key bytes) -> llmdd.CacheIndex
        self._lock = threading.Lock()

    # ------------------------------------------------------------ helpers
    def _handle(self, cache, name="cache"):
        if not isinstance(cache, Cache):
            raise TypeError(f"{name} must be a Cache")
        h = cache._handle
        raise_if_false(h is not None and not h.closed,
                       f"{name} (cache_id {cache.cache_id}) is not a live cache of this "
                       "instance", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        return h

    def _forget_keys(self):
        with self._lock:
            self._blocks_keys.clear()

    def _lookup(self, cluster_id, key, memo):
        k = (cluster_id, key)
        if memo:
            with self._lock:
                idx = self._blocks_keys.get(k)
            if idx is not None:
                return idx, True
        with translate("[lookup cache key]"):
            idx = self._dd.lookup_remote_key(cluster_id, key)
        if memo:
            with self._lock:
                self._blocks_keys[k] = idx
        return idx, False

    def _by_key(self, cache_key, what, fn):
        """Runs fn(llmdd.CacheIndex) for the remote cache cache_key names.
        A remembered BlocksCacheKey resolution is retried once, fresh, when
        the peer no longer has that cache."""
        if isinstance(cache_key, CacheKeyByIdAndIndex):
            idx = llmdd.CacheIndex(cache_key.cluster_id, cache_key.cache_id,
                                   cache_key.batch_index)
            with translate(what):
                return fn(idx)
        if isinstance(cache_key, CacheKey):
            raise_if_false(cache_key.req_id != _INVALID_ID or cache_key.prefix_id != _INVALID_ID,
                           "one of req id and prefix id should contain valid value")
        memo = isinstance(cache_key, BlocksCacheKey)
        idx, cached = self._lookup(cache_key.cluster_id, cache_key._key_bytes(), memo)
        try:
            with translate(what):
                return fn(idx)
        except LLMException as e:
            if not cached or e.status_code not in (LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,):
                raise
        self._forget_keys()
        idx, _ = self._lookup(cache_key.cluster_id, cache_key._key_bytes(), memo)
        with translate(what):
            return fn(idx)

    @staticmethod
    def _ranges(src_layer_range, dst_layer_range):
        check_layer_range("src_layer_range", src_layer_range)
        check_layer_range("dst_layer_range", dst_layer_range)
        return src_layer_range, dst_layer_range

    def _new_cache(self, h, desc, is_blocks):
        c = Cache(h.cache_id, desc, h.tensor_addrs, is_blocks, h)
        self._handles[h.cache_id] = h
        return c

    def _register(self, what, cache_desc, addrs, is_blocks, keys):
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError("cache_desc must be a CacheDesc")
        if not isinstance(addrs, (list, tuple)):
            raise TypeError("addrs must be a list")
        raise_if_false(len(addrs) > 0, "addrs can not be empty.")
        raise_if_false(len(addrs) == cache_desc.num_tensors,
                       "addrs length should be equal to num_tensors.")
        for a in addrs:
            # An int is an address (as_int refuses a bool); tensors and
            # arrays are checked by llmdd.
            if isinstance(a, int):
                raise_if_false(as_int("addr", a) != 0, "addr can not be zero.")
        d = cache_desc._llmdd()
        with translate(what):
            h = self._dd.register_cache(list(addrs), d)
        return self._keyed(what, h, cache_desc, is_blocks, keys)

    def _keyed(self, what, h, cache_desc, is_blocks, keys):
        try:
            for i, key in enumerate(keys):
                if key is None:
                    continue
                with translate(what):
                    self._dd.set_cache_key(h, i, key)
        except BaseException:
            h.close()
            raise
        return self._new_cache(h, cache_desc, is_blocks)

    @staticmethod
    def _cache_keys(cache_keys):
        if not isinstance(cache_keys, (list, tuple)) or not all(
                isinstance(k, CacheKey) for k in cache_keys):
            raise TypeError("cache_keys must be a list or tuple of CacheKey")
        # A key with req_id 2**64-1 holds an unused slot's place.
        return [None if (k.req_id == _INVALID_ID and k.prefix_id == _INVALID_ID)
                else k._key_bytes() for k in cache_keys]

    # ------------------------------------------------------------ caches
    def register_cache(self, cache_desc, addrs, cache_keys=(), remote_accessible=None):
        """Registers caller memory (int addresses, or tensors/arrays/buffers,
        whose sizes are then checked); cache_keys[i] names slot i."""
        if remote_accessible is not None and not isinstance(remote_accessible, bool):
            raise TypeError("remote_accessible must be a bool")
        return self._register("[register_cache]", cache_desc, addrs, False,
                              self._cache_keys(cache_keys))

    def register_blocks_cache(self, cache_desc, addrs, blocks_cache_key=None,
                              remote_accessible=None):
        if blocks_cache_key is not None and not isinstance(blocks_cache_key, BlocksCacheKey):
            raise TypeError("blocks_cache_key must be a BlocksCacheKey")
        if remote_accessible is not None and not isinstance(remote_accessible, bool):
            raise TypeError("remote_accessible must be a bool")
        keys = [] if blocks_cache_key is None else [blocks_cache_key._key_bytes()]
        return self._register("[register_blocks_cache]", cache_desc, addrs, True, keys)

    def allocate_cache(self, cache_desc, cache_keys=()):
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError("cache_desc must be a CacheDesc")
        keys = self._cache_keys(cache_keys)
        with translate("[allocate_cache]"):
            h = self._dd.allocate_cache(cache_desc._llmdd())
        return self._keyed("[allocate_cache]", h, cache_desc, False, keys)

    def allocate_blocks_cache(self, cache_desc, blocks_cache_key=None):
        if not isinstance(cache_desc, CacheDesc):
            raise TypeError("cache_desc must be a CacheDesc")
        if blocks_cache_key is not None and not isinstance(blocks_cache_key, BlocksCacheKey):
            raise TypeError("blocks_cache_key must be a BlocksCacheKey")
        keys = [] if blocks_cache_key is None else [blocks_cache_key._key_bytes()]
        with translate("[allocate_blocks_cache]"):
            h = self._dd.allocate_cache(cache_desc._llmdd())
        return self._keyed("[allocate_blocks_cache]", h, cache_desc, True, keys)

    def _release(self, what, cache_id):
        h = self._handles.pop(cache_id, None)
        if h is None:
            return False
        with translate(what):
            h.close()
        return True

    def deallocate_cache(self, cache):
        raise_if_false(isinstance(cache, Cache), "cache must be a Cache")
        raise_if_false(not cache.is_blocks_cache, "cache can not be blocks cache.")
        if not self._release("[deallocate_cache]", cache.cache_id):
            raise LLMException("[deallocate_cache] unknown cache",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        cache._tensor_addrs = []

    def deallocate_blocks_cache(self, cache):
        raise_if_false(isinstance(cache, Cache), "cache must be a Cache")
        raise_if_false(cache.is_blocks_cache, "cache should be blocks cache.")
        if not self._release("[deallocate_blocks_cache]", cache.cache_id):
            raise LLMException("[deallocate_blocks_cache] unknown cache",
                               status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        cache._tensor_addrs = []

    def unregister_cache(self, cache_id):
        cache_id = as_int("cache_id", cache_id)
        self._release("[unregister_cache]", cache_id)   # unknown id: success

    def remove_cache_key(self, cache_key):
        if not isinstance(cache_key, (CacheKey, BlocksCacheKey)):
            raise TypeError("cache_key must be a CacheKey")
        with translate("[remove_cache_key]"):
            self._dd.remove_cache_key(cache_key._key_bytes())

    def remap_registered_memory(self, mem_infos):
        """The reference remaps device memory after a hardware memory fault
        (UCE); llmdd has no device memory to remap."""
        items = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        if not all(isinstance(m, MemInfo) for m in items):
            raise TypeError("mem_infos must be a MemInfo or a list of MemInfo")
        raise LLMException("remap_registered_memory needs Ascend device memory; "
                           "llmdd has none", status_code=_NOT_ENABLED)

    @staticmethod
    def check_cache_key(cache_key):
        """A CacheKey names a request by exactly one of req_id and prefix_id."""
        if not isinstance(cache_key, CacheKey):
            raise TypeError("cache_key must be a CacheKey")
        raise_if_false((cache_key.req_id == _INVALID_ID) != (cache_key.prefix_id == _INVALID_ID),
                       "exactly one of req id and prefix id should contain a valid value: "
                       f"req id:{cache_key.req_id}, prefix id:{cache_key.prefix_id}.")

    # ------------------------------------------------------------ transfers
    def pull_cache(self, cache_key, cache, batch_index=0, size=-1, **kwargs):
        """Pulls the remote slot cache_key names into slot batch_index of
        cache; size -1 is the whole slot. kwargs: src_layer_range,
        dst_layer_range (half-open ranges), tensor_num_per_layer."""
        if not isinstance(cache_key, (CacheKey, CacheKeyByIdAndIndex)):
            raise TypeError("cache_key must be a CacheKey or CacheKeyByIdAndIndex")
        h = self._handle(cache)
        raise_if_false(not cache.is_blocks_cache, "cache can not be blocks cache.")
        size = _check_size("[pull_cache]", size)
        batch_index = check_int("batch_index", batch_index, 0, 2**32 - 1)
        tnpl = _check_tnpl(kwargs.get("tensor_num_per_layer", _NUM_TENSORS_PER_LAYER))
        sr, dr = self._ranges(kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"))
        self._by_key(cache_key, "[pull_cache]", lambda idx: self._dd.pull_cache(
            idx, h, batch_index, size, src_layers=sr, dst_layers=dr, tensor_num_per_layer=tnpl))

    def pull_blocks(self, src_cache_key, dst_cache, src_blocks=(), dst_blocks=(), **kwargs):
        """Pulls blocks src_blocks of the peer's blocks cache (BlocksCacheKey)
        into dst_blocks; with a CacheKey or CacheKeyByIdAndIndex (a slot of a
        cache without blocks) and no src_blocks, cuts that slot into blocks:
        chunk k lands in dst_blocks[k] (llmdd_pull_kv_cache_to_blocks)."""
        if not isinstance(src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)):
            raise TypeError("src_cache_key must be a BlocksCacheKey, CacheKey or "
                            "CacheKeyByIdAndIndex")
        h = self._handle(dst_cache, "dst_cache")
        src_blocks = check_ints("src_blocks", src_blocks)
        dst_blocks = check_ints("dst_blocks", dst_blocks)
        raise_if_false(dst_cache.is_blocks_cache, "dst_cache should be blocks cache.")
        raise_if_false(len(dst_blocks) > 0, "dst_blocks can not be empty.")
        tnpl = _check_tnpl(kwargs.get("tensor_num_per_layer", _NUM_TENSORS_PER_LAYER))
        sr, dr = self._ranges(kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"))
        if not isinstance(src_cache_key, BlocksCacheKey):
            raise_if_false(len(src_blocks) == 0, "src_blocks should be empty when "
                           "src_cache_key is not BlocksCacheKey.")
            if isinstance(src_cache_key, CacheKey):
                raise_if_false(src_cache_key.req_id != _INVALID_ID or
                               src_cache_key.prefix_id != _INVALID_ID,
                               "one of req id and prefix id should contain valid value")
            self._by_key(src_cache_key, "[pull_blocks]", lambda idx: self._dd.pull_cache_to_blocks(
                idx, h, dst_blocks, src_layers=sr, dst_layers=dr, tensor_num_per_layer=tnpl))
            return
        raise_if_false(len(src_blocks) > 0, "src_blocks can not be empty.")
        raise_if_false(len(src_blocks) == len(dst_blocks),
                       "src_blocks and dst_blocks must have the same length.")
        self._by_key(src_cache_key, "[pull_blocks]", lambda idx: self._dd.pull_blocks(
            idx, h, src_blocks, dst_blocks, src_layers=sr, dst_layers=dr,
            tensor_num_per_layer=tnpl))

    def push_cache(self, dst_cache_key, src_cache, src_batch_index=0, src_layer_range=None,
                   dst_layer_range=None, size=-1, tensor_num_per_layer=_NUM_TENSORS_PER_LAYER):
        if not isinstance(dst_cache_key, CacheKeyByIdAndIndex):
            raise TypeError("dst_cache_key must be a CacheKeyByIdAndIndex")
        h = self._handle(src_cache, "src_cache")
        raise_if_false(not src_cache.is_blocks_cache, "cache can not be blocks cache.")
        tensor_num_per_layer = _check_tnpl(tensor_num_per_layer)
        src_batch_index = check_int("src_batch_index", src_batch_index, 0, 2**32 - 1)
        sr, dr = self._ranges(src_layer_range, dst_layer_range)
        size = _check_size("[push_cache]", size)
        self._by_key(dst_cache_key, "[push_cache]", lambda idx: self._dd.push_cache(
            h, idx, src_batch_index, size, src_layers=sr, dst_layers=dr,
            tensor_num_per_layer=tensor_num_per_layer))

    def push_blocks(self, dst_cache_key, src_cache, src_blocks=(), dst_blocks=(),
                    src_layer_range=None, dst_layer_range=None,
                    tensor_num_per_layer=_NUM_TENSORS_PER_LAYER):
        """Pushes blocks src_blocks of src_cache into dst_blocks of the peer's
        blocks cache; with src_cache not a blocks cache and no src_blocks,
        cuts its slot 0 into the peer's blocks (llmdd_push_kv_cache_to_blocks)."""
        if not isinstance(dst_cache_key, BlocksCacheKey):
            raise TypeError("dst_cache_key must be a BlocksCacheKey")
        h = self._handle(src_cache, "src_cache")
        src_blocks = check_ints("src_blocks", src_blocks)
        dst_blocks = check_ints("dst_blocks", dst_blocks)
        raise_if_false(len(dst_blocks) > 0, "dst_blocks can not be empty.")
        tensor_num_per_layer = _check_tnpl(tensor_num_per_layer)
        sr, dr = self._ranges(src_layer_range, dst_layer_range)
        if len(src_blocks) == 0:
            raise_if_false(not src_cache.is_blocks_cache,
                           "src_blocks can not be empty for a blocks cache.")
            self._by_key(dst_cache_key, "[push_blocks]", lambda idx: self._dd.push_cache_to_blocks(
                h, idx, dst_blocks, 0, src_layers=sr, dst_layers=dr,
                tensor_num_per_layer=tensor_num_per_layer))
            return
        raise_if_false(len(src_blocks) == len(dst_blocks),
                       "src_blocks and dst_blocks must have the same length.")
        self._by_key(dst_cache_key, "[push_blocks]", lambda idx: self._dd.push_blocks(
            h, idx, src_blocks, dst_blocks, src_layers=sr, dst_layers=dr,
            tensor_num_per_layer=tensor_num_per_layer))

    def copy_cache(self, dst, src, dst_batch_index=0, src_batch_index=0, offset=0, size=-1,
                   req_id=None):
        hd = self._handle(dst, "dst")
        hs = self._handle(src, "src")
        size = _check_size("[copy_cache]", size)
        with translate("[copy_cache]"):
            self._dd.copy_cache(hs, hd, src_batch_index, dst_batch_index, offset, size)

    def copy_blocks(self, cache, copy_block_info):
        h = self._handle(cache)
        raise_if_false(cache.is_blocks_cache, "cache should be blocks cache.")
        if not isinstance(copy_block_info, dict):
            raise TypeError("copy_block_info must be a dict of int to list of int")
        pairs = [(s, d) for s, ds in copy_block_info.items() for d in ds]
        raise_if_false(len(pairs) > 0, "copy_block_info is empty.")
        with translate("[copy_blocks]"):
            self._dd.copy_blocks(h, h, [p[0] for p in pairs], [p[1] for p in pairs])

    def swap_blocks(self, src_cache, dst_cache, src_to_dst):
        """Copies blocks between a host cache and a 'device' cache (both host
        memory in this build), by address: a cache from create_cpu_cache
        works too."""
        for n, c in (("src_cache", src_cache), ("dst_cache", dst_cache)):
            if not isinstance(c, Cache):
                raise TypeError(f"{n} must be a Cache")
            raise_if_false(c.is_blocks_cache, f"{n} should be blocks cache.")
            raise_if_false(len(c.tensor_addrs) == c.cache_desc.num_tensors,
                           f"{n} has no memory (deallocated?)")
        if not isinstance(src_to_dst, dict):
            raise TypeError("src_to_dst must be a dict of int to int")
        sd, dd = src_cache.cache_desc, dst_cache.cache_desc
        raise_if_false(sd.batch_dim == 0 and dd.batch_dim == 0,
                       "blocks need batch_dim_index 0")
        sbs = sd.size // sd.batch_size
        dbs = dd.size // dd.batch_size
        raise_if_false(sbs == dbs, f"src block size:{sbs} and dst block size:{dbs} must be equal")
        raise_if_false(sd.num_tensors == dd.num_tensors, "num_tensors must be equal")
        raise_if_false({sd.placement, dd.placement} == {Placement.HOST, Placement.DEVICE},
                       f"swap {sd.placement} to {dd.placement} is not supported")
        for s, d in src_to_dst.items():
            for n, v, lim in (("src", s, sd.batch_size), ("dst", d, dd.batch_size)):
                v = as_int(f"{n} block index", v)
                raise_if_false(0 <= v < lim, f"{n}_block_index:{v} must be in [0, {lim})")
        for sa, da in zip(src_cache.tensor_addrs, dst_cache.tensor_addrs):
            for s, d in src_to_dst.items():
                ctypes.memmove(da + d * dbs, sa + s * sbs, sbs)

    # ------------------------------------------------------------ layer-wise
    def transfer_cache_async(self, src_cache, layer_synchronizer, transfer_configs,
                             src_block_indices=None, dst_block_indices=None,
                             dst_block_memory_size=None):
        """Posts one LLMDD_XFER_LAYERWISE push per config, then, in one thread
        for the task, calls layer_synchronizer.synchronize_layer(i, timeout)
        for every source layer i in order and marks layer i ready on the
        pushes that carry it. Returns a CacheTask.

        To a BlocksCacheKey: from a blocks cache, blocks src_block_indices
        to dst_block_indices, or with neither the whole cache, block b to
        block b (cache to cache); from a cache without blocks, its slot
        (src_batch_index) cut into dst_block_indices. To a
        CacheKeyByIdAndIndex: a slot to a slot. The block size of the
        destination is the peer cache's own; dst_block_memory_size is
        accepted and not needed."""
        h = self._handle(src_cache, "src_cache")
        if not isinstance(layer_synchronizer, LayerSynchronizer):
            raise TypeError("layer_synchronizer must be a LayerSynchronizer")
        if not isinstance(transfer_configs, (list, tuple)) or not transfer_configs:
            raise TypeError("transfer_configs must be a non-empty list")
        if dst_block_memory_size is not None:
            dst_block_memory_size = as_int("dst_block_memory_size", dst_block_memory_size)
            raise_if_false(dst_block_memory_size >= 0, "dst_block_memory_size is invalid")
        if src_block_indices is not None:
            src_block_indices = check_ints("src_block_indices", src_block_indices)
        if dst_block_indices is not None:
            dst_block_indices = check_ints("dst_block_indices", dst_block_indices)
        tnpl = _NUM_TENSORS_PER_LAYER
        nlayers = src_cache.cache_desc.num_tensors // tnpl
        raise_if_false(nlayers > 0, "src_cache has no whole layer")
        plans = []
        for i, cfg in enumerate(transfer_configs):
            if isinstance(cfg, TransferConfig):
                raise LLMException("TransferConfig writes raw remote addresses, which llmdd "
                                   "does not do: use TransferWithCacheKeyConfig",
                                   status_code=_NOT_ENABLED)
            if not isinstance(cfg, TransferWithCacheKeyConfig):
                raise TypeError(f"transfer_configs[{i}] must be a TransferWithCacheKeyConfig")
            sr = cfg.src_layer_range or range(0, nlayers)
            dr = cfg.dst_layer_range or sr
            raise_if_false(len(sr) == len(dr), "src/dst layer ranges differ in size")
            plans.append((cfg, sr, dr, self._poster(h, src_cache, cfg, sr, dr, tnpl,
                                                    src_block_indices, dst_block_indices)))
        reqs = []
        try:
            for cfg, sr, _, post in plans:
                reqs.append((self._by_key(cfg.cache_key, "[transfer_cache_async]", post), sr))
        except BaseException:
            for r, _ in reqs:
                r.close()
            raise
        state = {"results": [LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT] * len(reqs)}
        layers = sorted(set().union(*(set(sr) for _, sr in reqs)))
        t = threading.Thread(target=self._drive, name="llmdd-transfer-task", daemon=True,
                             args=(layer_synchronizer, layers, reqs, state))
        t.start()
        return CacheTask([r for r, _ in reqs], t, state)

    def _poster(self, h, src_cache, cfg, sr, dr, tnpl, src_blocks, dst_blocks):
        """The layer-wise push one config asks for, as a function of the
        resolved remote index; argument errors are raised here, before any
        push is posted."""
        kw = dict(src_layers=sr, dst_layers=dr, tensor_num_per_layer=tnpl, layerwise=True)
        if not isinstance(cfg.cache_key, BlocksCacheKey):
            raise_if_false(not src_cache.is_blocks_cache,
                           "a blocks cache can not be transferred to a cache without blocks")
            return lambda idx: self._dd.push_cache_async(h, idx, cfg.src_batch_index, -1, **kw)
        if not src_cache.is_blocks_cache:
            raise_if_false(src_blocks is None and dst_blocks is not None and len(dst_blocks) > 0,
                           "dst_block_indices (and no src_block_indices) are required from a "
                           "cache without blocks to a BlocksCacheKey")
            return lambda idx: self._dd.push_cache_to_blocks_async(
                h, idx, dst_blocks, cfg.src_batch_index, **kw)
        if src_blocks is None and dst_blocks is None:
            # Cache to cache: every block to the block of the same index.
            every = list(range(src_cache.cache_desc.batch_size))
            return lambda idx: self._dd.push_blocks_async(h, idx, every, every, **kw)
        raise_if_false(src_blocks is not None and dst_blocks is not None,
                       "src_block_indices and dst_block_indices go together")
        raise_if_false(len(src_blocks) == len(dst_blocks) and len(src_blocks) > 0,
                       "src_block_indices and dst_block_indices must have the same, "
                       "non-zero length")
        return lambda idx: self._dd.push_blocks_async(h, idx, src_blocks, dst_blocks, **kw)

    def _drive(self, sync, layers, reqs, state):
        ok = True
        try:
            for layer in layers:
                if not sync.synchronize_layer(layer, self._sync_timeout_ms):
                    ok = False
                    break
                for r, sr in reqs:
                    if layer in sr:
                        r.layer_ready(layer - sr.start)
        except Exception:
            ok = False
        results = []
        for r, _ in reqs:
            if not ok:
                r.cancel()
            try:
                r.wait()
                st = LLMStatusCode.LLM_SUCCESS
            except llmdd.LlmddError as e:
                st = code_2_status(e.status)
            results.append(st)
            r.close()
        state["results"] = results
