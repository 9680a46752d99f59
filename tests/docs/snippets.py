#!/usr/bin/env python3
"""Every fenced snippet of README.md and docs/*.md runs here, or is named
with the test that runs it.

A snippet is a fenced block with a language (```c, ```cpp, ```python, ```sh,
```yaml). Each one must be listed in SNIPPETS below, by its file, language
and first line; a new or changed snippet that is not listed fails this test,
so no doc example goes unrun. The runnable ones run against a real prompt
node (`llmdd serve`, started here on a free loopback port) with the doc's
address and port replaced by that node's, and the README's Llama-3-8B
shapes cut to 16 tokens a slot (the doc's 4 GiB would not fit a test).

    snippets.py SOURCE_DIR CLI LIBRARY     (CTest passes the three)
"""

import os
import re
import subprocess
import sys
import tempfile
import time

SRC, CLI, LIB = sys.argv[1], sys.argv[2], sys.argv[3]
PY = sys.executable
TOKENS = "16"       # the README's 4096 tokens a slot, cut down
README_SHAPE = ["--batch", "8", "--tokens", TOKENS, "--heads", "8", "--head-dim", "128",
                "--num-layers", "32"]


def blocks(path):
    """(language, text) of each fenced block with a language."""
    out, lang, body = [], None, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^```(\w*)\s*$", line)
            if m and lang is None:
                lang, body = m.group(1), []
            elif line.startswith("```") and lang is not None:
                if lang:
                    out.append((lang, "".join(body)))
                lang = None
            elif lang is not None:
                body.append(line)
    return out


def first_line(text):
    return text.strip().splitlines()[0].strip()


class Server:
    """`llmdd serve` on a free loopback port; .addr is "127.0.0.1:PORT"."""

    def __init__(self, *extra):
        self.p = subprocess.Popen([CLI, "serve", "--listen", "127.0.0.1:0", "--cluster-id",
                                   "1", "--fill", *extra], stdout=subprocess.PIPE, text=True)
        end = time.monotonic() + 30
        for line in self.p.stdout:
            m = re.search(r"listening on (127\.0\.0\.1):(\d+)", line)
            if m:
                self.addr, self.port = f"{m.group(1)}:{m.group(2)}", m.group(2)
                break
            if time.monotonic() > end:
                break
        else:
            raise SystemExit("llmdd serve did not start")

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise SystemExit("llmdd serve did not stop on SIGTERM")
        if self.p.returncode != 0:
            raise SystemExit(f"llmdd serve exited {self.p.returncode}")


