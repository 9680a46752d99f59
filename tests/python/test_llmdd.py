"""llmdd against a real second process (peer.py)."""

import array
import asyncio
import re
import select
import time

import numpy as np
import pytest
import torch

import llmdd
from common import pattern

DEC = 2


def wait_notifies(peer, want, timeout=5):
    """The peer's notifications once all of want arrived (or the timeout)."""
    end = time.monotonic() + timeout
    while True:
        got = peer.ask("notifies")
        if all(w in got for w in want) or time.monotonic() > end:
            return got
        time.sleep(0.01)


@pytest.fixture
def dd(peer):
    with llmdd.Instance(DEC, llmdd.Role.MIX,
                        options={"llm.SyncKvCacheWaitTime": "5000"}) as d:
        d.link(peer.cluster_id, peer.addr)
        yield d


def test_pull_into_numpy_and_torch(dd, peer):
    dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    with dd.register_cache(dst) as c:
        assert c.desc.data_type == llmdd.DataType.UINT8 and c.desc.shape == (8, 256)
        dd.pull_cache(llmdd.CacheIndex(1, peer.ids["A"], 5), c, 2)
        for i in range(4):
            assert (dst[i][2] == pattern(i, (8, 256), np.uint8)[5]).all()
            assert not dst[i][[0, 1, 3, 4, 5, 6, 7]].any()
        # size and layer ranges: layer 1 (tensors 2, 3) into layer 0, 16 bytes
        dd.pull_cache((1, peer.ids["A"], 0), c, 7, 16, src_layers=range(1, 2),
                      dst_layers=range(0, 1))
        assert (dst[0][7][:16] == pattern(2, (8, 256), np.uint8)[0][:16]).all()
        assert not dst[0][7][16:].any() and not dst[2][7].any()
    t = [torch.zeros(16, 64, dtype=torch.float16) for _ in range(4)]
    with dd.register_cache(t) as c:
        assert c.desc.data_type == llmdd.DataType.FLOAT16
        dd.pull_blocks((1, peer.ids["B"]), c, [0, 5, 6], [15, 1, 2])
        src = pattern(13, (16, 64), np.float16)
        assert (t[3][15].numpy() == src[0]).all() and (t[3][1:3].numpy() == src[5:7]).all()


def test_one_buffer_and_int_address(dd, peer):
    buf = bytearray(4 * 8 * 256)
    with dd.register_cache(buf, llmdd.CacheDesc(4, (8, 256))) as c:
        with pytest.raises(BufferError):
            buf.extend(b"x")          # exported: cannot move under a transfer
        dd.pull_cache((1, peer.ids["A"], 1), c, 1)
        assert bytes(buf[3 * 2048 + 256: 3 * 2048 + 512]) == \
            pattern(3, (8, 256), np.uint8)[1].tobytes()
    buf.extend(b"x")                  # released by close()
    arr = np.zeros((4, 8, 256), np.uint8)
    with dd.register_cache(arr.ctypes.data, llmdd.CacheDesc(4, (8, 256))) as c:
        dd.pull_cache((1, peer.ids["A"], 0), c, 0)
    assert (arr[1][0] == pattern(1, (8, 256), np.uint8)[0]).all()


def test_keys(dd, peer):
    idx = dd.lookup_remote_key(1, b"req-3")
    assert idx == llmdd.CacheIndex(1, peer.ids["A"], 3)
    with pytest.raises(llmdd.LlmddError) as e:
        dd.lookup_remote_key(1, b"nope")
    assert e.value.status == llmdd.LLM_KV_CACHE_NOT_EXIST
    assert "LLM_KV_CACHE_NOT_EXIST" in str(e.value)
    with dd.allocate_cache(llmdd.CacheDesc(2, (4, 8))) as c:
        dd.set_cache_key(c, 1, "mine")
        with pytest.raises(llmdd.LlmddError) as e:
            dd.set_cache_key(c, 0, "mine")
        assert e.value.status == llmdd.LLM_CACHE_KEY_ALREADY_EXIST
        dd.remove_cache_key("mine")
        dd.set_cache_key(c, 0, "mine")


