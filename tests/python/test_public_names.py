"""llm_datadist's public names are the reference's __all__ (hicann/hixl
9ed283b, its package's llm_datadist/__init__.py), each works as
data or raises LLM_FEATURE_NOT_ENABLED naming the feature, and
docs/python.md's table of the reference's API matches the package."""

import os
import re

import numpy as np
import pytest

import llm_datadist as ld
from llm_datadist import LLMException, LLMStatusCode

REFERENCE_ALL = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType", "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache",
    "BlocksCacheKey", "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer",
    "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
    "TensorDesc", "Tensor", "KvCacheManager",
]
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")


def test_public_names_are_the_references():
    assert sorted(ld.__all__) == sorted(REFERENCE_ALL)
    ns = {}
    exec("from llm_datadist import *", ns)
    assert sorted(k for k in ns if not k.startswith("__")) == sorted(REFERENCE_ALL)
    for name in REFERENCE_ALL:
        assert getattr(ld, name) is ns[name]
    # the reference's internal names are not public here
    assert not hasattr(ld, "v2_list") and not hasattr(ld, "v2")
    with pytest.raises(ImportError):
        exec("from llm_datadist import v2_list", {})
    from llm_datadist import MemInfo, Memtype    # noqa: F401  (issue 37's ImportError)


