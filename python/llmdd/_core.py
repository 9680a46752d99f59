"""Instances, caches, requests: the pythonic layer over _ffi."""

import asyncio
import collections
import ctypes
import enum
import math
import threading
import weakref

from . import _ffi
from ._ffi import lib
from ._memory import memory_of, U64_MAX
from ._status import Status, LlmddError, RequestTimeout, check

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


DTYPE_SIZE = {0: 4, 1: 2, 2: 1, 3: 4, 4: 1, 6: 2, 7: 2, 8: 4, 9: 8, 10: 8,
              11: 8, 12: 1, 27: 2}


# ----------------------------------------------------------------- checks

def _int(name, v, lo, hi):
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name}={v} out of range [{lo}, {hi}]")
    return v


def _u64(name, v):
    return _int(name, v, 0, U64_MAX)


def _u32(name, v):
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
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints")
    n = len(blocks)
    if n == 0:
        raise ValueError(f"{name} is empty")
    arr = (ctypes.c_uint64 * n)()
    for i, b in enumerate(blocks):
        if hasattr(b, "__index__") and not isinstance(b, bool):
            b = b.__index__()
        arr[i] = _u64(f"{name}[{i}]", b)
    return arr, n


# ----------------------------------------------------------------- values

class CacheDesc:
    """A cache's description: num_tensors tensors of one shape and type.
    shape[0] is the batch size (or number of blocks)."""

    __slots__ = ("num_tensors", "shape", "data_type", "placement")

    def __init__(self, num_tensors, shape, data_type=DataType.UINT8,
                 placement=Placement.HOST):
        _int("num_tensors", num_tensors, 1, _U32_MAX)
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not 1 <= len(shape) <= _ffi.MAX_DIMS:
            raise TypeError(f"shape must be a tuple of 1..{_ffi.MAX_DIMS} ints")
        for i, d in enumerate(shape):
            _int(f"shape[{i}]", d, 1, _I64_MAX)
        try:
            data_type = DataType(data_type)
        except ValueError:
            raise ValueError(f"unknown data_type {data_type!r}") from None
        try:
            placement = Placement(placement)
        except ValueError:
            raise ValueError(f"unknown placement {placement!r}") from None
        self.num_tensors = num_tensors
        self.shape = tuple(shape)
        self.data_type = data_type
        self.placement = placement

    @property
    def tensor_size(self):
        """Bytes in one tensor (prod(shape) * element size); None when the
        data type has no size."""
        es = DTYPE_SIZE.get(int(self.data_type))
        return None if es is None else math.prod(self.shape) * es

    @property
    def stride(self):
        ts = self.tensor_size
        return None if ts is None else ts // self.shape[0]

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
        return (f"CacheDesc(num_tensors={self.num_tensors}, shape={self.shape}, "
                f"data_type={self.data_type.name}, placement={self.placement.name})")


CacheIndex = collections.namedtuple("CacheIndex", "cluster_id cache_id batch_index",
                                    defaults=(0,))
CacheIndex.__doc__ = "Names a remote cache's batch slot: (cluster_id, cache_id, batch_index=0)."


def _index(v, name="src"):
    if isinstance(v, Cache):
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
        self.remote_role_type = _int("remote_role_type", int(remote_role_type), -2**31, _I32_MAX)

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
    _int("port", port, 0, 65535)
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


# ----------------------------------------------------------------- caches

class Cache:
    """A cache of this instance (allocated or registered). Use as a context
    manager, or close() it: that deallocates or unregisters it."""

    def __init__(self, instance, c_cache, desc, registered, keep):
        self._instance = instance
        self._c = c_cache
        self.desc = desc
        self.registered = registered
        self._keep = keep            # the memory owners of a registered cache
        self._closed = False
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


# ----------------------------------------------------------------- requests