def run(cmd, what, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    if r.returncode != 0:
        raise SystemExit(f"{what}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def readme_subst(text, srv):
    # The token count first: the port put in after it may contain "4096"
    # (port 40963 became 163 once).
    return (text.replace("4096", TOKENS).replace('"10.0.0.1"', '"127.0.0.1"')
            .replace("10.0.0.1:26000", srv.addr).replace("26000", srv.port))


def compile_and_run(src, lang, tmp, what):
    exe = os.path.join(tmp, "snippet")
    path = exe + (".c" if lang == "c" else ".cpp")
    with open(path, "w") as f:
        f.write(src)
    libdir = os.path.dirname(LIB)
    cc = ["cc", "-std=c11"] if lang == "c" else ["c++", "-std=c++17"]
    # Against a sanitizer build the program carries the same runtime, linked
    # first (a preloaded one deadlocks at exit in a dependency's fini).
    san = os.environ.get("LLMDD_SANITIZE", "")
    if san:
        cc.append("-fsanitize=" + san)
    run(cc + ["-Wall", "-Werror", "-Wno-unused-variable", "-o", exe, path,
              "-I", os.path.join(SRC, "include"), "-L", libdir, "-lllmdd",
              "-Wl,-rpath," + libdir], f"{what}: compile")
    env = {k: v for k, v in os.environ.items() if not (san and k == "LD_PRELOAD")}
    run([exe], what, env=env)


def wrap_main(text, lang, prelude="", ret="st == LLM_SUCCESS ? 0 : 1"):
    incs = [l for l in text.splitlines() if l.startswith("#include")]
    body = [l for l in text.splitlines() if not l.startswith("#include")]
    head = "\n".join(incs or (["#include <llmdd/llmdd.h>"] if lang == "c" else []))
    return (f"{head}\n#include <stdint.h>\n{prelude}\nint main(void) {{\n"
            + "\n".join("    " + l for l in body) + f"\n    return {ret};\n}}\n")


def c_pull(text, tmp):
    """README: the C API in ten lines, a decoder pulling slot 0 of cache 1."""
    srv = Server(*README_SHAPE)
    try:
        compile_and_run(wrap_main(readme_subst(text, srv), "c"), "c", tmp, "README C pull")
    finally:
        srv.stop()


def c_layerwise(text, tmp):
    """README: a layer-streamed, notified push; the prelude makes what the
    snippet names (a linked instance, its cache, the remote slot)."""
    srv = Server(*README_SHAPE)
    prelude = f"""
static llmdd *prompt;
static llmdd_cache kv;
static llmdd_cache_index dst = {{.cluster_id = 1, .cache_id = 1, .batch_index = 0}};
static void compute_layer(uint32_t l) {{ (void)l; }}
static int setup(void) {{
    llmdd_cache_desc d = {{.num_tensors = 64, .data_type = LLMDD_DT_BF16, .num_dims = 3,
                          .shape = {{8, {TOKENS}, 1024}}}};
    llmdd_ip_info ip = {{"127.0.0.1", {srv.port}}};
    llmdd_cluster_info c = {{.remote_cluster_id = 1, .remote_ip_infos = &ip,
                            .num_remote_ip_infos = 1}};
    llmdd_status rets[1];
    return llmdd_create(3, LLMDD_ROLE_PROMPT, &prompt) != LLM_SUCCESS ||
           llmdd_initialize(prompt, NULL, 0) != LLM_SUCCESS ||
           llmdd_allocate_cache(prompt, &d, &kv) != LLM_SUCCESS ||
           llmdd_link_clusters(prompt, &c, 1, rets, 5000) != LLM_SUCCESS;
}}"""
    body = "if (setup() != 0) return 2;\n" + text
    try:
        compile_and_run(wrap_main(body, "c", prelude), "c", tmp, "README layer-wise push")
    finally:
        srv.stop()


def cpp_pull(text, tmp):
    """README: the same pull through LLM-DataDist's C++ header."""
    srv = Server(*README_SHAPE)
    try:
        compile_and_run(wrap_main(readme_subst(text, srv), "cpp"), "cpp", tmp,
                        "README C++ pull")
    finally:
        srv.stop()


def py_readme(text, tmp):
    """README: the same pull from Python."""
    srv = Server(*README_SHAPE)
    try:
        run([PY, "-c", readme_subst(text, srv)], "README Python pull")
    finally:
        srv.stop()


def py_guide(text, tmp):
    """docs/python.md: against the serve command in its first line."""
    srv = Server("--model", "tiny")
    try:
        run([PY, "-c", text.replace("127.0.0.1:26000", srv.addr)], "docs/python.md example")
    finally:
        srv.stop()


def sh_serve_pull(text, tmp):
    """README: terminal 1 serves, terminal 2 pulls and verifies."""
    cmds = [l for l in text.splitlines() if l.strip() and not l.startswith("#")]
    assert len(cmds) == 2 and " serve " in cmds[0] and " pull " in cmds[1], cmds
    serve = cmds[0].split()
    assert serve[0] == "./build/llmdd" and "127.0.0.1:26000" in serve
    srv = Server(*serve[serve.index("--cluster-id") + 2:])
    try:
        pull = cmds[1].replace("127.0.0.1:26000", srv.addr).split()
        out = run([CLI] + pull[1:], "README llmdd pull")
        if "verified" not in out:
            raise SystemExit(f"README llmdd pull did not verify:\n{out}")
    finally:
        srv.stop()


def yaml_rules(text, tmp):
    """docs/operations.md: every series an alert names is one llmdd exports
    (llmdd_metrics_text); promtool checks the rules where it exists."""
    names = set(re.findall(r"\b(llmdd_[a-z_]+?)(?:_bucket|_sum|_count)?\b", text))
    served = run([PY, "-c", "import llmdd\nwith llmdd.Instance(9, llmdd.Role.DECODER) as d:\n"
                  "    print(d.metrics_text())"], "metrics text")
    for n in sorted(names):
        if not re.search(rf"^# TYPE {n} ", served, re.M):
            raise SystemExit(f"docs/operations.md alerts on {n}, which llmdd does not serve")
    promtool = "/usr/bin/promtool"
    if os.access(promtool, os.X_OK):
        path = os.path.join(tmp, "rules.yml")
        with open(path, "w") as f:
            f.write(text)
        run([promtool, "check", "rules", path], "promtool check rules")


# file, language, first line -> how it runs (a function above) or the test
# that runs it (a string).
SNIPPETS = {
    ("README.md", "sh", "# Build, then run the demo: a prompt and a decoder process move a "
     "Llama-3-8B-shaped KV cache."): "llmdd.cli.demo_* (the demo) and .ci/run (the build)",
    ("README.md", "sh", "# Build, then run every test."): ".ci/run calls it verbatim",
    ("README.md", "c", "#include <llmdd/llmdd.h>"): c_pull,
    ("README.md", "c", "llmdd_xfer_opts o = {.flags = LLMDD_XFER_LAYERWISE, .notify = "
     "\"req-7\", .notify_len = 5};"): c_layerwise,
    ("README.md", "cpp", "#include <llm_datadist/llm_datadist.h>"): cpp_pull,
    ("README.md", "python", "import llmdd, numpy as np"): py_readme,
    ("README.md", "sh", "# terminal 1: allocate and fill the caches, serve until Ctrl-C"):
        sh_serve_pull,
    ("README.md", "sh", "./build/llmdd bench --transport tcp --block-size 4K:64M --plot "
     "bench-tcp.png"): "llmdd.cli.bench (the same options, smaller sizes, the plot)",
    ("docs/python.md", "sh", "cmake -S . -B build && cmake --build build -j2"):
        "llmdd.python.pytest (test_install.py: cmake --install and pip)",
    ("docs/python.md", "python", "# against a prompt node: llmdd serve --listen "
     "127.0.0.1:26000 --cluster-id 1 --fill --model tiny"): py_guide,
    ("docs/python.md", "python", "import numpy as np, llmdd"):
        "llmdd.python.pytest (test_layout.py: the same two prefill ranks, NHD blocks of "
        "16, into an HND decoder cache, by tp_plan and pull_slices, every byte checked)",
    ("docs/cpp.md", "sh", "g++ -std=c++17 app.cpp -I<prefix>/include -L<prefix>/lib -lllmdd"):
        "llmdd.install.consumers (a C++ consumer against an installed tree)",
    ("docs/operations.md", "sh", "llmdd serve --listen 10.0.0.5:26000 --cluster-id 7 --fill "
     "--metrics 10.0.0.5:9464"): "llmdd.cli.serve_metrics (serve --metrics, then stats)",
    ("docs/operations.md", "sh", "# a fleet with etcd: prompts publish themselves, decoders "
     "find them by cluster id"):
        "llmdd.cli.metadata_test (serve, info and pull --metadata against a real etcd)",
    ("docs/operations.md", "yaml", "scrape_configs:"):
        "a Prometheus configuration fragment: nothing of llmdd's to run",
    ("docs/operations.md", "yaml", "groups:"): yaml_rules,
    ("docs/operations.md", "sh", "cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && "
     "cmake --build build -j2"): "llmdd.install.consumers (builds and extracts the .deb)",
    ("docs/operations.md", "sh", "export PKG_CONFIG_PATH=/opt/llmdd/lib/pkgconfig"):
        "llmdd.install.consumers (pkg-config consumer of a custom prefix, rpath)",
}


def main():
    docs = ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(SRC, "docs"))
                                  if f.endswith(".md"))
    seen, ran, bad = set(), 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for doc in docs:
            for lang, text in blocks(os.path.join(SRC, doc)):
                key = (doc, lang, first_line(text))
                how = SNIPPETS.get(key)
                if how is None:
                    bad.append(f"{doc}: a ```{lang} snippet starting {key[2]!r} is neither "
                               "run here nor named with its test (tests/docs/snippets.py)")
                    continue
                seen.add(key)
                if callable(how):
                    how(text, tmp)
                    print(f"ran     {doc} ```{lang}: {key[2][:60]}")
                    ran += 1
                else:
                    print(f"covered {doc} ```{lang}: {key[2][:60]} -> {how}")
    for key in SNIPPETS.keys() - seen:
        bad.append(f"{key[0]}: no ```{key[1]} snippet starts {key[2]!r} any more; "
                   "update tests/docs/snippets.py")
    if bad:
        raise SystemExit("\n".join(bad))
    print(f"snippets: {ran} ran, {len(seen) - ran} covered by the tests named")


if __name__ == "__main__":
    main()
