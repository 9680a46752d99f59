"""llmdd: move LLM KV caches between processes (Python binding, ctypes).

    import llmdd
    with llmdd.Instance(2, llmdd.Role.DECODER) as dd:
        dd.link(1, "127.0.0.1:26000")
        kv = dd.register_cache([torch.zeros(8, 4096) for _ in range(4)])
        dd.pull_cache(llmdd.CacheIndex(1, 1, 0), kv)

docs/python.md describes the binding; include/llmdd/llmdd.h the C API.
"""

from ._ffi import library_path, lib as _lib
from ._status import Status, LlmddError, RequestTimeout, status_str
from ._core import (Role, Placement, DataType, CacheDesc, CacheIndex, ClusterInfo,
                    Cache, Request, Instance, DTYPE_SIZE)
from ._ffi import XFER_LAYERWISE, NOTIFY_MAX, KEY_MAX, MAX_DIMS, SLICES_MAX
from ._layout import KvLayout, Slice, TpPiece, tp_plan, slice_plan_size
from . import _layout

for _name, _fn in _layout.METHODS.items():     # slice transfers on Instance
    setattr(Instance, _name, _fn)

globals().update({s.name: s for s in Status})   # llmdd.LLM_TIMEOUT, ...
__version__ = _lib.llmdd_version().decode()     # the library's, not a copy

__all__ = ["Status", "LlmddError", "RequestTimeout", "status_str", "Role", "Placement",
           "DataType", "CacheDesc", "CacheIndex", "ClusterInfo", "Cache", "Request",
           "Instance", "version", "transport_list", "transport_info", "library_path",
           "metadata_list", "KvLayout", "Slice", "TpPiece", "tp_plan", "slice_plan_size",
           "SLICES_MAX", "XFER_LAYERWISE", "NOTIFY_MAX", "KEY_MAX", "MAX_DIMS"] + [s.name for s in Status]


def version():
    """The library's version string."""
    return _lib.llmdd_version().decode()


def transport_list():
    """The transports built into the library, in llm.Transport=auto's order."""
    return _lib.llmdd_transport_list().decode().split(",")


def transport_info(name):
    """One line about a built-in transport's environment, or None."""
    if not isinstance(name, str):
        raise TypeError("name must be a str")
    s = _lib.llmdd_transport_info(name.encode())
    return None if s is None else s.decode()


def metadata_list(server, prefix="llmdd", timeout_ms=5000):
    """The clusters published in etcd (server: "etcd://host:port[,...]")
    under prefix, as a list of dicts (cluster_id, role, addrs, transports,
    pid, ...). Raises LlmddError (LLM_TIMEOUT: the server did not answer)."""
    import ctypes
    import json
    from ._status import check
    from ._values import _timeout
    if not isinstance(server, str) or not isinstance(prefix, str):
        raise TypeError("server and prefix must be str")
    timeout_ms = _timeout("timeout_ms", timeout_ms, allow_none=False)
    n = ctypes.c_size_t(0)
    check(_lib.llmdd_metadata_list(server.encode(), prefix.encode(), timeout_ms,
                                   None, 0, ctypes.byref(n)), "metadata_list")
    while True:
        cap = n.value + 4096
        buf = ctypes.create_string_buffer(cap)
        check(_lib.llmdd_metadata_list(server.encode(), prefix.encode(),
                                       timeout_ms, buf, cap, ctypes.byref(n)),
              "metadata_list")
        if n.value < cap:
            return json.loads(buf.value.decode())
