"""The binding on the library's own paths: synchronous calls are the C
library's synchronous calls (GIL released, bounded by the wait time, so
Ctrl-C ends them within it, and close() waits for them), and asyncio waits
on the instance's completion fd, with no thread of the binding's own."""

import asyncio
import glob
import os
import platform
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import llmdd
from common import pattern
from conftest import HERE, Peer

WAIT_MS = 1000


def threads():
    return len(os.listdir("/proc/self/task"))


# poll(2), where the library waits for a socket (x86-64: poll; arm64 has
# only ppoll).
POLL_NR = {"x86_64": "7", "aarch64": "73"}[platform.machine()]


def in_poll(pid, tid=None):
    """Whether the thread (the main one by default) waits in poll(2): not
    for the GIL (a futex), not running Python."""
    with open(f"/proc/{pid}/task/{tid or pid}/syscall") as f:
        return f.read().split()[0] == POLL_NR


def stopped(pid):
    """Whether every thread of pid has stopped (SIGSTOP is delivered to
    each thread on its way back to user space, after kill() returned)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "T":
                    return False
        except FileNotFoundError:   # a thread that ended meanwhile
            pass
    return True


def until(cond, what, timeout=10):
    """Waits for a condition another process or thread brings about."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.001)


@pytest.fixture
def stoppable():
    """A peer of this test's own, which the test may SIGSTOP for about the
    wait time; the instances that link to it allow 100 missed heartbeats,
    so the link stays however slow the machine is."""
    p = Peer(transport="tcp")
    yield p
    os.kill(p.proc.pid, signal.SIGCONT)
    p.close()


def test_speedups_loaded_and_bounded():
    """The build's llmdd._speedups is what the package calls (unless
    LLMDD_PY_SPEEDUPS=0, as llmdd.python.pytest_ctypes runs this suite),
    and it refuses what it cannot take with an exception, not a crash."""
    lib = os.environ.get("LLMDD_LIBRARY")
    built = bool(lib) and bool(glob.glob(os.path.join(os.path.dirname(lib), "python",
                                                      "_speedups*.so")))
    fast = llmdd._ffi.speedups
    if os.environ.get("LLMDD_PY_SPEEDUPS") == "0" or not built:
        assert fast is None
        return
    assert fast is not None
    with pytest.raises(TypeError):
        fast.pull_cache(0, 1)                          # too few arguments
    with pytest.raises(TypeError):
        fast.wait("request", 0)
    with pytest.raises(OverflowError):
        fast.wait(0, 1 << 40)                          # not an int32 timeout
    with pytest.raises(OverflowError):
        fast.pull_cache(0, -1, 0, 0, 0, 0, -1, 0)      # cluster id below 0
    with pytest.raises(OverflowError):
        fast.pull_cache(0, 1, 0, 1 << 32, 0, 0, -1, 0)  # batch past uint32
    # NULL instance and request: the library's own refusal.
    assert fast.pull_cache(0, 1, 0, 0, 0, 0, -1, 0) == llmdd.Status.LLM_PARAM_INVALID
    assert fast.wait(0, 0) == llmdd.Status.LLM_PARAM_INVALID


def test_sync_calls_are_the_c_calls(peer):
    """A synchronous pull runs on the calling thread: no worker thread is
    started (a posted request starts them)."""
    with llmdd.Instance(31, llmdd.Role.DECODER) as dd:
        dd.link(peer.cluster_id, peer.addr)
        dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
        with dd.register_cache(dst) as c:
            before = threads()
            for b in range(8):
                dd.pull_cache((1, peer.ids["A"], b), c, b)
                dd.pull_blocks((1, peer.ids["A"]), c, [b], [7 - b])
            assert threads() == before
            assert (dst[2][0] == pattern(2, (8, 256), np.uint8)[7]).all()
            dd.pull_cache_async((1, peer.ids["A"], 0), c, 0).close()
            assert threads() > before


CHILD = r"""
import sys, threading, time
sys.path.insert(0, sys.argv[1])
import llmdd
addr, cid = sys.argv[2], int(sys.argv[3])
with llmdd.Instance(41, llmdd.Role.DECODER, options={
        "llm.SyncKvCacheWaitTime": "%d", "llm.Transport": "tcp",
        "llm.HeartbeatMisses": "100"}) as dd:
    dd.link(1, addr)
    c = dd.allocate_cache(llmdd.CacheDesc(4, (8, 256)))
    dd.pull_cache((1, cid, 0), c, 0)        # the remote cache is known now
    count = [0]
    def spin():
        while True:
            count[0] += 1
    threading.Thread(target=spin, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()                    # the peer is stopped now
    t0 = time.monotonic()
    n0 = count[0]
    print("calling", flush=True)
    try:
        dd.pull_cache((1, cid, 1), c, 1)
        print("returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted %%.3f %%d" %% (time.monotonic() - t0, count[0] - n0), flush=True)
""" % WAIT_MS


