#!/usr/bin/python3
"""Disaggregated prefill/decode of a small transformer with llmdd (CPU, torch).

    /usr/bin/python3 examples/disagg/generate.py            # both sides on this host
    /usr/bin/python3 examples/disagg/generate.py --transport tcp
    /usr/bin/python3 examples/disagg/generate.py --small    # the CI configuration

Where layer streaming pays: the transfer a real share of the prefill. --long has 8
layers and prompts of 256 to 2000 tokens; --link-gbps G runs both sides (over tcp) in a
network namespace whose loopback caps every TCP flow at G Gbit/s, as clouds cap one flow
(scripts/flowcap.sh; needs root):

    /usr/bin/python3 examples/disagg/generate.py --long --link-gbps 1 --rounds 3

Heterogeneous: the prefill as N tensor-parallel processes, each holding its share of
the KV heads in a paged NHD cache of one block size; the decoder holds all heads in HND
blocks of another size and gathers every request's KV with one slice request from all
prefill ranks (llmdd.tp_plan; a rank with nothing to give is only notified):

    generate.py --prefill-tp 2 --prefill-block 16 --decode-block 32
    generate.py --prefill-tp 4 --small --transport tcp     # TP above the 2 KV heads

Two hosts (or two network namespaces): start the prefill first, then the decoder,
which links to the prefill's address and compares with its own one-process run:

    generate.py --role prefill --prefill-host 10.0.0.1:26000 --transport tcp
    generate.py --role decode  --prefill-host 10.0.0.1:26000 --decode-host 10.0.0.2 --transport tcp

The decoder allocates each request's blocks from its own shuffled free list, asks
the prefill (an llmdd notification) to prefill prompt i into those blocks; the
prefill computes the KV cache and pushes it with push_blocks_async (after the
prefill, or layer-streamed: layerwise=True and layer_ready(l) once layer l's
K/V are written), with a notification the decoder waits for. Exit 1 unless
the tokens are identical to the one-process run.
"""
import os
import sys

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")      # one thread per process: 2 processes, 2 cores
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True          # nothing written into the source tree
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import select  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import llmdd  # noqa: E402
from model import BLOCK, FULL, SMALL, Model, blocks_for, prompts  # noqa: E402

torch.set_num_threads(1)

LENGTHS = [17, 64, 129, 250, 383, 511, 777, 1000]
SMALL_LENGTHS = [17, 18, 31, 33, 64, 100, 160, 257]
LONG = dict(FULL, layers=8)       # --long: the KV a real share of the prefill
LONG_LENGTHS = [256, 512, 768, 1024, 1280, 1536, 1792, 2000]
GEN = 32
PREFILL_ID, DECODE_ID = 1, 2
MODES = ("after", "stream")
NAMES = {"one": "one process", "after": "disaggregated, push after prefill",
         "stream": "disaggregated, layer-streamed",
         "pull": "TP prefill, one slice pull"}


# ------------------------------------------------------------------ common

def send(dd, cluster, **msg):
    dd.send_notify(cluster, json.dumps(msg, separators=(",", ":")).encode())


def receive(dd, timeout_s):
    """Waits (on the notify fd) for notifications; [(cluster, dict)]."""
    got = dd.get_notifies()
    if not got:
        select.select([dd.notify_fd()], [], [], timeout_s)
        got = dd.get_notifies()
    return [(c, json.loads(m)) for c, m in got]


def blocks_print(cache, blocks):
    """An order-sensitive fingerprint of blocks (layer 0's K): block k's sum
    weighted by k + 1, in float64, the same ops on both sides. A rotation of
    whole blocks changes it even where attention cannot tell (every block
    full: the attention sums over keys in any order)."""
    idx = torch.as_tensor(blocks, dtype=torch.long)
    sums = cache[0][idx].double().sum(dim=(1, 2, 3))
    return float((sums * torch.arange(1, len(blocks) + 1, dtype=torch.float64)).sum())


