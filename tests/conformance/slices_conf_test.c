/*
 * Slice transfers over one transport (docs/model.md, "KV layouts"): random
 * cases (layouts, TP pairs, block sizes, permuted tables, layer ranges)
 * pulled and pushed between in-process instances and compared with the
 * per-byte reference of tests/harness/slice_cases.h, untouched bytes
 * included; one request from four sources with a notification per source
 * (an empty piece notified too); a layer-wise slice push; and every check of
 * the documented order with its exact status, the destination untouched
 * and nothing delivered.
 *
 *   slices_conf_test <transport> [cases]
 */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness/harness.h"
#include "harness/slice_cases.h"

#define NSRC 4
#define SELF 100
#define SENT 0xa5

static const char *transport;
static int ncases = 60;
static llmdd *dd, *src[NSRC];

static llmdd_cache_desc
desc_for(const llmdd_kv_layout *l, uint64_t blocks, uint32_t tensors)
{
    llmdd_cache_desc d;
    memset(&d, 0, sizeof(d));
    d.placement = LLMDD_PLACEMENT_HOST;
    d.num_tensors = tensors;
    d.data_type = LLMDD_DT_UINT8;
    d.num_dims = 2;
    d.shape[0] = (int64_t)blocks;
    d.shape[1] = (int64_t)sc_block_bytes(l);
    return d;
}

static int
setup(void **state)
{
    (void)state;
    /* Three lanes: tcp stripes large slices even over loopback. */
    llmdd_option o[] = {{"llm.Transport", transport},
                        {"llm.SyncKvCacheWaitTime", "10000"},
                        {"llm.TcpLanes", "3"}};
    if (llmdd_create(SELF, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, o, 3) != LLM_SUCCESS)
        return -1;
    for (int i = 0; i < NSRC; i++) {
        uint16_t port;
        if (llmdd_create((uint64_t)i + 1, LLMDD_ROLE_MIX, &src[i]) !=
                LLM_SUCCESS ||
            th_init_listen(src[i], "127.0.0.1", &port, o, 3) != LLM_SUCCESS ||
            th_link(dd, (uint64_t)i + 1, "127.0.0.1", port, 5000) !=
                LLM_SUCCESS)
            return -1;
    }
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    llmdd_destroy(dd);
    for (int i = 0; i < NSRC; i++)
        llmdd_destroy(src[i]);
    return 0;
}

/* Notifications that reached `who` within timeout_ms. */
static size_t
notifies(llmdd *who, int timeout_ms)
{
    llmdd_notify got[16];
    size_t n = 0;
    struct pollfd p = {.fd = llmdd_notify_fd(who), .events = POLLIN};
    if (poll(&p, 1, timeout_ms) == 1)
        assert_int_equal(llmdd_get_notifies(who, got, 16, &n), LLM_SUCCESS);
    return n;
}

/* One random case, pulled (push false) or pushed, 2 tensors with an
 * optional layer range (source tensor 1 into destination tensor 0). */