def test_requests_wait_done_cancel(dd, peer):
    dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    with dd.register_cache(dst) as c:
        reqs = [dd.pull_cache_async((1, peer.ids["A"], b), c, b) for b in range(8)]
        for r in reqs:
            r.wait(5000)
            assert r.done() and r.status == llmdd.LLM_SUCCESS
            r.close()
        assert (dst[2] == pattern(2, (8, 256), np.uint8)).all()
        # a layer-wise push never marked does not move: wait times out,
        # cancel ends it with LLM_FAILED
        src = dd.allocate_cache(llmdd.CacheDesc(4, (8, 256)))
        r = dd.push_cache_async(src, (1, peer.ids["C"], 0), 0, layerwise=True)
        assert not r.done()
        with pytest.raises(llmdd.RequestTimeout) as e:
            r.wait(50)
        assert isinstance(e.value, TimeoutError)
        assert e.value.status == llmdd.LLM_WAIT_PROC_TIMEOUT
        r.cancel()
        with pytest.raises(llmdd.LlmddError) as e:
            r.wait()
        assert e.value.status == llmdd.LLM_FAILED
        r.close()
        r.close()
        with pytest.raises(ValueError):
            r.layer_ready(0)


def test_layerwise_push_with_marks(dd, peer):
    data = [pattern(50 + i, (8, 256), np.uint8) for i in range(4)]
    with dd.register_cache(data) as src:
        with dd.push_cache_async(src, (1, peer.ids["C"], 0), 6, layerwise=True,
                                 notify=b"pushed") as r:
            r.layer_ready(1)
            with pytest.raises(llmdd.LlmddError) as e:
                r.layer_ready(2)      # two layers: 0 and 1
            assert e.value.status == llmdd.LLM_PARAM_INVALID
            with pytest.raises(llmdd.RequestTimeout):
                r.wait(100)           # layer 0 not marked yet
            r.layer_ready(0)
            r.wait(5000)
    dump = peer.ask("dump C")
    for i in range(4):
        assert bytes.fromhex(dump[i])[:256] == data[i][6].tobytes()
    # the notification is visible only after the bytes landed (dumped above)
    assert [DEC, "pushed"] in wait_notifies(peer, [[DEC, "pushed"]])


def test_notifications_and_asyncio(dd, peer):
    dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    with dd.register_cache(dst) as c:
        dd.pull_cache((1, peer.ids["A"], 0), c, 0, notify=b"pulled")
        dd.send_notify(1, "hello")
        got = wait_notifies(peer, [[DEC, "pulled"], [DEC, "hello"]])
        assert got[-2:] == [[DEC, "pulled"], [DEC, "hello"]]
        fd = dd.notify_fd()
        assert select.select([fd], [], [], 0)[0] == []

        async def main():
            waiter = asyncio.ensure_future(dd.wait_notify())
            await asyncio.sleep(0.05)
            assert not waiter.done()
            assert peer.ask("notify 2 back") == "ok"
            got = await asyncio.wait_for(waiter, 5)
            # many requests awaited at once, one waiter thread
            reqs = [dd.pull_cache_async((1, peer.ids["A"], b), c, b) for b in range(8)]
            res = await asyncio.wait_for(asyncio.gather(*reqs), 10)
            return got, res
        got, res = asyncio.run(main())
        assert got == [(1, b"back")] and res == [None] * 8
        assert (dst[3] == pattern(3, (8, 256), np.uint8)).all()

        async def failing():
            r = dd.push_cache_async(c, (1, peer.ids["C"], 0), layerwise=True)
            asyncio.get_running_loop().call_later(0.05, r.cancel)
            await r
        with pytest.raises(llmdd.LlmddError):
            asyncio.run(failing())


