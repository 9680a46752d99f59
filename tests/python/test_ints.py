"""Integer arguments take integers only (both packages): Python ints,
numpy and torch integer scalars and arrays; floats, strings and bools
(Python, numpy or torch) raise TypeError before anything moves."""

import numpy as np
import pytest
import torch

import llmdd
import llm_datadist as ld

# Not integers, each as a scalar argument would get it.
NOT_INTS = [0.0, 1.5, "1", True, False, np.float64(1.0), np.bool_(True), np.float32(0),
            torch.tensor(1.0), torch.tensor(True), torch.tensor([1]), np.array([1]),
            None, 1 + 0j]
# Integers of every kind the rule takes, each worth 1.
ONES = [1, np.int64(1), np.uint8(1), np.int32(1), np.array(1), torch.tensor(1),
        torch.tensor(1, dtype=torch.int16), llmdd.Role.PROMPT]
# Block tables that are not integers, and some that are (each [0, 1]).
BAD_TABLES = [[0.5], [0.0, 1.0], [True], ["0"], np.array([0.0, 1.0]), np.array([True]),
              torch.tensor([0.0, 1.0]), torch.tensor([True, False]), [np.float64(0)],
              [torch.tensor(0.0)], "01", b"\x00\x01", np.zeros((1, 2), dtype=np.int64)]
GOOD_TABLES = [[0, 1], (0, 1), np.array([0, 1]), np.array([0, 1], dtype=np.int32),
               np.array([0, 1], dtype=np.uint64), torch.tensor([0, 1]),
               torch.tensor([0, 1], dtype=torch.int32), [np.int64(0), torch.tensor(1)],
               range(2)]


def test_the_rule():
    from llmdd._values import as_int, as_ints
    for v in NOT_INTS:
        with pytest.raises(TypeError):
            as_int("v", v)
    for v in ONES:
        got = as_int("v", v)
        assert got == 1 and type(got) is int
    for t in BAD_TABLES:
        with pytest.raises(TypeError):
            as_ints("t", t)
    for t in GOOD_TABLES:
        got = as_ints("t", t)
        assert got == [0, 1] and all(type(b) is int for b in got)


LAYOUT = llmdd.KvLayout("NHD", 4, (0, 2), 2, 8)


def test_slice_refuses_a_float_block_table():
    # The case: a block table computed by a division.
    with pytest.raises(TypeError):
        llmdd.Slice([0.5], [0], (0, 1))
    for t in BAD_TABLES:
        with pytest.raises(TypeError):
            llmdd.Slice(t, [0, 1], (0, 8))
        with pytest.raises(TypeError):
            llmdd.Slice([0, 1], t, (0, 8))
    for bad in NOT_INTS:
        with pytest.raises(TypeError):
            llmdd.Slice([0], [0], (bad, 4))
        with pytest.raises(TypeError):
            llmdd.Slice([0], [0], (0, 4), (0, bad))
        with pytest.raises(TypeError):
            llmdd.Slice([0], [0], (0, 4), src_first=bad)
    want = llmdd.slice_plan_size(LAYOUT, LAYOUT, llmdd.Slice([0, 1], [0, 1], (0, 8)))
    for t in GOOD_TABLES:
        s = llmdd.Slice(t, t, (np.int64(0), torch.tensor(8)), (np.uint32(0), 2))
        assert llmdd.slice_plan_size(LAYOUT, LAYOUT, s) == want


