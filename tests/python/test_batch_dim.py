"""The batch dimension from Python (docs/model.md, "The batch dimension"):
llm_datadist's CacheDesc(batch_dim_index=...) and llmdd.CacheDesc(batch_dim=...)
make caches whose slots lie along that dim; pulls and pushes of a slot move
exactly it."""
import numpy as np
import pytest
import torch

import llmdd
from llm_datadist import (LLMDataDist, LLMRole, LLMClusterInfo, CacheDesc, CacheKey,
                          CacheKeyByIdAndIndex, DataType, LLMException, LLMStatusCode)

from common import pattern


def test_llm_datadist_batch_dim_index():
    from conftest import free_port
    port = free_port()
    p = LLMDataDist(LLMRole.PROMPT, 21)
    p.init({"llm.ListenIpInfo": f"127.0.0.1:{port}", "llm.SyncKvCacheWaitTime": "5000"})
    d = LLMDataDist(LLMRole.DECODER, 22)
    d.init({"llm.SyncKvCacheWaitTime": "5000"})
    try:
        ci = LLMClusterInfo()
        ci.remote_cluster_id = 21
        ci.append_remote_ip_info("127.0.0.1", port)
        assert d.link_clusters([ci])[0] == LLMStatusCode.LLM_SUCCESS
        # [3, 4, 8] int32 with the batch along dim 1: 4 slots of 3 rows of
        # 32 bytes.
        desc = CacheDesc(2, [3, 4, 8], DataType.DT_INT32, batch_dim_index=1)
        assert desc.batch_size == 4
        src = [torch.from_numpy(pattern(30 + i, (3, 4, 8), np.int32)) for i in range(2)]
        s = p.cache_manager.register_cache(desc, [t.data_ptr() for t in src],
                                           [CacheKey(21, req_id=5)])
        dst = [torch.zeros(3, 4, 8, dtype=torch.int32) for _ in range(2)]
        c = d.cache_manager.register_cache(
            CacheDesc(2, [3, 4, 8], DataType.DT_INT32, batch_dim_index=1),
            [t.data_ptr() for t in dst])
        # The key names slot 0; slot 3 exists though shape[0] is 3.
        d.cache_manager.pull_cache(CacheKey(21, req_id=5), c, batch_index=3)
        for i in range(2):
            assert (dst[i][:, 3, :] == src[i][:, 0, :]).all()
            assert not dst[i][:, :3, :].any()
        # One row (32 bytes) of slot 2 into slot 1.
        d.cache_manager.pull_cache(CacheKeyByIdAndIndex(21, s.cache_id, 2), c, 1, size=32)
        for i in range(2):
            assert (dst[i][0, 1, :] == src[i][0, 2, :]).all()
            assert not dst[i][1:, 1, :].any()
        # Not whole rows.
        with pytest.raises(LLMException) as e:
            d.cache_manager.pull_cache(CacheKeyByIdAndIndex(21, s.cache_id, 2), c, 1,
                                       size=20)
        assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        # A push of slot 3 into the prompt's slot 1.
        d.cache_manager.push_cache(CacheKeyByIdAndIndex(21, s.cache_id, 1), c, 3)
        for i in range(2):
            assert (src[i][:, 1, :] == src[i][:, 0, :]).all()
    finally:
        d.finalize()
        p.finalize()


def test_llm_datadist_batch_dim_index_out_of_range():
    with pytest.raises(LLMException) as e:
        CacheDesc(1, [3, 4], DataType.DT_INT32, batch_dim_index=2)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_llmdd_cache_desc_batch_dim():
    d = llmdd.CacheDesc(1, (2, 5, 4), llmdd.DataType.UINT8, batch_dim=1)
    assert d.batch_dim == 1 and d.stride == 8
    with pytest.raises(ValueError):
        llmdd.CacheDesc(1, (2, 5), llmdd.DataType.UINT8, batch_dim=2)
    dd = llmdd.Instance(31, llmdd.Role.MIX)
    try:
        a = dd.allocate_cache(d)
        b = dd.allocate_cache(llmdd.CacheDesc(1, (2, 5, 4), llmdd.DataType.UINT8))
        mem = np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * 40).from_address(a.tensor_addrs[0]))
        mem[:] = np.arange(40, dtype=np.uint8)
        # Slot 3 of a (two rows of 4 bytes, 20 apart) into slot 0 of b
        # (batch dim 0: 20 contiguous bytes), the first 8.
        dd.copy_cache(a, b, 3, 0, 0, 8)
        got = np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_uint8 * 40).from_address(b.tensor_addrs[0]))
        assert list(got[:8]) == [12, 13, 14, 15, 32, 33, 34, 35]
        assert not got[8:].any()
    finally:
        dd.finalize()
