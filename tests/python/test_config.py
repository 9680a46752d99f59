"""LLMConfig and LLMClusterInfo as the reference has them: every property's
type check, range and the option it produces; the options work in init."""

import json

import numpy as np
import pytest

from llm_datadist import (LLMConfig, LlmConfig, LLMClusterInfo, LLMDataDist, LLMException,
                          LLMRole, LLMStatusCode, CacheDesc, DataType, Placement)


def _invalid(fn):
    with pytest.raises(LLMException) as e:
        fn()
    assert e.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_device_id_list_and_int():
    c = LLMConfig()
    c.device_id = [0, 1]
    o = c.generate_options()
    assert o["ge.exec.deviceId"] == "0;1" and o["ge.session_device_id"] == "0"
    c = LLMConfig()
    c.device_id = (3,)
    assert c.generate_options()["ge.exec.deviceId"] == "3"
    c = LLMConfig()
    c.device_id = np.int64(2)
    o = c.generate_options()
    assert o["ge.exec.deviceId"] == "2" and o["ge.session_device_id"] == "2"
    assert c.device_id == 2
    for bad in ("0", 1.0, True, [0, "1"], [0.0], {0: 1}):
        with pytest.raises(TypeError):
            c.device_id = bad
    _invalid(lambda: setattr(c, "device_id", -1))
    _invalid(lambda: setattr(c, "device_id", [0, -1]))
    _invalid(lambda: setattr(c, "device_id", []))
    with pytest.raises(ValueError):
        c.device_id = 2**31
    # several devices in one process: init takes the first as llm.DeviceId
    c = LLMConfig()
    c.device_id = [0, 1]
    dd = LLMDataDist(LLMRole.MIX, 7)
    dd.init(c.generate_options())
    dd.cache_manager.allocate_cache(CacheDesc(1, [4], DataType.DT_INT8, Placement.DEVICE))
    dd.finalize()


def test_global_resource_config_and_the_other_strs():
    c = LlmConfig()
    assert c.global_resource_config == "" and "llm.GlobalResourceConfig" not in \
        c.generate_options()
    for bad in (1, b"x", ["a"], 1.5, True):
        with pytest.raises(TypeError):
            c.global_resource_config = bad
    c.global_resource_config = '{"x": 1}'
    assert c.generate_options()["llm.GlobalResourceConfig"] == '{"x": 1}'
    c = LLMConfig()
    c.global_resource_config = ""       # set, even empty: produced
    assert c.generate_options()["llm.GlobalResourceConfig"] == ""
    strs = {"listen_ip_info": "llm.listenIpInfo", "deploy_res_path": "llm.deployResPath",
            "buf_pool_cfg": "llm.BufPoolCfg", "mem_pool_cfg": "llm.MemPoolConfig",
            "host_mem_pool_cfg": "llm.HostMemPoolConfig", "local_comm_res": "llm.LocalCommRes",
            "transfer_backend": "llm.TransferBackend", "transport": "llm.Transport",
            "auth_token": "llm.AuthToken"}
    for name, key in strs.items():
        c = LLMConfig()
        with pytest.raises(TypeError):
            setattr(c, name, 1)
        setattr(c, name, "v")
        assert getattr(c, name) == "v" and c.generate_options()[key] == "v", name


def test_mem_utilization():
    c = LLMConfig()
    assert c.generate_options()["llm.MemoryUtilization"] == "0.95"
    for bad in (1.5, -0.1, 0.0, 1.0000001, float("nan")):
        _invalid(lambda: setattr(c, "mem_utilization", bad))
    for bad in (1, "0.5", True, None):
        with pytest.raises(TypeError):
            c.mem_utilization = bad
    c.mem_utilization = 1.0
    c.mem_utilization = np.float64(0.5)
    assert c.generate_options()["llm.MemoryUtilization"] == "0.5"


def test_numbers():
    c = LLMConfig()
    assert c.link_total_time == 0 and c.link_retry_count == 1
    o = c.generate_options()
    for key in ("llm.LinkTotalTime", "llm.LinkRetryCount", "llm.RdmaTrafficClass",
                "llm.RdmaServiceLevel", "llm.OutputMaxSize", "llm.SyncKvCacheWaitTime",
                "ge.exec.deviceId", "llm.EnableSwitchRole", "llm.EnableCacheManager"):
        assert key not in o
    c.link_total_time = 0
    c.link_total_time = 2**32 - 1
    _invalid(lambda: setattr(c, "link_total_time", 2**32))
    _invalid(lambda: setattr(c, "link_total_time", -1))
    c.link_retry_count = 100
    _invalid(lambda: setattr(c, "link_retry_count", 0))
    _invalid(lambda: setattr(c, "link_retry_count", 101))
    c.rdma_traffic_class = 2**32 - 1
    c.rdma_service_level = 0
    for name in ("rdma_traffic_class", "rdma_service_level"):
        with pytest.raises(ValueError):
            setattr(c, name, -1)
        with pytest.raises(ValueError):
            setattr(c, name, 2**32)
    c.output_max_size = 1 << 20
    c.sync_kv_timeout = "1500"
    for name in ("link_total_time", "link_retry_count", "rdma_traffic_class",
                 "rdma_service_level", "output_max_size", "sync_kv_timeout"):
        for bad in (1.0, True, [1], "x" if name != "sync_kv_timeout" else 2.5):
            with pytest.raises(TypeError):
                setattr(c, name, bad)
    _invalid(lambda: setattr(c, "sync_kv_timeout", "15a"))
    _invalid(lambda: setattr(c, "sync_kv_timeout", 0))
    _invalid(lambda: setattr(c, "sync_kv_timeout", "0"))
    with pytest.raises(ValueError):
        c.sync_kv_timeout = 2**31
    o = c.generate_options()
    assert (o["llm.LinkTotalTime"], o["llm.LinkRetryCount"], o["llm.RdmaTrafficClass"],
            o["llm.RdmaServiceLevel"], o["llm.OutputMaxSize"], o["llm.SyncKvCacheWaitTime"]) \
        == (str(2**32 - 1), "100", str(2**32 - 1), "0", str(1 << 20), "1500")


