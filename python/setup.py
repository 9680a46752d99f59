"""pip install ./python (offline, Debian 12):
    pip install --no-build-isolation --break-system-packages ./python
The library is copied into the package (llmdd/_lib/) from LLMDD_LIBRARY or
the build tree (../build); without either the package falls back to the
system loader (an installed libllmdd.so.0). The build's llmdd._speedups
(<build>/python/, made when python3-dev is installed) is copied beside it;
without it the package calls the library through ctypes only."""

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _find_library():
    env = os.environ.get("LLMDD_LIBRARY")
    if env:
        return env
    for d in (os.environ.get("LLMDD_BUILD_DIR", ""), os.path.join(HERE, "..", "build")):
        if d:
            hits = sorted(glob.glob(os.path.join(d, "libllmdd.so.*.*.*")))
            if hits:
                return hits[-1]
    return None


def _find_speedups(lib):
    """llmdd._speedups as the build made it (<build>/python/), for this
    interpreter; None without it (the package then uses ctypes only)."""
    import importlib.machinery
    dirs = [os.path.join(os.path.dirname(lib), "python")] if lib else []
    dirs += [os.path.join(d, "python") for d in (os.environ.get("LLMDD_BUILD_DIR", ""),
                                                 os.path.join(HERE, "..", "build")) if d]
    for d in dirs:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(d, "_speedups" + suffix)
            if os.path.exists(path):
                return path
    return None


class BuildPy(build_py):
    def run(self):
        super().run()
        lib = _find_library()
        dst = os.path.join(self.build_lib, "llmdd", "_lib")
        shutil.rmtree(dst, ignore_errors=True)   # never ship a stale copy
        if lib:
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(lib, os.path.join(dst, "libllmdd.so.0"))
        for old in glob.glob(os.path.join(self.build_lib, "llmdd", "_speedups*.so")):
            os.remove(old)
        sp = _find_speedups(lib)
        if sp:
            shutil.copy2(sp, os.path.join(self.build_lib, "llmdd", os.path.basename(sp)))


def _version():
    """The library's version, from its header (one place for it)."""
    parts = {}
    with open(os.path.join(HERE, "..", "include", "llmdd", "llmdd.h")) as f:
        for line in f:
            for k in ("MAJOR", "MINOR", "PATCH"):
                if line.startswith(f"#define LLMDD_VERSION_{k} "):
                    parts[k] = line.split()[2]
    return "{MAJOR}.{MINOR}.{PATCH}".format(**parts)


setup(
    name="llmdd",
    version=_version(),
    description="Python bindings of llmdd (LLM KV-cache transfer) and the "
                "llm_datadist API over it",
    packages=["llmdd", "llm_datadist"],
    python_requires=">=3.9",
    cmdclass={"build_py": BuildPy},
    zip_safe=False,
)
