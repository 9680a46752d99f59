import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    """A prompt process (peer.py) driven over stdin/stdout; always reaped."""

    def __init__(self, mode="llmdd", transport="auto", cluster_id=1, big=0):
        self.port = free_port()
        self.cluster_id = cluster_id
        self.addr = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peer.py"), "--port", str(self.port),
             "--cluster-id", str(cluster_id), "--mode", mode, "--transport", transport,
             "--big", str(big)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"peer did not start: {line!r}")
        self.ids = json.loads(line[6:])

    def ask(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


@pytest.fixture(scope="module")
def ref_peer():
    p = Peer(mode="ref")
    yield p
    p.close()