def test_ctrl_c_ends_a_sync_call_within_the_wait_time(stoppable):
    """SIGINT while the main thread is inside a synchronous pull from a
    stopped peer: KeyboardInterrupt once the call ends at the wait time;
    meanwhile another Python thread ran (the GIL was released)."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, os.path.join(HERE, "..", "..", "python"),
                          stoppable.addr, str(stoppable.ids["A"])],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        os.kill(stoppable.proc.pid, signal.SIGSTOP)
        until(lambda: stopped(stoppable.proc.pid), "the peer did not stop")
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline() == "calling\n"
        until(lambda: in_poll(p.pid), "the call did not block")
        t = time.monotonic()
        p.send_signal(signal.SIGINT)
        out = p.stdout.readline().split()
        waited = time.monotonic() - t
        assert out[0] == "interrupted", out
        took, spins = float(out[1]), int(out[2])
        assert WAIT_MS / 1000 * 0.9 <= took < WAIT_MS / 1000 + 2, took
        assert waited < WAIT_MS / 1000 + 2
        assert spins > 1000, spins
    finally:
        p.kill()
        p.wait()


def test_close_from_another_thread_waits_for_a_sync_call(stoppable):
    dd = llmdd.Instance(42, llmdd.Role.DECODER, options={
        "llm.SyncKvCacheWaitTime": str(WAIT_MS), "llm.Transport": "tcp",
        "llm.HeartbeatMisses": "100"})
    dd.link(1, stoppable.addr)
    c = dd.allocate_cache(llmdd.CacheDesc(4, (8, 256)))
    dd.pull_cache((1, stoppable.ids["A"], 0), c, 0)
    res, tid = [], []

    def call():
        tid.append(threading.get_native_id())
        try:
            dd.pull_cache((1, stoppable.ids["A"], 1), c, 1)
            res.append(0)
        except llmdd.LlmddError as e:
            res.append(e.status)
    os.kill(stoppable.proc.pid, signal.SIGSTOP)
    until(lambda: stopped(stoppable.proc.pid), "the peer did not stop")
    th = threading.Thread(target=call)
    th.start()
    until(lambda: tid and in_poll(os.getpid(), tid[0]), "the call did not block")
    t = time.monotonic()
    dd.close()
    took = time.monotonic() - t
    th.join(10)
    assert res == [llmdd.LLM_TIMEOUT]
    assert took >= WAIT_MS / 1000 * 0.8, took    # it waited for the call
    with pytest.raises(llmdd.LlmddError):
        dd.check_link(1)


def test_asyncio_reads_the_completion_fd(peer):
    """Awaited requests complete through llmdd_completion_fd on the loop:
    no Python thread of the binding's; many at once; on two loops in two threads;
    a request closed while awaited wakes its task; finalize wakes the
    rest with LLM_FAILED."""
    with llmdd.Instance(32, llmdd.Role.DECODER) as dd:
        dd.link(peer.cluster_id, peer.addr)
        dst = [np.zeros((8, 256), np.uint8) for _ in range(4)]
        c = dd.register_cache(dst)
        dd.pull_cache_async((1, peer.ids["A"], 0), c, 0).close()   # workers started
        names = {t.name for t in threading.enumerate()}   # Python's threads
        extra = set()

        async def many():
            # One surely in flight when awaited: a layer-wise push whose
            # layers are marked later, from the loop.
            lw = dd.push_cache_async(c, (1, peer.ids["C"], 0), layerwise=True)
            asyncio.get_running_loop().call_later(
                0.02, lambda: [lw.layer_ready(layer) for layer in range(2)])
            reqs = [lw] + [dd.pull_cache_async((1, peer.ids["A"], b), c, b) for b in range(8)]
            reqs += [dd.pull_blocks_async((1, peer.ids["A"]), c, [b], [b]) for b in range(8)]
            assert await asyncio.gather(*reqs) == [None] * 17
            assert {t.name for t in threading.enumerate()} <= names | extra
            fd = dd._cq._loops[asyncio.get_running_loop()]
            assert fd == llmdd._lib.llmdd_completion_fd(dd._dd)
            for r in reqs:
                r.close()
        asyncio.run(many())
        assert (dst[1] == pattern(1, (8, 256), np.uint8)).all()

        errs = []

        def other_loop():
            try:
                asyncio.run(many())
            except Exception as e:     # reported below
                errs.append(e)
        ts = [threading.Thread(target=other_loop) for _ in range(2)]
        extra = {t.name for t in ts}
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        assert errs == []

        async def closed_while_awaited():
            r = dd.push_cache_async(c, (1, peer.ids["C"], 0), layerwise=True)
            asyncio.get_running_loop().call_later(0.01, r.close)
            with pytest.raises(ValueError):
                await asyncio.wait_for(r, 5)
        asyncio.run(closed_while_awaited())

        async def finalized_while_awaited():
            r = dd.push_cache_async(c, (1, peer.ids["C"], 0), layerwise=True)
            asyncio.get_running_loop().call_later(0.01, dd.finalize)
            with pytest.raises(llmdd.LlmddError) as e:
                await asyncio.wait_for(r, 5)
            assert e.value.status == llmdd.LLM_FAILED
            r.close()
        asyncio.run(finalized_while_awaited())
