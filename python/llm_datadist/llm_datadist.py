"""LLMDataDist: the reference's entry point over an llmdd.Instance."""

import llmdd

from .cache_manager import CacheManager
from .kv_cache_manager import KvCacheManager
from .configs import LLMClusterInfo, LLMRole
from .rank_table import RankTableLinks
from .status import LLMStatusCode, code_2_status, raise_if_false, translate, as_int, check_int

# Keys the Python layer consumes (the reference's modes); never sent to C.
_PY_ONLY = {"llm.EnableCacheManager", "llm.EnableRemoteCacheAccessible",
            "llm.MemoryUtilization", "llm.Role"}


def _c_options(options):
    """The reference's option dict -> the C library's keys."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError("options must be a dict of str to str")
    out = {}
    for k, v in options.items():
        if not isinstance(k, str) or not isinstance(v, (str, int)) or isinstance(v, bool):
            raise TypeError(f"option {k!r}: keys and values must be str")
        if k == "ge.exec.deviceId":
            out.setdefault("llm.DeviceId", str(v).split(";")[0])
        elif k.startswith("llm.") and k not in _PY_ONLY:
            out[k] = str(v)
    return out


def _role(role):
    if not isinstance(role, LLMRole):
        raise TypeError("role must be an LLMRole")
    return llmdd.Role(role.value)


def _clusters(clusters, need_addr):
    if not isinstance(clusters, (list, tuple)) or not all(
            isinstance(c, LLMClusterInfo) for c in clusters):
        raise TypeError("clusters must be a list or tuple of LLMClusterInfo")
    raise_if_false(len(clusters) > 0, "clusters can not be empty.")
    out = []
    for c in clusters:
        raise_if_false(c.remote_cluster_id is not None, "remote_cluster_id is not set")
        if need_addr:
            # None: looked up by cluster id (llm.MetadataServer).
            raise_if_false(len(c.remote_ip_info_list) <= 1,
                           "a cluster takes at most one remote ip info "
                           "(append_remote_ip_info)")
        ci = llmdd.ClusterInfo(c.remote_cluster_id,
                               c.remote_ip_info_list[0] if c.remote_ip_info_list else None,
                               c.local_ip_info_list,
                               0 if c.remote_role_type is None else
                               getattr(c.remote_role_type, "value", c.remote_role_type))
        out.append(ci)
    return out


class LLMDataDist:
    """LLMDataDist(role, cluster_id); init(options) before use."""

    def __init__(self, role, cluster_id):
        _role(role)
        cluster_id = check_int("cluster_id", cluster_id, 0, 2**64 - 1)
        self._role = role
        self._cluster_id = cluster_id
        self._dd = None
        self._cache_manager = None
        self._kv_cache_manager = None
        self._rank_links = RankTableLinks(self)

    @property
    def cluster_id(self):
        return self._cluster_id

    @property
    def role(self):
        return self._role

    def init(self, options):
        """Creates and initializes the llmdd instance with the options
        (LLMConfig.generate_options())."""
        if self._dd is not None:
            return
        opts = _c_options(options)
        timeout = int(opts.get("llm.SyncKvCacheWaitTime", "1000") or 1000) \
            if str(opts.get("llm.SyncKvCacheWaitTime", "1000")).isdigit() else 1000
        with translate("[LLMDataDist.init]"):
            dd = llmdd.Instance(self._cluster_id, _role(self._role), opts)
        self._dd = dd
        self._cache_manager = CacheManager(self, dd, timeout)

    def finalize(self):
        if self._dd is None:
            return
        self._rank_links.close()
        dd, self._dd = self._dd, None
        self._cache_manager = None
        if self._kv_cache_manager is not None:
            self._kv_cache_manager._initialized = False
            self._kv_cache_manager = None
        dd.close()

    def _inited(self):
        raise_if_false(self._dd is not None, "LLMDataDist is not initialized",
                       LLMStatusCode.LLM_FAILED)
        return self._dd

    @property
    def cache_manager(self):
        self._inited()
        return self._cache_manager

    @property
    def kv_cache_manager(self):
        """The V1 cache API (KvCacheManager) on this instance's caches; the
        reference offers it only without enable_cache_manager, llmdd always."""
        self._inited()
        if self._kv_cache_manager is None:
            self._kv_cache_manager = KvCacheManager(self._cache_manager)
        return self._kv_cache_manager

    @staticmethod
    def _timeout(timeout):
        timeout = as_int("timeout", timeout)
        raise_if_false(0 < timeout <= 2**31 - 1, "Param timeout should be greater than 0.")
        return timeout

    def link_clusters(self, clusters, timeout=3000):
        """Returns (LLMStatusCode, [LLMStatusCode per cluster])."""
        dd = self._inited()
        timeout = self._timeout(timeout)
        cl = _clusters(clusters, True)
        with translate("[link_clusters]"):
            st, rets = dd.link_clusters_status(cl, timeout)
        self._cache_manager._forget_keys()
        return code_2_status(st), [code_2_status(r) for r in rets]

    def unlink_clusters(self, clusters, timeout=3000, force=False):
        dd = self._inited()
        timeout = self._timeout(timeout)
        if not isinstance(force, bool):
            raise TypeError("force must be a bool")
        cl = _clusters(clusters, False)     # a link is known by its id
        with translate("[unlink_clusters]"):
            st, rets = dd.unlink_clusters_status(cl, timeout, force)
        self._cache_manager._forget_keys()
        return code_2_status(st), [code_2_status(r) for r in rets]

    def switch_role(self, role, switch_options=None):
        dd = self._inited()
        r = _role(role)
        with translate("[switch_role]"):
            dd.set_role(r, _c_options(switch_options))
        self._role = role

    # The rank-table API (rank_table.py; docs/python.md).
    def link(self, comm_name, cluster_rank_info, rank_table):
        """Links this rank to the other ranks of cluster_rank_info, at the
        addresses of rank_table; returns a comm id at once. Poll
        query_register_mem_status(comm_id) until it is OK."""
        dd = self._inited()
        with translate("[link]"):
            comm_id = self._rank_links.link(dd, comm_name, cluster_rank_info, rank_table)
        self._cache_manager._forget_keys()
        return comm_id

    def query_register_mem_status(self, comm_id):
        """RegisterMemStatus.OK once every link of comm_id is made,
        PREPARING before, FAILED past HCCL_CONNECT_TIMEOUT."""
        self._inited()
        return self._rank_links.status(comm_id)

    def unlink(self, comm_id):
        """Ends the links link(...) made for comm_id, telling the peers."""
        dd = self._inited()
        with translate("[unlink]"):
            self._rank_links.unlink(dd, comm_id)
        self._cache_manager._forget_keys()

    def check_link_status(self, remote_cluster_id):
        """A round trip to the peer on the link's control connection within
        llm.SyncKvCacheWaitTime; raises LLMException (LLM_NOT_YET_LINK: no
        live link, LLM_TIMEOUT: no answer in time) otherwise."""
        dd = self._inited()
        remote_cluster_id = as_int("remote_cluster_id", remote_cluster_id)
        with translate("[check_link_status]"):
            dd.check_link(remote_cluster_id, self._cache_manager._sync_timeout_ms)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()
