"""Discovery through a real etcd from Python: llmdd and llm_datadist pass
the llm.Metadata* options through, link by cluster id alone, and
llmdd.metadata_list lists what is published."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

import llmdd
from llm_datadist import LLMDataDist, LLMRole, LLMConfig, LLMClusterInfo, LLMStatusCode


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd():
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (scripts/deps.sh installs etcd-server)")
    d = tempfile.mkdtemp(prefix="llmdd-etcd-")
    c, p = _free_port(), _free_port()
    cu, pu = f"http://127.0.0.1:{c}", f"http://127.0.0.1:{p}"
    log = open(os.path.join(d, "etcd.log"), "w")
    proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", os.path.join(d, "data"),
         "--listen-client-urls", cu, "--advertise-client-urls", cu,
         "--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
         "--initial-cluster", f"t={pu}", "--log-level", "warn"],
        stdout=log, stderr=log)
    server = f"etcd://127.0.0.1:{c}"
    deadline = time.monotonic() + 20
    while True:
        try:
            llmdd.metadata_list(server, timeout_ms=500)
            break
        except llmdd.LlmddError:
            assert proc.poll() is None and time.monotonic() < deadline, "etcd did not start"
    yield server
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    shutil.rmtree(d, ignore_errors=True)


def test_llmdd_by_cluster_id(etcd):
    opts = {"llm.MetadataServer": etcd, "llm.MetadataPrefix": "py"}
    with llmdd.Instance(1, llmdd.Role.PROMPT,
                        options=dict(opts, **{"llm.ListenIpInfo": "127.0.0.1:0"})) as p, \
            llmdd.Instance(2, llmdd.Role.DECODER, options=opts) as d:
        src = [np.full((4, 64), i + 1, np.uint8) for i in range(2)]
        dst = [np.zeros((4, 64), np.uint8) for _ in range(2)]
        with p.register_cache(src) as pc, d.register_cache(dst) as dc:
            entries = llmdd.metadata_list(etcd, "py")
            assert [e["cluster_id"] for e in entries] == ["1"]
            assert entries[0]["role"] == int(llmdd.Role.PROMPT)
            assert llmdd.metadata_list(etcd) == []      # another prefix
            d.link(1)                                   # no address
            d.pull_cache(llmdd.CacheIndex(1, pc.cache_id, 3), dc, 0)
            assert (dst[0][0] == 1).all() and (dst[1][0] == 2).all()
            with pytest.raises(llmdd.LlmddError) as e:
                d.link(9)
            assert e.value.status == llmdd.Status.LLM_LINK_FAILED
    assert llmdd.metadata_list(etcd, "py") == []        # finalize revoked it


def test_llm_datadist_by_cluster_id(etcd):
    cfg = LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.ge_options = {"llm.MetadataServer": etcd}
    prompt = LLMDataDist(LLMRole.PROMPT, 11)
    prompt.init(cfg.generate_options())
    dec = LLMDataDist(LLMRole.DECODER, 12)
    dec.init({"llm.MetadataServer": etcd})
    ci = LLMClusterInfo()
    ci.remote_cluster_id = 11                           # no remote ip info
    st, rets = dec.link_clusters([ci], timeout=3000)
    assert st == LLMStatusCode.LLM_SUCCESS and rets == [LLMStatusCode.LLM_SUCCESS]
    st, rets = dec.unlink_clusters([ci], timeout=3000)
    assert st == LLMStatusCode.LLM_SUCCESS
    dec.finalize()
    prompt.finalize()
