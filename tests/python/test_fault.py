"""The interpreter survives a peer's death mid-transfer: SIGKILL the prompt
while requests are in flight; every request ends with a status, no hang."""

import os
import signal
import time

import pytest

import llmdd
from conftest import Peer


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_peer_killed_mid_transfer(transport):
    peer = Peer(transport=transport, big=8)       # 2 tensors x 8 MiB
    try:
        with llmdd.Instance(2, llmdd.Role.DECODER, options={
                "llm.SyncKvCacheWaitTime": "3000", "llm.Transport": transport}) as dd:
            dd.link(1, peer.addr)
            n = 8 << 20
            bufs = [bytearray(n) for _ in range(2)]
            with dd.register_cache(bufs, llmdd.CacheDesc(2, (64, n // 64))) as c:
                src = (1, peer.ids["BIG"], 0)
                dd.pull_blocks(src, c, [0], [0])       # the cache is known: posts need no answer
                # Stopped first, so that every request is surely in flight
                # when the peer dies (no sleep to guess at it).
                if transport == "tcp":
                    os.kill(peer.proc.pid, signal.SIGSTOP)
                reqs = [dd.pull_blocks_async(src, c, list(range(64)), list(range(64)))
                        for _ in range(24)]
                peer.proc.kill()
                t0 = time.monotonic()
                statuses = []
                for r in reqs:
                    try:
                        r.wait(10000)
                        statuses.append(0)
                    except llmdd.RequestTimeout:
                        pytest.fail("a request still in flight 10 s after the peer died")
                    except llmdd.LlmddError as e:
                        statuses.append(e.status)
                    r.close()
                assert time.monotonic() - t0 < 10
                print(transport, [llmdd.status_str(s) for s in statuses])
                # Each ended as a transfer to a dead peer may: whole (shm
                # copies what the peer shared), or with the link gone or
                # the wait time over; never anything else.
                ok = {0, int(llmdd.LLM_NOT_YET_LINK), int(llmdd.LLM_TIMEOUT)}
                assert set(statuses) <= ok, [llmdd.status_str(s) for s in statuses]
                if transport == "tcp":     # the peer served none of them
                    assert 0 not in statuses
                # a request posted now fails at once: the link is gone
                deadline = time.monotonic() + 5
                while True:
                    try:
                        dd.pull_blocks(src, c, [0], [0], timeout_ms=5000)
                    except llmdd.LlmddError as e:
                        if e.status == llmdd.LLM_NOT_YET_LINK:
                            break
                    assert time.monotonic() < deadline, "the dead link was not dropped"
                    time.sleep(0.05)
            # the instance stays usable: link again to a new peer
            peer2 = Peer(transport=transport, big=0)
            try:
                dd.link(1, peer2.addr)
                assert dd.lookup_remote_key(1, b"req-3").cache_id == peer2.ids["A"]
            finally:
                peer2.close()
    finally:
        peer.close()

