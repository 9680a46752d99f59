"""Both ways of installing find the library without LD_LIBRARY_PATH:
cmake --install (a generated _libpath.py) and pip install ./python (the
library copied into llmdd/_lib)."""

import glob
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB = os.environ.get("LLMDD_LIBRARY")
PROBE = ("import llmdd, llm_datadist; print(llmdd.library_path); "
         "llmdd.Instance(1).close(); print(llm_datadist.LLMStatusCode.LLM_SUCCESS); "
         "print(llmdd._ffi.speedups is not None)")
# The build made llmdd._speedups (python3-dev installed): both ways of
# installing carry it, and the installed package loads it.
SPEEDUPS = bool(LIB) and bool(glob.glob(os.path.join(os.path.dirname(LIB), "python",
                                                     "_speedups*.so")))


def _clean_env(sitedir):
    env = {k: v for k, v in os.environ.items()
           if k not in ("LLMDD_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH",
                        "LLMDD_PY_SPEEDUPS")}
    env["PYTHONPATH"] = sitedir
    return env


def _probe(sitedir, cwd):
    out = subprocess.run([sys.executable, "-c", PROBE], env=_clean_env(sitedir), cwd=cwd,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not LIB, reason="needs LLMDD_LIBRARY (set by CTest)")
def test_cmake_install(tmp_path):
    build = os.path.dirname(LIB)
    subprocess.run(["cmake", "--install", build, "--prefix", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    ver = "%d.%d" % sys.version_info[:2]
    site = tmp_path / "lib" / f"python{ver}" / "dist-packages"
    assert (site / "llmdd" / "_libpath.py").exists()
    path, ok, fast = _probe(str(site), str(tmp_path))
    assert path.startswith(str(tmp_path)) and ok == "LLMStatusCode.LLM_SUCCESS"
    assert fast == str(SPEEDUPS)


@pytest.mark.skipif(not LIB, reason="needs LLMDD_LIBRARY (set by CTest)")
def test_pip_install(tmp_path):
    env = dict(os.environ, LLMDD_LIBRARY=LIB)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                        "--no-index", "--no-deps", "--target", str(tmp_path / "site"),
                        os.path.join(REPO, "python")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path, ok, fast = _probe(str(tmp_path / "site"), str(tmp_path))
    assert path == str(tmp_path / "site" / "llmdd" / "_lib" / "libllmdd.so.0")
    assert fast == str(SPEEDUPS)


def test_default_prefix_is_on_debians_path():
    """cmake --install with the default prefix (/usr/local) puts the packages
    where Debian's python3 looks: /usr/local/lib/python3.X/dist-packages."""
    ver = "%d.%d" % sys.version_info[:2]
    assert f"/usr/local/lib/python{ver}/dist-packages" in sys.path
    out = subprocess.run(["cmake", "-LA", "-N", os.path.dirname(LIB or "build")],
                         capture_output=True, text=True, timeout=60).stdout
    assert f"LLMDD_PYTHON_SITEDIR:STRING=lib/python{ver}/dist-packages" in out
