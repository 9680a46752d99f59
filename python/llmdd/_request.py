"""Posted transfers: Request, and the router that settles awaited requests
from the instance's completion queue."""

import asyncio
import ctypes
import threading
import weakref

from ._ffi import lib, speedups as _fast
from ._status import Status, LlmddError, RequestTimeout, check
from ._values import _WAIT, _timeout, _u32

# ----------------------------------------------------------------- requests

class Request:
    """A posted transfer. wait(), cancel(), done(), layer_ready(); ``await``
    it in asyncio. Freed by close(), the context manager or __del__."""

    def __init__(self, instance, ptr, keep):
        self._instance = instance
        self._ptr = ptr              # an int or a ctypes.c_void_p
        # The address, as the completion queue names it.
        self._key = ptr if type(ptr) is int else ptr.value
        self._keep = keep            # caches and arrays the transfer uses
        self._users = 0              # threads inside a call on _ptr
        self._lock = threading.Lock()
        self._idle = None            # a Condition on _lock, once close() waits
        self._final = None

    def _enter(self):
        with self._lock:
            if self._ptr is None:
                raise ValueError("request is closed")
            self._users += 1
            return self._ptr

    def _leave(self):
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._idle is not None:
                self._idle.notify_all()

    def _wait_raw(self, timeout_ms):
        ptr = self._enter()
        try:
            st = (_fast.wait(self._key, timeout_ms) if _fast is not None
                  else lib.llmdd_request_wait(ptr, timeout_ms))
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
        t = -1 if timeout_ms is None else _timeout("timeout_ms", timeout_ms)
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
        layer = _u32("layer", layer)
        ptr = self._enter()
        try:
            check(lib.llmdd_request_layer_ready(ptr, layer), f"layer_ready({layer})")
        finally:
            self._leave()

    def close(self):
        """Frees the request, cancelling it first if it is in flight."""
        with self._lock:
            ptr = self._ptr
            if ptr is None:
                return
            self._ptr = None
            busy = self._users
        if busy:
            lib.llmdd_request_cancel(ptr)   # wakes the other waiters
            with self._lock:
                self._idle = threading.Condition(self._lock)
                while self._users:
                    self._idle.wait()
        if _fast is not None:               # cancels first if in flight
            _fast.free(self._key)
        else:
            lib.llmdd_request_free(ptr)
        self._keep = None
        cq = self._instance._cq
        if cq is not None and self._key in cq._waiting:
            # Awaiting tasks wake and find the request closed. (An await
            # that registers after this finds it closed by itself.)
            cq.forget(self._key)

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
        # An ended request (also one whose instance is finalized) needs no
        # loop; otherwise watch() registers, then tests again.
        while self._final is None and self._wait_raw(0) == _WAIT:
            cq = self._instance._completions()
            fut = cq.watch(self)
            if fut is None:
                break
            try:
                yield from fut.__await__()
            finally:
                if not fut.done() or fut.cancelled():
                    cq.forget(self._key, fut)
        return self.wait(0)


class _Completions:
    """An instance's completion queue, read on the loops that await.

    Every request the binding posts carries LLMDD_XFER_COMPLETION. An
    ``await`` registers its future under the request's address, makes sure
    its loop reads llmdd_completion_fd (a reader added on a loop's first
    await stays until the instance is finalized or the loop goes), and then
    tests the request once, so a request that ended before the registration
    is seen. When the fd is readable the loop collects every ended request
    (llmdd_get_completions) and settles the futures registered for them, on
    their own loops. Completions of requests nobody awaits are collected
    and dropped: wait() reads their status. No thread, no polling."""

    CAP = 64

    def __init__(self, instance):
        self._inst = instance
        self._lock = threading.Lock()
        self._waiting = {}                        # request address -> [(loop, future)]
        self._loops = weakref.WeakKeyDictionary()  # loop -> the fd it reads
        self._out = (ctypes.c_void_p * self.CAP)()
        self._n = ctypes.c_size_t()
        self._closed = False

    def watch(self, req):
        """A future of the running loop, settled once req may have ended;
        None when it already has."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._closed:
                raise LlmddError(Status.LLM_FAILED, "instance is closed")
            if loop not in self._loops:
                fd = self._inst._call(lib.llmdd_completion_fd)
                if fd < 0:
                    raise LlmddError(Status.LLM_FAILED, "instance is not initialized")
                loop.add_reader(fd, self._readable)
                self._loops[loop] = fd
            ents = self._waiting.get(req._key)
            if ents is None:
                self._waiting[req._key] = [(loop, fut)]
            else:
                ents.append((loop, fut))
        try:
            ended = req._wait_raw(0) != _WAIT
        except BaseException:
            self.forget(req._key, fut)
            raise
        if ended:
            self.forget(req._key, fut)
            return None
        return fut

    def forget(self, key, fut=None):
        """Settles the futures registered for key (only fut, when given)."""
        with self._lock:
            ents = self._waiting.pop(key, None)
            if ents is None:
                return
            if fut is not None:
                rest = [e for e in ents if e[1] is not fut]
                if rest:
                    self._waiting[key] = rest
                ents = [e for e in ents if e[1] is fut]
        for loop, f in ents:
            _settle(loop, f)

    def _readable(self):
        keys = []
        with self._lock:
            while True:
                try:
                    if _fast is not None:
                        st, got = self._inst._call(_fast.completions)
                        cap = _fast.COMPLETIONS_CAP
                    else:
                        st = self._inst._call(lib.llmdd_get_completions, self._out,
                                              self.CAP, ctypes.byref(self._n))
                        got = self._out[:self._n.value] if st == 0 else []
                        cap = self.CAP
                except LlmddError:   # finalizing: shutdown() settles everyone
                    return
                keys += got
                if len(got) < cap:
                    break
        for k in keys:
            if k in self._waiting:
                self.forget(k)

    def shutdown(self):
        """After llmdd_finalize ended every request: settles every future
        and drops the readers."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, {}
            loops = list(self._loops.items())
            self._loops.clear()
        for ents in waiting.values():
            for loop, fut in ents:
                _settle(loop, fut)
        for loop, fd in loops:
            _on_loop(loop, loop.remove_reader, fd)


def _on_loop(loop, fn, *args):
    """Runs fn(*args) on loop's thread: now when this is it, else soon."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:   # the loop is closed: nobody is waiting there
        pass


def _settle(loop, fut):
    def set_():
        if not fut.done():
            fut.set_result(None)
    _on_loop(loop, set_)
