"""Instances and caches: the pythonic layer over _ffi. Values and checks are
in _values, requests in _request."""

import asyncio
import collections
import ctypes
import threading
import weakref

from . import _ffi
from ._ffi import lib
from ._memory import U64_MAX, memory_of
from ._status import Status, LlmddError, check
from ._request import Request, _Completions
from ._values import (Role, Placement, DataType, DTYPE_SIZE, CacheDesc, CacheIndex,
                      ClusterInfo, _I32_MAX, _I64_MAX, _U32_MAX, _int, _u64, _u32, _bytes,
                      _options, _ext_ref, _blocks, _index, _timeout, _ip_array, _role,
                      _size, _bad_cache)

_fast = _ffi.speedups   # llmdd._speedups, or None: ctypes for every call

__all__ = ["Role", "Placement", "DataType", "DTYPE_SIZE", "CacheDesc", "CacheIndex",
           "ClusterInfo", "Cache", "Request", "Instance"]

# ----------------------------------------------------------------- caches

class Cache:
    """A cache of this instance (allocated or registered). Use as a context
    manager, or close() it: that deallocates or unregisters it."""

    _is_local_cache = True

    def __init__(self, instance, c_cache, desc, registered, keep):
        self._instance = instance
        self._c = c_cache
        self.desc = desc
        self.registered = registered
        self._keep = keep            # the memory owners of a registered cache
        self._closed = False
        self._byref = ctypes.byref(c_cache)
        self._addr = ctypes.addressof(c_cache)
        self.tensor_addrs = [int(c_cache.tensor_addrs[i]) for i in range(desc.num_tensors)]

    @property
    def cache_id(self):
        return int(self._c.cache_id)

    @property
    def closed(self):
        return self._closed or self._instance._dd is None

    def _ref(self, inst):
        if inst is not self._instance:
            raise ValueError(f"cache {self.cache_id} belongs to another instance")
        if self.closed:
            raise ValueError(f"cache {self.cache_id} is closed")
        return ctypes.byref(self._c)

    def close(self):
        """Deallocates (allocated) or unregisters (registered) the cache."""
        if self._closed:
            return
        self._closed = True
        inst = self._instance
        if inst._dd is not None:
            fn = (lib.llmdd_unregister_kv_cache if self.registered
                  else lib.llmdd_deallocate_cache)
            try:
                st = inst._call(fn, self.cache_id)
            except LlmddError:      # the instance closed meanwhile
                st = 0
            inst._caches.discard(self)
            self._keep = None
            check(st, f"closing cache {self.cache_id}")
        self._keep = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<llmdd.Cache id={self.cache_id} {self.desc!r} {state}>"


# ----------------------------------------------------------------- instance