def test_values_refuse_non_integers():
    for bad in NOT_INTS:
        if bad is None:
            continue        # None is a default in some of these
        for make in (lambda: llmdd.CacheDesc(bad, [4]),
                     lambda: llmdd.CacheDesc(1, [4, bad]),
                     lambda: llmdd.CacheDesc(1, [4], bad),
                     lambda: llmdd.CacheDesc(1, [4], llmdd.DataType.INT8, bad),
                     lambda: llmdd.ClusterInfo(bad, "127.0.0.1:1"),
                     lambda: llmdd.ClusterInfo(1, ("127.0.0.1", bad)),
                     lambda: llmdd.ClusterInfo(1, "127.0.0.1:1", remote_role_type=bad),
                     lambda: llmdd.KvLayout("NHD", bad, (0, 2), 2, 8),
                     lambda: llmdd.KvLayout("NHD", 4, (bad, 2), 2, 8),
                     lambda: llmdd.KvLayout("NHD", 4, (0, 2), 2, 8, num_parts=bad),
                     lambda: llmdd.KvLayout([bad, 1, 2, 3], 4, (0, 2), 2, 8),
                     lambda: llmdd.tp_plan(bad, 2, 2, 0),
                     lambda: llmdd.tp_plan(8, 2, 2, bad),
                     lambda: llmdd.Instance(bad, initialize=False),
                     lambda: llmdd.Instance(1, bad, initialize=False)):
            with pytest.raises(TypeError):
                make()
    d = llmdd.CacheDesc(np.int64(2), np.array([3, 4]), np.int32(4), torch.tensor(0))
    assert (d.num_tensors, d.shape, d.data_type) == (2, (3, 4), llmdd.DataType.UINT8)
    assert all(type(x) is int for x in (d.num_tensors,) + d.shape)
    assert llmdd.CacheDesc(1, torch.Size([2, 2])).shape == (2, 2)
    assert llmdd.CacheDesc(1, np.int64(8)).shape == (8,)
    assert llmdd.tp_plan(np.int64(8), 2, torch.tensor(2), 0) == llmdd.tp_plan(8, 2, 2, 0)


def test_instance_calls_refuse_non_integers():
    with llmdd.Instance(np.uint64(5), np.int64(3)) as dd:
        assert dd.cluster_id == 5 and type(dd.cluster_id) is int
        src = bytearray(range(256)) * 4
        c = dd.register_cache([np.frombuffer(src, dtype=np.uint8).copy().reshape(4, 256)])
        d = dd.allocate_cache(llmdd.CacheDesc(1, (4, 256)))
        calls = [lambda b: dd.pull_cache(llmdd.CacheIndex(9, 0, 0), d, b),
                 lambda b: dd.pull_cache((9, b, 0), d),
                 lambda b: dd.pull_cache_async(llmdd.CacheIndex(9, 0, b), d),
                 lambda b: dd.push_cache(c, llmdd.CacheIndex(9, 0, 0), 0, b),
                 lambda b: dd.pull_blocks(llmdd.CacheIndex(9, 0), d, [0], [b]),
                 lambda b: dd.pull_blocks(llmdd.CacheIndex(9, 0), d, [0], [0],
                                          tensor_num_per_layer=b),
                 lambda b: dd.copy_cache(c, d, b),
                 lambda b: dd.copy_cache(c, d, 0, 0, b),
                 lambda b: dd.copy_blocks(c, d, [b], [0]),
                 lambda b: dd.check_link(b),
                 lambda b: dd.check_link(9, b),
                 lambda b: dd.get_notifies(b),
                 lambda b: dd.send_notify(b, b"x"),
                 lambda b: dd.set_cache_key(c, b, b"k"),
                 lambda b: dd.link(b, "127.0.0.1:1"),
                 lambda b: dd.link(9, "127.0.0.1:1", b)]
        for bad in NOT_INTS:
            if bad is None:
                continue
            for call in calls:
                with pytest.raises(TypeError):
                    call(bad)
        # Nothing moved: d is still all zeros.
        view = (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 1024)
                                      .from_address(d.tensor_addrs[0])))
        assert not view.any()
        # Integers of every kind work, as the ints they are.
        dd.copy_blocks(c, d, np.array([2, 0]), torch.tensor([0, 3]))
        dd.copy_cache(c, d, np.int64(1), torch.tensor(1), np.uint16(16), np.int32(100))
        want = np.zeros(1024, dtype=np.uint8)
        want[0:256] = src[512:768]
        want[768:1024] = src[0:256]
        want[256 + 16:256 + 116] = src[256 + 16:256 + 116]
        assert bytes(view) == bytes(want)
        assert dd.get_notifies(np.int64(4)) == []
        c.close()
        d.close()


