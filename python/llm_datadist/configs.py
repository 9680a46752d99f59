"""LLMRole, LLMConfig and LLMClusterInfo (the reference's configs)."""

import enum
import ipaddress
import socket

from .status import LLMException, LLMStatusCode, raise_if_false, check_int, as_int


class LLMRole(enum.Enum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


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


def _str_prop(name):
    attr = "_" + name

    def get(self):
        return getattr(self, attr)

    def set_(self, v):
        if not isinstance(v, str):
            raise TypeError(f"{name} must be a str")
        setattr(self, attr, v)
    return property(get, set_)


def _bool_prop(name):
    attr = "_" + name

    def get(self):
        return bool(getattr(self, attr))

    def set_(self, v):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool")
        setattr(self, attr, v)
    return property(get, set_)


class LLMConfig:
    """Options for LLMDataDist.init: set attributes, then generate_options().

    The keys are the C library's (docs/python.md lists the mapping); the
    library accepts llm.BufPoolCfg, llm.EnableSwitchRole and llm.LocalCommRes
    and ignores them with a log line.
    """

    def __init__(self):
        self._device_id = None
        self._listen_ip_info = ""
        self._sync_kv_timeout = None
        self._enable_cache_manager = None
        self._enable_remote_cache_accessible = None
        self._enable_switch_role = False
        self._local_comm_res = None
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._buf_pool_cfg = ""
        self._ge_options = {}
        self._transport = ""
        self._auth_token = ""

    listen_ip_info = _str_prop("listen_ip_info")
    mem_pool_cfg = _str_prop("mem_pool_cfg")
    host_mem_pool_cfg = _str_prop("host_mem_pool_cfg")
    buf_pool_cfg = _str_prop("buf_pool_cfg")
    transport = _str_prop("transport")          # llmdd extension: llm.Transport
    auth_token = _str_prop("auth_token")        # llmdd extension: llm.AuthToken
    enable_cache_manager = _bool_prop("enable_cache_manager")
    enable_remote_cache_accessible = _bool_prop("enable_remote_cache_accessible")
    enable_switch_role = _bool_prop("enable_switch_role")

    @property
    def device_id(self):
        return self._device_id

    @device_id.setter
    def device_id(self, v):
        if isinstance(v, (list, tuple)):
            v = [check_int("device_id", d, 0, 2**31 - 1) for d in v]
        else:
            v = check_int("device_id", v, 0, 2**31 - 1)
        self._device_id = v

    @property
    def sync_kv_timeout(self):
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, v):
        if isinstance(v, str):
            raise_if_false(v.isdigit(), "sync_kv_timeout must be digit.")
            iv = int(v)
        else:
            iv = v = as_int("sync_kv_timeout", v)
        raise_if_false(0 < iv <= 2**31 - 1, "sync_kv_timeout should be greater than zero.")
        self._sync_kv_timeout = v

    @property
    def local_comm_res(self):
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, v):
        if not isinstance(v, str):
            raise TypeError("local_comm_res must be a str")
        self._local_comm_res = v

    @property
    def ge_options(self):
        return self._ge_options

    @ge_options.setter
    def ge_options(self, v):
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str)
                                              for k, x in v.items()):
            raise TypeError("ge_options must be a dict of str to str")
        self._ge_options = v

    def generate_options(self):
        """A dict of option keys (str) to values (str)."""
        o = dict(self._ge_options)
        if self._listen_ip_info:
            o["llm.ListenIpInfo"] = self._listen_ip_info
        if self._device_id is not None:
            d = self._device_id
            o["llm.DeviceId"] = str(d[0] if isinstance(d, (list, tuple)) else d)
        if self._sync_kv_timeout is not None:
            o["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._mem_pool_cfg:
            o["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            o["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._buf_pool_cfg:
            o["llm.BufPoolCfg"] = self._buf_pool_cfg
        if self._enable_switch_role:
            o["llm.EnableSwitchRole"] = "1"
        if self._local_comm_res is not None:
            o["llm.LocalCommRes"] = self._local_comm_res
        if self._enable_cache_manager is not None:
            o["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            o["llm.EnableRemoteCacheAccessible"] = \
                "1" if self._enable_remote_cache_accessible else "0"
        if self._transport:
            o["llm.Transport"] = self._transport
        if self._auth_token:
            o["llm.AuthToken"] = self._auth_token
        return o

    gen_options = generate_options


LlmConfig = LLMConfig
