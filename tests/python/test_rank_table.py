"""The rank-table API of llm_datadist over llmdd links: link(comm_name,
cluster_rank_info, rank_table), query_register_mem_status(comm_id),
unlink(comm_id), in either call order, with a timeout when the other side
never calls (docs/python.md)."""

import json
import logging
import socket
import time

import numpy as np
import pytest

from llm_datadist import (LLMDataDist, LLMRole, LLMException, LLMStatusCode, CacheDesc,
                          DataType, CacheKeyByIdAndIndex, RegisterMemStatus)
from common import pattern


def free_pair():
    """A base port whose ranks 0 and 1 (base, base + 1) are free now."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no two consecutive free ports")


def table(*ranks):
    """A rank table with one server a rank, every one at 127.0.0.1 (one host,
    as in the reference's single-machine samples: the ports tell them
    apart)."""
    return json.dumps({"server_count": str(len(ranks)), "status": "completed",
                       "version": "1.2", "server_list": [
                           {"server_id": str(r), "host_ip": "127.0.0.1",
                            "device": [{"device_id": "0", "device_ip": "192.0.2.1",
                                        "rank_id": str(r)}]} for r in ranks]})


def instance(role, cluster_id):
    dd = LLMDataDist(role, cluster_id)
    dd.init({"llm.SyncKvCacheWaitTime": "5000", "llm.EnableCacheManager": "1"})
    return dd


def wait_status(dd, comm_id, want, timeout=10):
    end = time.monotonic() + timeout
    while True:
        st = dd.query_register_mem_status(comm_id)
        if st != RegisterMemStatus.PREPARING or time.monotonic() > end:
            assert st == want
            return
        time.sleep(0.01)


@pytest.fixture
def ports(monkeypatch):
    base = free_pair()
    monkeypatch.setenv("LLMDD_RANK_BASE_PORT", str(base))
    return base


@pytest.mark.parametrize("first", ["prompt", "decoder"])
def test_link_either_order(ports, first):
    p = instance(LLMRole.PROMPT, 1)
    d = instance(LLMRole.DECODER, 2)
    try:
        rt = table(0, 1)
        order = [(p, {1: 0, 2: 1}), (d, {1: 0, 2: 1})]
        if first == "decoder":
            order.reverse()
        (a, ia), (b, ib) = order
        ca = a.link("comm", ia, rt)
        # The other side has not called: a waits for it, and says so.
        time.sleep(0.3)
        assert a.query_register_mem_status(ca) == RegisterMemStatus.PREPARING
        cb = b.link("comm", ib, rt)
        wait_status(a, ca, RegisterMemStatus.OK)
        wait_status(b, cb, RegisterMemStatus.OK)
        # Rank r listens at the base port + r.
        assert p._dd.listen_address() == f"127.0.0.1:{ports}"
        assert d._dd.listen_address() == f"127.0.0.1:{ports + 1}"
        # The link carries pulls both ways, every byte checked.
        src = [pattern(40 + i, (4, 64), np.int32) for i in range(2)]
        pc = p.cache_manager.register_cache(CacheDesc(2, [4, 64], DataType.DT_INT32), src)
        dst = [np.zeros((4, 64), np.int32) for _ in range(2)]
        dc = d.cache_manager.register_cache(CacheDesc(2, [4, 64], DataType.DT_INT32), dst)
        d.cache_manager.pull_cache(CacheKeyByIdAndIndex(1, pc.cache_id, 3), dc, 1)
        assert all((dst[i][1] == src[i][3]).all() for i in range(2))
        assert not dst[0][[0, 2, 3]].any()
        d.check_link_status(1)
        p.check_link_status(2)
        a.unlink(ca)
        with pytest.raises(LLMException) as e:
            a.unlink(ca)
        assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        end = time.monotonic() + 5
        while True:      # the peer's side goes just after it acknowledged
            try:
                b.check_link_status(1 if b is d else 2)
            except LLMException as e:
                assert e.status_code == LLMStatusCode.LLM_NOT_YET_LINK
                break
            assert time.monotonic() < end
            time.sleep(0.01)
        b.unlink(cb)     # nothing left to end: success
    finally:
        d.finalize()
        p.finalize()


def test_link_times_out_when_the_peer_never_calls(ports, monkeypatch, caplog):
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1")
    d = instance(LLMRole.DECODER, 2)
    try:
        t0 = time.monotonic()
        c = d.link("comm", {1: 0, 2: 1}, table(0, 1))
        assert d.query_register_mem_status(c) == RegisterMemStatus.PREPARING
        wait_status(d, c, RegisterMemStatus.FAILED, timeout=10)
        assert 0.9 < time.monotonic() - t0 < 8
        # Every refused attempt was retried quietly; giving up is the one
        # error, with the peer and its last status.
        errors = [r for r in caplog.records
                  if r.name == "llm_datadist" and r.levelno == logging.ERROR]
        assert len(errors) == 1, errors
        assert f"cluster 1 at 127.0.0.1:{ports}: LLM_LINK_FAILED" in errors[0].getMessage()
        with pytest.raises(LLMException) as e:
            d.check_link_status(1)
        assert e.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        d.unlink(c)
    finally:
        d.finalize()


def test_bad_rank_tables(ports):
    d = instance(LLMRole.DECODER, 2)
    try:
        for args, code in (
                (("c", {1: 0, 2: 1}, "not json"), LLMStatusCode.LLM_PARAM_INVALID),
                (("c", {1: 0, 2: 1}, table(0)), LLMStatusCode.LLM_PARAM_INVALID),
                (("c", {1: 0, 3: 1}, table(0, 1)), LLMStatusCode.LLM_PARAM_INVALID),
                (("c", {1: 0, 2: 0}, table(0, 1)), LLMStatusCode.LLM_PARAM_INVALID),
                (("c", {2: 1}, table(0, 1)), LLMStatusCode.LLM_PARAM_INVALID),
                (("c", {1: 0, 2: 1}, json.dumps({"server_list": [
                    {"device": [{"rank_id": "0"}, {"rank_id": "1"}]}]})),
                 LLMStatusCode.LLM_PARAM_INVALID)):
            with pytest.raises(LLMException) as e:
                d.link(*args)
            assert e.value.status_code == code, args
        with pytest.raises(TypeError):
            d.link("c", [1, 2], table(0, 1))
        for call in (d.query_register_mem_status, d.unlink):
            with pytest.raises(LLMException) as e:
                call(77)
            assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    finally:
        d.finalize()