def test_reference_package_refuses_non_integers():
    for bad in NOT_INTS:
        if bad is None:
            continue
        for make in (lambda: ld.CacheKey(1, bad),
                     lambda: ld.CacheKey(bad, 1),
                     lambda: ld.CacheKey(1, 2, model_id=bad),
                     lambda: ld.BlocksCacheKey(bad),
                     lambda: ld.CacheKeyByIdAndIndex(1, bad),
                     lambda: ld.CacheKeyByIdAndIndex(1, 0, bad),
                     lambda: ld.CacheDesc(bad, [4], ld.DataType.DT_INT8),
                     lambda: ld.CacheDesc(1, [4, bad], ld.DataType.DT_INT8),
                     lambda: ld.CacheDesc(1, [4], ld.DataType.DT_INT8).update_dim(0, bad),
                     lambda: ld.CacheDesc(1, [4], ld.DataType.DT_INT8).update_dim(bad, 2),
                     lambda: ld.TransferWithCacheKeyConfig(ld.CacheKeyByIdAndIndex(1, 0),
                                                           src_batch_index=bad),
                     lambda: ld.LLMDataDist(ld.LLMRole.PROMPT, bad),
                     lambda: ld.LLMClusterInfo().append_remote_ip_info("127.0.0.1", bad),
                     lambda: setattr(ld.LLMClusterInfo(), "remote_cluster_id", bad),
                     lambda: setattr(ld.LLMConfig(), "device_id", bad),
                     lambda: setattr(ld.LLMConfig(), "device_id", [0, bad])):
            with pytest.raises(TypeError):
                make()
    for bad in (1.5, True, np.float64(0)):      # an ip is a str or an int
        with pytest.raises(TypeError):
            ld.LLMClusterInfo().append_local_ip_info(bad, 1)
    k = ld.CacheKey(np.int64(1), np.uint64(2), torch.tensor(3))
    assert (k.cluster_id, k.req_id, k.model_id) == (1, 2, 3)
    assert type(k.req_id) is int
    d = ld.CacheDesc(np.uint32(1), np.array([2, 8]), ld.DataType.DT_INT8, ld.Placement.HOST)
    assert d.shape == [2, 8] and d.size == 16
    ci = ld.LLMClusterInfo()
    ci.remote_cluster_id = np.int64(3)
    ci.append_remote_ip_info("127.0.0.1", np.uint16(26000))
    assert ci.remote_cluster_id == 3 and ci.remote_ip_info_list == [("127.0.0.1", 26000)]


def test_reference_calls_refuse_non_integers():
    dd = ld.LLMDataDist(ld.LLMRole.MIX, np.int64(7))
    dd.init({})
    try:
        cm = dd.cache_manager
        desc = ld.CacheDesc(1, [4, 8], ld.DataType.DT_INT8, ld.Placement.HOST)
        c = cm.allocate_cache(desc)
        b = cm.allocate_blocks_cache(desc, ld.BlocksCacheKey(7))
        key = ld.CacheKeyByIdAndIndex(9, 0)
        calls = [lambda v: cm.pull_cache(key, c, v),
                 lambda v: cm.pull_cache(key, c, 0, v),
                 lambda v: cm.pull_cache(key, c, tensor_num_per_layer=v),
                 lambda v: cm.push_cache(key, c, v),
                 lambda v: cm.push_cache(key, c, size=v),
                 lambda v: cm.pull_blocks(ld.BlocksCacheKey(9), b, [0], [v]),
                 lambda v: cm.copy_cache(c, c, size=v),
                 lambda v: cm.unregister_cache(v),
                 lambda v: dd.link_clusters([], v),
                 lambda v: dd.check_link_status(v)]
        for bad in NOT_INTS:
            if bad is None:
                continue
            for call in calls:
                with pytest.raises(TypeError):
                    call(bad)
        cm.copy_cache(c, c, np.int64(1), 0, size=np.int32(8))
    finally:
        dd.finalize()