def decode_rest(model, cache, ps, tables, first, gen):
    """Steps 2..gen, the whole batch at once, in prompt order."""
    out = [[first[i]] for i in range(len(ps))]
    for s in range(1, gen):
        cur = [o[-1] for o in out]
        pos = [len(p) - 1 + s for p in ps]
        for o, t in zip(out, model.decode_step(cur, pos, tables, cache)):
            o.append(t)
    return out


def one_process(cfg, lengths, gen):
    """Prefill and decode in this process; TTFT of request i = its first
    token's time after the batch arrived (requests prefilled in order)."""
    model = Model(cfg)
    ps = prompts(cfg, lengths)
    tables, nb = [], 0
    for p in ps:
        tables.append(list(range(nb, nb + blocks_for(len(p) + gen))))
        nb += len(tables[-1])
    cache = model.new_cache(nb)
    first, ttft = {}, {}
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        model.prefill(p[:-1], tables[i], cache)
        first[i] = model.decode_step([p[-1]], [len(p) - 1], [tables[i]], cache)[0]
        ttft[i] = time.perf_counter() - t0
    return {"tokens": decode_rest(model, cache, ps, tables, first, gen),
            "ttft": [ttft[i] for i in range(len(ps))]}


# ------------------------------------------------------------------ prefill

def prefill_role(a):
    opts = {"llm.ListenIpInfo": a.prefill_host, "llm.Transport": a.transport,
            "llm.SyncKvCacheWaitTime": "10000"}
    with llmdd.Instance(PREFILL_ID, llmdd.Role.PROMPT, options=opts) as dd:
        addr = dd.listen_address()
        if a.json:                           # the launcher waits for this line
            print(json.dumps({"listen": addr}), flush=True)
        else:
            print(f"prefill: listening on {addr} ({a.transport})", flush=True)
        model = cache = cache_t = ps = None
        free, inflight, dec, done = [], [], None, False
        while not done or inflight:
            for c, m in receive(dd, 0.005 if inflight else 1.0):
                if m["cmd"] == "hello":          # the decoder's configuration
                    dec = (c, m["cache"], 0)
                    model = Model(m["cfg"])
                    ps = prompts(m["cfg"], m["lengths"])
                    nb = sum(blocks_for(len(p)) for p in ps) + 8
                    if cache is not None:
                        cache.close()
                    cache_t = model.new_cache(nb)
                    cache = dd.register_cache(cache_t)
                    free = list(range(nb))       # in order: a request's blocks are contiguous
                    send(dd, c, cmd="ready")
                elif m["cmd"] == "prefill":
                    p = ps[m["rid"]][:-1]        # the decoder recomputes the last token
                    src = free[:blocks_for(len(p))]
                    del free[:len(src)]
                    assert len(src) == len(m["blocks"])
                    note = json.dumps({"cmd": "kv", "rid": m["rid"]}).encode()
                    dst, nl = m["blocks"], model.L
                    if m.get("brk") == "blocks":     # --break blocks: one block off
                        dst = dst[1:] + dst[:1]
                    elif m.get("brk") == "layer":    # --break layer: the last layer stays
                        nl -= 1
                    kw = dict(notify=note, src_layers=range(nl), dst_layers=range(nl))
                    if m["mode"] == "stream":
                        req = dd.push_blocks_async(cache, dec, src, dst, layerwise=True, **kw)
                        model.prefill(p, src, cache_t,
                                      on_layer=lambda l: l < nl and req.layer_ready(l))
                        tc = time.monotonic()
                    else:
                        model.prefill(p, src, cache_t)
                        tc = time.monotonic()
                        req = dd.push_blocks_async(cache, dec, src, dst, **kw)
                    inflight.append((m["rid"], req, src))
                    send(dd, c, cmd="computed", rid=m["rid"], t=tc,   # when compute ended
                         fp=blocks_print(cache_t, src))
                elif m["cmd"] == "quit":
                    done = True
            for item in list(inflight):
                rid, req, src = item
                if not req.done():
                    continue
                inflight.remove(item)
                try:
                    req.wait(0)
                except llmdd.LlmddError as e:
                    print(f"prefill: push of request {rid} failed: {e}", file=sys.stderr)
                    send(dd, dec[0], cmd="error", rid=rid, msg=str(e))
                req.close()
                free = sorted(free + src)
        if cache is not None:
            cache.close()
    return 0


