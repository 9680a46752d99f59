"""What the Python binding adds to a pull: Python against C, in one run.

    PYTHONPATH=python /usr/bin/python3 tests/python/bench_overhead.py \
        [--transport tcp] [--iters 20000] [--rounds 3] [--large-size 256M] \
        [--loop uvloop]

One prompt process allocates two caches: 1024 slots of 4 KiB (one tensor)
and one slot of --large-size. Then, --rounds times, alternately:
- C (build/tests/python/bench_calls, a decoder of its own): 4 KiB slot
  pulls as llmdd_pull_kv_cache (sync), as llmdd_pull_kv_cache_async +
  llmdd_request_wait + llmdd_request_free (posted), and as a post with
  LLMDD_XFER_COMPLETION waited for by poll() on llmdd_completion_fd and
  llmdd_get_completions (posted_fd); then the large slot, synchronous,
  into malloc'd memory it registered;
- Python (this process, a decoder): the same 4 KiB pulls as
  dd.pull_cache (sync), pull_cache_async + wait() + close() (posted) and
  pull_cache_async + `await` + close() in asyncio (await); then the large
  slot with dd.pull_cache into a registered numpy array.
Every call names its CacheIndex afresh, as an engine would. Prints each
round's p50 per call (us) and large-pull GB/s with the ratios Python / C,
then the event loop's own cost without llmdd (a byte echoed by a child
process, waited for by a blocking recv and by an awaited future settled
from loop.add_reader: what an `await` adds on that loop), then the medians
over rounds. --loop uvloop runs the awaits on uvloop (Debian's
python3-uvloop, which llmdd does not need) instead of CPython's default.
"""

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))
import numpy as np  # noqa: E402
import llmdd  # noqa: E402

SLOTS = 1024


def _size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def prompt(port, block, large, transport):
    with llmdd.Instance(1, llmdd.Role.PROMPT, options={
            "llm.ListenIpInfo": f"127.0.0.1:{port}", "llm.Transport": transport}) as dd:
        s = dd.allocate_cache(llmdd.CacheDesc(1, (SLOTS, block)))
        lg = dd.allocate_cache(llmdd.CacheDesc(1, (1, large)))
        print(s.cache_id, lg.cache_id, flush=True)
        sys.stdin.read()


