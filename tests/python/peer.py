"""The prompt side of the Python tests: a second, real process.

    peer.py --port P --cluster-id 1 [--mode llmdd|ref] [--transport T]

Sets up caches filled with pattern(), prints one line "READY <json>" and
then serves commands from stdin, one per line, answering one JSON line:
    dump <cache>      the cache's bytes, as a list of hex strings per tensor
    notifies          the notifications received so far
    notify <cid> <m>  sends notification m to cluster cid
    quit              exits
"""

import argparse
import json
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--cluster-id", type=int, default=1)
    ap.add_argument("--mode", default="llmdd")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--big", type=int, default=0, help="MiB per tensor of a 'big' cache")
    a = ap.parse_args()
    if a.mode == "ref":
        return ref(a)
    import llmdd
    opts = {"llm.ListenIpInfo": f"127.0.0.1:{a.port}", "llm.Transport": a.transport,
            "llm.SyncKvCacheWaitTime": "5000"}
    with llmdd.Instance(a.cluster_id, llmdd.Role.MIX, options=opts) as dd:
        caches = {}
        # A: numpy, 4 tensors x 8 slots x 256 bytes, with a key on slot 3.
        arrs = [common.pattern(i, (8, 256), np.uint8) for i in range(4)]
        caches["A"] = (dd.register_cache(arrs), arrs)
        dd.set_cache_key(caches["A"][0], 3, b"req-3")
        # B: torch blocks cache, 4 tensors x 16 blocks x 64 float16.
        import torch
        ts = [torch.from_numpy(common.pattern(10 + i, (16, 64), np.float16)) for i in range(4)]
        caches["B"] = (dd.register_cache(ts), ts)
        # C: an allocated, zeroed push target, same shape as A.
        c = dd.allocate_cache(llmdd.CacheDesc(4, (8, 256), llmdd.DataType.UINT8))
        caches["C"] = (c, None)
        dd.set_cache_key(c, 0, b"push-target")
        if a.big:
            n = a.big << 20
            big = [bytearray(n) for _ in range(2)]
            caches["BIG"] = (dd.register_cache(big, llmdd.CacheDesc(2, (64, n // 64))), big)
        ids = {k: v[0].cache_id for k, v in caches.items()}
        print("READY " + json.dumps(ids), flush=True)
        serve(dd, caches)


def serve(dd, caches):
    import ctypes
    got = []
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] == "dump":
            c = caches[cmd[1]][0]
            ts = c.desc.tensor_size
            out = [ctypes.string_at(addr, ts).hex() for addr in c.tensor_addrs]
        elif cmd[0] == "notifies":
            got += dd.get_notifies()
            out = [[cid, m.decode()] for cid, m in got]
        elif cmd[0] == "notify":
            dd.send_notify(int(cmd[1]), cmd[2].encode())
            out = "ok"
        else:
            out = "?"
        print(json.dumps(out), flush=True)


def ref(a):
    """The reference API's prompt: a blocks cache under BlocksCacheKey and a
    cache whose slots are named by CacheKeys."""
    import torch
    from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType,
                              BlocksCacheKey, CacheKey)
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{a.port}"
    cfg.device_id = 0
    cfg.sync_kv_timeout = 5000
    cfg.enable_cache_manager = True
    cfg.transport = a.transport
    dd = LLMDataDist(LLMRole.PROMPT, a.cluster_id)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    bts = [torch.from_numpy(common.pattern(20 + i, (16, 32), np.float16)) for i in range(4)]
    blocks = cm.register_blocks_cache(CacheDesc(4, [16, 32], DataType.DT_FLOAT16),
                                      [t.data_ptr() for t in bts], BlocksCacheKey(a.cluster_id))
    kts = [torch.from_numpy(common.pattern(30 + i, (4, 64), np.int32)) for i in range(4)]
    keyed = cm.register_cache(CacheDesc(4, [4, 64], DataType.DT_INT32),
                              [t.data_ptr() for t in kts],
                              [CacheKey(a.cluster_id, req_id=100 + b) for b in range(4)])
    # push targets: a slot cache and a blocks cache (BlocksCacheKey model 1)
    pts = [torch.zeros(4, 64, dtype=torch.int32) for _ in range(4)]
    pslot = cm.register_cache(CacheDesc(4, [4, 64], DataType.DT_INT32), [t.data_ptr() for t in pts])
    pbt = [torch.zeros(16, 32, dtype=torch.float16) for _ in range(4)]
    pblk = cm.register_blocks_cache(CacheDesc(4, [16, 32], DataType.DT_FLOAT16),
                                    [t.data_ptr() for t in pbt], BlocksCacheKey(a.cluster_id, 1))
    caches = {"blocks": (blocks._handle, bts), "keyed": (keyed._handle, kts),
              "pslot": (pslot._handle, pts), "pblk": (pblk._handle, pbt)}
    print("READY " + json.dumps({k: v[0].cache_id for k, v in caches.items()}), flush=True)
    serve(dd._dd, caches)
    dd.finalize()


if __name__ == "__main__":
    main()
