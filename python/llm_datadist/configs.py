"""LLMRole, LLMConfig and LLMClusterInfo (the reference's configs)."""

import enum
import ipaddress
import json
import socket

from .status import LLMException, LLMStatusCode, raise_if_false, check_int, as_int


class LLMRole(enum.IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self):
        return f"{self.__class__.__name__}.{self.name}"


def _ip_to_str(ip):
    """The reference carries an IPv4 address as str or as the int that
    inet_aton's bytes make in little-endian order."""
    if isinstance(ip, str):
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ValueError(f"Can not parse ip str:{ip}") from None
        return ip
    ip = check_int("ip", ip, 0, 2**32 - 1)
    return socket.inet_ntoa(ip.to_bytes(4, "little"))


def _ip_to_int(ip):
    """An IPv4 str as the reference's little-endian int (an int as is)."""
    if isinstance(ip, str):
        try:
            return int.from_bytes(socket.inet_aton(ip), "little")
        except OSError:
            raise RuntimeError(f"Can not parse ip str:{ip}") from None
    return ip


class LLMClusterInfo:
    """A peer for link_clusters / unlink_clusters."""

    def __init__(self):
        self._remote_cluster_id = None
        self._remote_role_type = None
        self._local_ip_info_list = []
        self._remote_ip_info_list = []

    @property
    def remote_cluster_id(self):
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, v):
        self._remote_cluster_id = check_int("remote_cluster_id", v, 0, 2**64 - 1)

    @property
    def remote_role_type(self):
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, v):
        self._remote_role_type = v if isinstance(v, LLMRole) \
            else as_int("remote_role_type", v)

    @property
    def local_ip_info_list(self):
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self):
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip, port):
        port = check_int("port", port, 0, 65535)
        self._local_ip_info_list.append((_ip_to_str(ip), port))

    def append_remote_ip_info(self, ip, port):
        port = check_int("port", port, 0, 65535)
        self._remote_ip_info_list.append((_ip_to_str(ip), port))

    def __repr__(self):
        return (f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
                f"remote={self._remote_ip_info_list}, local={self._local_ip_info_list})")


def _str_prop(name, key=None):
    """A str option (None allowed, as the reference's check_isinstance
    allows it), emitted under key when not empty."""
    attr = "_" + name

    def get(self):
        return getattr(self, attr)

    def set_(self, v):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name} only support ['str'], but got {type(v)}.")
        setattr(self, attr, v)
    return property(get, set_)


def _bool_prop(name):
    """A bool option; unset (None) reads as False."""
    attr = "_" + name

    def get(self):
        return bool(getattr(self, attr))

    def set_(self, v):
        if v is not None and not isinstance(v, bool):
            raise TypeError(f"{name} only support ['bool'], but got {type(v)}.")
        setattr(self, attr, v)
    return property(get, set_)


def _set_str_prop(name, default=""):
    """A str option emitted whenever it was set, even to "" (the
    reference's local_comm_res, transfer_backend, global_resource_config);
    unset reads as ""."""
    attr = "_" + name

    def get(self):
        v = getattr(self, attr)
        return default if v is None else v

    def set_(self, v):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"{name} only support ['str'], but got {type(v)}.")
        setattr(self, attr, v)
    return property(get, set_)


def _u32_prop(name):
    """An unsigned 32-bit option (the reference's check_uint32: None is a
    TypeError, out of range a ValueError)."""
    attr = "_" + name

    def get(self):
        return getattr(self, attr)

    def set_(self, v):
        setattr(self, attr, check_int(name, v, 0, 2**32 - 1))
    return property(get, set_)


_I32_MAX = 2**31 - 1
_U32_MAX = 2**32 - 1