def p50(xs):
    return sorted(xs)[len(xs) // 2] / 1000


def py_round(dd, cid, lid, small, large, iters, liters):
    def run(fn):
        for i in range(iters // 10):
            fn(i % SLOTS)
        out = []
        for i in range(iters):
            t = time.perf_counter_ns()
            fn(i % SLOTS)
            out.append(time.perf_counter_ns() - t)
        return p50(out)

    def sync(b):
        dd.pull_cache(llmdd.CacheIndex(1, cid, b), small, b)

    def posted(b):
        r = dd.pull_cache_async(llmdd.CacheIndex(1, cid, b), small, b)
        r.wait()
        r.close()

    async def aloop():
        out = []
        for i in range(-(iters // 10), iters):
            b = i % SLOTS
            t = time.perf_counter_ns()
            r = dd.pull_cache_async(llmdd.CacheIndex(1, cid, b), small, b)
            await r
            r.close()
            if i >= 0:
                out.append(time.perf_counter_ns() - t)
        return p50(out)

    res = {"sync": run(sync), "posted": run(posted), "await": asyncio.run(aloop())}
    src = llmdd.CacheIndex(1, lid, 0)
    dd.pull_cache(src, large)
    ts = []
    for _ in range(liters):
        t = time.perf_counter_ns()
        dd.pull_cache(src, large)
        ts.append(time.perf_counter_ns() - t)
    res["large"] = large.desc.tensor_size / statistics.median(ts)
    return res


def asyncio_floor(iters):
    """What asyncio's own loop adds to one awaited round trip, without
    llmdd: a byte to a child process that echoes it, p50 us, waited for by
    a blocking recv and by a future settled from loop.add_reader."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        while b.recv(1):
            b.send(b"x")
        os._exit(0)
    b.close()

    def blocking():
        out = []
        for _ in range(iters):
            t = time.perf_counter_ns()
            a.send(b"x")
            a.recv(1)
            out.append(time.perf_counter_ns() - t)
        return p50(out)

    async def awaited():
        loop = asyncio.get_running_loop()
        box = [None]

        def readable():
            a.recv(1)
            if box[0] is not None and not box[0].done():
                box[0].set_result(None)
        loop.add_reader(a.fileno(), readable)
        out = []
        for _ in range(iters):
            t = time.perf_counter_ns()
            box[0] = loop.create_future()
            a.send(b"x")
            await box[0]
            out.append(time.perf_counter_ns() - t)
        loop.remove_reader(a.fileno())
        return p50(out)
    try:
        return blocking(), asyncio.run(awaited())
    finally:
        a.close()
        os.waitpid(pid, 0)


def c_round(a, port, cid, lid):
    out = subprocess.run(
        [a.c_bench, str(port), a.transport, str(cid), str(SLOTS), str(a.block_size),
         str(a.iters), str(lid), str(a.large_size), str(a.large_iters)],
        check=True, stdout=subprocess.PIPE, text=True).stdout
    res = {}
    for line in out.splitlines():
        name, v, _ = line.split()
        res[name] = float(v)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--block-size", type=_size, default=4096)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--large-size", type=_size, default=256 << 20)
    ap.add_argument("--large-iters", type=int, default=8)
    ap.add_argument("--c-bench", default=os.path.join(REPO, "build", "tests", "python",
                                                      "bench_calls"))
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                    help="the event loop of the await rows and the floor (uvloop: "
                         "Debian's python3-uvloop, not a dependency of llmdd)")
    ap.add_argument("--prompt", type=int)
    a = ap.parse_args()
    if a.prompt:
        return prompt(a.prompt, a.block_size, a.large_size, a.transport)
    if a.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            ap.error("--loop uvloop: install Debian's python3-uvloop")
        uvloop.install()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, __file__, "--prompt", str(port), "--block-size",
                          str(a.block_size), "--large-size", str(a.large_size),
                          "--transport", a.transport],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        cid, lid = map(int, p.stdout.readline().split())
        with llmdd.Instance(2, llmdd.Role.DECODER,
                            options={"llm.Transport": a.transport,
                                     "llm.SyncKvCacheWaitTime": "30000"}) as dd:
            dd.link(1, f"127.0.0.1:{port}")
            sa = np.ones((SLOTS, a.block_size), np.uint8)
            la = np.ones((1, a.large_size), np.uint8)
            with dd.register_cache([sa]) as small, dd.register_cache([la]) as large:
                for _ in range(a.rounds):
                    c = c_round(a, port, cid, lid)
                    py = py_round(dd, cid, lid, small, large, a.iters, a.large_iters)
                    rows.append((c, py))
    finally:
        p.stdin.close()
        p.wait()
    print(f"transport={a.transport}, {a.block_size}-byte slot pulls x {a.iters}, "
          f"{a.large_size >> 20} MiB pulls x {a.large_iters}; p50 us per call")
    print("round | C sync | Py sync  ratio  +us | C posted | Py posted ratio | "
          "C posted_fd | Py await ratio | C GB/s | Py GB/s ratio")
    keys = ("sync", "posted", "await", "large")
    ratios = {k: [] for k in keys}
    for i, (c, py) in enumerate(rows):
        r = {"sync": py["sync"] / c["sync"], "posted": py["posted"] / c["posted"],
             "await": py["await"] / c["posted"], "large": py["large"] / c["large"]}
        for k in keys:
            ratios[k].append(r[k])
        print(f"{i + 1:5} | {c['sync']:6.1f} | {py['sync']:7.1f} {r['sync']:5.2f} "
              f"{py['sync'] - c['sync']:+5.1f} | {c['posted']:8.1f} | {py['posted']:9.1f} "
              f"{r['posted']:5.2f} | {c['posted_fd']:11.1f} | {py['await']:8.1f} "
              f"{r['await']:5.2f} | {c['large']:6.2f} | {py['large']:7.2f} {r['large']:5.2f}")
    blk, aw = asyncio_floor(min(a.iters, 10000))
    print(f"{a.loop}'s own cost, without llmdd (a byte echoed by a child process, p50): "
          f"blocking recv {blk:.1f} us, awaited through loop.add_reader {aw:.1f} us "
          f"(+{aw - blk:.1f} us)")
    med = lambda k: statistics.median(ratios[k])  # noqa: E731
    print(f"median ratios: sync {med('sync'):.2f} (+{statistics.median(py['sync'] - c['sync'] for c, py in rows):.1f} us), "
          f"posted {med('posted'):.2f}, await/C posted {med('await'):.2f}, "
          f"large {med('large'):.2f}")


if __name__ == "__main__":
    main()
