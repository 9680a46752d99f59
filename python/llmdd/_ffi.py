"""ctypes declarations of include/llmdd/llmdd.h and the library loader.

Every structure and prototype here mirrors the public header; nothing else in
the package calls the library without going through these prototypes, so
ctypes converts and range-checks every scalar argument.
"""

import ctypes
import ctypes.util
import os

__all__ = ["lib", "library_path", "speedups"]

MAX_DIMS = 31
IP_LEN = 64
NOTIFY_MAX = 1024
KEY_MAX = 128
XFER_LAYERWISE = 0x1
XFER_COMPLETION = 0x2

status_t = ctypes.c_uint32


class CacheDescC(ctypes.Structure):
    _fields_ = [
        ("placement", ctypes.c_int),
        ("num_tensors", ctypes.c_uint32),
        ("data_type", ctypes.c_int),
        ("num_dims", ctypes.c_uint32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
    ]


class CacheC(ctypes.Structure):
    _fields_ = [
        ("cache_id", ctypes.c_int64),
        ("desc", CacheDescC),
        ("tensor_addrs", ctypes.POINTER(ctypes.c_uint64)),
    ]


class CacheIndexC(ctypes.Structure):
    _fields_ = [
        ("cluster_id", ctypes.c_uint64),
        ("cache_id", ctypes.c_int64),
        ("batch_index", ctypes.c_uint32),
    ]


class LayerRangeC(ctypes.Structure):
    _fields_ = [("first", ctypes.c_int32), ("second", ctypes.c_int32)]


class KvExtParamC(ctypes.Structure):
    _fields_ = [
        ("src_layer_range", LayerRangeC),
        ("dst_layer_range", LayerRangeC),
        ("tensor_num_per_layer", ctypes.c_uint32),
    ]


class OptionC(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_char_p)]


class IpInfoC(ctypes.Structure):
    _fields_ = [("ip", ctypes.c_char * IP_LEN), ("port", ctypes.c_uint16)]


class ClusterInfoC(ctypes.Structure):
    _fields_ = [
        ("remote_cluster_id", ctypes.c_uint64),
        ("remote_role_type", ctypes.c_int32),
        ("local_ip_infos", ctypes.POINTER(IpInfoC)),
        ("num_local_ip_infos", ctypes.c_size_t),
        ("remote_ip_infos", ctypes.POINTER(IpInfoC)),
        ("num_remote_ip_infos", ctypes.c_size_t),
    ]


class XferOptsC(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint32),
        ("notify", ctypes.c_void_p),
        ("notify_len", ctypes.c_size_t),
    ]


KV_MAX_DIMS = 5
SLICES_MAX = 256
KV_DIM_BLOCK, KV_DIM_PART, KV_DIM_HEAD, KV_DIM_TOKEN, KV_DIM_BYTES = 1, 2, 3, 4, 5


class KvLayoutC(ctypes.Structure):
    _fields_ = [
        ("num_dims", ctypes.c_uint32),
        ("order", ctypes.c_int * KV_MAX_DIMS),
        ("block_size", ctypes.c_uint32),
        ("num_heads", ctypes.c_uint32),
        ("head_first", ctypes.c_uint32),
        ("total_heads", ctypes.c_uint32),
        ("head_bytes", ctypes.c_uint32),
        ("num_parts", ctypes.c_uint32),
        ("compat_tag", ctypes.c_uint64),
    ]


class BlockTableC(ctypes.Structure):
    _fields_ = [
        ("blocks", ctypes.POINTER(ctypes.c_uint64)),
        ("num_blocks", ctypes.c_size_t),
        ("first_token", ctypes.c_uint64),
    ]


class KvSliceC(ctypes.Structure):
    _fields_ = [
        ("src", BlockTableC),
        ("dst", BlockTableC),
        ("token_begin", ctypes.c_uint64),
        ("token_end", ctypes.c_uint64),
        ("head_begin", ctypes.c_uint32),
        ("head_end", ctypes.c_uint32),
        ("ext", KvExtParamC),
    ]


class TpPieceC(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_uint32), ("head_begin", ctypes.c_uint32),
                ("head_end", ctypes.c_uint32)]


class NotifyC(ctypes.Structure):
    _fields_ = [
        ("cluster_id", ctypes.c_uint64),
        ("len", ctypes.c_size_t),
        ("msg", ctypes.c_ubyte * NOTIFY_MAX),
    ]


