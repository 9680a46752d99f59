"""pip install ./python (offline, Debian 12):
    pip install --no-build-isolation --break-system-packages ./python
The library is copied into the package (llmdd/_lib/) from LLMDD_LIBRARY or
the build tree (../build); without either the package falls back to the
system loader (an installed libllmdd.so.0)."""

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


class BuildPy(build_py):
    def run(self):
        super().run()
        lib = _find_library()
        dst = os.path.join(self.build_lib, "llmdd", "_lib")
        shutil.rmtree(dst, ignore_errors=True)   # never ship a stale copy
        if lib:
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(lib, os.path.join(dst, "libllmdd.so.0"))


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