def test_metrics_and_info(dd, peer):
    dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    with dd.register_cache(dst) as c:
        dd.pull_cache((1, peer.ids["A"], 0), c, 0)
    text = dd.metrics_text()
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    # The one pull, counted under the transport the link chose, and timed.
    pulls = {k: v for k, v in series.items()
             if re.fullmatch(r'llmdd_transfers_total\{side="caller",op="pull",'
                             r'transport="(\w+)",status="LLM_SUCCESS"\}', k)}
    assert list(pulls.values()) == [1]
    tp = re.search(r'transport="(\w+)"', next(iter(pulls))).group(1)
    assert series[f'llmdd_transfer_duration_seconds_count{{op="pull",transport="{tp}"}}'] == 1
    assert series[f'llmdd_transfer_duration_seconds_sum{{op="pull",transport="{tp}"}}'] > 0
    assert series['llmdd_links{direction="out"}'] == 1
    assert series['llmdd_instance_info{cluster_id="2",role="mix",version="%s"}'
                  % llmdd.version()] == 1
    assert llmdd.version() and "tcp" in llmdd.transport_list()
    assert llmdd.status_str(0x5010B01A) == "LLM_TIMEOUT"


def test_bad_arguments(dd, peer):
    good = [np.zeros((8, 256), np.uint8) for _ in range(4)]
    with pytest.raises(ValueError):
        dd.register_cache([np.zeros((8, 256), np.uint8)[:, ::2]] * 4)   # not contiguous
    ro = np.zeros((8, 256), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        dd.register_cache([ro] * 4)
    with pytest.raises(ValueError):
        dd.register_cache([bytes(2048)] * 4, llmdd.CacheDesc(4, (8, 256)))
    with pytest.raises(ValueError):       # too small for the desc
        dd.register_cache([np.zeros(100, np.uint8)] * 4, llmdd.CacheDesc(4, (8, 256)))
    with pytest.raises(ValueError):
        dd.register_cache(good, llmdd.CacheDesc(3, (8, 256)))
    with pytest.raises(TypeError):
        dd.register_cache(["nope"] * 4, llmdd.CacheDesc(4, (8, 256)))
    with pytest.raises(ValueError):
        dd.register_cache([0] * 4, llmdd.CacheDesc(4, (8, 256)))
    with pytest.raises(TypeError):
        dd.register_cache([True] * 4, llmdd.CacheDesc(4, (8, 256)))
    with pytest.raises(ValueError):       # not a CPU tensor (duck-typed)
        class Meta:
            device = type("D", (), {"type": "meta"})()
            def data_ptr(self): return 4096
        dd.register_cache([Meta()] * 4, llmdd.CacheDesc(4, (8, 256)))
    with pytest.raises(ValueError):
        dd.register_cache([torch.zeros(8, 256).t()] * 4)
    with pytest.raises(ValueError):
        llmdd.CacheDesc(0, (8,))
    with pytest.raises(ValueError):
        llmdd.CacheDesc(1, (8, 0))
    with pytest.raises(ValueError):
        llmdd.CacheDesc(1, (8,), data_type=5)
    with pytest.raises(ValueError):
        llmdd.Instance(3, role=7)
    with pytest.raises(ValueError):
        llmdd.Instance(-1)
    with pytest.raises(TypeError):
        llmdd.Instance("1")
    with dd.register_cache(good) as c:
        with pytest.raises(TypeError):
            dd.pull_cache(c, c)
        with pytest.raises(ValueError):
            dd.pull_cache((1, 1, -1), c)
        with pytest.raises(ValueError):
            dd.pull_cache((1, 1), c, 0, 0)
        with pytest.raises(ValueError):
            dd.pull_cache((1, 1), c, src_layers=range(2, 1))
        with pytest.raises(TypeError):
            dd.pull_cache((1, 1), c, src_layers=(0, 1))
        with pytest.raises(ValueError):
            dd.pull_blocks((1, 1), c, [0, 1], [0])
        with pytest.raises(ValueError):
            dd.pull_blocks((1, 1), c, [], [])
        with pytest.raises(ValueError):
            dd.send_notify(1, b"x" * (llmdd.NOTIFY_MAX + 1))
        with pytest.raises(ValueError):
            dd.set_cache_key(c, 0, b"")
        with pytest.raises(ValueError):
            dd.link(1, "127.0.0.1:70000")
        with pytest.raises(TypeError):
            dd.wait_notify  # attribute exists
            dd.get_notifies("3")
        # status errors from the library
        with pytest.raises(llmdd.LlmddError) as e:
            dd.pull_cache((1, 999), c)
        assert e.value.status == llmdd.LLM_KV_CACHE_NOT_EXIST
        with pytest.raises(llmdd.LlmddError) as e:
            dd.pull_cache((7, 1), c)
        assert e.value.status == llmdd.LLM_NOT_YET_LINK
        with pytest.raises(llmdd.LlmddError) as e:
            dd.pull_cache((1, peer.ids["A"], 8), c)
        assert e.value.status == llmdd.LLM_PARAM_INVALID
        with pytest.raises(llmdd.LlmddError) as e:
            dd.link(1, peer.addr)
        assert e.value.status == llmdd.LLM_ALREADY_LINK and e.value.statuses == [e.value.status]
    with pytest.raises(ValueError):
        dd.pull_cache((1, 1), c)           # closed cache
    with llmdd.Instance(9, llmdd.Role.DECODER) as other:
        oc = other.allocate_cache(llmdd.CacheDesc(1, (4,)))
        with pytest.raises(ValueError):
            dd.pull_cache((1, 1), oc)      # another instance's cache
        with pytest.raises(llmdd.LlmddError) as e:
            other.push_cache(oc, (1, 1))   # a decoder pushes: no link here
        assert e.value.status == llmdd.LLM_NOT_YET_LINK
    d2 = llmdd.Instance(10)
    d2.close()
    with pytest.raises(llmdd.LlmddError) as e:
        d2.allocate_cache(llmdd.CacheDesc(1, (4,)))
    assert e.value.status == llmdd.LLM_FAILED
    assert array  # the buffer protocol's other users work too
    a = array.array("b", bytes(8))
    with dd.register_cache(a, llmdd.CacheDesc(1, (8,))):
        pass


def test_listen_address_port_zero():
    with llmdd.Instance(7, llmdd.Role.PROMPT,
                        options={"llm.ListenIpInfo": "127.0.0.1:0"}) as p:
        addr = p.listen_address()
        ip, port = addr.rsplit(":", 1)
        assert ip == "127.0.0.1" and 0 < int(port) < 65536
        with llmdd.Instance(8, llmdd.Role.DECODER) as d:
            d.link(7, addr)
    with llmdd.Instance(9, llmdd.Role.DECODER) as d:
        with pytest.raises(llmdd.LlmddError) as e:
            d.listen_address()
        assert e.value.status == llmdd.Status.LLM_FAILED


def test_check_link(dd, peer):
    assert dd.check_link(peer.cluster_id) is None
    assert dd.check_link(peer.cluster_id, timeout_ms=50) is None
    with pytest.raises(llmdd.LlmddError) as e:
        dd.check_link(99)
    assert e.value.status == llmdd.LLM_NOT_YET_LINK
    with pytest.raises(ValueError):
        dd.check_link(peer.cluster_id, timeout_ms=0)


def test_close_waits_for_calls_in_flight(peer):
    """Instance.close() on one thread while others call it and wait on its
    requests: every call ends (with a status, or "closed" once it is), no
    crash, and the requests report LLM_FAILED once finalize ended them."""
    import threading
    for rnd in range(20):
        d = llmdd.Instance(DEC + 10 + rnd, llmdd.Role.MIX,
                           options={"llm.SyncKvCacheWaitTime": "2000"})
        d.link(peer.cluster_id, peer.addr)
        dst = d.allocate_cache(llmdd.CacheDesc(4, (8, 256)))
        endless = [d.push_cache_async(dst, (peer.cluster_id, peer.ids["C"], 0), 0,
                                      layerwise=True) for _ in range(3)]
        waited, errors = [], []
        stop = threading.Event()

        def waiter(r):
            try:
                r.wait()
            except llmdd.LlmddError as e:
                waited.append(e.status)

        def caller():
            while not stop.is_set():
                try:
                    d.pull_cache((peer.cluster_id, peer.ids["A"], 1), dst, 1)
                    d.check_link(peer.cluster_id)
                except llmdd.LlmddError as e:
                    if e.status not in (llmdd.LLM_FAILED, llmdd.LLM_NOT_YET_LINK):
                        errors.append(e)
                    return
                except ValueError:       # the cache went with the instance
                    return
        ts = [threading.Thread(target=waiter, args=(r,)) for r in endless]
        ts += [threading.Thread(target=caller) for _ in range(2)]
        for t in ts:
            t.start()
        time.sleep(0.002 * (rnd % 5))   # a different moment each round
        d.close()
        stop.set()
        for t in ts:
            t.join(10)
            assert not t.is_alive()
        assert waited == [llmdd.LLM_FAILED] * 3
        assert errors == []
        for r in endless:
            r.close()


def test_one_tensor_cache_without_layer_arguments():
    """tensor_num_per_layer (2 by default) is not used without layer ranges:
    a one-tensor cache moves with the default arguments, as with NULL in C."""
    with llmdd.Instance(7, llmdd.Role.PROMPT,
                        options={"llm.ListenIpInfo": "127.0.0.1:0"}) as p, \
            llmdd.Instance(8, llmdd.Role.DECODER) as d:
        d.link(7, p.listen_address())
        src = [pattern(5, (4, 64), np.uint8)]
        dst = [np.zeros((4, 64), np.uint8)]
        with p.register_cache(src) as s, d.register_cache(dst) as c:
            d.pull_cache((7, s.cache_id, 2), c, 1)
            assert (dst[0][1] == src[0][2]).all()
            d.pull_blocks((7, s.cache_id), c, [3], [0])
            assert (dst[0][0] == src[0][3]).all()
            d.pull_cache((7, s.cache_id, 1), c, 2, tensor_num_per_layer=0)
            assert (dst[0][2] == src[0][1]).all() and not dst[0][3].any()
            dst[0][3] = 9
            d.push_cache(c, (7, s.cache_id, 0), 3)
            assert (src[0][0] == 9).all()
            # a layer-wise push counts layers: tnpl 2 does not fit one tensor
            with pytest.raises(llmdd.LlmddError) as e:
                d.push_cache_async(c, (7, s.cache_id, 0), 3, layerwise=True)
            assert e.value.status == llmdd.LLM_PARAM_INVALID


def test_unlink_by_cluster_id(peer):
    """A link is known by its cluster id: a non-force unlink needs no
    address."""
    with llmdd.Instance(5, llmdd.Role.DECODER,
                        options={"llm.SyncKvCacheWaitTime": "5000"}) as d:
        d.link(peer.cluster_id, peer.addr)
        d.unlink(peer.cluster_id)
        assert d.unlink_clusters_status([llmdd.ClusterInfo(peer.cluster_id)]) == (0, [0])
        with d.register_cache([np.zeros((8, 256), np.uint8) for _ in range(4)]) as c:
            with pytest.raises(llmdd.LlmddError) as e:
                d.pull_cache((peer.cluster_id, peer.ids["A"]), c)
            assert e.value.status == llmdd.LLM_NOT_YET_LINK


def test_tables_come_from_the_library():
    """Status names, element sizes and the version are the library's."""
    from llmdd._ffi import lib
    assert llmdd.__version__ == llmdd.version() == lib.llmdd_version().decode()
    for s in llmdd.Status:
        assert lib.llmdd_status_str(int(s)).decode() == s.name
    assert len(llmdd.Status) == 30
    for t in llmdd.DataType:
        assert llmdd.DTYPE_SIZE.get(int(t), 0) == lib.llmdd_data_type_size(int(t))
    assert llmdd.DTYPE_SIZE[int(llmdd.DataType.BF16)] == 2