class Request:
    """A posted transfer. wait(), cancel(), done(), layer_ready(); ``await``
    it in asyncio. Freed by close(), the context manager or __del__."""

    def __init__(self, instance, ptr, keep):
        self._instance = instance
        self._ptr = ptr
        self._keep = keep            # caches and arrays the transfer uses
        self._users = 0
        self._cv = threading.Condition(threading.Lock())
        self._final = None

    def _enter(self):
        with self._cv:
            if self._ptr is None:
                raise ValueError("request is closed")
            self._users += 1
            return self._ptr

    def _leave(self):
        with self._cv:
            self._users -= 1
            if self._users == 0:
                self._cv.notify_all()

    def _wait_raw(self, timeout_ms):
        ptr = self._enter()
        try:
            st = lib.llmdd_request_wait(ptr, timeout_ms)
        finally:
            self._leave()
        if st != _WAIT:
            self._final = st
            self._keep = None if st == 0 else self._keep
        return st

    @property
    def status(self):
        """The final status once done, else LLM_WAIT_PROC_TIMEOUT."""
        if self._final is not None:
            return self._final
        return self._wait_raw(0)

    def done(self):
        return self.status != _WAIT

    def wait(self, timeout_ms=None):
        """Waits until the transfer is done (timeout_ms None: no limit).
        Returns None on LLM_SUCCESS; raises RequestTimeout while in flight
        past timeout_ms, LlmddError with the final status otherwise."""
        t = _timeout("timeout_ms", timeout_ms)
        if self._final is not None:
            st = self._final
        elif t < 0:
            # Slices keep Ctrl-C working in the main thread; a done request
            # returns from the first one.
            while True:
                st = self._wait_raw(200)
                if st != _WAIT:
                    break
        else:
            st = self._wait_raw(t)
        if st == _WAIT:
            raise RequestTimeout()
        check(st, "transfer")

    def cancel(self):
        """Returns once no byte of the transfer moves any more."""
        ptr = self._enter()
        try:
            check(lib.llmdd_request_cancel(ptr), "cancel")
        finally:
            self._leave()

    def layer_ready(self, layer):
        """LLMDD_XFER_LAYERWISE: layer (0-based inside the source layer
        range) may move now."""
        _u32("layer", layer)
        ptr = self._enter()
        try:
            check(lib.llmdd_request_layer_ready(ptr, layer), f"layer_ready({layer})")
        finally:
            self._leave()

    def close(self):
        """Frees the request, cancelling it first if it is in flight."""
        with self._cv:
            ptr = self._ptr
            if ptr is None:
                return
            self._ptr = None
        with self._cv:
            busy = self._users
        if busy:
            lib.llmdd_request_cancel(ptr)   # wakes the other waiters
            with self._cv:
                while self._users:
                    self._cv.wait()
        lib.llmdd_request_free(ptr)         # cancels first if in flight
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

    def __await__(self):
        if self._final is None:
            fut = self._instance._waiter().submit(self)
            yield from fut.__await__()
        return self.wait(0)


class _Waiter:
    """One thread per instance completes the asyncio futures of awaited
    requests: a blocking wait on the oldest request, in slices, then a
    non-blocking test of the others. No thread per request, no busy loop."""

    SLICE_MS = 10

    def __init__(self):
        self._cv = threading.Condition()
        self._pending = collections.deque()   # (request, loop, future)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="llmdd-waiter",
                                        daemon=True)
        self._thread.start()

    def submit(self, req):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._stop:
                raise ValueError("instance is closed")
            self._pending.append((req, loop, fut))
            self._cv.notify()
        return fut

    @staticmethod
    def _complete(loop, fut, st):
        def set_():
            if not fut.done():
                fut.set_result(st)
        try:
            loop.call_soon_threadsafe(set_)
        except RuntimeError:   # the loop is closed: nobody is waiting
            pass

    def _poll(self, item, timeout_ms):
        req, loop, fut = item
        if fut.cancelled():
            return True
        try:
            st = req._wait_raw(timeout_ms)
        except ValueError:     # closed meanwhile
            st = int(Status.LLM_FAILED)
        if st == _WAIT:
            return False
        self._complete(loop, fut, st)
        return True

    def _run(self):
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop and not self._pending:
                    return
                items = list(self._pending)
            done = set()
            if self._poll(items[0], self.SLICE_MS):
                done.add(id(items[0]))
            for it in items[1:]:
                if self._poll(it, 0):
                    done.add(id(it))
            if done:
                with self._cv:
                    self._pending = collections.deque(
                        it for it in self._pending if id(it) not in done)

    def stop(self):
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()


# ----------------------------------------------------------------- instance

