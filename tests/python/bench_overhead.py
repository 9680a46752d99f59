"""What the Python binding adds to an async pull of 64 blocks.

    PYTHONPATH=python /usr/bin/python3 tests/python/bench_overhead.py [--transport shm]
        [--block-size 4096] [--iters 20000]

Against one prompt process (one tensor, a 64 MiB cache of --block-size
blocks), the same async pull of 64 scattered blocks, alternately from C
(build/tests/python/bench_async: llmdd_pull_kv_blocks_async +
llmdd_request_wait + llmdd_request_free) and from Python
(pull_blocks_async + wait + close, and the same with `await`); prints p50
and p99 per call and the ratio Python / C.
"""

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))
import llmdd  # noqa: E402

TOTAL = 64 << 20


def prompt(port, block, transport):
    with llmdd.Instance(1, llmdd.Role.PROMPT, options={
            "llm.ListenIpInfo": f"127.0.0.1:{port}", "llm.Transport": transport}) as dd:
        c = dd.allocate_cache(llmdd.CacheDesc(1, (TOTAL // block, block)))
        print(c.cache_id, flush=True)
        sys.stdin.read()


def py_bench(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, __file__, "--prompt", str(port), "--block-size",
                          str(args.block_size), "--transport", args.transport],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        cid = int(p.stdout.readline())
        nslots = TOTAL // args.block_size
        with llmdd.Instance(2, llmdd.Role.DECODER,
                            options={"llm.Transport": args.transport}) as dd:
            dd.link(1, f"127.0.0.1:{port}")
            dst = dd.allocate_cache(llmdd.CacheDesc(1, (nslots, args.block_size)))
            rnd = random.Random(1)
            import ctypes
            sb = (ctypes.c_uint64 * 64)(*rnd.sample(range(nslots), 64))
            db = (ctypes.c_uint64 * 64)(*rnd.sample(range(nslots), 64))
            src = llmdd.CacheIndex(1, cid, 0)

            def once():
                r = dd.pull_blocks_async(src, dst, sb, db, tensor_num_per_layer=1)
                r.wait()
                r.close()
            for _ in range(2000):
                once()
            sync = []
            for _ in range(args.iters):
                t = time.perf_counter_ns()
                once()
                sync.append(time.perf_counter_ns() - t)

            async def aloop():
                out = []
                for _ in range(args.iters // 4):
                    t = time.perf_counter_ns()
                    r = dd.pull_blocks_async(src, dst, sb, db, tensor_num_per_layer=1)
                    await r
                    r.close()
                    out.append(time.perf_counter_ns() - t)
                return out
            aw = asyncio.run(aloop())
            cres = subprocess.run(
                [args.c_bench, str(port), str(cid), str(nslots), str(args.block_size),
                 args.transport, str(args.iters), ",".join(map(str, sb)),
                 ",".join(map(str, db))], check=True, capture_output=True, text=True)
            c50, c99 = map(float, cres.stdout.split())
    finally:
        p.stdin.close()
        p.wait()
    q = lambda xs, f: sorted(xs)[int(len(xs) * f)] / 1000  # noqa: E731
    return {"c_p50_us": c50, "c_p99_us": c99, "wait_p50_us": q(sync, 0.5), "wait_p99_us": q(sync, 0.99),
            "await_p50_us": q(aw, 0.5), "await_p99_us": q(aw, 0.99),
            "mean_wait_us": statistics.mean(sync) / 1000}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--block-size", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--c-bench", default=os.path.join(REPO, "build", "tests", "python",
                                                      "bench_async"))
    ap.add_argument("--prompt", type=int)
    a = ap.parse_args()
    if a.prompt:
        return prompt(a.prompt, a.block_size, a.transport)
    py = py_bench(a)
    c50 = py["c_p50_us"]
    print(f"transport={a.transport} block={a.block_size} B x 64 blocks, {a.iters} calls")
    print(f"  C  async post+wait+free      p50 {c50:9.1f} us  p99 {py['c_p99_us']:9.1f} us")
    print(f"  Py pull_blocks_async+wait    p50 {py['wait_p50_us']:9.1f} us  "
          f"p99 {py['wait_p99_us']:9.1f} us  ratio {py['wait_p50_us'] / c50:.2f}")
    print(f"  Py pull_blocks_async+await   p50 {py['await_p50_us']:9.1f} us  "
          f"p99 {py['await_p99_us']:9.1f} us  ratio {py['await_p50_us'] / c50:.2f}")


if __name__ == "__main__":
    main()
