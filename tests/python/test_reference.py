"""llm_datadist (the reference's API) against a real prompt process."""

import ctypes
import sys
import threading
import time

import numpy as np
import pytest
import torch

from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, LLMClusterInfo, CacheDesc, Cache,
                          DataType, Placement, BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex,
                          LLMException, LLMStatusCode, LayerSynchronizer, TransferConfig,
                          TransferWithCacheKeyConfig)
from common import pattern


def test_config_options():
    c = LLMConfig()
    c.listen_ip_info = "127.0.0.1:26000"
    c.device_id = 3
    c.sync_kv_timeout = 1500
    c.mem_pool_cfg = '{"memory_size": 1048576}'
    c.host_mem_pool_cfg = '{"memory_size": 1048576, "page_shift": 16}'
    c.buf_pool_cfg = '{"buf_cfg": []}'
    c.enable_switch_role = True
    c.local_comm_res = ""
    c.enable_cache_manager = True
    c.enable_remote_cache_accessible = True
    o = c.generate_options()
    assert o["llm.listenIpInfo"] == "127.0.0.1:26000" and o["ge.exec.deviceId"] == "3"
    assert o["llm.SyncKvCacheWaitTime"] == "1500"
    assert o["llm.MemPoolConfig"] and o["llm.HostMemPoolConfig"] and o["llm.BufPoolCfg"]
    assert o["llm.EnableSwitchRole"] == "1" and o["llm.LocalCommRes"] == ""
    with pytest.raises(LLMException) as e:
        c.sync_kv_timeout = 0
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        c.enable_cache_manager = 1
    # the C library takes every key (the Ascend-only ones with a log line)
    o.pop("llm.listenIpInfo")
    dd = LLMDataDist(LLMRole.MIX, 7)
    dd.init(o)
    dd.cache_manager.allocate_cache(CacheDesc(1, [4], DataType.DT_INT8, Placement.HOST))
    dd.finalize()
    assert LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT.value == 0x5010B001
    assert LLMStatusCode.LLM_FEATURE_NOT_ENABLED.value == 0x5010B019


@pytest.fixture
def dec(ref_peer):
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 5000
    cfg.enable_cache_manager = True
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(cfg.generate_options())
    ci = LLMClusterInfo()
    ci.remote_cluster_id = 1
    ci.append_local_ip_info("127.0.0.1", 0)
    ci.append_remote_ip_info("127.0.0.1", ref_peer.port)
    st, rets = dd.link_clusters([ci], timeout=3000)
    assert st == LLMStatusCode.LLM_SUCCESS and rets == [LLMStatusCode.LLM_SUCCESS]
    dd.ci = ci
    yield dd
    st, rets = dd.unlink_clusters([ci], timeout=3000)
    assert st == LLMStatusCode.LLM_SUCCESS
    dd.finalize()


def test_link_failures_and_hccl_entry_points(dec, ref_peer):
    ci = LLMClusterInfo()
    ci.remote_cluster_id = 9
    ci.append_remote_ip_info(int.from_bytes(bytes([127, 0, 0, 1]), "little"), 1)
    st, rets = dec.link_clusters([ci], timeout=500)
    assert st == LLMStatusCode.LLM_LINK_FAILED and rets == [LLMStatusCode.LLM_LINK_FAILED]
    st, rets = dec.link_clusters([dec.ci])
    assert rets == [LLMStatusCode.LLM_ALREADY_LINK]
    with pytest.raises(LLMException) as e:
        dec.link_clusters([dec.ci], timeout=0)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as e:
        dec.switch_role(LLMRole.PROMPT)          # links are alive
    assert e.value.status_code == LLMStatusCode.LLM_EXIST_LINK
    dec.check_link_status(dec.ci.remote_cluster_id)   # no exception: alive
    with pytest.raises(LLMException) as e:
        dec.check_link_status(9)
    assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK


