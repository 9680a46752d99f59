"""Shared by the Python compat programs: starting the processes of one
program, the process group they synchronise with (torch.distributed over
gloo, as the reference's samples do), and the contents every byte is checked
against. The device runtime (torch_npu, torchair) is the host-memory
stand-in of stubs/."""

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch_npu  # noqa: F401  (the stand-in: tensor.npu() is the tensor)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, per_process_args, timeout=120, no_error_lines=False):
    """Runs `script` once per argument list, all at once, in a process
    group of that size; returns 0 when every process exited with 0. A
    process still running at the timeout is killed (and fails the run).

    no_error_lines: judge the run as the reference's example runner does.
    It starts both sides at once, each with its output (stdout and stderr
    together) in a file, and fails a run whose output holds "error" in
    any case anywhere. The log level is the default one."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(len(per_process_args)))
    outs = []
    if no_error_lines:
        env.pop("LLMDD_LOG_LEVEL", None)
        env.pop("LLMDD_LOG_FORMAT", None)
    procs = []
    for rank, args in enumerate(per_process_args):
        out = tempfile.TemporaryFile() if no_error_lines else None
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, script, "--rank", str(rank)] + args,
                                      env=env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None))
    end = time.monotonic() + timeout
    failed = 0
    for p in procs:
        try:
            rc = p.wait(max(1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
            print(f"{script}: process {p.args[3:]} timed out", flush=True)
        if rc != 0:
            print(f"{script}: process {p.args[3:]} exited with {rc}", flush=True)
            failed += 1
    for p, out in zip(procs, outs):
        if out is None:
            continue
        out.seek(0)
        text = out.read().decode(errors="replace")
        out.close()
        print(text, end="", flush=True)
        bad = [line for line in text.splitlines() if "error" in line.lower()]
        if bad:
            print(f"{script}: process {p.args[3:]} printed {len(bad)} line(s) "
                  f"with \"error\", the first: {bad[0]!r}", flush=True)
            failed += 1
    return 1 if failed else 0


def init_process_group(rank):
    dist.init_process_group(backend="gloo", rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))


def exchange(obj):
    """Every process's obj, by rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def pattern(seed, shape, dtype=torch.float16):
    """Contents of tensor `seed`: small integers, exact in float16."""
    n = 1
    for d in shape:
        n *= d
    v = (torch.arange(n, dtype=torch.int64) * 7 + seed * 131) % 251
    return v.to(dtype).reshape(shape)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def same(a, b):
    """Bytewise equality of two tensors of one shape and type."""
    return a.shape == b.shape and a.dtype == b.dtype and \
        a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes()


def wait_link_refused(datadist, timeout=60):
    """Waits until a link attempt of datadist's instance has failed (its
    peer not listening yet), as its metrics count them: a program that
    links before its peer listens then has been refused at least once."""
    end = time.monotonic() + timeout
    while True:
        for line in datadist._dd.metrics_text().splitlines():
            if line.startswith("llmdd_link_attempts_total{") and \
                    'status="LLM_SUCCESS"' not in line:
                return
        check(time.monotonic() < end, "no link attempt failed")
        time.sleep(0.01)


def single_host_rank_table(host_ip):
    """A rank table of one server holding ranks 0 and 1, as the reference's
    samples build for a run on one machine (is_single)."""
    return json.dumps({"server_count": "1", "status": "completed", "version": "1.2",
                       "server_list": [{"device": [
                           {"device_id": "0", "device_ip": "192.0.2.10", "rank_id": "0"},
                           {"device_id": "1", "device_ip": "192.0.2.11", "rank_id": "1"}],
                           "host_ip": host_ip, "server_id": "1"}]})


def rank_base_port():
    """A port p with p and p + 1 free: ranks 0 and 1 listen there
    (LLMDD_RANK_BASE_PORT)."""
    while True:
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            pass