def test_data_classes_work_as_data():
    m = ld.MemInfo(ld.Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    assert (m.mem_type, m.addr, m.size) == (ld.Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    assert ld.Memtype.MEM_TYPE_HOST.value == 1
    with pytest.raises(TypeError):
        ld.MemInfo(0, 0x1000, 4096)
    with pytest.raises(TypeError):
        ld.MemInfo(ld.Memtype.MEM_TYPE_HOST, 0x1000, 4096.0)
    assert ld.Status(LLMStatusCode.LLM_SUCCESS).is_ok()
    st = ld.Status(LLMStatusCode.LLM_TIMEOUT)
    assert not st.is_ok() and st.status_code == LLMStatusCode.LLM_TIMEOUT
    assert LLMStatusCode.LLM_DEVICE_MEM_ERROR == 507053
    assert LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR == 507057
    assert LLMStatusCode(0x5010B001).name == "LLM_WAIT_PROCESS_TIMEOUT"
    assert LLMStatusCode.LLM_WAIT_PROC_TIMEOUT is LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
    assert str(LLMStatusCode.LLM_FAILED) == "LLMStatusCode.LLM_FAILED"
    assert int(ld.Placement.DEVICE) == 1 and str(ld.Placement.HOST) == "Placement.HOST"
    assert int(ld.LLMRole.DECODER) == 2
    assert ld.LlmConfig is ld.LLMConfig
    desc = ld.CacheDesc(2, [4, 8], ld.DataType.DT_INT16, ld.Placement.HOST)
    buf = [np.zeros((4, 8), dtype=np.int16) for _ in range(2)]
    kv = ld.KvCache.create_cpu_cache(desc, [b.ctypes.data for b in buf])
    assert kv.cache_id == -1 and kv.per_device_tensor_addrs == [[b.ctypes.data for b in buf]]
    kv2 = ld.KvCache.create_cpu_cache(desc, [[1, 2], [3, 4]])
    assert len(kv2.per_device_tensor_addrs) == 2
    with pytest.raises(LLMException):
        ld.KvCache.create_cpu_cache(desc, [1])
    td = ld.TensorDesc(ld.DataType.DT_FLOAT16, [2, 3])
    assert td.dtype == ld.DataType.DT_FLOAT16 and td.shape == [2, 3]
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    t = ld.Tensor(a, td)
    assert t.numpy() is a and (ld.Tensor(t).numpy(copy=True) == a).all()
    assert ld.Tensor(np.arange(3, dtype=np.int32)).tensor_desc.dtype == ld.DataType.DT_INT32
    with pytest.raises(RuntimeError):
        ld.Tensor(a, ld.TensorDesc(ld.DataType.DT_FLOAT16, [3, 2]))
    tc = ld.TransferConfig(1, [0x1000, 0x2000], range(0, 2), 0)
    assert tc.dst_addrs == [0x1000, 0x2000] and tc.src_layer_range == range(0, 2)
    with pytest.raises(TypeError):
        tc.dst_cluster_id = "1"
    cfg = ld.TransferWithCacheKeyConfig(ld.CacheKeyByIdAndIndex(1, 2, 0), range(0, 1),
                                        range(1, 2), 3)
    assert cfg.dst_cluster_id == 1 and cfg.src_batch_index == 3
    with pytest.raises(TypeError):
        cfg.cache_key = ld.CacheKey(1, 2)
    cfg.cache_key = ld.BlocksCacheKey(1)
    with pytest.raises(LLMException):
        cfg.src_batch_index = 1
    assert ld.RegisterMemStatus.OK.value == 0 and issubclass(ld.LayerSynchronizer, object)


def test_features_llmdd_lacks_raise_not_enabled():
    with pytest.raises(LLMException) as e:
        ld.Tensor(12345)
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert "native tensor" in str(e.value)
    dd = ld.LLMDataDist(ld.LLMRole.MIX, 9)
    dd.init({})
    try:
        with pytest.raises(TypeError):
            dd.cache_manager.remap_registered_memory([1])
        with pytest.raises(LLMException) as e:
            dd.cache_manager.remap_registered_memory(
                [ld.MemInfo(ld.Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)])
        assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert "remap_registered_memory" in str(e.value)
        # the V1 manager on the same instance: allocate, copy, read, free
        km = dd.kv_cache_manager
        assert isinstance(km, ld.KvCacheManager) and km.is_initialized()
        desc = ld.CacheDesc(2, [2, 4], ld.DataType.DT_INT32)
        a, b = km.allocate_cache(desc), km.allocate_cache(desc)
        ta = km.get_cache_tensors(a, 1)[0].numpy()
        ta[:] = np.arange(8, dtype=np.int32).reshape(2, 4)
        km.copy_cache(b, a, 0, 1, 0, 16)
        assert (km.get_cache_tensors(b, 1)[0].numpy()[0] == [4, 5, 6, 7]).all()
        with pytest.raises(LLMException) as e:
            km.pull_cache(ld.CacheKeyByIdAndIndex(3, 1, 0), b, 0, src_cache_offset=8)
        assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        km.deallocate_cache(a)
        km.deallocate_cache(a)                  # a second time: nothing
        assert a.per_device_tensor_addrs == []
        with pytest.raises(LLMException) as e:
            km.copy_cache(b, a)
        assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        ld.CacheManager.check_cache_key(ld.CacheKey(1, 2))
        with pytest.raises(LLMException):
            ld.CacheManager.check_cache_key(ld.CacheKey(1, 2**64 - 1))
    finally:
        dd.finalize()
    assert not km.is_initialized()


def _docs_table():
    text = open(DOCS, encoding="utf-8").read()
    start = text.index("| reference name | in llmdd |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, status = line.split("|")[1:3]
        for name in re.findall(r"`([A-Za-z_.]+)`", first):
            rows[name] = status
        # the members a row names as working exist
        cls = re.findall(r"`([A-Za-z_]+)`", first)
        for member in re.findall(r"`([a-z_]+)`", status.split(";")[0]):
            for c in cls:
                assert hasattr(getattr(ld, c), member), f"{c}.{member} (docs/python.md)"
    return rows


def test_docs_table_matches_the_package():
    rows = _docs_table()
    for name in REFERENCE_ALL:
        assert name in rows, f"{name} missing from docs/python.md's table"
    for name, status in rows.items():
        obj = ld
        for part in name.split("."):
            obj = getattr(obj, part)            # every name in the table exists
        assert status.strip(), name