def test_pull_blocks_and_cache(dec, ref_peer):
    cm = dec.cache_manager
    ts = [torch.zeros(16, 32, dtype=torch.float16) for _ in range(4)]
    blocks = cm.register_blocks_cache(CacheDesc(4, [16, 32], DataType.DT_FLOAT16),
                                      [t.data_ptr() for t in ts])
    cm.pull_blocks(BlocksCacheKey(prompt_cluster_id=1), blocks, [1, 2, 9], [4, 5, 0])
    src1 = pattern(21, (16, 32), np.float16)
    assert (ts[1][4:6].numpy() == src1[1:3]).all() and (ts[1][0].numpy() == src1[9]).all()
    cm.pull_blocks(BlocksCacheKey(1), blocks, [3], [3], src_layer_range=range(1, 2),
                   dst_layer_range=range(0, 1), tensor_num_per_layer=2)
    assert (ts[0][3].numpy() == pattern(22, (16, 32), np.float16)[3]).all()
    with pytest.raises(LLMException) as e:
        cm.pull_blocks(BlocksCacheKey(1, 5), blocks, [0], [0])   # no such model key
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    # A slot of a cache without blocks (CacheKey) cut into blocks: the
    # peer's 256-byte int32 slot into four 64-byte blocks, every byte.
    cm.pull_blocks(CacheKey(1, 100), blocks, [], [15, 12, 13, 7])
    for t in range(4):
        slot = pattern(30 + t, (4, 64), np.int32)[0].tobytes()
        got = ts[t].numpy().tobytes()
        for k, b in enumerate((15, 12, 13, 7)):
            assert got[b * 64:(b + 1) * 64] == slot[k * 64:(k + 1) * 64]
    with pytest.raises(LLMException) as e:
        cm.pull_blocks(CacheKey(1, 100), blocks, [], [0])       # 4 blocks needed
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as e:
        cm.pull_blocks(CacheKey(1, 100), blocks, [1], [0])      # no source blocks
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID

    arrs = [np.zeros((4, 64), np.int32) for _ in range(4)]
    cache = cm.register_cache(CacheDesc(4, [4, 64], DataType.DT_INT32), arrs)
    cm.pull_cache(CacheKey(1, req_id=102), cache, batch_index=1)            # whole slot
    assert (arrs[3][1] == pattern(33, (4, 64), np.int32)[2]).all()
    cm.pull_cache(CacheKey(prompt_cluster_id=1, req_id=103), cache, 2, size=64)
    assert (arrs[0][2][:16] == pattern(30, (4, 64), np.int32)[3][:16]).all()
    assert not arrs[0][2][16:].any()
    cm.pull_cache(CacheKeyByIdAndIndex(1, ref_peer.ids["keyed"], 0), cache, 3,
                  src_layer_range=range(0, 1), dst_layer_range=range(1, 2))
    assert (arrs[2][3] == pattern(30, (4, 64), np.int32)[0]).all()
    assert not arrs[0][3].any()
    with pytest.raises(LLMException) as e:
        cm.pull_cache(CacheKey(1, req_id=999), cache)
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(LLMException) as e:
        cm.pull_cache(CacheKeyByIdAndIndex(1, ref_peer.ids["keyed"], 0), cache, size=0)
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    cm.unregister_cache(cache.cache_id)
    cm.unregister_cache(blocks.cache_id)
    with pytest.raises(LLMException) as e:
        cm.pull_cache(CacheKey(1, req_id=102), cache)
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_push_copy_swap(ref_peer):
    dd = LLMDataDist(LLMRole.MIX, 3)
    dd.init({"llm.SyncKvCacheWaitTime": "5000", "llm.EnableCacheManager": "1"})
    ci = LLMClusterInfo()
    ci.remote_cluster_id = 1
    ci.append_remote_ip_info("127.0.0.1", ref_peer.port)
    assert dd.link_clusters([ci])[0] == LLMStatusCode.LLM_SUCCESS
    cm = dd.cache_manager
    src = cm.allocate_cache(CacheDesc(4, [4, 64], DataType.DT_INT32))
    vals = [pattern(60 + i, (4, 64), np.int32) for i in range(4)]
    for i, a in enumerate(src.tensor_addrs):
        ctypes.memmove(a, vals[i].ctypes.data, vals[i].nbytes)
    cm.push_cache(CacheKeyByIdAndIndex(1, ref_peer.ids["pslot"], 2), src, src_batch_index=1)
    cm.push_cache(CacheKeyByIdAndIndex(1, ref_peer.ids["pslot"], 3), src, 0,
                  src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
    d = [np.frombuffer(bytes.fromhex(h), np.int32).reshape(4, 64)
         for h in ref_peer.ask("dump pslot")]
    assert (d[1][2] == vals[1][1]).all() and (d[0][3] == vals[2][0]).all()
    assert not d[2][3].any()
    bsrc = cm.allocate_blocks_cache(CacheDesc(4, [16, 32], DataType.DT_FLOAT16))
    bv = [pattern(70 + i, (16, 32), np.float16) for i in range(4)]
    for i, a in enumerate(bsrc.tensor_addrs):
        ctypes.memmove(a, bv[i].ctypes.data, bv[i].nbytes)
    cm.push_blocks(BlocksCacheKey(1, 1), bsrc, [0, 1], [7, 8])
    d = [np.frombuffer(bytes.fromhex(h), np.float16).reshape(16, 32)
         for h in ref_peer.ask("dump pblk")]
    assert (d[3][7:9] == bv[3][0:2]).all()
    # local copies
    dst = cm.allocate_cache(CacheDesc(4, [4, 64], DataType.DT_INT32))
    cm.copy_cache(dst, src, dst_batch_index=3, src_batch_index=2, offset=8, size=16)
    got = np.ctypeslib.as_array((ctypes.c_int32 * 256).from_address(dst.tensor_addrs[2]))
    assert (got.reshape(4, 64)[3][2:6] == vals[2][2][2:6]).all() and not got[:194].any()
    cm.copy_blocks(bsrc, {0: [5, 6]})
    host = np.zeros((4, 16, 32), np.float16)
    hc = Cache.create_cpu_cache(CacheDesc(4, [16, 32], DataType.DT_FLOAT16, Placement.HOST),
                                [host[i].ctypes.data for i in range(4)])
    cm.swap_blocks(bsrc, hc, {5: 0, 1: 2})
    assert (host[2][0] == bv[2][0]).all() and (host[2][2] == bv[2][1]).all()
    with pytest.raises(LLMException):
        cm.swap_blocks(bsrc, hc, {16: 0})
    cm.deallocate_cache(dst)
    with pytest.raises(LLMException) as e:
        cm.copy_cache(dst, src)
    assert e.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    # layer-wise transfer driven by a LayerSynchronizer
    seen = []

    class Sync(LayerSynchronizer):
        def synchronize_layer(self, layer_index, timeout_in_millis):
            seen.append((layer_index, threading.current_thread().name))
            return True
    task = cm.transfer_cache_async(bsrc, Sync(), [TransferWithCacheKeyConfig(
        BlocksCacheKey(1, 1), src_layer_range=range(0, 2))], [2, 3], [10, 11])
    assert task.synchronize(5000) == LLMStatusCode.LLM_SUCCESS
    assert [s[0] for s in seen] == [0, 1]
    assert task.get_results() == [LLMStatusCode.LLM_SUCCESS]
    d = [np.frombuffer(bytes.fromhex(h), np.float16).reshape(16, 32)
         for h in ref_peer.ask("dump pblk")]
    assert (d[0][10:12] == bv[0][2:4]).all() and (d[3][10:12] == bv[3][2:4]).all()

    class Fail(LayerSynchronizer):
        def synchronize_layer(self, layer_index, timeout_in_millis):
            return layer_index == 0
    task = cm.transfer_cache_async(src, Fail(), [TransferWithCacheKeyConfig(
        CacheKeyByIdAndIndex(1, ref_peer.ids["pslot"], 0))])
    assert task.synchronize(5000) == LLMStatusCode.LLM_FAILED
    with pytest.raises(LLMException) as e:
        cm.transfer_cache_async(src, Sync(), [TransferConfig(1, [4096])])
    assert e.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    dd.finalize()


def test_one_tensor_cache_default_layers():
    """A one-tensor cache pulled without layer arguments: the default
    tensor_num_per_layer (2) is not used when no range is given."""
    from conftest import free_port
    port = free_port()
    p = LLMDataDist(LLMRole.PROMPT, 11)
    p.init({"llm.ListenIpInfo": f"127.0.0.1:{port}", "llm.SyncKvCacheWaitTime": "5000"})
    d = LLMDataDist(LLMRole.DECODER, 12)
    d.init({"llm.SyncKvCacheWaitTime": "5000"})
    try:
        ci = LLMClusterInfo()
        ci.remote_cluster_id = 11
        ci.append_remote_ip_info("127.0.0.1", port)
        assert d.link_clusters([ci])[0] == LLMStatusCode.LLM_SUCCESS
        src = [torch.from_numpy(pattern(6, (4, 32), np.int32))]
        s = p.cache_manager.register_cache(CacheDesc(1, [4, 32], DataType.DT_INT32),
                                           [src[0].data_ptr()], [CacheKey(11, req_id=7)])
        dst = [torch.zeros(4, 32, dtype=torch.int32)]
        c = d.cache_manager.register_cache(CacheDesc(1, [4, 32], DataType.DT_INT32),
                                           [dst[0].data_ptr()])
        d.cache_manager.pull_cache(CacheKey(11, req_id=7), c, batch_index=3)
        assert (dst[0][3] == src[0][0]).all() and not dst[0][:3].any()
        d.cache_manager.pull_cache(CacheKeyByIdAndIndex(11, s.cache_id, 2), c, 1)
        assert (dst[0][1] == src[0][2]).all()
    finally:
        d.finalize()
        p.finalize()


def test_unlink_by_cluster_id(ref_peer):
    """unlink_clusters needs only remote_cluster_id (not forced: the peer is
    told); a link is known by its id."""
    dd = LLMDataDist(LLMRole.DECODER, 4)
    dd.init({"llm.SyncKvCacheWaitTime": "5000"})
    try:
        ci = LLMClusterInfo()
        ci.remote_cluster_id = 1
        ci.append_remote_ip_info("127.0.0.1", ref_peer.port)
        assert dd.link_clusters([ci])[0] == LLMStatusCode.LLM_SUCCESS
        by_id = LLMClusterInfo()
        by_id.remote_cluster_id = 1
        st, rets = dd.unlink_clusters([by_id], 3000)
        assert st == LLMStatusCode.LLM_SUCCESS and rets == [LLMStatusCode.LLM_SUCCESS]
        arrs = [np.zeros((4, 64), np.int32) for _ in range(4)]
        cache = dd.cache_manager.register_cache(CacheDesc(4, [4, 64], DataType.DT_INT32), arrs)
        with pytest.raises(LLMException) as e:
            dd.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, ref_peer.ids["keyed"], 0), cache)
        assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        # linked again at once: the peer's side went with the unlink
        deadline = time.monotonic() + 5
        while dd.link_clusters([ci])[0] == LLMStatusCode.LLM_ALREADY_LINK:
            assert time.monotonic() < deadline
        dd.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, ref_peer.ids["keyed"], 0), cache)
        assert (arrs[1][0] == pattern(31, (4, 64), np.int32)[0]).all()
        assert dd.unlink_clusters([by_id], 3000)[0] == LLMStatusCode.LLM_SUCCESS
    finally:
        dd.finalize()