def _candidates():
    """Where libllmdd is looked for, in order (docs/python.md)."""
    env = os.environ.get("LLMDD_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    # 1. Next to the package: pip install copies the library to llmdd/_lib/,
    #    cmake --install writes _libpath.py naming the installed library.
    for name in ("libllmdd.so.0", "libllmdd.so"):
        yield os.path.join(here, "_lib", name)
    try:
        from . import _libpath  # generated at install time
        yield _libpath.LIBRARY
    except ImportError:
        pass
    # 2. The build tree: <repo>/python/llmdd -> <repo>/build.
    repo = os.path.dirname(os.path.dirname(here))
    for build in ("build", os.environ.get("LLMDD_BUILD_DIR", "")):
        if build:
            yield os.path.join(repo, build, "libllmdd.so.0")
    # 3. The system loader.
    found = ctypes.util.find_library("llmdd")
    yield found or "libllmdd.so.0"


def _load():
    errors = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError("llmdd: cannot load libllmdd (set LLMDD_LIBRARY to its path): "
                      + "; ".join(errors))


lib, library_path = _load()

_P = ctypes.POINTER
_vp = ctypes.c_void_p
_u64p = _P(ctypes.c_uint64)
_req_pp = _P(ctypes.c_void_p)


def _proto(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)


_proto("llmdd_create", status_t, ctypes.c_uint64, ctypes.c_int, _P(_vp))
_proto("llmdd_destroy", None, _vp)
_proto("llmdd_initialize", status_t, _vp, _P(OptionC), ctypes.c_size_t)
_proto("llmdd_finalize", None, _vp)
_proto("llmdd_set_role", status_t, _vp, ctypes.c_int, _P(OptionC), ctypes.c_size_t)
_proto("llmdd_link_clusters", status_t, _vp, _P(ClusterInfoC), ctypes.c_size_t,
       _P(status_t), ctypes.c_int32)
_proto("llmdd_unlink_clusters", status_t, _vp, _P(ClusterInfoC), ctypes.c_size_t,
       _P(status_t), ctypes.c_int32, ctypes.c_bool)
_proto("llmdd_allocate_cache", status_t, _vp, _P(CacheDescC), _P(CacheC))
_proto("llmdd_deallocate_cache", status_t, _vp, ctypes.c_int64)
_proto("llmdd_register_kv_cache", status_t, _vp, _P(CacheDescC), _u64p,
       ctypes.c_size_t, _P(ctypes.c_int64))
_proto("llmdd_unregister_kv_cache", status_t, _vp, ctypes.c_int64)
_proto("llmdd_pull_kv_cache", status_t, _vp, _P(CacheIndexC), _P(CacheC),
       ctypes.c_uint32, ctypes.c_int64, _P(KvExtParamC))
_proto("llmdd_pull_kv_blocks", status_t, _vp, _P(CacheIndexC), _P(CacheC),
       _u64p, _u64p, ctypes.c_size_t, _P(KvExtParamC))
_proto("llmdd_push_kv_cache", status_t, _vp, _P(CacheC), _P(CacheIndexC),
       ctypes.c_uint32, ctypes.c_int64, _P(KvExtParamC))
_proto("llmdd_push_kv_blocks", status_t, _vp, _P(CacheC), _P(CacheIndexC),
       _u64p, _u64p, ctypes.c_size_t, _P(KvExtParamC))
_proto("llmdd_copy_kv_cache", status_t, _vp, _P(CacheC), _P(CacheC),
       ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64)
_proto("llmdd_copy_kv_blocks", status_t, _vp, _P(CacheC), _P(CacheC),
       _u64p, _u64p, ctypes.c_size_t)
_proto("llmdd_status_str", ctypes.c_char_p, status_t)
_proto("llmdd_version", ctypes.c_char_p)
_proto("llmdd_data_type_size", ctypes.c_size_t, ctypes.c_int)
_proto("llmdd_transport_list", ctypes.c_char_p)
_proto("llmdd_transport_info", ctypes.c_char_p, ctypes.c_char_p)

_proto("llmdd_pull_kv_cache_async", status_t, _vp, _P(CacheIndexC), _P(CacheC),
       ctypes.c_uint32, ctypes.c_int64, _P(KvExtParamC), _P(XferOptsC), _req_pp)
_proto("llmdd_pull_kv_blocks_async", status_t, _vp, _P(CacheIndexC), _P(CacheC),
       _u64p, _u64p, ctypes.c_size_t, _P(KvExtParamC), _P(XferOptsC), _req_pp)
_proto("llmdd_push_kv_cache_async", status_t, _vp, _P(CacheC), _P(CacheIndexC),
       ctypes.c_uint32, ctypes.c_int64, _P(KvExtParamC), _P(XferOptsC), _req_pp)
_proto("llmdd_push_kv_blocks_async", status_t, _vp, _P(CacheC), _P(CacheIndexC),
       _u64p, _u64p, ctypes.c_size_t, _P(KvExtParamC), _P(XferOptsC), _req_pp)
_proto("llmdd_pull_kv_cache_to_blocks", status_t, _vp, _P(CacheIndexC), _P(CacheC),
       _u64p, ctypes.c_size_t, _P(KvExtParamC))
_proto("llmdd_pull_kv_cache_to_blocks_async", status_t, _vp, _P(CacheIndexC), _P(CacheC),
       _u64p, ctypes.c_size_t, _P(KvExtParamC), _P(XferOptsC), _req_pp)
_proto("llmdd_push_kv_cache_to_blocks", status_t, _vp, _P(CacheC), _P(CacheIndexC),
       ctypes.c_uint32, _u64p, ctypes.c_size_t, _P(KvExtParamC))
_proto("llmdd_push_kv_cache_to_blocks_async", status_t, _vp, _P(CacheC), _P(CacheIndexC),
       ctypes.c_uint32, _u64p, ctypes.c_size_t, _P(KvExtParamC), _P(XferOptsC), _req_pp)
_proto("llmdd_request_wait", status_t, _vp, ctypes.c_int32)
_proto("llmdd_request_cancel", status_t, _vp)
_proto("llmdd_request_layer_ready", status_t, _vp, ctypes.c_uint32)
_proto("llmdd_request_free", None, _vp)
_proto("llmdd_send_notify", status_t, _vp, ctypes.c_uint64, _vp, ctypes.c_size_t)
_proto("llmdd_get_notifies", status_t, _vp, _P(NotifyC), ctypes.c_size_t,
       _P(ctypes.c_size_t))
_proto("llmdd_notify_fd", ctypes.c_int, _vp)
_proto("llmdd_set_cache_key", status_t, _vp, ctypes.c_int64, ctypes.c_uint32,
       ctypes.c_char_p, ctypes.c_size_t)
_proto("llmdd_remove_cache_key", status_t, _vp, ctypes.c_char_p, ctypes.c_size_t)
_proto("llmdd_lookup_remote_key", status_t, _vp, ctypes.c_uint64, ctypes.c_char_p,
       ctypes.c_size_t, _P(CacheIndexC))
_proto("llmdd_metrics_text", ctypes.c_size_t, _vp, ctypes.c_char_p, ctypes.c_size_t)
_proto("llmdd_listen_address", status_t, _vp, _P(IpInfoC))
_proto("llmdd_metadata_list", status_t, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32,
       ctypes.c_char_p, ctypes.c_size_t, _P(ctypes.c_size_t))
_proto("llmdd_check_link", status_t, _vp, ctypes.c_uint64, ctypes.c_int32)
_proto("llmdd_completion_fd", ctypes.c_int, _vp)
_proto("llmdd_get_completions", status_t, _vp, _P(_vp), ctypes.c_size_t,
       _P(ctypes.c_size_t))
_proto("llmdd_allocate_cache_layout", status_t, _vp, _P(CacheDescC), _P(KvLayoutC),
       _P(CacheC))
_proto("llmdd_register_kv_cache_layout", status_t, _vp, _P(CacheDescC), _P(KvLayoutC),
       _u64p, ctypes.c_size_t, _P(ctypes.c_int64))
_proto("llmdd_allocate_cache_ex", status_t, _vp, _P(CacheDescC), ctypes.c_uint32,
       _P(CacheC))
_proto("llmdd_register_kv_cache_ex", status_t, _vp, _P(CacheDescC), ctypes.c_uint32,
       _u64p, ctypes.c_size_t, _P(ctypes.c_int64))
_proto("llmdd_query_remote_layout", status_t, _vp, ctypes.c_uint64, ctypes.c_int64,
       _P(KvLayoutC))
_proto("llmdd_pull_kv_slices_async", status_t, _vp, _P(CacheIndexC), _P(KvSliceC),
       ctypes.c_size_t, _P(CacheC), _P(XferOptsC), _req_pp)
_proto("llmdd_push_kv_slices_async", status_t, _vp, _P(CacheC), _P(CacheIndexC),
       _P(KvSliceC), ctypes.c_size_t, _P(XferOptsC), _req_pp)
_proto("llmdd_tp_plan", status_t, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
       ctypes.c_uint32, _P(TpPieceC), ctypes.c_size_t, _P(ctypes.c_size_t))
_proto("llmdd_kv_slice_plan_size", status_t, _P(KvLayoutC), _P(KvLayoutC), _P(KvSliceC),
       _P(ctypes.c_uint64), _P(ctypes.c_uint64))


def _load_speedups():
    """llmdd._speedups (llmdd/_speedups.c), bound to lib: installed next to
    the package, or in the build tree beside the library (<build>/python/).
    None, and ctypes for every call, without it or with
    LLMDD_PY_SPEEDUPS=0."""
    if os.environ.get("LLMDD_PY_SPEEDUPS", "1") == "0":
        return None
    try:
        from . import _speedups as mod
    except ImportError:
        import importlib.machinery
        import importlib.util
        d = os.path.join(os.path.dirname(os.path.abspath(library_path)), "python")
        mod = None
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(d, "_speedups" + suffix)
            if not os.path.exists(path):
                continue
            spec = importlib.util.spec_from_file_location(__package__ + "._speedups", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            break
        if mod is None:
            return None

    def addr(f):
        return ctypes.cast(f, ctypes.c_void_p).value
    mod.bind(addr(lib.llmdd_pull_kv_cache), addr(lib.llmdd_push_kv_cache),
             addr(lib.llmdd_pull_kv_cache_async), addr(lib.llmdd_push_kv_cache_async),
             addr(lib.llmdd_request_wait), addr(lib.llmdd_get_completions),
             addr(lib.llmdd_request_free))
    return mod


speedups = _load_speedups()