# ------------------------------------------------------------------ decode

def decode_role(a, cfg, lengths, gen):
    model = Model(cfg)
    ps = prompts(cfg, lengths)
    nb = sum(blocks_for(len(p) + gen) for p in ps) * 2
    cache = model.new_cache(nb, fill=float("nan"))
    opts = {"llm.Transport": a.transport, "llm.SyncKvCacheWaitTime": "10000"}
    if a.decode_host:
        opts["llm.ListenIpInfo"] = a.decode_host if ":" in a.decode_host else a.decode_host + ":0"
    results = {m: [] for m in MODES}
    rng = random.Random(cfg["seed"])
    with llmdd.Instance(DECODE_ID, llmdd.Role.DECODER, options=opts) as dd:
        kv = dd.register_cache(cache)
        deadline = time.monotonic() + 60
        while True:                               # the prefill may still be starting
            try:
                dd.link(PREFILL_ID, a.prefill_host, timeout_ms=3000)
                break
            except llmdd.LlmddError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        send(dd, PREFILL_ID, cmd="hello", cfg=cfg, lengths=lengths, cache=kv.cache_id)
        deadline = time.monotonic() + 60          # the prefill builds the model first
        while not any(m["cmd"] == "ready" for _, m in receive(dd, 1.0)):
            if time.monotonic() > deadline:
                raise SystemExit("decode: the prefill did not answer hello in 60 s")
        for rnd in range(a.rounds + 1):           # round 0 warms up: tokens checked, not timed
            for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):   # alternate the order
                for t in cache:                   # stale KV must not pass for a transfer
                    t.fill_(float("nan"))
                free = list(range(nb))
                rng.shuffle(free)                 # scattered, unlike the prefill's blocks
                tables = [[free.pop() for _ in range(blocks_for(len(p) + gen))] for p in ps]
                first, ttft, landed, computed = {}, {}, {}, {}
                fps, misplaced = {}, []
                t0 = time.perf_counter()
                for i, p in enumerate(ps):
                    send(dd, PREFILL_ID, cmd="prefill", rid=i, mode=mode, brk=a.brk,
                         blocks=tables[i][:blocks_for(len(p) - 1)])
                while len(first) < len(ps) or len(computed) < len(ps):
                    got = receive(dd, 1.0)
                    now = time.monotonic()
                    if not got and time.perf_counter() - t0 > 30:
                        raise SystemExit(f"decode: no KV for requests "
                                         f"{sorted(set(range(len(ps))) - set(first))} in 30 s")
                    for _, m in got:
                        if m["cmd"] == "error":
                            raise SystemExit(f"decode: prefill reports {m}")
                        i = m["rid"]
                        if m["cmd"] == "computed":    # the prefill's clock: same host only
                            computed[i] = m["t"]
                            fps[i] = m["fp"]
                            continue
                        landed[i] = now               # m["cmd"] == "kv": request i's KV landed
                        # Before the first step writes into the last block.
                        landed_fp = blocks_print(cache, tables[i][:blocks_for(len(ps[i]) - 1)])
                        fps.setdefault(("dec", i), landed_fp)
                        first[i] = model.decode_step([ps[i][-1]], [len(ps[i]) - 1],
                                                     [tables[i]], cache)[0]
                        ttft[i] = time.perf_counter() - t0
                for i in range(len(ps)):
                    if fps[("dec", i)] != fps[i]:
                        misplaced.append(i)
                results[mode].append({
                    "misplaced": misplaced,
                    "tokens": decode_rest(model, cache, ps, tables, first, gen),
                    "ttft": [ttft[i] for i in range(len(ps))], "warmup": rnd == 0,
                    "tail": [landed[i] - computed[i] for i in range(len(ps))]})
        send(dd, PREFILL_ID, cmd="quit")
        kv.close()
    return results


# ------------------------------------------------------------------ tensor-parallel prefill