def _link_retrying(dd, ci, timeout=3000, deadline_s=20):
    """A serving framework's link loop: retries LLM_LINK_BUSY,
    LLM_PROCESSING_LINK and LLM_TIMEOUT with back-off; the last rets[0]."""
    retry = (LLMStatusCode.LLM_LINK_BUSY, LLMStatusCode.LLM_PROCESSING_LINK,
             LLMStatusCode.LLM_TIMEOUT)
    end = time.monotonic() + deadline_s
    pause = 0.005
    while True:
        _, rets = dd.link_clusters([ci], timeout=timeout)
        if rets[0] not in retry or time.monotonic() > end:
            return rets[0]
        time.sleep(pause)          # the loop's back-off, not a wait
        pause = min(pause * 2, 0.1)


def test_finalize_then_init_again(ref_peer):
    """An engine's sleep and wake-up: finalize() and init() again on the
    same LLMDataDist object, then link again and pull, every byte."""
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 5000
    cfg.enable_cache_manager = True
    opts = cfg.generate_options()
    dd = LLMDataDist(LLMRole.DECODER, 3)
    ci = LLMClusterInfo()
    ci.remote_cluster_id = 1
    ci.append_local_ip_info("127.0.0.1", 0)
    ci.append_remote_ip_info("127.0.0.1", ref_peer.port)
    for life in range(3):
        dd.init(opts)
        t0 = time.monotonic()
        assert _link_retrying(dd, ci) == LLMStatusCode.LLM_SUCCESS, life
        print(f"life {life}: linked in {time.monotonic() - t0:.3f} s", file=sys.stderr)
        cm = dd.cache_manager
        ts = [torch.zeros(16, 32, dtype=torch.float16) for _ in range(4)]
        blocks = cm.register_blocks_cache(CacheDesc(4, [16, 32], DataType.DT_FLOAT16),
                                          [t.data_ptr() for t in ts])
        cm.pull_blocks(BlocksCacheKey(1), blocks, [life, 15], [2, 0])
        for t in range(4):
            src = pattern(20 + t, (16, 32), np.float16)
            assert (ts[t][2].numpy() == src[life]).all(), (life, t)
            assert (ts[t][0].numpy() == src[15]).all(), (life, t)
            assert not ts[t][1].numpy().any() and not ts[t][3:].numpy().any()
        kv = dd.kv_cache_manager
        assert kv.is_initialized()
        if life == 1:
            # Asleep without unlinking first: finalize ends the link too.
            dd.finalize()
        else:
            st, rets = dd.unlink_clusters([ci], timeout=3000)
            assert st == LLMStatusCode.LLM_SUCCESS and rets == [LLMStatusCode.LLM_SUCCESS]
            dd.finalize()
        assert not kv.is_initialized()
        with pytest.raises(LLMException) as e:
            dd.link_clusters([ci])
        assert e.value.status_code == LLMStatusCode.LLM_FAILED