static void
run_case(sc_rng *r, bool push)
{
    sc_case c;
    sc_case_make(r, &c, 40);
    bool ranged = sc_below(r, 3) == 0;
    if (ranged)
        c.slice.ext = (llmdd_kv_ext_param){{1, 1}, {0, 0}, 1};
    llmdd *sdd = push ? dd : src[0], *ddd = push ? src[0] : dd;
    llmdd_cache sc, dc;
    llmdd_cache_desc sd = desc_for(&c.sl, c.s_blocks, 2);
    llmdd_cache_desc dsd = desc_for(&c.dl, c.d_blocks, 2);
    assert_int_equal(llmdd_allocate_cache_layout(sdd, &sd, &c.sl, &sc),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache_layout(ddd, &dsd, &c.dl, &dc),
                     LLM_SUCCESS);
    uint64_t ss = (uint64_t)sd.shape[0] * (uint64_t)sd.shape[1];
    uint64_t ds = (uint64_t)dsd.shape[0] * (uint64_t)dsd.shape[1];
    uint8_t *ref[2];
    for (uint32_t t = 0; t < 2; t++) {
        sc_fill_src(&c, t, (uint8_t *)(uintptr_t)sc.tensor_addrs[t]);
        memset((void *)(uintptr_t)dc.tensor_addrs[t], SENT, ds);
        ref[t] = malloc(ds);
        memset(ref[t], SENT, ds);
    }
    if (ranged) {
        sc_reference(&c, (uint8_t *)(uintptr_t)sc.tensor_addrs[1], ref[0]);
    } else {
        for (uint32_t t = 0; t < 2; t++)
            sc_reference(&c, (uint8_t *)(uintptr_t)sc.tensor_addrs[t],
                         ref[t]);
    }
    llmdd_status st;
    if (push) {
        llmdd_cache_index di = {1, dc.cache_id, 0};
        st = llmdd_push_kv_slices(dd, &sc, &di, &c.slice, 1);
    } else {
        llmdd_cache_index si = {1, sc.cache_id, 0};
        st = llmdd_pull_kv_slices(dd, &si, &c.slice, 1, &dc);
    }
    assert_int_equal(st, LLM_SUCCESS);
    for (uint32_t t = 0; t < 2; t++) {
        assert_memory_equal((void *)(uintptr_t)dc.tensor_addrs[t], ref[t],
                            ds);
        free(ref[t]);
    }
    (void)ss;
    assert_int_equal(llmdd_deallocate_cache(sdd, sc.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(ddd, dc.cache_id), LLM_SUCCESS);
    sc_case_free(&c);
}

static void
test_random(void **state)
{
    (void)state;
    sc_rng r = {0x9e3779b97f4a7c15ull};
    for (int i = 0; i < ncases; i++)
        run_case(&r, i % 2 == 1);
}

static llmdd_kv_layout
lay(bool hnd, uint32_t B, uint32_t heads, uint32_t first, uint32_t total,
    uint32_t hb)
{
    llmdd_kv_layout l = {.num_dims = 4,
                         .order = {LLMDD_KV_DIM_BLOCK, LLMDD_KV_DIM_TOKEN,
                                   LLMDD_KV_DIM_HEAD, LLMDD_KV_DIM_BYTES},
                         .block_size = B, .num_heads = heads,
                         .head_first = first, .total_heads = total,
                         .head_bytes = hb, .num_parts = 1};
    if (hnd) {
        l.order[1] = LLMDD_KV_DIM_HEAD;
        l.order[2] = LLMDD_KV_DIM_TOKEN;
    }
    return l;
}

/*
 * Prefill TP 4 (NHD, block 16, 8 heads: 2 a rank) into decode rank 0 of TP
 * 2 (HND, block 32, heads 0..3): one request over the plan's four pieces,
 * two of them empty; every source notified once, every byte right.
 */
static void
test_four_sources(void **state)
{
    (void)state;
    enum { TOK = 100, NB = 8 };
    llmdd_tp_piece pc[NSRC];
    size_t np;
    assert_int_equal(llmdd_tp_plan(8, NSRC, 2, 0, pc, NSRC, &np), LLM_SUCCESS);
    assert_int_equal(np, NSRC);
    llmdd_kv_layout dl = lay(true, 32, 4, 0, 8, 16);
    llmdd_cache dc, sc[NSRC];
    llmdd_cache_desc dd_desc = desc_for(&dl, NB, 1);
    assert_int_equal(llmdd_allocate_cache_layout(dd, &dd_desc, &dl, &dc),
                     LLM_SUCCESS);
    uint64_t ds = (uint64_t)dd_desc.shape[0] * (uint64_t)dd_desc.shape[1];
    memset((void *)(uintptr_t)dc.tensor_addrs[0], SENT, ds);
    uint8_t *ref = malloc(ds);
    memset(ref, SENT, ds);
    uint64_t stab[NB] = {7, 6, 5, 4, 3, 2, 1, 0}, dtab[4] = {3, 0, 2, 1};
    llmdd_kv_slice sl[NSRC];
    llmdd_cache_index si[NSRC];
    for (int i = 0; i < NSRC; i++) {
        llmdd_kv_layout l = lay(false, 16, 2, 2 * (uint32_t)i, 8, 16);
        llmdd_cache_desc d = desc_for(&l, NB, 1);
        assert_int_equal(llmdd_allocate_cache_layout(src[i], &d, &l, &sc[i]),
                         LLM_SUCCESS);
        sc_case c = {.sl = l, .dl = dl, .s_blocks = NB, .d_blocks = NB};
        c.slice = (llmdd_kv_slice){.src = {stab, NB, 0},
                                   .dst = {dtab, 4, 0},
                                   .token_begin = 0,
                                   .token_end = TOK,
                                   .head_begin = pc[i].head_begin,
                                   .head_end = pc[i].head_end,
                                   .ext = LLMDD_KV_EXT_PARAM_DEFAULT};
        if (pc[i].head_begin == pc[i].head_end)
            c.slice.token_end = 0; /* notification only */
        c.h0 = pc[i].head_begin, c.h1 = pc[i].head_end;
        sc_fill_src(&c, 0, (uint8_t *)(uintptr_t)sc[i].tensor_addrs[0]);
        sc_reference(&c, (uint8_t *)(uintptr_t)sc[i].tensor_addrs[0], ref);
        sl[i] = c.slice;
        si[i] = (llmdd_cache_index){(uint64_t)i + 1, sc[i].cache_id, 0};
    }
    llmdd_xfer_opts o = {.notify = "done", .notify_len = 4};
    llmdd_request *req;
    assert_int_equal(
        llmdd_pull_kv_slices_async(dd, si, sl, NSRC, &dc, &o, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    assert_memory_equal((void *)(uintptr_t)dc.tensor_addrs[0], ref, ds);
    for (int i = 0; i < NSRC; i++) {
        assert_int_equal(notifies(src[i], 5000), 1);
        assert_int_equal(llmdd_deallocate_cache(src[i], sc[i].cache_id),
                         LLM_SUCCESS);
    }
    free(ref);
    assert_int_equal(llmdd_deallocate_cache(dd, dc.cache_id), LLM_SUCCESS);
}

/*
 * Moves case c (1 tensor a side) pulled or pushed, checks every byte. With
 * reg the remote side's cache is registered user memory (shm reaches it by
 * cross-memory attach, not through a mapping).
 */
static void
move_checked(sc_case *c, bool push, bool reg)
{
    llmdd *sdd = push ? dd : src[0], *ddd = push ? src[0] : dd;
    llmdd_cache sc, dc;
    llmdd_cache_desc sd = desc_for(&c->sl, c->s_blocks, 1);
    llmdd_cache_desc dsd = desc_for(&c->dl, c->d_blocks, 1);
    uint64_t ss = (uint64_t)sd.shape[0] * (uint64_t)sd.shape[1];
    uint64_t ds = (uint64_t)dsd.shape[0] * (uint64_t)dsd.shape[1];
    uint8_t *user = NULL;
    uint64_t addr = 0;
    if (reg) { /* the remote cache: the source of a pull, else the dest */
        user = malloc(push ? ds : ss);
        assert_non_null(user);
        addr = (uint64_t)(uintptr_t)user;
        llmdd_cache *rc = push ? &dc : &sc;
        memset(rc, 0, sizeof(*rc));
        rc->desc = push ? dsd : sd;
        rc->tensor_addrs = &addr;
        assert_int_equal(llmdd_register_kv_cache_layout(
                             src[0], push ? &dsd : &sd, push ? &c->dl : &c->sl,
                             &addr, 1, &rc->cache_id),
                         LLM_SUCCESS);
    }
    if (!reg || push)
        assert_int_equal(llmdd_allocate_cache_layout(sdd, &sd, &c->sl, &sc),
                         LLM_SUCCESS);
    if (!reg || !push)
        assert_int_equal(llmdd_allocate_cache_layout(ddd, &dsd, &c->dl, &dc),
                         LLM_SUCCESS);
    uint8_t *ref = malloc(ds), *dst = (uint8_t *)(uintptr_t)dc.tensor_addrs[0];
    assert_non_null(ref);
    sc_fill_src(c, 0, (uint8_t *)(uintptr_t)sc.tensor_addrs[0]);
    memset(dst, SENT, ds);
    memset(ref, SENT, ds);
    sc_reference(c, (uint8_t *)(uintptr_t)sc.tensor_addrs[0], ref);
    if (push) {
        llmdd_cache_index di = {1, dc.cache_id, 0};
        assert_int_equal(llmdd_push_kv_slices(dd, &sc, &di, &c->slice, 1),
                         LLM_SUCCESS);
    } else {
        llmdd_cache_index si = {1, sc.cache_id, 0};
        assert_int_equal(llmdd_pull_kv_slices(dd, &si, &c->slice, 1, &dc),
                         LLM_SUCCESS);
    }
    assert_memory_equal(dst, ref, ds);
    free(ref);
    if (reg)
        assert_int_equal(
            llmdd_unregister_kv_cache(src[0], push ? dc.cache_id : sc.cache_id),
            LLM_SUCCESS);
    if (!reg || push)
        assert_int_equal(llmdd_deallocate_cache(sdd, sc.cache_id), LLM_SUCCESS);
    if (!reg || !push)
        assert_int_equal(llmdd_deallocate_cache(ddd, dc.cache_id), LLM_SUCCESS);
    free(user);
}

/*
 * Slices large enough to be striped over a link's lanes (tcp moves 4 MiB
 * and more on several connections, cut at 4 KiB borders that fall inside
 * 100-byte elements), of elements short enough for the bounce buffer; and
 * a source table naming one block for every token, so that each request
 * may carry only one source tensor's worth and the 2-D runs are cut
 * between elements. Each with allocated and with registered remote memory.
 */
static void
test_large(void **state)
{
    (void)state;
    enum { TOK = 24672, SB = 16, DB = 32 };
    uint64_t *stab = malloc(TOK / SB * sizeof(*stab));
    uint64_t *dtab = malloc(TOK / DB * sizeof(*dtab));
    assert_true(stab != NULL && dtab != NULL);
    for (uint64_t i = 0; i < TOK / SB; i++)
        stab[i] = i;
    for (uint64_t i = 0; i < TOK / DB; i++)
        dtab[i] = i;
    sc_case c = {.sl = lay(false, SB, 4, 0, 4, 100),
                 .dl = lay(true, DB, 4, 0, 4, 100),
                 .s_blocks = TOK / SB,
                 .d_blocks = TOK / DB,
                 .h0 = 1,
                 .h1 = 3};
    c.slice = (llmdd_kv_slice){.src = {stab, TOK / SB, 0},
                               .dst = {dtab, TOK / DB, 0},
                               .token_begin = 0,
                               .token_end = TOK,
                               .head_begin = 1,
                               .head_end = 3,
                               .ext = LLMDD_KV_EXT_PARAM_DEFAULT};
    move_checked(&c, false, false);
    move_checked(&c, true, false);
    move_checked(&c, false, true);
    move_checked(&c, true, true);

    /* One source block (16 tokens, 6,400 bytes) for all 2,048 tokens. */
    enum { REP = 2048 };
    for (uint64_t i = 0; i < REP / SB; i++)
        stab[i] = 0;
    c.s_blocks = 1;
    c.d_blocks = REP / DB;
    c.slice.src.num_blocks = REP / SB;
    c.slice.dst.num_blocks = REP / DB;
    c.slice.token_end = REP;
    move_checked(&c, false, false);
    move_checked(&c, false, true);
    free(stab);
    free(dtab);
}

/* A layer-wise slice push: 3 layers of 2 tensors, marked one by one. */
static void
test_layerwise_push(void **state)
{
    (void)state;
    llmdd_kv_layout sl = lay(false, 16, 2, 0, 2, 8), dl = lay(true, 8, 2, 0, 2, 8);
    llmdd_cache sc, dc;
    llmdd_cache_desc sd = desc_for(&sl, 4, 6), dsd = desc_for(&dl, 8, 6);
    assert_int_equal(llmdd_allocate_cache_layout(dd, &sd, &sl, &sc),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache_layout(src[1], &dsd, &dl, &dc),
                     LLM_SUCCESS);
    uint64_t st[4] = {1, 0, 3, 2}, dt[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    sc_case c = {.sl = sl, .dl = dl, .s_blocks = 4, .d_blocks = 8,
                 .h0 = 0, .h1 = 2};
    c.slice = (llmdd_kv_slice){.src = {st, 4, 0}, .dst = {dt, 8, 0},
                               .token_begin = 3, .token_end = 60,
                               .ext = LLMDD_KV_EXT_PARAM_DEFAULT};
    uint64_t ds = (uint64_t)dsd.shape[0] * (uint64_t)dsd.shape[1];
    uint8_t *ref[6];
    for (uint32_t t = 0; t < 6; t++) {
        sc_fill_src(&c, t, (uint8_t *)(uintptr_t)sc.tensor_addrs[t]);
        memset((void *)(uintptr_t)dc.tensor_addrs[t], SENT, ds);
        ref[t] = malloc(ds);
        memset(ref[t], SENT, ds);
        sc_reference(&c, (uint8_t *)(uintptr_t)sc.tensor_addrs[t], ref[t]);
    }
    llmdd_cache_index di = {2, dc.cache_id, 0};
    llmdd_xfer_opts o = {.flags = LLMDD_XFER_LAYERWISE, .notify = "lw",
                         .notify_len = 2};
    llmdd_request *req;
    assert_int_equal(
        llmdd_push_kv_slices_async(dd, &sc, &di, &c.slice, 1, &o, &req),
        LLM_SUCCESS);
    for (uint32_t l = 0; l < 3; l++) {
        assert_int_equal(llmdd_request_wait(req, 0), LLM_WAIT_PROC_TIMEOUT);
        assert_int_equal(llmdd_request_layer_ready(req, l), LLM_SUCCESS);
    }
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    assert_int_equal(notifies(src[1], 5000), 1);
    for (uint32_t t = 0; t < 6; t++) {
        assert_memory_equal((void *)(uintptr_t)dc.tensor_addrs[t], ref[t], ds);
        free(ref[t]);
    }
    assert_int_equal(llmdd_deallocate_cache(dd, sc.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(src[1], dc.cache_id),
                     LLM_SUCCESS);
}

/* ---- The check order: each case one failing check, nothing moved ---- */

static llmdd_cache g_dc, g_sc, g_plain, g_rplain, g_other;
static uint64_t g_ds;
static uint64_t g_stab[8] = {0, 1, 2, 3, 4, 5, 6, 7};
static uint64_t g_dtab[8] = {7, 6, 5, 4, 3, 2, 1, 0};

static llmdd_kv_slice
good_slice(void)
{
    return (llmdd_kv_slice){.src = {g_stab, 4, 0}, .dst = {g_dtab, 8, 0},
                            .token_begin = 0, .token_end = 60,
                            .ext = LLMDD_KV_EXT_PARAM_DEFAULT};
}

static void
expect(llmdd_status want, const llmdd_cache_index *si,
       const llmdd_kv_slice *sl, size_t n, const llmdd_cache *dc,
       const llmdd_xfer_opts *o)
{
    llmdd_request *req = NULL;
    assert_int_equal(llmdd_pull_kv_slices_async(dd, si, sl, n, dc, o, &req),
                     want);
    assert_null(req);
    const uint8_t *p = (const uint8_t *)(uintptr_t)g_dc.tensor_addrs[0];
    for (uint64_t i = 0; i < g_ds; i++)
        if (p[i] != SENT)
            fail_msg("byte %llu written by a refused request",
                     (unsigned long long)i);
}

static void
test_check_order(void **state)
{
    (void)state;
    llmdd_kv_layout sl = lay(false, 16, 2, 0, 2, 8), dl = lay(true, 8, 2, 0, 2, 8);
    llmdd_cache_desc sd = desc_for(&sl, 4, 2), dsd = desc_for(&dl, 8, 2);
    assert_int_equal(llmdd_allocate_cache_layout(src[0], &sd, &sl, &g_sc),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache_layout(dd, &dsd, &dl, &g_dc),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &dsd, &g_plain), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(src[0], &sd, &g_rplain),
                     LLM_SUCCESS);
    llmdd_kv_layout ol = sl;
    ol.head_bytes = 4, ol.block_size = 32; /* same block bytes, other heads */
    assert_int_equal(llmdd_allocate_cache_layout(src[0], &sd, &ol, &g_other),
                     LLM_SUCCESS);
    g_ds = (uint64_t)dsd.shape[0] * (uint64_t)dsd.shape[1];
    memset((void *)(uintptr_t)g_dc.tensor_addrs[0], SENT, g_ds);
    memset((void *)(uintptr_t)g_dc.tensor_addrs[1], SENT, g_ds);

    llmdd_cache_index si = {1, g_sc.cache_id, 0};
    llmdd_kv_slice s = good_slice(), b;
    llmdd_cache_index bi;
    llmdd_cache bc;
    llmdd_request *req;
    static llmdd_kv_slice many[LLMDD_SLICES_MAX + 1];
    static llmdd_cache_index many_i[LLMDD_SLICES_MAX + 1];

    /* Not initialized. */
    llmdd *cold;
    assert_int_equal(llmdd_create(77, LLMDD_ROLE_MIX, &cold), LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_slices(cold, &si, &s, 1, &g_dc),
                     LLM_FAILED);
    llmdd_destroy(cold);
    /* n. */
    expect(LLM_PARAM_INVALID, &si, &s, 0, &g_dc, NULL);
    for (int i = 0; i <= LLMDD_SLICES_MAX; i++)
        many[i] = s, many_i[i] = si;
    expect(LLM_CLUSTER_NUM_EXCEED_LIMIT, many_i, many, LLMDD_SLICES_MAX + 1,
           &g_dc, NULL);
    /* NULLs. */
    expect(LLM_PARAM_INVALID, NULL, &s, 1, &g_dc, NULL);
    expect(LLM_PARAM_INVALID, &si, NULL, 1, &g_dc, NULL);
    expect(LLM_PARAM_INVALID, &si, &s, 1, NULL, NULL);
    assert_int_equal(llmdd_pull_kv_slices_async(dd, &si, &s, 1, &g_dc, NULL,
                                                NULL),
                     LLM_PARAM_INVALID);
    b = s, b.src.blocks = NULL;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* Own cluster id; batch_index not 0. */
    bi = si, bi.cluster_id = SELF;
    expect(LLM_PARAM_INVALID, &bi, &s, 1, &g_dc, NULL);
    bi = si, bi.batch_index = 1;
    expect(LLM_PARAM_INVALID, &bi, &s, 1, &g_dc, NULL);
    /* Reversed or empty head range other than {0,0}. */
    b = s, b.head_begin = 1, b.head_end = 1;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    b = s, b.head_begin = 2, b.head_end = 1;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* Empty table for a slice that moves tokens. */
    b = s, b.src.num_blocks = 0;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* A destination table naming a block twice (a source may). */
    uint64_t twice[8] = {7, 6, 5, 4, 3, 2, 1, 7};
    b = s, b.dst.blocks = twice;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* ext shape. */
    b = s, b.ext.src_layer_range = (llmdd_layer_range){2, 1};
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* LAYERWISE on a pull. */
    llmdd_xfer_opts lw = {.flags = LLMDD_XFER_LAYERWISE};
    expect(LLM_PARAM_INVALID, &si, &s, 1, &g_dc, &lw);
    /* Layer-wise slices with source ranges of different widths (a push). */
    llmdd_kv_slice two[2] = {s, s};
    two[0].ext = (llmdd_kv_ext_param){{0, 0}, {0, 0}, 1};
    two[1].ext = (llmdd_kv_ext_param){{0, 1}, {0, 1}, 1};
    llmdd_cache_index two_i[2] = {si, si};
    req = NULL;
    assert_int_equal(llmdd_push_kv_slices_async(dd, &g_dc, two_i, two, 2, &lw,
                                                &req),
                     LLM_PARAM_INVALID);
    assert_null(req);
    /* The local cache: unknown, no layout. */
    bc = g_dc, bc.cache_id = 9999;
    expect(LLM_KV_CACHE_NOT_EXIST, &si, &s, 1, &bc, NULL);
    expect(LLM_CACHE_INCOMPATIBLE, &si, &s, 1, &g_plain, NULL);
    /* Misaligned first_token; a table not covering the tokens; a block out
     * of range (the local side is the destination of a pull). */
    b = s, b.dst.first_token = 3;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    b = s, b.dst.num_blocks = 7;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    uint64_t far[8] = {7, 6, 5, 4, 3, 2, 1, 8};
    b = s, b.dst.blocks = far;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* Not linked; the not-linked status wins over a bad remote table. */
    bi = si, bi.cluster_id = 55;
    expect(LLM_NOT_YET_LINK, &bi, &s, 1, &g_dc, NULL);
    b = s, b.src.num_blocks = 1;
    expect(LLM_NOT_YET_LINK, &bi, &b, 1, &g_dc, NULL);
    /* The remote cache: unknown; no layout; other head bytes. */
    bi = si, bi.cache_id = 9999;
    expect(LLM_KV_CACHE_NOT_EXIST, &bi, &s, 1, &g_dc, NULL);
    bi = si, bi.cache_id = g_rplain.cache_id;
    expect(LLM_CACHE_INCOMPATIBLE, &bi, &s, 1, &g_dc, NULL);
    bi = si, bi.cache_id = g_other.cache_id;
    expect(LLM_CACHE_INCOMPATIBLE, &bi, &s, 1, &g_dc, NULL);
    /* Slice 0's remote cache is incompatible (other head bytes), slice 1's
     * unknown: slice 0 decides, whatever the kind of its incompatibility. */
    llmdd_cache_index pair_i[2] = {si, si};
    llmdd_kv_slice pair[2] = {s, s};
    pair_i[0].cache_id = g_other.cache_id;
    pair_i[1].cache_id = 9999;
    expect(LLM_CACHE_INCOMPATIBLE, pair_i, pair, 2, &g_dc, NULL);
    llmdd_kv_layout got;
    assert_int_equal(llmdd_query_remote_layout(dd, 1, g_sc.cache_id, &got),
                     LLM_SUCCESS);
    assert_memory_equal(&got, &sl, sizeof(sl));
    assert_int_equal(llmdd_query_remote_layout(dd, 1, g_rplain.cache_id, &got),
                     LLM_CACHE_INCOMPATIBLE);
    assert_int_equal(llmdd_query_remote_layout(dd, 1, 9999, &got),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_query_remote_layout(dd, 55, g_sc.cache_id, &got),
                     LLM_NOT_YET_LINK);
    /* Its table: not covering; a block past its cache. */
    b = s, b.src.num_blocks = 3;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    uint64_t sfar[4] = {0, 1, 2, 4};
    b = s, b.src.blocks = sfar;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* Heads not held (a head past both sides). */
    b = s, b.head_begin = 1, b.head_end = 3;
    expect(LLM_PARAM_INVALID, &si, &b, 1, &g_dc, NULL);
    /* Two slices writing one destination (token, head); a bad k-th of n
     * slices posts nothing. */
    llmdd_kv_slice dup[2] = {s, s};
    dup[1].token_begin = 59, dup[1].token_end = 60;
    dup[1].head_begin = 1, dup[1].head_end = 2;
    expect(LLM_PARAM_INVALID, two_i, dup, 2, &g_dc, NULL);
    llmdd_kv_slice kth[3] = {s, s, s};
    kth[0].token_end = 20;
    kth[1].token_begin = 20, kth[1].token_end = 40;
    kth[2].token_begin = 40, kth[2].src.num_blocks = 2; /* covers 32 */
    llmdd_cache_index three_i[3] = {si, si, si};
    llmdd_xfer_opts note = {.notify = "no", .notify_len = 2};
    expect(LLM_PARAM_INVALID, three_i, kth, 3, &g_dc, &note);
    /* The same three, fixed, move; one notification to the one source. */
    kth[2].src.num_blocks = 4;
    req = NULL;
    assert_int_equal(llmdd_pull_kv_slices_async(dd, three_i, kth, 3, &g_dc,
                                                &note, &req),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    assert_int_equal(notifies(src[0], 5000), 1); /* none from the refusals */
    assert_int_equal(llmdd_deallocate_cache(dd, g_dc.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, g_plain.cache_id),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(src[0], g_sc.cache_id),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(src[0], g_rplain.cache_id),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(src[0], g_other.cache_id),
                     LLM_SUCCESS);
}

/* Layout creation rules reach the public calls. */
static void
test_layout_creation(void **state)
{
    (void)state;
    llmdd_kv_layout l = lay(false, 16, 2, 0, 2, 8);
    llmdd_cache_desc d = desc_for(&l, 4, 1);
    llmdd_cache c;
    d.shape[1] += 1; /* the product rule */
    assert_int_equal(llmdd_allocate_cache_layout(dd, &d, &l, &c),
                     LLM_PARAM_INVALID);
    d = desc_for(&l, 4, 1);
    assert_int_equal(llmdd_allocate_cache_layout(dd, &d, NULL, &c),
                     LLM_PARAM_INVALID);
    static uint8_t mem[4 * 16 * 2 * 8];
    uint64_t addr = (uint64_t)(uintptr_t)mem;
    int64_t id;
    assert_int_equal(llmdd_register_kv_cache_layout(dd, &d, &l, &addr, 1, &id),
                     LLM_SUCCESS);
    l.head_first = 1; /* 1 + 2 > 2 */
    int64_t id2;
    assert_int_equal(
        llmdd_register_kv_cache_layout(dd, &d, &l, &addr, 1, &id2),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_unregister_kv_cache(dd, id), LLM_SUCCESS);
}

int
main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s <transport> [cases]\n", argv[0]);
        return 2;
    }
    transport = argv[1];
    if (argc > 2)
        ncases = atoi(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_creation),
        cmocka_unit_test(test_check_order),
        cmocka_unit_test(test_random),
        cmocka_unit_test(test_four_sources),
        cmocka_unit_test(test_layerwise_push),
        cmocka_unit_test(test_large),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