class LLMConfig:
    """Options for LLMDataDist.init: set attributes, then generate_options()
    (or gen_options()), which adds them to the dict `options` and returns
    it. The properties, their checks and the keys they produce are the
    reference's (docs/python.md, "LLMConfig"); the C library takes every
    llm.* key it produces, those that mean nothing here with a log line.
    """

    def __init__(self):
        self._options = {}
        self._ge_options = {}
        self._device_id = None
        self._listen_ip_info = ""
        self._sync_kv_timeout = None
        self._deploy_res_path = ""
        self._enable_switch_role = False
        self._link_total_time = None
        self._link_retry_count = None
        self._cluster_info = ""
        self._output_max_size = None
        self._mem_utilization = 0.95
        self._buf_pool_cfg = ""
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._enable_cache_manager = None
        self._enable_remote_cache_accessible = None
        self._rdma_traffic_class = None
        self._rdma_service_level = None
        self._local_comm_res = None
        self._transfer_backend = None
        self._global_resource_config = None
        self._transport = ""
        self._auth_token = ""

    listen_ip_info = _str_prop("listen_ip_info")
    deploy_res_path = _str_prop("deploy_res_path")
    mem_pool_cfg = _str_prop("mem_pool_cfg")
    host_mem_pool_cfg = _str_prop("host_mem_pool_cfg")
    buf_pool_cfg = _str_prop("buf_pool_cfg")
    transport = _str_prop("transport")          # llmdd extension: llm.Transport
    auth_token = _str_prop("auth_token")        # llmdd extension: llm.AuthToken
    enable_switch_role = _bool_prop("enable_switch_role")
    enable_cache_manager = _bool_prop("enable_cache_manager")
    enable_remote_cache_accessible = _bool_prop("enable_remote_cache_accessible")
    local_comm_res = _set_str_prop("local_comm_res")
    transfer_backend = _set_str_prop("transfer_backend")
    global_resource_config = _set_str_prop("global_resource_config")
    rdma_traffic_class = _u32_prop("rdma_traffic_class")
    rdma_service_level = _u32_prop("rdma_service_level")

    @property
    def options(self):
        return self._options

    @property
    def ge_options(self):
        return self._ge_options

    @ge_options.setter
    def ge_options(self, v):
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str)
                                              for k, x in v.items()):
            raise TypeError("ge_options must be a dict of str to str")
        self._ge_options = v

    @property
    def device_id(self):
        return self._device_id

    @device_id.setter
    def device_id(self, v):
        # One device or a list of them (one process, several devices).
        if v is None:
            self._device_id = None
            return
        many = isinstance(v, (list, tuple))
        ids = [as_int("device_id", d) for d in (v if many else [v])]
        raise_if_false(len(ids) > 0, "device_id can not be an empty list.")
        for d in ids:
            raise_if_false(d >= 0, "device_id should be greater than or equal to zero.")
            check_int("device_id", d, 0, _I32_MAX)
        self._device_id = ids if many else ids[0]

    @property
    def sync_kv_timeout(self):
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, v):
        # An int or a str of digits; kept as given, as the reference does.
        if isinstance(v, str):
            raise_if_false(v.isdigit(), "sync_kv_timeout must be digit.")
            iv = int(v)
        else:
            iv = v = as_int("sync_kv_timeout", v)
        raise_if_false(iv > 0, "sync_kv_timeout should be greater than zero.")
        check_int("sync_kv_timeout", iv, 1, _I32_MAX)
        self._sync_kv_timeout = v

    @property
    def link_total_time(self):
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, v):
        v = as_int("link_total_time", v)
        raise_if_false(0 <= v <= _U32_MAX, "link_total_time should be an integer between "
                       f"[0, 2^32-1], given value is {v}")
        self._link_total_time = v

    @property
    def link_retry_count(self):
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, v):
        v = as_int("link_retry_count", v)
        raise_if_false(1 <= v <= 100, "link_retry_count should be an integer between "
                       f"[1, 100], given value is {v}")
        self._link_retry_count = v

    @property
    def output_max_size(self):
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, v):
        self._output_max_size = None if v is None else as_int("output_max_size", v)

    @property
    def mem_utilization(self):
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, v):
        if not isinstance(v, float):
            raise TypeError(f"mem_utilization only support ['float'], but got {type(v)}.")
        raise_if_false(0.0 < v <= 1.0,
                       f"mem_utilization must be in range (0, 1], current:{v}")
        self._mem_utilization = v

    @property
    def cluster_info(self):
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, v):
        # JSON; its listen_ip_info ips become the reference's int form.
        if not isinstance(v, str):
            raise TypeError(f"cluster_info only support ['str'], but got {type(v)}.")
        d = json.loads(v)
        try:
            for ip_info in d.get("listen_ip_info", []) if isinstance(d, dict) else []:
                ip_info["ip"] = _ip_to_int(ip_info["ip"])
        except (KeyError, TypeError, AttributeError):
            raise LLMException(f"cluster_info: bad listen_ip_info in {v}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
        self._cluster_info = json.dumps(d)

    def generate_options(self):
        """The options dict (self.options, with every set property added)."""
        o = self._options
        if self._ge_options:
            o.update(self._ge_options)
        d = self._device_id
        if d is not None:
            ids = d if isinstance(d, list) else [d]
            o["ge.exec.deviceId"] = ";".join(str(x) for x in ids)
            o["ge.session_device_id"] = str(ids[0])
        if self._sync_kv_timeout is not None:
            o["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        for key, v in (("llm.deployResPath", self._deploy_res_path),
                       ("llm.BufPoolCfg", self._buf_pool_cfg),
                       ("llm.MemPoolConfig", self._mem_pool_cfg),
                       ("llm.HostMemPoolConfig", self._host_mem_pool_cfg),
                       ("llm.listenIpInfo", self._listen_ip_info),
                       ("llm.ClusterInfo", self._cluster_info),
                       ("llm.Transport", self._transport),
                       ("llm.AuthToken", self._auth_token)):
            if v:
                o[key] = v
        for key, v in (("llm.EnableCacheManager", self._enable_cache_manager),
                       ("llm.EnableRemoteCacheAccessible",
                        self._enable_remote_cache_accessible)):
            if v is not None:
                o[key] = "1" if v else "0"
        for key, v in (("llm.LinkTotalTime", self._link_total_time),
                       ("llm.LinkRetryCount", self._link_retry_count),
                       ("llm.RdmaTrafficClass", self._rdma_traffic_class),
                       ("llm.RdmaServiceLevel", self._rdma_service_level),
                       ("llm.LocalCommRes", self._local_comm_res),
                       ("llm.TransferBackend", self._transfer_backend),
                       ("llm.GlobalResourceConfig", self._global_resource_config),
                       ("llm.OutputMaxSize", self._output_max_size),
                       ("llm.MemoryUtilization", self._mem_utilization)):
            if v is not None:
                o[key] = str(v)
        if self._enable_switch_role:
            o["llm.EnableSwitchRole"] = "1"
        return o

    gen_options = generate_options


LlmConfig = LLMConfig