def _stop_all_threads(pid):
    """SIGSTOPs pid and returns once every thread of it is stopped."""
    import os
    import signal
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 5
    while time.monotonic() < end:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in "Tt" for s in states):
            return
        time.sleep(0.001)
    raise AssertionError("the peer did not stop")


def test_concurrent_link_calls_retry(ref_peer):
    """Two threads link the same cluster at once, each in a framework's
    retry loop: while one call runs (the peer stopped), the other and an
    unlink are LLM_PROCESSING_LINK; the retry loop then finds the link made
    (LLM_ALREADY_LINK), and the one link pulls every byte."""
    import os
    import signal
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 5000
    cfg.enable_cache_manager = True
    dd = LLMDataDist(LLMRole.DECODER, 4)
    dd.init(cfg.generate_options())
    ci = LLMClusterInfo()
    ci.remote_cluster_id = 1
    ci.append_local_ip_info("127.0.0.1", 0)
    ci.append_remote_ip_info("127.0.0.1", ref_peer.port)
    start = threading.Barrier(2)
    cond = threading.Condition()
    first, last = [None, None], [None, None]

    def linker(i):
        start.wait()
        _, rets = dd.link_clusters([ci], timeout=10000)
        with cond:
            first[i] = rets[0]
            cond.notify_all()
        last[i] = rets[0] if rets[0] == LLMStatusCode.LLM_SUCCESS else _link_retrying(dd, ci)

    _stop_all_threads(ref_peer.proc.pid)
    try:
        ts = [threading.Thread(target=linker, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        with cond:
            cond.wait_for(lambda: first[0] is not None or first[1] is not None, timeout=5)
            done = [f is not None for f in first]
        _, unlinked = dd.unlink_clusters([ci], timeout=1000)
    finally:
        os.kill(ref_peer.proc.pid, signal.SIGCONT)
    for t in ts:
        t.join()
    try:
        assert done.count(True) == 1, first
        w = done.index(True)             # the call that returned at once
        assert first[w] == LLMStatusCode.LLM_PROCESSING_LINK
        assert unlinked == [LLMStatusCode.LLM_PROCESSING_LINK]
        assert first[1 - w] == last[1 - w] == LLMStatusCode.LLM_SUCCESS
        assert last[w] == LLMStatusCode.LLM_ALREADY_LINK
        cm = dd.cache_manager
        bts = [torch.zeros(16, 32, dtype=torch.float16) for _ in range(4)]
        blocks = cm.register_blocks_cache(CacheDesc(4, [16, 32], DataType.DT_FLOAT16),
                                          [t.data_ptr() for t in bts])
        cm.pull_blocks(BlocksCacheKey(1), blocks, list(range(16)), list(range(16)))
        for t in range(4):
            assert (bts[t].numpy() == pattern(20 + t, (16, 32), np.float16)).all()
        st, rets = dd.unlink_clusters([ci], timeout=3000)
        assert rets == [LLMStatusCode.LLM_SUCCESS]
    finally:
        dd.finalize()