def tp_heads(kv_heads, tp, rank):
    """The KV heads rank holds: [r*H/tp, (r+1)*H/tp), or with tp > H one
    head, floor(r*H/tp) (the ownership llmdd.tp_plan assumes)."""
    if tp <= kv_heads:
        return rank * kv_heads // tp, (rank + 1) * kv_heads // tp
    h = rank * kv_heads // tp
    return h, h + 1


def tp_prefill_role(a):
    """Prefill rank a.prefill_rank of a.prefill_tp: computes the whole
    forward (no collectives in this example) and keeps its KV heads in an
    NHD cache of --prefill-block tokens; frees a request's blocks when the
    decoder's slice request notifies it."""
    rank = a.prefill_rank
    opts = {"llm.ListenIpInfo": a.prefill_host, "llm.Transport": a.transport,
            "llm.SyncKvCacheWaitTime": "10000"}
    with llmdd.Instance(PREFILL_ID + rank, llmdd.Role.PROMPT, options=opts) as dd:
        print(json.dumps({"listen": dd.listen_address()}), flush=True)
        model = cache = views = ps = heads = None
        free, held, done = [], {}, False
        rng = random.Random(rank)
        while not done:
            for c, m in receive(dd, 1.0):
                if m["cmd"] == "hello":
                    model = Model(m["cfg"])
                    ps = prompts(m["cfg"], m["lengths"])
                    heads = tp_heads(model.KVH, m["tp"], rank)
                    B = m["block"]
                    nb = sum(blocks_for(len(p), B) for p in ps) + 8
                    if cache is not None:
                        cache.close()
                    ts, views = model.new_paged(nb, B, heads[1] - heads[0], "NHD")
                    lay = llmdd.KvLayout.of(ts[0], "NHD", heads_first=heads[0],
                                            total_heads=model.KVH)
                    cache = dd.register_cache(ts, layout=lay)
                    free = list(range(nb))
                    rng.shuffle(free)            # each rank's own, permuted table
                    send(dd, c, cmd="ready", rank=rank, cache=cache.cache_id)
                elif m["cmd"] == "prefill":
                    p = ps[m["rid"]][:-1]
                    src = [free.pop() for _ in range(blocks_for(len(p), views[0].shape[1]))]
                    model.prefill(p, src, views, heads=heads)
                    held[m["rid"]] = src
                    send(dd, c, cmd="computed", rid=m["rid"], rank=rank, blocks=src,
                         t=time.monotonic())
                elif m["cmd"] == "free":         # the slice request's notification
                    free += held.pop(m["rid"])
                elif m["cmd"] == "quit":
                    done = True
        if cache is not None:
            cache.close()
    return 0


