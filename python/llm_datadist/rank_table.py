"""The V1 rank-table API (LLMDataDist.link / query_register_mem_status /
unlink) over llmdd links.

The reference builds an HCCL communication domain from a rank table; here
each rank of the table is an llmdd instance and a domain is the set of
links between this rank and every other rank named in cluster_rank_info.
docs/python.md has the rules; in short:

- A rank's address is its server's "host_ip", or its device's "device_ip"
  when the server has none. A rank table has no ports: rank r listens on
  port LLMDD_RANK_BASE_PORT + r (60000 + r by default), so that ranks on
  one host (all at one address, as in a test) do not collide.
- link() starts listening there when the instance does not already, then
  returns the comm id at once; one thread per domain links to every other
  rank and retries while the peer is not there yet. Both sides link to each
  other, so whichever calls first, the calls cross and end with one link
  (docs/model.md, crossed links).
- query_register_mem_status() says PREPARING until every link of the domain
  is made (OK), or FAILED once HCCL_CONNECT_TIMEOUT seconds (the
  reference's knob, 120 by default) have passed without it.
- Each refused attempt is the library's info line; only giving up is an
  error, logged once on the "llm_datadist" logger with each peer's last
  status (docs/operations.md, Logs).
"""

import json
import logging
import os
import threading
import time

import llmdd

from .llm_types import RegisterMemStatus
from .status import LLMException, LLMStatusCode, raise_if_false, as_int

_BASE_PORT_ENV = "LLMDD_RANK_BASE_PORT"
_BASE_PORT_DEFAULT = 60000
_TIMEOUT_ENV = "HCCL_CONNECT_TIMEOUT"
_TIMEOUT_DEFAULT_S = 120
_ATTEMPT_MS = 1000            # one link_clusters call; finalize waits at most this
_RETRY_FIRST_S, _RETRY_MAX_S = 0.01, 0.5   # each refused attempt logs at info
_LINKED = (int(llmdd.Status.LLM_SUCCESS), int(llmdd.Status.LLM_ALREADY_LINK))

_log = logging.getLogger("llm_datadist")


