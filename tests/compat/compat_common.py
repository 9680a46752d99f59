"""Shared by the Python compat programs: starting the processes of one
program, the process group they synchronise with (torch.distributed over
gloo, as the reference's samples do), and the contents every byte is checked
against. The device runtime (torch_npu, torchair) is the host-memory
stand-in of stubs/."""

import datetime
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch_npu  # noqa: F401  (the stand-in: tensor.npu() is the tensor)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, per_process_args, timeout=120):
    """Runs `script` once per argument list, all at once, in a process
    group of that size; returns 0 when every process exited with 0. A
    process still running at the timeout is killed (and fails the run)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(len(per_process_args)))
    procs = []
    for rank, args in enumerate(per_process_args):
        procs.append(subprocess.Popen([sys.executable, script, "--rank", str(rank)] + args,
                                      env=env))
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