def tp_decode_role(a, cfg, lengths, gen):
    """The decoder: all KV heads in HND blocks of --decode-block tokens; one
    slice request per prompt gathers the heads from every prefill rank."""
    model = Model(cfg)
    ps = prompts(cfg, lengths)
    B = a.decode_block
    nb = sum(blocks_for(len(p) + gen, B) for p in ps) * 2
    ts, views = model.new_paged(nb, B, model.KVH, "HND", fill=float("nan"))
    hosts = a.prefill_host.split(",")
    opts = {"llm.Transport": a.transport, "llm.SyncKvCacheWaitTime": "10000"}
    runs = []
    rng = random.Random(cfg["seed"])
    with llmdd.Instance(DECODE_ID + 100, llmdd.Role.DECODER, options=opts) as dd:
        kv = dd.register_cache(ts, layout=llmdd.KvLayout.of(ts[0], "HND",
                                                            total_heads=model.KVH))
        for r, h in enumerate(hosts):
            dd.link(PREFILL_ID + r, h, timeout_ms=10000)
            send(dd, PREFILL_ID + r, cmd="hello", cfg=cfg, lengths=lengths, tp=len(hosts),
                 block=a.prefill_block)
        caches = {}
        deadline = time.monotonic() + 60
        while len(caches) < len(hosts):
            for c, m in receive(dd, 1.0):
                if m["cmd"] == "ready":
                    caches[m["rank"]] = m["cache"]
            if time.monotonic() > deadline:
                raise SystemExit("decode: the prefill ranks did not answer hello in 60 s")
        for r in range(len(hosts)):            # a check at startup, not per request
            lay = dd.query_remote_layout(PREFILL_ID + r, caches[r])
            assert lay.block_size == a.prefill_block and lay.total_heads == model.KVH
        plan = llmdd.tp_plan(model.KVH, len(hosts), 1, 0)
        idx = [llmdd.CacheIndex(PREFILL_ID + p.rank, caches[p.rank]) for p in plan]
        for rnd in range(a.rounds + 1):
            for t in ts:
                t.fill_(float("nan"))
            free = list(range(nb))
            rng.shuffle(free)
            tables = [[free.pop() for _ in range(blocks_for(len(p) + gen, B))] for p in ps]
            src = {i: {} for i in range(len(ps))}
            first, ttft, tail = {}, {}, {}
            t0 = time.perf_counter()
            for i in range(len(ps)):
                for r in range(len(hosts)):
                    send(dd, PREFILL_ID + r, cmd="prefill", rid=i)
            while len(first) < len(ps):
                got = receive(dd, 1.0)
                if not got and time.perf_counter() - t0 > 60:
                    raise SystemExit("decode: the prefill ranks stopped answering")
                for _, m in got:
                    i = m["rid"]
                    src[i][m["rank"]] = (m["blocks"], m["t"])
                    if len(src[i]) < len(hosts):
                        continue
                    n = len(ps[i]) - 1           # the decoder recomputes the last token
                    slices = [llmdd.Slice(src[i][p.rank][0] if p.head_end > p.head_begin else [],
                                          tables[i] if p.head_end > p.head_begin else [],
                                          (0, n) if p.head_end > p.head_begin else (0, 0),
                                          (p.head_begin, p.head_end)
                                          if p.head_end > p.head_begin else None)
                              for p in plan]
                    note = json.dumps({"cmd": "free", "rid": i}).encode()
                    dd.pull_slices(idx, slices, kv, notify=note, timeout_ms=10000)
                    tail[i] = time.monotonic() - max(t for _, t in src[i].values())
                    first[i] = model.decode_step([ps[i][-1]], [n], [tables[i]], views)[0]
                    ttft[i] = time.perf_counter() - t0
            runs.append({"tokens": decode_rest(model, views, ps, tables, first, gen),
                         "ttft": [ttft[i] for i in range(len(ps))], "warmup": rnd == 0,
                         "tail": [tail[i] for i in range(len(ps))]})
        for r in range(len(hosts)):
            send(dd, PREFILL_ID + r, cmd="quit")
        kv.close()
    return {"pull": runs}


def tp_launch(a, cfg, lengths, ref):
    """--prefill-tp N with --role both: N prefill processes, then the decoder."""
    common = [sys.executable, os.path.abspath(__file__), "--transport", a.transport,
              "--rounds", str(a.rounds), "--prefill-tp", str(a.prefill_tp),
              "--prefill-block", str(a.prefill_block), "--decode-block", str(a.decode_block)]
    common += ["--small"] if a.small else []
    pres, hosts = [], []
    try:
        for r in range(a.prefill_tp):
            pres.append(subprocess.Popen(common + ["--role", "prefill", "--prefill-rank", str(r),
                                                   "--prefill-host", "127.0.0.1:0"],
                                         stdout=subprocess.PIPE, text=True))
            line = pres[-1].stdout.readline()
            if not line:
                print(f"prefill rank {r} failed (exit {pres[-1].wait(timeout=30)})")
                return 1
            hosts.append(json.loads(line)["listen"])
        dec = subprocess.run(common + ["--role", "decode", "--json",
                                       "--prefill-host", ",".join(hosts)],
                             stdout=subprocess.PIPE, text=True, timeout=600)
        if dec.returncode != 0:
            print(f"decoder failed (exit {dec.returncode})")
            print("tokens identical: no")
            return 1
        results = json.loads(dec.stdout.strip().splitlines()[-1])
        for r, pre in enumerate(pres):
            if pre.wait(timeout=30) != 0:
                print(f"prefill rank {r} failed (exit {pre.returncode})")
                return 1
    finally:
        for pre in pres:
            if pre.poll() is None:
                pre.kill()
    print(f"prefill: {a.prefill_tp} tensor-parallel processes, NHD blocks of "
          f"{a.prefill_block}; decode: one process, HND blocks of {a.decode_block}")
    return report(cfg, lengths, ref, results, a.transport, same_clock=True)