def _int_field(v, what):
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise LLMException(f"rank table: {what} must be an int or a string of digits",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    try:
        return int(v)
    except ValueError:
        raise LLMException(f"rank table: {what} {v!r} is not a number",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None


def parse_rank_table(rank_table):
    """rank_id -> address, from the table's JSON text."""
    if not isinstance(rank_table, str):
        raise TypeError("rank_table must be a str (JSON)")
    try:
        table = json.loads(rank_table)
    except ValueError as e:
        raise LLMException(f"rank table is not JSON: {e}",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    servers = table.get("server_list") if isinstance(table, dict) else None
    raise_if_false(isinstance(servers, list) and servers, "rank table: no server_list")
    ranks = {}
    for server in servers:
        raise_if_false(isinstance(server, dict), "rank table: a server is not an object")
        devices = server.get("device", [])
        raise_if_false(isinstance(devices, list), "rank table: device must be a list")
        host = server.get("host_ip")
        for dev in devices:
            raise_if_false(isinstance(dev, dict) and "rank_id" in dev,
                           "rank table: a device has no rank_id")
            rank = _int_field(dev["rank_id"], "rank_id")
            addr = host if host else dev.get("device_ip")
            raise_if_false(isinstance(addr, str) and addr,
                           f"rank table: rank {rank} has no host_ip or device_ip")
            raise_if_false(rank not in ranks, f"rank table: rank {rank} appears twice")
            ranks[rank] = addr
    return ranks


def _listen_text(addr, port):
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


class _Domain:
    """One link() call: the links from this rank to the others."""

    def __init__(self, dd, comm_name, peers, timeout_s):
        self.dd = dd
        self.comm_name = comm_name
        self.peers = peers            # [(cluster_id, addr, port)]
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.status = RegisterMemStatus.PREPARING
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="llmdd-rank-link", daemon=True)

    def _run(self):
        todo = [(peer, None) for peer in self.peers]   # (peer, its last status)
        pause = _RETRY_FIRST_S
        gave_up = False
        while todo and not self.stop.is_set():
            left_ms = int((self.deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                gave_up = True
                break
            clusters = [llmdd.ClusterInfo(c, (a, p)) for (c, a, p), _ in todo]
            try:
                _, rets = self.dd.link_clusters_status(clusters, min(_ATTEMPT_MS, left_ms))
            except llmdd.LlmddError:
                break                  # the instance is gone (finalize)
            todo = [(peer, st) for (peer, _), st in zip(todo, rets) if st not in _LINKED]
            if todo:
                # The peer has not called link() yet, or is not listening yet.
                self.stop.wait(pause)
                pause = min(pause * 2, _RETRY_MAX_S)
        if gave_up:
            # Before the status says so: a caller that sees FAILED finds it.
            _log.error("link(%r): not linked within HCCL_CONNECT_TIMEOUT (%d s): %s",
                       self.comm_name, self.timeout_s, "; ".join(
                           f"cluster {c} at {_listen_text(a, p)}: {_status_name(st)}"
                           for (c, a, p), st in todo))
        self.status = RegisterMemStatus.OK if not todo else RegisterMemStatus.FAILED


class RankTableLinks:
    """The domains of one LLMDataDist."""

    def __init__(self, datadist):
        self._datadist = datadist
        self._domains = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def link(self, dd, comm_name, cluster_rank_info, rank_table):
        if not isinstance(comm_name, str) or not comm_name:
            raise TypeError("comm_name must be a non-empty str")
        if not isinstance(cluster_rank_info, dict):
            raise TypeError("cluster_rank_info must be a dict of int to int")
        cluster_rank_info = {as_int("cluster_rank_info key", k):
                             as_int("cluster_rank_info value", v)
                             for k, v in cluster_rank_info.items()}
        me = self._datadist.cluster_id
        raise_if_false(me in cluster_rank_info,
                       f"cluster_rank_info has no rank for this cluster ({me})")
        raise_if_false(len(cluster_rank_info) >= 2, "cluster_rank_info needs two clusters")
        raise_if_false(len(set(cluster_rank_info.values())) == len(cluster_rank_info),
                       "cluster_rank_info gives one rank to two clusters")
        ranks = parse_rank_table(rank_table)
        base = _int_field(os.environ.get(_BASE_PORT_ENV, _BASE_PORT_DEFAULT), _BASE_PORT_ENV)
        for cluster, rank in cluster_rank_info.items():
            raise_if_false(rank in ranks, f"rank {rank} (cluster {cluster}) is not in the "
                           "rank table")
            raise_if_false(0 < base + rank <= 65535,
                           f"rank {rank}: port {base + rank} is out of range")
        timeout_s = _int_field(os.environ.get(_TIMEOUT_ENV, _TIMEOUT_DEFAULT_S), _TIMEOUT_ENV)
        my_rank = cluster_rank_info[me]
        self._listen(dd, ranks[my_rank], base + my_rank)
        peers = [(c, ranks[r], base + r) for c, r in sorted(cluster_rank_info.items())
                 if c != me]
        domain = _Domain(dd, comm_name, peers, max(timeout_s, 1))
        with self._lock:
            comm_id = self._next_id
            self._next_id += 1
            self._domains[comm_id] = domain
        domain.thread.start()
        return comm_id

    def _listen(self, dd, addr, port):
        """Listens at this rank's address unless the instance does already."""
        want = _listen_text(addr, port)
        try:
            have = dd.listen_address()
        except llmdd.LlmddError:
            have = None
        if have == want:
            return
        raise_if_false(have is None, f"this instance listens at {have}; the rank table "
                       f"puts its rank at {want}")
        try:
            dd.set_role(dd.role, {"llm.ListenIpInfo": want})
        except llmdd.LlmddError as e:
            # LLM_EXIST_LINK: listening starts only while no link is alive.
            raise LLMException(f"link: cannot listen at {want}: {e}",
                               status_code=_status(e.status)) from e

    def _domain(self, comm_id):
        comm_id = as_int("comm_id", comm_id)
        with self._lock:
            d = self._domains.get(comm_id)
        raise_if_false(d is not None, f"comm_id {comm_id} is not a link of this LLMDataDist")
        return d

    def status(self, comm_id):
        return self._domain(comm_id).status

    def unlink(self, dd, comm_id):
        d = self._domain(comm_id)
        d.stop.set()
        d.thread.join()
        with self._lock:
            self._domains.pop(comm_id, None)
        clusters = [llmdd.ClusterInfo(c) for c, _, _ in d.peers]
        st, rets = dd.unlink_clusters_status(clusters, 3000)
        if st != 0:
            raise LLMException(f"unlink({comm_id}) failed: {[_status(r) for r in rets]}",
                               status_code=_status(st))

    def close(self):
        with self._lock:
            domains, self._domains = list(self._domains.values()), {}
        for d in domains:
            d.stop.set()
        for d in domains:
            d.thread.join()


def _status_name(code):
    if code is None:
        return "not tried"
    try:
        return llmdd.Status(int(code)).name
    except ValueError:
        return f"status {int(code):#x}"


def _status(code):
    try:
        return LLMStatusCode(int(code))
    except ValueError:
        return LLMStatusCode.LLM_FAILED
