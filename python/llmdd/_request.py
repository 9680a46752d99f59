"""Posted transfers: Request, and the one waiter thread per instance that
completes awaited requests for asyncio."""

import asyncio
import collections
import threading

from ._ffi import lib
from ._status import Status, RequestTimeout, check
from ._values import _WAIT, _timeout, _u32

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