# ------------------------------------------------------------------ report

def report(cfg, lengths, ref, results, transport, same_clock=False):
    ok = True
    modes = [m for m in list(MODES) + ["pull"] if m in results]
    print(f"model: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} query heads, "
          f"{cfg['kv_heads']} KV heads, head dim {cfg['head_dim']}, vocab {cfg['vocab']}, "
          f"float32, KV blocks of {BLOCK} tokens; transport {transport}")
    for i, n in enumerate(lengths):
        print(f"prompt {i} ({n} tokens)")
        print(f"  one process:    {ref['tokens'][i]}")
        for mode in modes:
            for r, res in enumerate(results[mode]):
                same = res["tokens"][i] == ref["tokens"][i]
                ok &= same
                if r == 0 or not same:
                    print(f"  {mode + ' #' + str(r):<15} {res['tokens'][i]}"
                          f"{'' if same else '   <-- DIFFERS'}")
    for mode in modes:
        for r, res in enumerate(results[mode]):
            for i in res.get("misplaced", []):
                ok = False
                whole = (lengths[i] - 1) % BLOCK == 0
                print(f"  {mode} #{r}: KV blocks out of place: request {i} ({lengths[i] - 1} "
                      f"tokens{', whole blocks' if whole else ''})")
    print("time to first token (ms), mean over the batch / the last request; median over rounds:")
    rows = [("one", ref.get("rounds", [ref]))]
    rows += [(m, [r for r in results[m] if not r.get("warmup")]) for m in modes]
    for key, rs in rows:
        mean = statistics.median(1000 * statistics.mean(r["ttft"]) for r in rs)
        last = statistics.median(1000 * r["ttft"][-1] for r in rs)
        print(f"  {NAMES[key]:<36} {mean:8.1f} / {last:8.1f}   ({len(rs)} round(s))")
    if same_clock:
        print("KV landed in the decoder after the prefill's compute ended (ms), median over "
              "requests and rounds:")
        for key, rs in rows[1:]:
            tail = statistics.median(1000 * t for r in rs for t in r["tail"])
            print(f"  {NAMES[key]:<36} {tail:8.2f}")
    pairs = list(zip(rows[1][1], rows[2][1])) if len(rows) > 2 else []
    if pairs:
        lower = sum(statistics.mean(s["ttft"]) < statistics.mean(f["ttft"]) for f, s in pairs)
        print(f"  layer-streamed below push-after-prefill in {lower} of {len(pairs)} rounds")
    print(f"tokens identical: {'yes' if ok else 'no'}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("both", "prefill", "decode"), default="both")
    ap.add_argument("--transport", default="auto", help="auto, shm, tcp, ucx, ...")
    ap.add_argument("--prefill-host", default="127.0.0.1",
                    help="where the prefill listens, host[:port] (the decoder links to it)")
    ap.add_argument("--decode-host", default=None,
                    help="the decoder's own address (it listens there); optional")
    ap.add_argument("--small", action="store_true", help="the small CI configuration")
    ap.add_argument("--long", action="store_true",
                    help="8 layers, prompts of 256 to 2000 tokens (the streaming configuration)")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="run in a network namespace that caps each TCP flow at this rate "
                         "(implies --transport tcp; needs root)")
    ap.add_argument("--rounds", type=int, default=3, help="batches per mode (default 3)")
    ap.add_argument("--break", dest="brk", choices=("layer", "blocks"), default=None,
                    help="test the test: the prefill leaves out the last layer, or pushes "
                         "every block one block off (the tokens must differ)")
    ap.add_argument("--prefill-tp", type=int, default=0,
                    help="the prefill as N tensor-parallel processes (each its share of "
                         "the KV heads); the decoder gathers them with slice requests")
    ap.add_argument("--prefill-block", type=int, default=BLOCK,
                    help="with --prefill-tp: the prefill's block size (NHD)")
    ap.add_argument("--decode-block", type=int, default=BLOCK,
                    help="with --prefill-tp: the decoder's block size (HND)")
    ap.add_argument("--prefill-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.link_gbps is not None and not os.environ.get("LLMDD_FLOWCAP"):
        if a.role != "both" or a.link_gbps <= 0:
            ap.error("--link-gbps: a rate > 0, with --role both")
        if os.geteuid() != 0:
            ap.error("--link-gbps needs root (a network namespace and tc)")
        # Again, inside the namespace; every process it starts stays there.
        argv = sys.argv[1:]                    # the last --transport wins
        env = dict(os.environ, LLMDD_FLOWCAP="1", RATE=f"{int(a.link_gbps * 1000)}mbit")
        return subprocess.call(["sh", os.path.join(ROOT, "scripts", "flowcap.sh"),
                                sys.executable, os.path.abspath(__file__)] + argv
                               + ["--transport", "tcp"], env=env)
    if a.link_gbps is not None:
        a.transport = "tcp"
    cfg, lengths = ((SMALL, SMALL_LENGTHS) if a.small else (LONG, LONG_LENGTHS) if a.long
                    else (FULL, LENGTHS))
    cfg = dict(cfg)
    if a.prefill_tp:
        if a.brk:
            ap.error("--break is for the symmetric mode")
        if a.role == "prefill":
            return tp_prefill_role(a)
        if a.role == "decode":
            print(json.dumps(tp_decode_role(a, cfg, lengths, GEN)))
            return 0
        refs = [one_process(cfg, lengths, GEN) for _ in range(a.rounds + 1)]
        if any(r["tokens"] != refs[0]["tokens"] for r in refs):
            print("one process: two runs differ")
            return 1
        return tp_launch(a, cfg, lengths, {"tokens": refs[0]["tokens"], "rounds": refs[1:]})
    if a.role == "prefill":
        if ":" not in a.prefill_host:
            a.prefill_host += ":26000"
        return prefill_role(a)
    if a.role == "decode":
        if ":" not in a.prefill_host:
            a.prefill_host += ":26000"
        results = decode_role(a, cfg, lengths, GEN)
        if a.json:
            print(json.dumps(results))
            return 0
        one_process(cfg, lengths, GEN)
        return report(cfg, lengths, one_process(cfg, lengths, GEN), results, a.transport)
    # both: one process first (alone on the CPUs; round 0 warms up), then the two processes
    refs = [one_process(cfg, lengths, GEN) for _ in range(a.rounds + 1)]
    if any(r["tokens"] != refs[0]["tokens"] for r in refs):
        print("one process: two runs differ")
        return 1
    ref = {"tokens": refs[0]["tokens"], "rounds": refs[1:]}
    if ":" not in a.prefill_host:
        a.prefill_host += ":0"                    # the kernel picks; the prefill says which
    common = [sys.executable, os.path.abspath(__file__), "--transport", a.transport,
              "--rounds", str(a.rounds)]
    common += ["--break", a.brk] if a.brk else []
    pre = subprocess.Popen(common + ["--role", "prefill", "--json",
                                     "--prefill-host", a.prefill_host],
                           stdout=subprocess.PIPE, text=True)
    try:
        line = pre.stdout.readline()
        if not line:
            print(f"prefill failed (exit {pre.wait(timeout=30)})")
            return 1
        common += ["--prefill-host", json.loads(line)["listen"]]
        cmd = common + ["--role", "decode", "--json"]
        cmd += ["--small"] if a.small else ["--long"] if a.long else []
        cmd += ["--decode-host", a.decode_host] if a.decode_host else []
        dec = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=300)
        if dec.returncode != 0:
            print(f"decoder failed (exit {dec.returncode})")
            print("tokens identical: no")
            return 1
        results = json.loads(dec.stdout.strip().splitlines()[-1])
        if pre.wait(timeout=30) != 0:
            print(f"prefill failed (exit {pre.returncode})")
            return 1
    finally:
        if pre.poll() is None:
            pre.kill()
    return report(cfg, lengths, ref, results, a.transport, same_clock=True)


if __name__ == "__main__":
    sys.exit(main())
