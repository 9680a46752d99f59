"""KV layouts from Python: numpy and torch caches described by "NHD"/"HND"
with a block size and a head range, one slice request from two prefill
ranks (llmdd.tp_plan) into a decoder cache of another block size and order,
checked against the same data rearranged by numpy; and the errors."""

import select

import numpy as np
import pytest

import llmdd

from conftest import free_port

H, D, TOK = 4, 8, 45          # KV heads, head dim (float32: 32 bytes), tokens


@pytest.fixture
def fleet():
    opts = {"llm.Transport": "tcp"}
    dec = llmdd.Instance(100, llmdd.Role.DECODER, opts)
    srcs = []
    try:
        for r in range(2):
            port = free_port()
            o = dict(opts, **{"llm.ListenIpInfo": f"127.0.0.1:{port}"})
            s = llmdd.Instance(r + 1, llmdd.Role.PROMPT, o)
            srcs.append(s)
            dec.link(r + 1, f"127.0.0.1:{port}")
        yield dec, srcs
    finally:
        dec.close()
        for s in srcs:
            s.close()


def test_two_prefill_ranks_into_one_decoder(fleet):
    dec, srcs = fleet
    rng = np.random.default_rng(7)
    # The whole model's K for TOK tokens: [tokens, heads, dim].
    k = rng.standard_normal((TOK, H, D)).astype(np.float32)
    # Prefill TP 2: rank r holds heads [2r, 2r + 2) in NHD blocks of 16,
    # its table permuted.
    tabs, caches = [], []
    for r, s in enumerate(srcs):
        nb = 4
        cache = np.zeros((nb, 16, 2, D), np.float32)
        tab = [3, 1, 0, 2]
        for t in range(TOK):
            cache[tab[t // 16], t % 16] = k[t, 2 * r:2 * r + 2]
        lay = llmdd.KvLayout.of(cache, "NHD", heads_first=2 * r, total_heads=H)
        assert lay.block_size == 16 and lay.heads == (2 * r, 2 * r + 2)
        assert lay.head_bytes == D * 4
        c = s.register_cache([cache], layout=lay)
        tabs.append(tab)
        caches.append((cache, c))
    # The decoder: all heads, HND blocks of 32, its own table.
    dcache = np.full((3, H, 32, D), -1.0, np.float32)
    dlay = llmdd.KvLayout.of(dcache, "HND", total_heads=H)
    dc = dec.register_cache([dcache], layout=dlay)
    assert dec.query_remote_layout(1, caches[0][1].cache_id) == \
        llmdd.KvLayout("NHD", 16, (0, 2), H, D * 4)
    dtab = [2, 0]
    plan = llmdd.tp_plan(H, 2, 1, 0)
    assert plan == [llmdd.TpPiece(0, 0, 2), llmdd.TpPiece(1, 2, 4)]
    slices = [llmdd.Slice(tabs[p.rank], dtab, (0, TOK), (p.head_begin, p.head_end))
              for p in plan]
    idx = [llmdd.CacheIndex(p.rank + 1, caches[p.rank][1].cache_id) for p in plan]
    with dec.pull_slices_async(idx, slices, dc, notify=b"freed") as req:
        req.wait(10000)
    want = np.full_like(dcache, -1.0)
    for t in range(TOK):
        want[dtab[t // 32], :, t % 32] = k[t]
    np.testing.assert_array_equal(dcache, want)
    for s in srcs:   # each source told once, after its bytes landed
        assert select.select([s.notify_fd()], [], [], 5)[0]
        assert s.get_notifies() == [(100, b"freed")]


def test_torch_push_and_errors(fleet):
    torch = pytest.importorskip("torch")
    dec, srcs = fleet
    src = torch.arange(2 * 8 * H * D, dtype=torch.float32).reshape(2, H, 8, D)  # HND
    dst = torch.zeros(1, 16, H, D)                                              # NHD
    sl = llmdd.KvLayout.of(src, "HND", total_heads=H)
    dl = llmdd.KvLayout.of(dst, "NHD", total_heads=H)
    sc = dec.register_cache([src], layout=sl)
    dc = srcs[0].register_cache([dst], layout=dl)
    dec.push_slices(sc, llmdd.CacheIndex(1, dc.cache_id), llmdd.Slice([1, 0], [0], (3, 14)))
    for t in range(16):
        row = src[[1, 0][t // 8], :, t % 8] if 3 <= t < 14 else torch.zeros(H, D)
        assert torch.equal(dst[0, t], row)
    assert llmdd.slice_plan_size(sl, dl, llmdd.Slice([1, 0], [0], (3, 14)))[1] == \
        11 * H * D * 4
    # Errors are exceptions with the library's status.
    with pytest.raises(llmdd.LlmddError) as e:
        dec.push_slices(sc, llmdd.CacheIndex(1, dc.cache_id),
                        llmdd.Slice([1, 0], [0, 0], (3, 14)))  # a block twice
    assert e.value.status == llmdd.Status.LLM_PARAM_INVALID
    with pytest.raises(llmdd.LlmddError) as e:
        dec.query_remote_layout(1, 12345)
    assert e.value.status == llmdd.Status.LLM_KV_CACHE_NOT_EXIST
    with pytest.raises(llmdd.LlmddError):
        llmdd.tp_plan(6, 4, 2, 0)
    with pytest.raises(ValueError):
        llmdd.KvLayout.of(src, "HD")
    with pytest.raises(llmdd.LlmddError) as e:
        dec.register_cache([torch.zeros(2, 8)], layout=sl)   # the product rule
    assert e.value.status == llmdd.Status.LLM_PARAM_INVALID