class Instance:
    """An llmdd instance: ``with Instance(cluster_id, role, options={...}) as dd``
    creates and initializes it; leaving the block finalizes and destroys it.
    Every method raises LlmddError (with ``.status``) when the library
    returns a failure, TypeError/ValueError for bad arguments before any
    library call."""

    def __init__(self, cluster_id, role=Role.MIX, options=None, *, initialize=True):
        cluster_id = _u64("cluster_id", cluster_id)
        role = _role(role)
        self.cluster_id = cluster_id
        self.role = role
        self._dd = None
        self._ddi = 0               # the same pointer as an int (llmdd._speedups)
        self._inflight = []         # one entry per call in flight (_call)
        self._gate = False          # finalize or close is waiting for them
        self._calls_cv = threading.Condition(threading.Lock())
        self._caches = weakref.WeakSet()
        self._plain_opts = _ffi.XferOptsC(_ffi.XFER_COMPLETION, None, 0)
        self._plain_opts_addr = ctypes.addressof(self._plain_opts)
        self._cq = None             # _Completions, made by the first await
        self._cq_lock = threading.Lock()
        self._notify_waiters = collections.deque()
        self._reader_loop = None
        out = ctypes.c_void_p()
        check(lib.llmdd_create(cluster_id, int(role), ctypes.byref(out)), "llmdd_create")
        self._dd = out
        self._ddi = out.value
        if initialize:
            try:
                self.initialize(options)
            except BaseException:
                self.close()
                raise

    # -- lifecycle
    #
    # The C library lets other calls run beside each other but not beside
    # finalize or destroy; several Python threads may use one Instance, so
    # every call goes through _call, which counts it, and finalize and
    # close first stop new calls and wait for those in flight (each ends
    # within its own wait time or timeout). Requests need no instance: a
    # Request.wait() on another thread returns once finalize ends it.

    # No lock on a call's way: entering appends to _inflight and then looks
    # at the gate; _quiesce sets the gate and then waits for _inflight to
    # empty. Each step is atomic under the GIL (list.append and .pop are
    # atomic in free-threaded builds too) and they run in program order, so
    # a call is either counted before _quiesce looks or sees the gate and
    # backs out. A lock around every call cost 0.5 us of a synchronous 4 KiB
    # pull that takes C about 1 us over shm.

    def _call(self, fn, *args):
        # The instance goes as an int: llmdd._speedups takes one, and the
        # ctypes prototypes (_ffi._proto) convert it to a pointer.
        inflight = self._inflight
        inflight.append(None)
        try:
            if self._dd is None or self._gate:
                raise LlmddError(Status.LLM_FAILED, "instance is closed")
            return fn(self._ddi, *args)
        finally:
            inflight.pop()
            if self._gate:
                self._call_left()

    def _call_left(self):
        with self._calls_cv:
            self._calls_cv.notify_all()

    def _quiesce(self):
        """Stops new calls and waits for the ones in flight; the dd, or
        None when closed (or another thread is finalizing)."""
        with self._calls_cv:
            if self._dd is None or self._gate:
                return None
            self._gate = True
            while self._inflight:
                self._calls_cv.wait()
            return self._dd

    def initialize(self, options=None):
        arr, n, _keep = _options(options)
        check(self._call(lib.llmdd_initialize, arr, n), "initialize")

    def finalize(self):
        """Finalizes (idempotent); posted requests end with LLM_FAILED.
        Waits for calls other threads have in flight on this instance."""
        dd = self._quiesce()
        if dd is None:
            return
        try:
            self._finalize(dd)
        finally:
            with self._calls_cv:
                self._gate = False

    def _finalize(self, dd):
        for c in list(self._caches):
            c._closed = True
        self._caches = weakref.WeakSet()
        lib.llmdd_finalize(dd)      # ends every request (LLM_FAILED)
        with self._cq_lock:
            cq, self._cq = self._cq, None
        if cq is not None:
            cq.shutdown()           # wakes their awaits

    def close(self):
        """Finalizes and destroys the instance; later calls raise LLM_FAILED.
        Waits for calls other threads have in flight on this instance."""
        dd = self._quiesce()
        if dd is None:
            return
        self._finalize(dd)
        with self._calls_cv:
            self._dd = None
            self._ddi = 0
            self._gate = False
        lib.llmdd_destroy(dd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def set_role(self, role, options=None):
        role = _role(role)
        arr, n, _keep = _options(options)
        check(self._call(lib.llmdd_set_role, int(role), arr, n), "set_role")
        self.role = role

    # -- links
    def _clusters(self, clusters, need_addr=True):
        if isinstance(clusters, ClusterInfo):
            clusters = [clusters]
        if not isinstance(clusters, (list, tuple)) or not clusters:
            raise ValueError("clusters must be a non-empty list of ClusterInfo")
        arr = (_ffi.ClusterInfoC * len(clusters))()
        keep = []
        for i, c in enumerate(clusters):
            if not isinstance(c, ClusterInfo):
                raise TypeError(f"clusters[{i}] must be a ClusterInfo")
            # No address: looked up by cluster id (llm.MetadataServer).
            if need_addr and len(c.remote_addrs) > 1:
                raise ValueError(f"clusters[{i}]: at most one remote address")
            r, nr = _ip_array(c.remote_addrs)
            lo, nl = _ip_array(c.local_addrs)
            keep += [r, lo]
            arr[i].remote_cluster_id = c.remote_cluster_id
            arr[i].remote_role_type = c.remote_role_type
            arr[i].remote_ip_infos = r
            arr[i].num_remote_ip_infos = nr
            arr[i].local_ip_infos = lo
            arr[i].num_local_ip_infos = nl
        return arr, len(clusters), keep

    def link_clusters_status(self, clusters, timeout_ms=3000):
        """Links; returns (status, [status per cluster]) without raising on
        link failures (the reference's convention)."""
        arr, n, _keep = self._clusters(clusters)
        timeout_ms = _int("timeout_ms", timeout_ms, 1, _I32_MAX)
        rets = (_ffi.status_t * n)()
        st = self._call(lib.llmdd_link_clusters, arr, n, rets, timeout_ms)
        return int(st), [int(r) for r in rets]

    def link_clusters(self, clusters, timeout_ms=3000):
        """Links; raises LlmddError (with ``.statuses``) if any failed."""
        st, rets = self.link_clusters_status(clusters, timeout_ms)
        if st != 0:
            e = LlmddError(st, f"link_clusters {rets}")
            e.statuses = rets
            raise e
        return rets

    def link(self, remote_cluster_id, remote_addr=None, timeout_ms=3000):
        """Links one peer listening at remote_addr ("host:port"); without
        one, its address is looked up by cluster id in the metadata server
        (llm.MetadataServer)."""
        self.link_clusters([ClusterInfo(remote_cluster_id, remote_addr)], timeout_ms)

    def unlink_clusters_status(self, clusters, timeout_ms=3000, force=False):
        if not isinstance(force, bool):
            raise TypeError("force must be a bool")
        # A link is known by its cluster id: no address is needed or used.
        arr, n, _keep = self._clusters(clusters, need_addr=False)
        timeout_ms = _int("timeout_ms", timeout_ms, 1, _I32_MAX)
        rets = (_ffi.status_t * n)()
        st = self._call(lib.llmdd_unlink_clusters, arr, n, rets, timeout_ms, force)
        return int(st), [int(r) for r in rets]

    def unlink_clusters(self, clusters, timeout_ms=3000, force=False):
        st, rets = self.unlink_clusters_status(clusters, timeout_ms, force)
        if st != 0:
            e = LlmddError(st, f"unlink_clusters {rets}")
            e.statuses = rets
            raise e
        return rets

    def unlink(self, remote_cluster_id, remote_addr=None, timeout_ms=3000, force=False):
        self.unlink_clusters([ClusterInfo(remote_cluster_id, remote_addr)], timeout_ms, force)

    # -- caches
    def allocate_cache(self, desc, layout=None):
        """Allocates (and zeroes) a cache; returns a Cache. layout: a
        llmdd.KvLayout, for slice transfers."""
        if not isinstance(desc, CacheDesc):
            raise TypeError("desc must be a llmdd.CacheDesc")
        out = _ffi.CacheC()
        cd = desc._c()
        if layout is not None and desc.batch_dim != 0:
            raise ValueError("a layout cache has batch_dim 0")
        if layout is not None:
            check(self._call(lib.llmdd_allocate_cache_layout, ctypes.byref(cd),
                             ctypes.byref(layout._c()), ctypes.byref(out)),
                  "allocate_cache")
        elif desc.batch_dim != 0:
            check(self._call(lib.llmdd_allocate_cache_ex, ctypes.byref(cd),
                             desc.batch_dim, ctypes.byref(out)), "allocate_cache")
        else:
            check(self._call(lib.llmdd_allocate_cache, ctypes.byref(cd),
                             ctypes.byref(out)), "allocate_cache")
        c = Cache(self, out, desc, False, None)
        self._caches.add(c)
        return c

    def register_cache(self, tensors, desc=None, layout=None):
        """Registers caller memory as a cache; returns a Cache that keeps the
        memory objects alive until it is closed (unregistered).

        tensors: a list with one memory object per tensor (torch tensor,
        numpy array, writable buffer, int address), or one memory object
        holding all tensors back to back. desc: a CacheDesc; when omitted it
        is read from a list of equal numpy arrays or torch tensors
        (shape and dtype). layout: a llmdd.KvLayout (KvLayout.of(tensor,
        "NHD", ...) reads it from a tensor's shape), for slice transfers."""
        single = not isinstance(tensors, (list, tuple))
        items = [tensors] if single else list(tensors)
        if not items:
            raise ValueError("tensors is empty")
        mems = [memory_of(t, f"tensors[{i}]") for i, t in enumerate(items)]
        if desc is None:
            if single:
                raise ValueError("desc is required with a single memory object")
            m0 = mems[0]
            if m0.shape is None or m0.dtype is None:
                raise ValueError("desc is required: cannot read shape and dtype from "
                                 f"{type(items[0]).__name__}")
            for i, m in enumerate(mems):
                if m.shape != m0.shape or m.dtype != m0.dtype:
                    raise ValueError(f"tensors[{i}] differs in shape or dtype from tensors[0]")
            desc = CacheDesc(len(mems), m0.shape, m0.dtype)
        elif not isinstance(desc, CacheDesc):
            raise TypeError("desc must be a llmdd.CacheDesc")
        ts = desc.tensor_size
        if ts is None:
            raise ValueError(f"data_type {desc.data_type.name} has no size")
        if single:
            m = mems[0]
            if m.nbytes is not None and m.nbytes < ts * desc.num_tensors:
                raise ValueError(f"memory holds {m.nbytes} bytes, the cache needs "
                                 f"{desc.num_tensors} x {ts}")
            addrs = [m.addr + i * ts for i in range(desc.num_tensors)]
        else:
            if len(mems) != desc.num_tensors:
                raise ValueError(f"{len(mems)} tensors given, desc.num_tensors is "
                                 f"{desc.num_tensors}")
            for i, m in enumerate(mems):
                if m.nbytes is not None and m.nbytes < ts:
                    raise ValueError(f"tensors[{i}] holds {m.nbytes} bytes, a tensor "
                                     f"of the cache needs {ts}")
            addrs = [m.addr for m in mems]
        arr = (ctypes.c_uint64 * len(addrs))(*addrs)
        cid = ctypes.c_int64()
        cd = desc._c()
        if layout is not None and desc.batch_dim != 0:
            raise ValueError("a layout cache has batch_dim 0")
        if layout is not None:
            check(self._call(lib.llmdd_register_kv_cache_layout, ctypes.byref(cd),
                             ctypes.byref(layout._c()), arr, len(addrs),
                             ctypes.byref(cid)), "register_cache")
        elif desc.batch_dim != 0:
            check(self._call(lib.llmdd_register_kv_cache_ex, ctypes.byref(cd),
                             desc.batch_dim, arr, len(addrs), ctypes.byref(cid)),
                  "register_cache")
        else:
            check(self._call(lib.llmdd_register_kv_cache, ctypes.byref(cd), arr,
                             len(addrs), ctypes.byref(cid)), "register_cache")
        out = _ffi.CacheC()
        out.cache_id = cid.value
        out.desc = cd
        out.tensor_addrs = arr
        c = Cache(self, out, desc, True, (mems, arr))
        self._caches.add(c)
        return c

    # -- transfers
    #
    # A synchronous call is the C library's synchronous call: ctypes
    # releases the GIL for it, and it ends within llm.SyncKvCacheWaitTime
    # (so Ctrl-C, which Python delivers when it returns, ends it within
    # that time too). notify= or timeout_ms= need a request: then the call
    # posts and waits. Posted requests carry LLMDD_XFER_COMPLETION, for
    # `await` (_Completions).
    def _opts(self, notify, layerwise):
        if notify is None and not layerwise:
            return self._plain_opts, None   # read by the library at the post only
        o = _ffi.XferOptsC()
        o.flags = _ffi.XFER_COMPLETION | (_ffi.XFER_LAYERWISE if layerwise else 0)
        buf = None
        if notify is not None:
            buf = _bytes("notify", notify, 0, _ffi.NOTIFY_MAX)
            o.notify = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p)
            o.notify_len = len(buf)
        return o, buf

    def _post(self, fn, args, keep, notify=None, layerwise=False):
        opts, nbuf = self._opts(notify, layerwise)
        req = ctypes.c_void_p()
        st = self._call(fn, *args, opts, ctypes.byref(req))
        if st != 0:
            raise LlmddError(st, fn.__name__)
        return Request(self, req, (keep, args, nbuf))

    def _fast_sync(self, fn, name, f):
        # _call, inline: this is the hottest path there is (the extra call
        # cost a synchronous 4 KiB pull over shm 0.2-0.3 us of its 3.7).
        inflight = self._inflight
        inflight.append(None)
        try:
            if self._dd is None or self._gate:
                raise LlmddError(Status.LLM_FAILED, "instance is closed")
            st = fn(self._ddi, *f)
        finally:
            inflight.pop()
            if self._gate:
                self._call_left()
        if st != 0:
            raise LlmddError(st, name)

    def _post_fast(self, f, keep, push):
        st, req = self._call(_fast.post, *f, self._plain_opts_addr, push)
        if st != 0:
            raise LlmddError(st, "llmdd_push_kv_cache_async" if push
                             else "llmdd_pull_kv_cache_async")
        return Request(self, req, (keep,))

    def _wait_posted(self, post_fn, args, keep, notify, timeout_ms):
        _timeout("timeout_ms", timeout_ms)     # checked before anything is posted
        with self._post(post_fn, args, keep, notify) as r:
            r.wait(timeout_ms)

    def _local(self, cache, name):
        # The common case first: an open cache of this open instance.
        if type(cache) is Cache and cache._instance is self and not cache._closed \
                and self._dd is not None:
            return cache._byref
        if isinstance(cache, Cache):
            return cache._ref(self)
        _bad_cache(name)

    def _fast_slot(self, remote, cache, batch_index, size, sl, dl, tnpl):
        """The arguments of llmdd._speedups' slot calls after the instance
        (remote index as ints, the local cache's address, batch index, size,
        ext NULL), or None where the ctypes path is taken, which checks
        again and raises: no llmdd._speedups, layer ranges, or an argument
        that is not the plain case (an open Cache of this instance, a
        CacheIndex or tuple of ints in range). Checked inline, no calls: a
        function call costs about 0.1 us."""
        if _fast is None or sl is not None or dl is not None or type(tnpl) is not int \
                or tnpl != 2 or type(cache) is not Cache or cache._instance is not self \
                or cache._closed:
            return None
        t = type(remote)
        if t is CacheIndex or (t is tuple and len(remote) == 3):
            a, b, c = remote
        elif t is tuple and len(remote) == 2:
            (a, b), c = remote, 0
        else:
            return None
        if (type(a) is int and type(b) is int and type(c) is int
                and type(batch_index) is int and type(size) is int
                and 0 <= a <= U64_MAX and -2**63 <= b <= _I64_MAX and 0 <= c <= _U32_MAX
                and 0 <= batch_index <= _U32_MAX and (size == -1 or 0 < size <= _I64_MAX)):
            return (a, b, c, cache._addr, batch_index, size, 0)
        return None

    def _pull_cache_args(self, src, dst, batch_index, size, sl, dl, tnpl):
        return (_index(src), self._local(dst, "dst"),
                _u32("batch_index", batch_index), _size(size), _ext_ref(sl, dl, tnpl))

    def _blocks_args(self, cache, name, other, src_blocks, dst_blocks, sl, dl, tnpl):
        sb, n = _blocks("src_blocks", src_blocks)
        db, m = _blocks("dst_blocks", dst_blocks)
        if n != m:
            raise ValueError(f"src_blocks has {n} entries, dst_blocks {m}")
        if name == "dst":    # a pull: (remote source, local destination)
            pair = (_index(other), self._local(cache, name))
        else:
            pair = (self._local(cache, name), _index(other, "dst"))
        return pair + (sb, db, n, _ext_ref(sl, dl, tnpl))

    def _to_blocks_args(self, src, dst, dst_blocks, sl, dl, tnpl):
        db, n = _blocks("dst_blocks", dst_blocks)
        return (_index(src), self._local(dst, "dst"), db, n,
                _ext_ref(sl, dl, tnpl))

    def _push_cache_args(self, src, dst, src_batch_index, size, sl, dl, tnpl):
        return (self._local(src, "src"), _index(dst, "dst"),
                _u32("src_batch_index", src_batch_index), _size(size), _ext_ref(sl, dl, tnpl))

    def _push_to_blocks_args(self, src, dst, dst_blocks, src_batch_index, sl, dl, tnpl):
        db, n = _blocks("dst_blocks", dst_blocks)
        return (self._local(src, "src"), _index(dst, "dst"),
                _u32("src_batch_index", src_batch_index), db, n, _ext_ref(sl, dl, tnpl))

    def pull_cache_async(self, src, dst, batch_index=0, size=-1, *, src_layers=None,
                         dst_layers=None, tensor_num_per_layer=2, notify=None):
        """Posts a pull of the remote slot src (CacheIndex) into slot
        batch_index of the local cache dst; returns a Request."""
        if notify is None:
            f = self._fast_slot(src, dst, batch_index, size, src_layers, dst_layers,
                                tensor_num_per_layer)
            if f is not None:
                return self._post_fast(f, dst, False)
        args = self._pull_cache_args(src, dst, batch_index, size, src_layers, dst_layers,
                                     tensor_num_per_layer)
        return self._post(lib.llmdd_pull_kv_cache_async, args, dst, notify)

    def pull_blocks_async(self, src, dst, src_blocks, dst_blocks, *, src_layers=None,
                          dst_layers=None, tensor_num_per_layer=2, notify=None):
        args = self._blocks_args(dst, "dst", src, src_blocks, dst_blocks, src_layers,
                                 dst_layers, tensor_num_per_layer)
        return self._post(lib.llmdd_pull_kv_blocks_async, args, dst, notify)

    def pull_cache_to_blocks_async(self, src, dst, dst_blocks, *, src_layers=None,
                                   dst_layers=None, tensor_num_per_layer=2, notify=None):
        """Posts a pull of the remote slot src (CacheIndex; a cache without
        blocks) into blocks of the local block cache dst: chunk k of the
        slot, one block's bytes, lands in dst_blocks[k]; the last may be
        short. len(dst_blocks) must be ceil(slot / block)."""
        args = self._to_blocks_args(src, dst, dst_blocks, src_layers, dst_layers,
                                    tensor_num_per_layer)
        return self._post(lib.llmdd_pull_kv_cache_to_blocks_async, args, dst, notify)

    def push_cache_async(self, src, dst, src_batch_index=0, size=-1, *, src_layers=None,
                         dst_layers=None, tensor_num_per_layer=2, notify=None,
                         layerwise=False):
        """Posts a push of local slot src_batch_index of src into the remote
        slot dst (CacheIndex). layerwise: layers move once layer_ready()."""
        if notify is None and not layerwise:
            f = self._fast_slot(dst, src, src_batch_index, size, src_layers, dst_layers,
                                tensor_num_per_layer)
            if f is not None:
                return self._post_fast(f, src, True)
        args = self._push_cache_args(src, dst, src_batch_index, size, src_layers, dst_layers,
                                     tensor_num_per_layer)
        return self._post(lib.llmdd_push_kv_cache_async, args, src, notify, layerwise)

    def push_cache_to_blocks_async(self, src, dst, dst_blocks, src_batch_index=0, *,
                                   src_layers=None, dst_layers=None, tensor_num_per_layer=2,
                                   notify=None, layerwise=False):
        """Posts a push of local slot src_batch_index of src (a cache without
        blocks) into blocks of the remote block cache dst (CacheIndex,
        batch_index 0): chunk k of the slot lands in dst_blocks[k]."""
        args = self._push_to_blocks_args(src, dst, dst_blocks, src_batch_index, src_layers,
                                         dst_layers, tensor_num_per_layer)
        return self._post(lib.llmdd_push_kv_cache_to_blocks_async, args, src, notify,
                          layerwise)

    def push_blocks_async(self, src, dst, src_blocks, dst_blocks, *, src_layers=None,
                          dst_layers=None, tensor_num_per_layer=2, notify=None,
                          layerwise=False):
        args = self._blocks_args(src, "src", dst, src_blocks, dst_blocks, src_layers,
                                 dst_layers, tensor_num_per_layer)
        return self._post(lib.llmdd_push_kv_blocks_async, args, src, notify, layerwise)

    def pull_cache(self, src, dst, batch_index=0, size=-1, *, src_layers=None,
                   dst_layers=None, tensor_num_per_layer=2, notify=None, timeout_ms=None):
        """Pulls as pull_cache_async does and returns once the bytes landed
        (llmdd_pull_kv_cache); raises on failure. With notify or timeout_ms
        (posted, then waited for up to timeout_ms)."""
        if notify is None and timeout_ms is None:
            f = self._fast_slot(src, dst, batch_index, size, src_layers, dst_layers,
                                tensor_num_per_layer)
            if f is not None:
                return self._fast_sync(_fast.pull_cache, "llmdd_pull_kv_cache", f)
        args = self._pull_cache_args(src, dst, batch_index, size, src_layers, dst_layers,
                                     tensor_num_per_layer)
        if notify is None and timeout_ms is None:
            st = self._call(lib.llmdd_pull_kv_cache, *args)
            if st != 0:
                raise LlmddError(st, "llmdd_pull_kv_cache")
        else:
            self._wait_posted(lib.llmdd_pull_kv_cache_async, args, dst, notify, timeout_ms)

    def pull_blocks(self, src, dst, src_blocks, dst_blocks, *, src_layers=None,
                    dst_layers=None, tensor_num_per_layer=2, notify=None, timeout_ms=None):
        args = self._blocks_args(dst, "dst", src, src_blocks, dst_blocks, src_layers,
                                 dst_layers, tensor_num_per_layer)
        if notify is None and timeout_ms is None:
            st = self._call(lib.llmdd_pull_kv_blocks, *args)
            if st != 0:
                raise LlmddError(st, "llmdd_pull_kv_blocks")
        else:
            self._wait_posted(lib.llmdd_pull_kv_blocks_async, args, dst, notify, timeout_ms)

    def pull_cache_to_blocks(self, src, dst, dst_blocks, *, src_layers=None, dst_layers=None,
                             tensor_num_per_layer=2, notify=None, timeout_ms=None):
        args = self._to_blocks_args(src, dst, dst_blocks, src_layers, dst_layers,
                                    tensor_num_per_layer)
        if notify is None and timeout_ms is None:
            st = self._call(lib.llmdd_pull_kv_cache_to_blocks, *args)
            if st != 0:
                raise LlmddError(st, "llmdd_pull_kv_cache_to_blocks")
        else:
            self._wait_posted(lib.llmdd_pull_kv_cache_to_blocks_async, args, dst, notify, timeout_ms)

    def push_cache(self, src, dst, src_batch_index=0, size=-1, *, src_layers=None,
                   dst_layers=None, tensor_num_per_layer=2, notify=None, timeout_ms=None):
        if notify is None and timeout_ms is None:
            f = self._fast_slot(dst, src, src_batch_index, size, src_layers, dst_layers,
                                tensor_num_per_layer)
            if f is not None:
                return self._fast_sync(_fast.push_cache, "llmdd_push_kv_cache", f)
        args = self._push_cache_args(src, dst, src_batch_index, size, src_layers, dst_layers,
                                     tensor_num_per_layer)
        if notify is None and timeout_ms is None:
            st = self._call(lib.llmdd_push_kv_cache, *args)
            if st != 0:
                raise LlmddError(st, "llmdd_push_kv_cache")
        else:
            self._wait_posted(lib.llmdd_push_kv_cache_async, args, src, notify, timeout_ms)

    def push_blocks(self, src, dst, src_blocks, dst_blocks, *, src_layers=None,
                    dst_layers=None, tensor_num_per_layer=2, notify=None, timeout_ms=None):
        args = self._blocks_args(src, "src", dst, src_blocks, dst_blocks, src_layers,
                                 dst_layers, tensor_num_per_layer)
        if notify is None and timeout_ms is None:
            st = self._call(lib.llmdd_push_kv_blocks, *args)
            if st != 0:
                raise LlmddError(st, "llmdd_push_kv_blocks")
        else:
            self._wait_posted(lib.llmdd_push_kv_blocks_async, args, src, notify, timeout_ms)

    def push_cache_to_blocks(self, src, dst, dst_blocks, src_batch_index=0, *,
                             src_layers=None, dst_layers=None, tensor_num_per_layer=2,
                             notify=None, timeout_ms=None):
        args = self._push_to_blocks_args(src, dst, dst_blocks, src_batch_index, src_layers,
                                         dst_layers, tensor_num_per_layer)
        if notify is None and timeout_ms is None:
            st = self._call(lib.llmdd_push_kv_cache_to_blocks, *args)
            if st != 0:
                raise LlmddError(st, "llmdd_push_kv_cache_to_blocks")
        else:
            self._wait_posted(lib.llmdd_push_kv_cache_to_blocks_async, args, src, notify, timeout_ms)

    def copy_cache(self, src, dst, src_batch_index=0, dst_batch_index=0, offset=0, size=-1):
        """Local copy of one slot of every tensor (offset/size per tensor)."""
        check(self._call(
            lib.llmdd_copy_kv_cache,
            src._ref(self) if isinstance(src, Cache) else _bad_cache("src"),
            dst._ref(self) if isinstance(dst, Cache) else _bad_cache("dst"),
            _u32("src_batch_index", src_batch_index), _u32("dst_batch_index", dst_batch_index),
            _u64("offset", offset), _size(size)), "copy_cache")

    def copy_blocks(self, src, dst, src_blocks, dst_blocks):
        sb, n = _blocks("src_blocks", src_blocks)
        db, m = _blocks("dst_blocks", dst_blocks)
        if n != m:
            raise ValueError(f"src_blocks has {n} entries, dst_blocks {m}")
        check(self._call(
            lib.llmdd_copy_kv_blocks,
            src._ref(self) if isinstance(src, Cache) else _bad_cache("src"),
            dst._ref(self) if isinstance(dst, Cache) else _bad_cache("dst"), sb, db, n),
            "copy_blocks")

    def check_link(self, remote_cluster_id, timeout_ms=1000):
        """A round trip to the peer on the link's control connection.
        Returns None when it answered within timeout_ms; raises LlmddError
        with LLM_NOT_YET_LINK (no live link) or LLM_TIMEOUT."""
        rid = _u64("remote_cluster_id", remote_cluster_id)
        t = _int("timeout_ms", timeout_ms, 1, _I32_MAX)
        check(self._call(lib.llmdd_check_link, rid, t), "check_link")

    # -- notifications
    def send_notify(self, cluster_id, msg):
        cluster_id = _u64("cluster_id", cluster_id)
        buf = _bytes("msg", msg, 0, _ffi.NOTIFY_MAX)
        check(self._call(lib.llmdd_send_notify, cluster_id, buf, len(buf)), "send_notify")

    def get_notifies(self, max_count=64):
        """Never blocks: up to max_count received notifications, oldest
        first, as a list of (cluster_id, bytes)."""
        max_count = _int("max_count", max_count, 1, 1 << 20)
        out = (_ffi.NotifyC * max_count)()
        n = ctypes.c_size_t()
        check(self._call(lib.llmdd_get_notifies, out, max_count, ctypes.byref(n)),
              "get_notifies")
        res = []
        for i in range(min(n.value, max_count)):
            ln = min(out[i].len, _ffi.NOTIFY_MAX)
            res.append((int(out[i].cluster_id), bytes(out[i].msg[:ln])))
        return res

    def notify_fd(self):
        """A level-triggered fd, readable while notifications wait. Owned by
        the instance; do not close it."""
        fd = self._call(lib.llmdd_notify_fd)
        if fd < 0:
            raise LlmddError(Status.LLM_FAILED, "notify_fd: not initialized")
        return fd

    async def wait_notify(self, max_count=64):
        """Waits (in asyncio, via loop.add_reader on notify_fd) for at least
        one notification; returns them as get_notifies does."""
        got = self.get_notifies(max_count)
        if got:
            return got
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = self.notify_fd()
        self._notify_waiters.append((fut, max_count))
        if self._reader_loop is not loop:
            loop.add_reader(fd, self._on_notify_fd, loop, fd)
            self._reader_loop = loop
        try:
            return await fut
        finally:
            try:
                self._notify_waiters.remove((fut, max_count))
            except ValueError:
                pass
            if not self._notify_waiters and self._reader_loop is loop:
                loop.remove_reader(fd)
                self._reader_loop = None

    def _on_notify_fd(self, loop, fd):
        while self._notify_waiters:
            fut, cap = self._notify_waiters[0]
            if fut.done():
                self._notify_waiters.popleft()
                continue
            try:
                got = self.get_notifies(cap)
            except LlmddError as e:
                self._notify_waiters.popleft()
                fut.set_exception(e)
                continue
            if got:
                self._notify_waiters.popleft()
                fut.set_result(got)
            return
        loop.remove_reader(fd)
        self._reader_loop = None

    # -- keys
    def set_cache_key(self, cache, batch_index, key):
        """Names slot batch_index of a local cache by key (1..128 bytes)."""
        k = _bytes("key", key, 1, _ffi.KEY_MAX)
        if not isinstance(cache, Cache):
            _bad_cache("cache")
        cache._ref(self)
        check(self._call(lib.llmdd_set_cache_key, cache.cache_id,
                                      _u32("batch_index", batch_index), k, len(k)),
              "set_cache_key")

    def remove_cache_key(self, key):
        k = _bytes("key", key, 1, _ffi.KEY_MAX)
        check(self._call(lib.llmdd_remove_cache_key, k, len(k)), "remove_cache_key")

    def lookup_remote_key(self, cluster_id, key):
        """Asks the linked peer which slot its key names: a CacheIndex."""
        cluster_id = _u64("cluster_id", cluster_id)
        k = _bytes("key", key, 1, _ffi.KEY_MAX)
        out = _ffi.CacheIndexC()
        check(self._call(lib.llmdd_lookup_remote_key, cluster_id, k, len(k),
                                          ctypes.byref(out)), "lookup_remote_key")
        return CacheIndex(int(out.cluster_id), int(out.cache_id), int(out.batch_index))

    def listen_address(self):
        """Where this instance listens, as "ip:port" ("[ip]:port" for IPv6);
        the port the kernel chose when llm.ListenIpInfo gave port 0."""
        out = _ffi.IpInfoC()
        check(self._call(lib.llmdd_listen_address, ctypes.byref(out)),
              "listen_address")
        ip = out.ip.decode()
        return f"[{ip}]:{out.port}" if ":" in ip else f"{ip}:{out.port}"

    # -- metrics
    def metrics_text(self):
        """The Prometheus text exposition of this instance's metrics."""
        cap = 16384
        while True:
            buf = ctypes.create_string_buffer(cap)
            need = self._call(lib.llmdd_metrics_text, buf, cap)
            if need < cap:
                return buf.value.decode()
            cap = need + 4096

    # -- asyncio support
    def _completions(self):
        with self._cq_lock:
            if self._dd is None:
                raise LlmddError(Status.LLM_FAILED, "instance is closed")
            if self._cq is None:
                self._cq = _Completions(self)
            return self._cq

    def __repr__(self):
        state = "closed" if self._dd is None else "open"
        return f"<llmdd.Instance cluster_id={self.cluster_id} {self.role.name} {state}>"