class Instance:
    """An llmdd instance: ``with Instance(cluster_id, role, options={...}) as dd``
    creates and initializes it; leaving the block finalizes and destroys it.
    Every method raises LlmddError (with ``.status``) when the library
    returns a failure, TypeError/ValueError for bad arguments before any
    library call."""

    def __init__(self, cluster_id, role=Role.MIX, options=None, *, initialize=True):
        _u64("cluster_id", cluster_id)
        role = _role(role)
        self.cluster_id = cluster_id
        self.role = role
        self._dd = None
        self._calls = 0             # calls in flight (_call)
        self._gate = False          # finalize or close is waiting for them
        self._calls_cv = threading.Condition(threading.Lock())
        self._caches = weakref.WeakSet()
        self._waiter_obj = None
        self._waiter_lock = threading.Lock()
        self._notify_waiters = collections.deque()
        self._reader_loop = None
        out = ctypes.c_void_p()
        check(lib.llmdd_create(cluster_id, int(role), ctypes.byref(out)), "llmdd_create")
        self._dd = out
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

    def _call(self, fn, *args):
        with self._calls_cv:
            dd = self._dd
            if dd is None or self._gate:
                raise LlmddError(Status.LLM_FAILED, "instance is closed")
            self._calls += 1
        try:
            return fn(dd, *args)
        finally:
            with self._calls_cv:
                self._calls -= 1
                if self._calls == 0:
                    self._calls_cv.notify_all()

    def _quiesce(self):
        """Stops new calls and waits for the ones in flight; the dd, or
        None when closed (or another thread is finalizing)."""
        with self._calls_cv:
            if self._dd is None or self._gate:
                return None
            self._gate = True
            while self._calls:
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
        self._stop_waiter()
        for c in list(self._caches):
            c._closed = True
        self._caches = weakref.WeakSet()
        lib.llmdd_finalize(dd)

    def close(self):
        """Finalizes and destroys the instance; later calls raise LLM_FAILED.
        Waits for calls other threads have in flight on this instance."""
        dd = self._quiesce()
        if dd is None:
            return
        self._finalize(dd)
        with self._calls_cv:
            self._dd = None
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
            if need_addr and len(c.remote_addrs) != 1:
                raise ValueError(f"clusters[{i}]: exactly one remote address needed")
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
        _int("timeout_ms", timeout_ms, 1, _I32_MAX)
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

    def link(self, remote_cluster_id, remote_addr, timeout_ms=3000):
        """Links one peer listening at remote_addr ("host:port")."""
        self.link_clusters([ClusterInfo(remote_cluster_id, remote_addr)], timeout_ms)

    def unlink_clusters_status(self, clusters, timeout_ms=3000, force=False):
        if not isinstance(force, bool):
            raise TypeError("force must be a bool")
        # A link is known by its cluster id: no address is needed or used.
        arr, n, _keep = self._clusters(clusters, need_addr=False)
        _int("timeout_ms", timeout_ms, 1, _I32_MAX)
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
    def allocate_cache(self, desc):
        """Allocates (and zeroes) a cache; returns a Cache."""
        if not isinstance(desc, CacheDesc):
            raise TypeError("desc must be a llmdd.CacheDesc")
        out = _ffi.CacheC()
        cd = desc._c()
        check(self._call(lib.llmdd_allocate_cache, ctypes.byref(cd), ctypes.byref(out)),
              "allocate_cache")
        c = Cache(self, out, desc, False, None)
        self._caches.add(c)
        return c

    def register_cache(self, tensors, desc=None):
        """Registers caller memory as a cache; returns a Cache that keeps the
        memory objects alive until it is closed (unregistered).

        tensors: a list with one memory object per tensor (torch tensor,
        numpy array, writable buffer, int address), or one memory object
        holding all tensors back to back. desc: a CacheDesc; when omitted it
        is read from a list of equal numpy arrays or torch tensors
        (shape and dtype)."""
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
        check(self._call(lib.llmdd_register_kv_cache, ctypes.byref(cd), arr, len(addrs),
                                          ctypes.byref(cid)), "register_cache")
        out = _ffi.CacheC()
        out.cache_id = cid.value
        out.desc = cd
        out.tensor_addrs = arr
        c = Cache(self, out, desc, True, (mems, arr))
        self._caches.add(c)
        return c

    # -- transfers
    def _opts(self, notify, layerwise):
        if notify is None and not layerwise:
            return None, None
        o = _ffi.XferOptsC()
        o.flags = _ffi.XFER_LAYERWISE if layerwise else 0
        buf = None
        if notify is not None:
            buf = _bytes("notify", notify, 0, _ffi.NOTIFY_MAX)
            o.notify = ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p)
            o.notify_len = len(buf)
        return o, buf

    def _post(self, fn, args, keep, notify=None, layerwise=False):
        opts, nbuf = self._opts(notify, layerwise)
        req = ctypes.c_void_p()
        st = self._call(fn, *args, ctypes.byref(opts) if opts is not None else None,
                ctypes.byref(req))
        check(st, fn.__name__)
        return Request(self, req, (keep, args, opts, nbuf))

    def pull_cache_async(self, src, dst, batch_index=0, size=-1, *, src_layers=None,
                         dst_layers=None, tensor_num_per_layer=2, notify=None):
        """Posts a pull of the remote slot src (CacheIndex) into slot
        batch_index of the local cache dst; returns a Request."""
        args = (ctypes.byref(_index(src)), dst._ref(self) if isinstance(dst, Cache) else _bad_cache("dst"),
                _u32("batch_index", batch_index), _size(size),
                ctypes.byref(_ext(src_layers, dst_layers, tensor_num_per_layer)))
        return self._post(lib.llmdd_pull_kv_cache_async, args, dst, notify)

    def pull_blocks_async(self, src, dst, src_blocks, dst_blocks, *, src_layers=None,
                          dst_layers=None, tensor_num_per_layer=2, notify=None):
        sb, n = _blocks("src_blocks", src_blocks)
        db, m = _blocks("dst_blocks", dst_blocks)
        if n != m:
            raise ValueError(f"src_blocks has {n} entries, dst_blocks {m}")
        args = (ctypes.byref(_index(src)), dst._ref(self) if isinstance(dst, Cache) else _bad_cache("dst"),
                sb, db, n, ctypes.byref(_ext(src_layers, dst_layers, tensor_num_per_layer)))
        return self._post(lib.llmdd_pull_kv_blocks_async, args, dst, notify)

    def push_cache_async(self, src, dst, src_batch_index=0, size=-1, *, src_layers=None,
                         dst_layers=None, tensor_num_per_layer=2, notify=None,
                         layerwise=False):
        """Posts a push of local slot src_batch_index of src into the remote
        slot dst (CacheIndex). layerwise: layers move once layer_ready()."""
        args = (src._ref(self) if isinstance(src, Cache) else _bad_cache("src"),
                ctypes.byref(_index(dst, "dst")), _u32("src_batch_index", src_batch_index),
                _size(size), ctypes.byref(_ext(src_layers, dst_layers, tensor_num_per_layer)))
        return self._post(lib.llmdd_push_kv_cache_async, args, src, notify, layerwise)

    def push_blocks_async(self, src, dst, src_blocks, dst_blocks, *, src_layers=None,
                          dst_layers=None, tensor_num_per_layer=2, notify=None,
                          layerwise=False):
        sb, n = _blocks("src_blocks", src_blocks)
        db, m = _blocks("dst_blocks", dst_blocks)
        if n != m:
            raise ValueError(f"src_blocks has {n} entries, dst_blocks {m}")
        args = (src._ref(self) if isinstance(src, Cache) else _bad_cache("src"),
                ctypes.byref(_index(dst, "dst")), sb, db, n,
                ctypes.byref(_ext(src_layers, dst_layers, tensor_num_per_layer)))
        return self._post(lib.llmdd_push_kv_blocks_async, args, src, notify, layerwise)

    def pull_cache(self, *a, timeout_ms=None, **kw):
        """pull_cache_async(...) then wait(): raises on failure."""
        with self.pull_cache_async(*a, **kw) as r:
            r.wait(timeout_ms)

    def pull_blocks(self, *a, timeout_ms=None, **kw):
        with self.pull_blocks_async(*a, **kw) as r:
            r.wait(timeout_ms)

    def push_cache(self, *a, timeout_ms=None, **kw):
        with self.push_cache_async(*a, **kw) as r:
            r.wait(timeout_ms)

    def push_blocks(self, *a, timeout_ms=None, **kw):
        with self.push_blocks_async(*a, **kw) as r:
            r.wait(timeout_ms)

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
        _u64("remote_cluster_id", remote_cluster_id)
        t = _int("timeout_ms", timeout_ms, 1, _I32_MAX)
        check(self._call(lib.llmdd_check_link, remote_cluster_id, t), "check_link")

    # -- notifications
    def send_notify(self, cluster_id, msg):
        _u64("cluster_id", cluster_id)
        buf = _bytes("msg", msg, 0, _ffi.NOTIFY_MAX)
        check(self._call(lib.llmdd_send_notify, cluster_id, buf, len(buf)), "send_notify")

    def get_notifies(self, max_count=64):
        """Never blocks: up to max_count received notifications, oldest
        first, as a list of (cluster_id, bytes)."""
        _int("max_count", max_count, 1, 1 << 20)
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
        _u64("cluster_id", cluster_id)
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
    def _waiter(self):
        with self._waiter_lock:
            if self._dd is None:
                raise LlmddError(Status.LLM_FAILED, "instance is closed")
            if self._waiter_obj is None:
                self._waiter_obj = _Waiter()
            return self._waiter_obj

    def _stop_waiter(self):
        with self._waiter_lock:
            w, self._waiter_obj = self._waiter_obj, None
        if w is not None:
            with w._cv:
                items = list(w._pending)
            for req, _loop, _fut in items:
                try:
                    req.cancel()
                except (ValueError, LlmddError):
                    pass
            w.stop()

    def __repr__(self):
        state = "closed" if self._dd is None else "open"
        return f"<llmdd.Instance cluster_id={self.cluster_id} {self.role.name} {state}>"


def _role(role):
    try:
        return Role(role)
    except ValueError:
        raise ValueError(f"role must be PROMPT, DECODER or MIX, got {role!r}") from None


def _size(size):
    _int("size", size, -1, _I64_MAX)
    if size == 0:
        raise ValueError("size must be -1 (whole slot) or > 0")
    return size


def _bad_cache(name):
    raise TypeError(f"{name} must be a llmdd.Cache of this instance")