def test_bools_and_ge_options():
    c = LLMConfig()
    for name, key in (("enable_cache_manager", "llm.EnableCacheManager"),
                      ("enable_remote_cache_accessible", "llm.EnableRemoteCacheAccessible")):
        assert getattr(c, name) is False
        with pytest.raises(TypeError):
            setattr(c, name, 1)
        setattr(c, name, False)
        assert c.generate_options()[key] == "0"
        setattr(c, name, True)
        assert c.generate_options()[key] == "1"
    c.enable_switch_role = False
    assert "llm.EnableSwitchRole" not in c.generate_options()
    c.enable_switch_role = True
    assert c.generate_options()["llm.EnableSwitchRole"] == "1"
    with pytest.raises(TypeError):
        c.enable_switch_role = "1"
    for bad in ({"a": 1}, {1: "a"}, [("a", "b")], "a=b"):
        with pytest.raises(TypeError):
            c.ge_options = bad
    c.ge_options = {"ge.graphRunMode": "1", "llm.SyncKvCacheWaitTime": "700"}
    o = c.generate_options()
    assert o["ge.graphRunMode"] == "1" and o["llm.SyncKvCacheWaitTime"] == "700"
    assert o is c.options       # the reference returns its options dict


def test_cluster_info():
    c = LLMConfig()
    with pytest.raises(TypeError):
        c.cluster_info = {"cluster_id": 1}
    with pytest.raises(ValueError):
        c.cluster_info = "{not json"
    c.cluster_info = json.dumps({"cluster_id": 1, "listen_ip_info": [
        {"ip": "1.2.3.4", "port": 26000}]})
    got = json.loads(c.generate_options()["llm.ClusterInfo"])
    assert got["listen_ip_info"][0]["ip"] == 0x04030201 and got["cluster_id"] == 1
    with pytest.raises(RuntimeError):
        c.cluster_info = json.dumps({"listen_ip_info": [{"ip": "no ip"}]})
    _invalid(lambda: setattr(c, "cluster_info", json.dumps({"listen_ip_info": [{}]})))


def test_every_option_initializes(capfd):
    """Every key a full LLMConfig produces is taken by init: the C library
    knows each llm.* key (none is refused or unknown)."""
    c = LLMConfig()
    c.device_id = [0, 1]
    c.sync_kv_timeout = 1500
    c.deploy_res_path = "/x"
    c.buf_pool_cfg = '{"buf_cfg": []}'
    c.mem_pool_cfg = '{"memory_size": 1048576}'
    c.host_mem_pool_cfg = '{"memory_size": 1048576, "page_shift": 16}'
    c.enable_cache_manager = True
    c.enable_remote_cache_accessible = True
    c.link_total_time = 100
    c.link_retry_count = 3
    c.rdma_traffic_class = 1
    c.rdma_service_level = 2
    c.local_comm_res = ""
    c.transfer_backend = ""
    c.global_resource_config = "{}"
    c.cluster_info = '{"cluster_id": 7}'
    c.output_max_size = 100
    c.mem_utilization = 0.9
    c.enable_switch_role = True
    c.listen_ip_info = "127.0.0.1:0"
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    dd.init(c.generate_options())
    try:
        dd.cache_manager.allocate_cache(CacheDesc(1, [4], DataType.DT_INT8, Placement.HOST))
        assert dd._dd.listen_address().startswith("127.0.0.1:")
    finally:
        dd.finalize()
    err = capfd.readouterr().err
    assert "unknown option" not in err, err


def test_cluster_info_class():
    ci = LLMClusterInfo()
    ci.remote_role_type = LLMRole.PROMPT
    ci.remote_role_type = 2
    assert int(LLMRole.MIX) == 3 and str(LLMRole.MIX) == "LLMRole.MIX"
    ci.append_local_ip_info(0x0100007F, 0)
    assert ci.local_ip_info_list == [("127.0.0.1", 0)]
    for bad in (-1, 65536):
        with pytest.raises(ValueError):
            ci.append_remote_ip_info("127.0.0.1", bad)
    with pytest.raises(TypeError):
        ci.append_remote_ip_info(["127.0.0.1"], 1)
    with pytest.raises(ValueError):
        ci.remote_cluster_id = -1
    with pytest.raises(TypeError):
        ci.remote_role_type = "PROMPT"
