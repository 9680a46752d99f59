/*
 * The transport conformance suite: every pull and push shape of docs/model.md
 * against one transport, checked byte for byte against a model of every
 * cache on both sides, including the bytes that must not change.
 *
 *   conformance_test <transport> inproc|proc
 *
 * inproc: the peer instance lives in this process; proc: the peer is a
 * peer_helper process. The remote caches are read back with a full pull of
 * all blocks and compared with the model after every test.
 * LLMDD_TEST_TCP_LANES=N runs it with llm.TcpLanes=N on both instances (the
 * peer_helper's own requests are not striped, but ours are), so that every
 * large shape also goes through striping.
 */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness/fault_util.h"
#include "harness/harness.h"

#define NT 8
#define PEER 1
#define SELF 2

typedef struct {
    llmdd_cache_desc desc;
    uint64_t size, stride;
    uint8_t *t[NT];
} shadow;

static const char *transport;
static bool proc_mode;
static th_proc proc;
static llmdd *peer, *dd;
static th_peer_caches ids;
static uint16_t port;

/* Remote caches and their models. */
static shadow r_kv, r_reg, r_blocks, r_small;
/* Local caches, their models, and scratch caches for read-back. */
static llmdd_cache l_kv, l_blocks, l_small, s_kv, s_blocks, s_small;
static shadow m_kv, m_blocks, m_small;

static void
shadow_init(shadow *s, llmdd_cache_desc d, uint32_t seed)
{
    s->desc = d;
    s->size = th_tensor_size(&d);
    s->stride = s->size / (uint64_t)d.shape[0];
    for (int t = 0; t < NT; t++) {
        s->t[t] = malloc(s->size);
        assert_non_null(s->t[t]);
        th_fill_buf(s->t[t], s->size, seed, (uint32_t)t);
    }
}

static void
shadow_free(shadow *s)
{
    for (int t = 0; t < NT; t++)
        free(s->t[t]);
}

static void
local_new(llmdd_cache *c, shadow *m, llmdd_cache_desc d, uint32_t seed)
{
    assert_int_equal(llmdd_allocate_cache(dd, &d, c), LLM_SUCCESS);
    th_fill(c, seed);
    if (m != NULL)
        shadow_init(m, d, seed);
}

static void
verify_local(const llmdd_cache *c, const shadow *m)
{
    for (int t = 0; t < NT; t++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)c->tensor_addrs[t];
        for (uint64_t i = 0; i < m->size; i++)
            if (p[i] != m->t[t][i])
                fail_msg("local cache %lld tensor %d byte %llu: %u != %u",
                         (long long)c->cache_id, t, (unsigned long long)i, p[i],
                         m->t[t][i]);
    }
}

/* Reads the whole remote cache back into scratch and compares. */
static void
verify_remote(int64_t id, const shadow *m, const llmdd_cache *scratch)
{
    uint64_t n = (uint64_t)m->desc.shape[0];
    uint64_t *blocks = malloc(n * sizeof(*blocks));
    llmdd_cache_index idx = {PEER, id, 0};

    for (uint64_t i = 0; i < n; i++)
        blocks[i] = i;
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &idx, scratch, blocks, blocks, n, NULL),
        LLM_SUCCESS);
    free(blocks);
    verify_local(scratch, m);
}

static void
verify_all(void)
{
    verify_local(&l_kv, &m_kv);
    verify_local(&l_blocks, &m_blocks);
    verify_local(&l_small, &m_small);
    verify_remote(ids.kv, &r_kv, &s_kv);
    verify_remote(ids.reg, &r_reg, &s_kv);
    verify_remote(ids.blocks, &r_blocks, &s_blocks);
    verify_remote(ids.small, &r_small, &s_small);
}

/* Model of a transfer: tensors [sf, sf+count) -> [df, df+count). */
static void
model_copy(shadow *dst, const shadow *src, uint32_t df, uint32_t sf,
           uint32_t count, uint64_t doff, uint64_t soff, uint64_t len)
{
    for (uint32_t i = 0; i < count; i++)
        memmove(dst->t[df + i] + doff, src->t[sf + i] + soff, len);
}

static void
model_blocks(shadow *dst, const shadow *src, uint32_t df, uint32_t sf,
             uint32_t count, const uint64_t *sb, const uint64_t *db, size_t n)
{
    for (size_t k = 0; k < n; k++)
        model_copy(dst, src, df, sf, count, db[k] * dst->stride,
                   sb[k] * src->stride, src->stride);
}

static int
setup(void **state)
{
    (void)state;
    if (llmdd_create(SELF, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS)
        return -1;
    const char *lanes = getenv("LLMDD_TEST_TCP_LANES");
    llmdd_option o = {"llm.Transport", transport};
    llmdd_option po[] = {o, {"llm.TcpLanes", lanes != NULL ? lanes : "1"}};
    if (proc_mode) {
        const char *args[] = {"--cluster", "1", "--transport", transport, NULL};
        if (th_proc_start(&proc, NULL, args) != 0)
            return -1;
        port = proc.port;
        ids = proc.ids;
    } else {
        if (llmdd_create(PEER, LLMDD_ROLE_MIX, &peer) != LLM_SUCCESS ||
            th_init_listen(peer, "127.0.0.1", &port, po, 2) != LLM_SUCCESS ||
            th_peer_setup(peer, &ids) != 0)
            return -1;
    }
    /* Correctness, not speed: a loaded 2-core host under a sanitizer can
     * take more than the default second for test_large_pull's 64 MiB. */
    llmdd_option mine[] = {o, {"llm.SyncKvCacheWaitTime", "10000"}, po[1]};
    if (llmdd_initialize(dd, mine, 3) != LLM_SUCCESS)
        return -1;
    if (th_link(dd, PEER, "127.0.0.1", port, 5000) != LLM_SUCCESS)
        return -1;
    shadow_init(&r_kv, th_desc_kv(), 1);
    shadow_init(&r_reg, th_desc_kv(), 2);
    shadow_init(&r_blocks, th_desc_blocks(), 3);
    shadow_init(&r_small, th_desc_small(), 4);
    local_new(&l_kv, &m_kv, th_desc_kv(), 101);
    local_new(&l_blocks, &m_blocks, th_desc_blocks(), 102);
    local_new(&l_small, &m_small, th_desc_small(), 103);
    local_new(&s_kv, NULL, th_desc_kv(), 0);
    local_new(&s_blocks, NULL, th_desc_blocks(), 0);
    local_new(&s_small, NULL, th_desc_small(), 0);
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    llmdd_destroy(dd);
    if (proc_mode) {
        th_proc_stop(&proc);
    } else {
        th_peer_teardown(peer, &ids);
        llmdd_destroy(peer);
    }
    shadow *all[] = {&r_kv, &r_reg,    &r_blocks, &r_small,
                     &m_kv, &m_blocks, &m_small};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        shadow_free(all[i]);
    return 0;
}

static void
test_initial_state(void **state)
{
    (void)state;
    verify_all();
}

static void
test_pull_full_slot(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 2};

    (void)state;
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &l_kv, 1, -1, NULL),
                     LLM_SUCCESS);
    model_copy(&m_kv, &r_kv, 0, 0, NT, 1 * 1024, 2 * 1024, 1024);
    verify_all();
}

static void
test_pull_partial_size(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 3};

    (void)state;
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &l_kv, 0, 100, NULL),
                     LLM_SUCCESS);
    model_copy(&m_kv, &r_kv, 0, 0, NT, 0, 3 * 1024, 100);
    verify_all();
}

static void
test_pull_layer_range(void **state)
{
    llmdd_cache_index idx = {PEER, ids.reg, 0};
    llmdd_kv_ext_param ext = {{1, 2}, {2, 3}, 2};

    (void)state;
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &l_kv, 3, -1, &ext),
                     LLM_SUCCESS);
    model_copy(&m_kv, &r_reg, 4, 2, 4, 3 * 1024, 0, 1024);
    verify_all();
}

static void
test_pull_registered(void **state)
{
    llmdd_cache_index idx = {PEER, ids.reg, 1};

    (void)state;
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &l_kv, 2, -1, NULL),
                     LLM_SUCCESS);
    model_copy(&m_kv, &r_reg, 0, 0, NT, 2 * 1024, 1024, 1024);
    verify_all();
}

static void
test_pull_smaller_stride(void **state)
{
    /* A remote slot larger than the local one: size = local stride. */
    llmdd_cache_index idx = {PEER, ids.kv, 1};

    (void)state;
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &l_small, 2, -1, NULL),
                     LLM_SUCCESS);
    model_copy(&m_small, &r_kv, 0, 0, NT, 2 * 512, 1024, 512);
    verify_all();
}

static void
test_pull_blocks_scattered(void **state)
{
    /* A contiguous run, an unsorted tail and a repeated source block. */
    uint64_t sb[] = {5, 6, 7, 0, 63, 5, 40};
    uint64_t db[] = {10, 11, 12, 40, 0, 1, 2};
    llmdd_cache_index idx = {PEER, ids.blocks, 0};

    (void)state;
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &l_blocks, sb, db, 7, NULL),
                     LLM_SUCCESS);
    model_blocks(&m_blocks, &r_blocks, 0, 0, NT, sb, db, 7);
    verify_all();
}

static void
test_pull_blocks_duplicate_dst(void **state)
{
    uint64_t sb[] = {20, 21};
    uint64_t db[] = {30, 30};
    llmdd_cache_index idx = {PEER, ids.blocks, 0};

    (void)state;
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &l_blocks, sb, db, 2, NULL),
                     LLM_SUCCESS);
    model_blocks(&m_blocks, &r_blocks, 0, 0, NT, sb, db, 2);
    verify_all();
}

static void
test_pull_blocks_layer_range(void **state)
{
    uint64_t sb[] = {1, 2, 3, 9};
    uint64_t db[] = {50, 51, 52, 60};
    llmdd_cache_index idx = {PEER, ids.blocks, 0};
    llmdd_kv_ext_param ext = {{0, 0}, {3, 3}, 2};

    (void)state;
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &l_blocks, sb, db, 4, &ext),
                     LLM_SUCCESS);
    model_blocks(&m_blocks, &r_blocks, 6, 0, 2, sb, db, 4);
    verify_all();
}

static void
test_pull_blocks_many_runs(void **state)
{
    /* More runs than one wire request carries: every other block of a
     * 140000-block cache, in reverse order. */
    char reply[64];
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {140000, 8}};
    llmdd_cache local;
    int64_t rid;
    size_t n = 70000;

    (void)state;
    if (proc_mode) {
        assert_int_equal(
            th_proc_cmd(&proc, "alloc-blocks 140000 8 7", reply, sizeof(reply)),
            0);
        rid = atoll(reply + 3);
    } else {
        llmdd_cache c;
        assert_int_equal(llmdd_allocate_cache(peer, &d, &c), LLM_SUCCESS);
        th_fill(&c, 7);
        rid = c.cache_id;
    }
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    uint64_t *sb = malloc(n * sizeof(*sb)), *db = malloc(n * sizeof(*db));
    for (size_t k = 0; k < n; k++) {
        sb[k] = 2 * (n - 1 - k);
        db[k] = 2 * k + 1;
    }
    llmdd_cache_index idx = {PEER, rid, 0};
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &local, sb, db, n, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 2; t++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)local.tensor_addrs[t];
        for (size_t k = 0; k < n; k++)
            for (int i = 0; i < 8; i++)
                assert_int_equal(p[db[k] * 8 + (uint64_t)i],
                                 th_byte(7, t, sb[k] * 8 + (uint64_t)i));
        for (size_t k = 0; k < n; k++)
            for (int i = 0; i < 8; i++)
                assert_int_equal(p[2 * k * 8 + (uint64_t)i], 0);
    }
    free(sb);
    free(db);
    assert_int_equal(llmdd_deallocate_cache(dd, local.cache_id), LLM_SUCCESS);
}

/*
 * Repeated blocks that add up to more than a whole tensor: the serving side
 * takes at most a tensor's worth of bytes per tensor in one request, so the
 * requester must split the plan, and both directions still work.
 */
static void
test_blocks_more_than_a_tensor(void **state)
{
    enum { NB = 64, EXTRA = 3 }; /* th_desc_blocks: 64 blocks */
    uint64_t sb[NB + EXTRA], db[NB + EXTRA];
    llmdd_cache_index idx = {PEER, ids.blocks, 0};

    (void)state;
    for (uint64_t k = 0; k < NB; k++)
        sb[k] = db[k] = k;
    for (uint64_t k = 0; k < EXTRA; k++) {
        sb[NB + k] = 40 + k;
        db[NB + k] = 5 + k;
    }
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &idx, &l_blocks, sb, db, NB + EXTRA, NULL),
        LLM_SUCCESS);
    model_blocks(&m_blocks, &r_blocks, 0, 0, NT, sb, db, NB + EXTRA);
    verify_all();
    assert_int_equal(
        llmdd_push_kv_blocks(dd, &l_blocks, &idx, db, sb, NB + EXTRA, NULL),
        LLM_SUCCESS);
    model_blocks(&r_blocks, &m_blocks, 0, 0, NT, db, sb, NB + EXTRA);
    verify_all();
}

/* A remote cache of 2 uint8 tensors [blocks, stride] filled with seed. */
static int64_t
remote_blocks_cache(uint32_t blocks, uint32_t stride, uint32_t seed)
{
    char cmd[64], reply[64];

    if (proc_mode) {
        snprintf(cmd, sizeof(cmd), "alloc-blocks %u %u %u", blocks, stride,
                 seed);
        assert_int_equal(th_proc_cmd(&proc, cmd, reply, sizeof(reply)), 0);
        return atoll(reply + 3);
    }
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {blocks, stride}};
    llmdd_cache c;
    assert_int_equal(llmdd_allocate_cache(peer, &d, &c), LLM_SUCCESS);
    th_fill(&c, seed);
    return c.cache_id;
}

/* Model of llmdd_pull_kv_cache_to_blocks: chunk k of the source slot lands
 * in dst block db[k]; the last chunk may be short. */
static void
model_slot_blocks(shadow *dst, const shadow *src, uint32_t df, uint32_t sf,
                  uint32_t count, uint64_t slot, const uint64_t *db, size_t n)
{
    for (size_t k = 0; k < n; k++) {
        uint64_t off = k * dst->stride;
        uint64_t len =
            src->stride - off < dst->stride ? src->stride - off : dst->stride;
        model_copy(dst, src, df, sf, count, db[k] * dst->stride,
                   slot * src->stride + off, len);
    }
}

/*
 * A batch slot of a cache without blocks into blocks of a block cache (the
 * reference's pull_blocks from a CacheKey): a 1024-byte slot into four
 * 256-byte blocks, scattered, two of them contiguous.
 */
static void
test_pull_slot_into_blocks(void **state)
{
    uint64_t db[] = {9, 3, 4, 60};
    llmdd_cache_index idx = {PEER, ids.kv, 2};

    (void)state;
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &idx, &l_blocks, db, 4, NULL),
        LLM_SUCCESS);
    model_slot_blocks(&m_blocks, &r_kv, 0, 0, NT, 2, db, 4);
    verify_all();

    /* Posted, with layer ranges: layers 1..2 of the slot into 2..3. */
    llmdd_kv_ext_param ext = {{1, 2}, {2, 3}, 2};
    uint64_t db2[] = {20, 21, 22, 23};
    llmdd_request *req = NULL;
    idx.cache_id = ids.reg;
    idx.batch_index = 3;
    assert_int_equal(llmdd_pull_kv_cache_to_blocks_async(
                         dd, &idx, &l_blocks, db2, 4, &ext, NULL, &req),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    model_slot_blocks(&m_blocks, &r_reg, 4, 2, 4, 3, db2, 4);
    verify_all();
}

/*
 * A slot that is not a whole number of blocks: the last chunk is short and
 * the rest of its block stays as it was. The source has 2 tensors, mapped
 * onto tensors 6..7 of the destination by a layer range.
 */
static void
test_pull_slot_into_blocks_short_tail(void **state)
{
    enum { SLOT = 600, SEED = 9 };
    int64_t rid = remote_blocks_cache(3, SLOT, SEED);
    uint64_t db[] = {33, 12, 13}; /* ceil(600 / 256) = 3 */
    llmdd_cache_index idx = {PEER, rid, 1};
    llmdd_kv_ext_param ext = {{-1, -1}, {3, 3}, 2};
    shadow src;

    (void)state;
    src.desc = (llmdd_cache_desc){.num_tensors = 2,
                                  .data_type = LLMDD_DT_UINT8,
                                  .num_dims = 2,
                                  .shape = {3, SLOT}};
    src.size = 3 * SLOT;
    src.stride = SLOT;
    for (int t = 0; t < 2; t++) {
        src.t[t] = malloc(src.size);
        assert_non_null(src.t[t]);
        th_fill_buf(src.t[t], src.size, SEED, (uint32_t)t);
    }
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &idx, &l_blocks, db, 3, &ext),
        LLM_SUCCESS);
    model_slot_blocks(&m_blocks, &src, 6, 0, 2, 1, db, 3);
    verify_all();

    /* The block count must be ceil(slot / block): 2 and 4 are refused,
     * and so are a slot out of range and a block out of range. */
    uint64_t db4[] = {0, 1, 2, 5}, out[] = {0, 64, 1};
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &idx, &l_blocks, db, 2, &ext),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &idx, &l_blocks, db4, 4, &ext),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &idx, &l_blocks, out, 3, &ext),
        LLM_PARAM_INVALID);
    idx.batch_index = 3;
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &idx, &l_blocks, db, 3, &ext),
        LLM_PARAM_INVALID);
    /* Without ranges the tensor counts differ (2 and 8). */
    idx.batch_index = 0;
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &idx, &l_blocks, db, 3, NULL),
        LLM_PARAM_INVALID);
    verify_all();
    for (int t = 0; t < 2; t++)
        free(src.t[t]);
}

/*
 * The mirror image: a local slot into remote blocks, whole and then layer
 * by layer (posted with LLMDD_XFER_LAYERWISE, layers marked in turn).
 */
static void
test_push_slot_into_blocks(void **state)
{
    uint64_t db[] = {10, 50, 51, 2};
    llmdd_cache_index idx = {PEER, ids.blocks, 0};

    (void)state;
    assert_int_equal(
        llmdd_push_kv_cache_to_blocks(dd, &l_kv, &idx, 1, db, 4, NULL),
        LLM_SUCCESS);
    model_slot_blocks(&r_blocks, &m_kv, 0, 0, NT, 1, db, 4);
    verify_all();

    uint64_t db2[] = {30, 31, 32, 33};
    llmdd_xfer_opts lw = {.flags = LLMDD_XFER_LAYERWISE};
    llmdd_request *req = NULL;
    assert_int_equal(llmdd_push_kv_cache_to_blocks_async(
                         dd, &l_kv, &idx, 3, db2, 4, NULL, &lw, &req),
                     LLM_SUCCESS);
    for (uint32_t layer = 0; layer < NT / 2; layer++)
        assert_int_equal(llmdd_request_layer_ready(req, layer), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    model_slot_blocks(&r_blocks, &m_kv, 0, 0, NT, 3, db2, 4);
    verify_all();

    /* A block count that does not fit, a remote batch index other than 0,
     * a remote block out of range: refused, nothing moves. */
    assert_int_equal(
        llmdd_push_kv_cache_to_blocks(dd, &l_kv, &idx, 1, db, 3, NULL),
        LLM_PARAM_INVALID);
    uint64_t out[] = {0, 1, 64, 3};
    assert_int_equal(
        llmdd_push_kv_cache_to_blocks(dd, &l_kv, &idx, 1, out, 4, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_push_kv_cache_to_blocks(dd, &l_kv, &idx, 4, db, 4, NULL),
        LLM_PARAM_INVALID);
    idx.batch_index = 1;
    assert_int_equal(
        llmdd_push_kv_cache_to_blocks(dd, &l_kv, &idx, 1, db, 4, NULL),
        LLM_PARAM_INVALID);
    verify_all();
}

static void
test_push_slot(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 0};

    (void)state;
    assert_int_equal(llmdd_push_kv_cache(dd, &l_kv, &idx, 2, -1, NULL),
                     LLM_SUCCESS);
    model_copy(&r_kv, &m_kv, 0, 0, NT, 0, 2 * 1024, 1024);
    verify_all();
}

static void
test_push_layers_and_size(void **state)
{
    llmdd_cache_index idx = {PEER, ids.reg, 3};
    llmdd_kv_ext_param ext = {{3, 3}, {0, 0}, 2};

    (void)state;
    assert_int_equal(llmdd_push_kv_cache(dd, &l_kv, &idx, 1, 300, &ext),
                     LLM_SUCCESS);
    model_copy(&r_reg, &m_kv, 0, 6, 2, 3 * 1024, 1024, 300);
    verify_all();
}

static void
test_push_blocks(void **state)
{
    uint64_t sb[] = {0, 1, 2, 3, 17, 4};
    uint64_t db[] = {60, 61, 62, 63, 0, 0};
    llmdd_cache_index idx = {PEER, ids.blocks, 0};

    (void)state;
    assert_int_equal(llmdd_push_kv_blocks(dd, &l_blocks, &idx, sb, db, 6, NULL),
                     LLM_SUCCESS);
    model_blocks(&r_blocks, &m_blocks, 0, 0, NT, sb, db, 6);
    verify_all();
}

static void
test_rejected_calls_change_nothing(void **state)
{
    uint64_t b1[] = {1}, b_out[] = {64}, b2[] = {2};
    llmdd_cache_index kv = {PEER, ids.kv, 0};
    llmdd_cache_index kv_bad_bi = {PEER, ids.kv, 4};
    llmdd_cache_index gone = {PEER, 999999, 0};
    llmdd_cache_index unlinked = {77, ids.kv, 0};
    llmdd_cache_index own = {SELF, ids.kv, 0};
    llmdd_cache_index small = {PEER, ids.small, 0};
    llmdd_cache_index blocks = {PEER, ids.blocks, 0};
    llmdd_cache_index blocks_bi = {PEER, ids.blocks, 1};
    llmdd_kv_ext_param bad_layer = {{0, 4}, {0, 4}, 2};
    llmdd_kv_ext_param width = {{0, 1}, {0, 0}, 2};
    llmdd_cache ghost = l_kv;

    (void)state;
    ghost.cache_id = 424242;
    assert_int_equal(llmdd_pull_kv_cache(dd, &gone, &l_kv, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_pull_kv_cache(dd, &kv_bad_bi, &l_kv, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &unlinked, &l_kv, 0, -1, NULL),
                     LLM_NOT_YET_LINK);
    assert_int_equal(llmdd_pull_kv_cache(dd, &own, &l_kv, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &kv, &ghost, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    /* The remote slot (512) is smaller than the local one (1024). */
    assert_int_equal(llmdd_pull_kv_cache(dd, &small, &l_kv, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &small, &l_kv, 0, 513, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &kv, &l_kv, 0, 0, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &kv, &l_kv, 0, -2, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &kv, &l_kv, 4, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &kv, &l_kv, 0, -1, &bad_layer),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &kv, &l_kv, 0, -1, &width),
                     LLM_PARAM_INVALID);
    /* Blocks: stride mismatch, out of range, batch index, empty list. */
    assert_int_equal(llmdd_pull_kv_blocks(dd, &kv, &l_blocks, b1, b1, 1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &blocks, &l_blocks, b_out, b1, 1, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &blocks, &l_blocks, b1, b_out, 1, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &blocks_bi, &l_blocks, b1, b2, 1, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &blocks, &l_blocks, b1, b2, 0, NULL),
        LLM_PARAM_INVALID);
    /* Pushes: the same checks on the other side. */
    assert_int_equal(llmdd_push_kv_cache(dd, &l_kv, &gone, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_push_kv_cache(dd, &l_kv, &small, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_push_kv_blocks(dd, &l_blocks, &blocks, b1, b_out, 1, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_push_kv_blocks(dd, &l_blocks, &kv, b1, b1, 1, NULL),
                     LLM_PARAM_INVALID);
    verify_all();
}

/* The peer allocates a th_desc_kv cache filled with seed; returns its id. */
static int64_t
remote_alloc(uint32_t seed)
{
    char cmd[32], reply[64];

    if (proc_mode) {
        snprintf(cmd, sizeof(cmd), "alloc %u", seed);
        assert_int_equal(th_proc_cmd(&proc, cmd, reply, sizeof(reply)), 0);
        return atoll(reply + 3);
    }
    llmdd_cache c;
    llmdd_cache_desc d = th_desc_kv();
    assert_int_equal(llmdd_allocate_cache(peer, &d, &c), LLM_SUCCESS);
    th_fill(&c, seed);
    return c.cache_id;
}

static void
remote_dealloc(int64_t id)
{
    char cmd[48];

    if (proc_mode) {
        snprintf(cmd, sizeof(cmd), "dealloc %lld", (long long)id);
        assert_int_equal(th_proc_cmd(&proc, cmd, NULL, 0), 0);
    } else {
        assert_int_equal(llmdd_deallocate_cache(peer, id), LLM_SUCCESS);
    }
}

static void
test_cache_made_after_link(void **state)
{
    (void)state;
    int64_t id = remote_alloc(9);
    shadow m;
    shadow_init(&m, th_desc_kv(), 9);
    verify_remote(id, &m, &s_kv);
    shadow_free(&m);

    /* Once the owner deallocates it, it can be neither read nor written,
     * although this side has seen it. */
    remote_dealloc(id);
    llmdd_cache_index idx = {PEER, id, 0};
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &s_kv, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_push_kv_cache(dd, &l_kv, &idx, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    verify_all();
}

/* The peer binds `key` to (id, slot); returns that call's status. */
static llmdd_status
peer_key(int64_t id, uint32_t slot, const char *key)
{
    char cmd[128], reply[64];

    if (!proc_mode)
        return llmdd_set_cache_key(peer, id, slot, key, strlen(key));
    snprintf(cmd, sizeof(cmd), "key %lld %u %s", (long long)id, slot, key);
    if (th_proc_cmd(&proc, cmd, reply, sizeof(reply)) == 0)
        return LLM_SUCCESS;
    return strstr(reply, "LLM_CACHE_KEY_ALREADY_EXIST") != NULL
               ? LLM_CACHE_KEY_ALREADY_EXIST
               : LLM_FAILED;
}

static void
test_cache_keys(void **state)
{
    llmdd_cache_index idx, before = {7, 7, 7};
    const char *key = "req-42/blocks";

    (void)state;
    /* Unknown key, then bound: the pull by key moves the right slot. */
    idx = before;
    assert_int_equal(llmdd_lookup_remote_key(dd, PEER, key, strlen(key), &idx),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_memory_equal(&idx, &before, sizeof(idx));
    assert_int_equal(peer_key(ids.kv, 3, key), LLM_SUCCESS);
    assert_int_equal(peer_key(ids.kv, 1, key), LLM_CACHE_KEY_ALREADY_EXIST);
    assert_int_equal(llmdd_lookup_remote_key(dd, PEER, key, strlen(key), &idx),
                     LLM_SUCCESS);
    assert_int_equal(idx.cluster_id, PEER);
    assert_int_equal(idx.cache_id, ids.kv);
    assert_int_equal(idx.batch_index, 3); /* the first binding stays */
    /* Keys are bytes compared by length: a prefix is another key. */
    assert_int_equal(
        llmdd_lookup_remote_key(dd, PEER, key, strlen(key) - 1, &idx),
        LLM_KV_CACHE_NOT_EXIST);
    /* Bad arguments and unlinked clusters change nothing. */
    assert_int_equal(llmdd_lookup_remote_key(dd, PEER, key, 0, &idx),
                     LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_lookup_remote_key(dd, PEER, key, LLMDD_KEY_MAX + 1, &idx),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_lookup_remote_key(dd, PEER, NULL, 3, &idx),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_lookup_remote_key(dd, PEER, key, strlen(key), NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_lookup_remote_key(dd, 99, key, strlen(key), &idx),
                     LLM_NOT_YET_LINK);
    /* Removed: unknown again; removing twice is fine. */
    if (proc_mode) {
        char cmd[64];
        snprintf(cmd, sizeof(cmd), "unkey %s", key);
        assert_int_equal(th_proc_cmd(&proc, cmd, NULL, 0), 0);
        assert_int_equal(th_proc_cmd(&proc, cmd, NULL, 0), 0);
    } else {
        assert_int_equal(llmdd_remove_cache_key(peer, key, strlen(key)),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_remove_cache_key(peer, key, strlen(key)),
                         LLM_SUCCESS);
    }
    assert_int_equal(llmdd_lookup_remote_key(dd, PEER, key, strlen(key), &idx),
                     LLM_KV_CACHE_NOT_EXIST);
    verify_all();
}

/* ---- Requests (0.2): the same transfers posted. ---- */

/*
 * The notifications the peer received within timeout_ms, as
 * " <sender>:<message>" each after "OK <n>" (peer_helper's format).
 */
static void
peer_notifies(char *out, size_t cap, int timeout_ms)
{
    if (proc_mode) {
        char cmd[32];
        snprintf(cmd, sizeof(cmd), "notifies %d", timeout_ms);
        assert_int_equal(th_proc_cmd(&proc, cmd, out, cap), 0);
        return;
    }
    llmdd_notify got[16];
    struct pollfd p = {.fd = llmdd_notify_fd(peer), .events = POLLIN};
    size_t n = 0, off;
    if (poll(&p, 1, timeout_ms) == 1)
        assert_int_equal(llmdd_get_notifies(peer, got, 16, &n), LLM_SUCCESS);
    off = (size_t)snprintf(out, cap, "OK %zu", n);
    for (size_t i = 0; i < n && off < cap; i++)
        off += (size_t)snprintf(out + off, cap - off, " %llu:%.*s",
                                (unsigned long long)got[i].cluster_id,
                                (int)got[i].len, (const char *)got[i].msg);
}

static void
test_async_pulls(void **state)
{
    enum { N = 24 };
    llmdd_request *req[N];
    uint64_t sb[N], db[N];
    llmdd_cache_index bidx = {PEER, ids.blocks, 0};

    (void)state;
    /* Many in flight at once: single blocks, scattered both ways. */
    for (int i = 0; i < N; i++) {
        sb[i] = (uint64_t)(i * 7 + 3) % 64;
        db[i] = (uint64_t)(63 - i * 2);
        assert_int_equal(llmdd_pull_kv_blocks_async(dd, &bidx, &l_blocks,
                                                    &sb[i], &db[i], 1, NULL,
                                                    NULL, &req[i]),
                         LLM_SUCCESS);
    }
    llmdd_cache_index kidx = {PEER, ids.kv, 1};
    llmdd_request *slot;
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &kidx, &l_kv, 3, -1, NULL, NULL, &slot),
        LLM_SUCCESS);
    for (int i = 0; i < N; i++) {
        assert_int_equal(llmdd_request_wait(req[i], -1), LLM_SUCCESS);
        /* Done stays done: the status is kept. */
        assert_int_equal(llmdd_request_wait(req[i], 0), LLM_SUCCESS);
        llmdd_request_free(req[i]);
    }
    assert_int_equal(llmdd_request_wait(slot, 5000), LLM_SUCCESS);
    llmdd_request_free(slot);
    model_blocks(&m_blocks, &r_blocks, 0, 0, NT, sb, db, N);
    model_copy(&m_kv, &r_kv, 0, 0, NT, 3 * 1024, 1 * 1024, 1024);
    verify_all();
}

static void
test_async_push_with_notification(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 2};
    llmdd_xfer_opts o = {.notify = "slot-2-landed", .notify_len = 13};
    llmdd_request *req;
    char got[512];

    (void)state;
    peer_notifies(got, sizeof(got), 0); /* nothing left from before */
    assert_string_equal(got, "OK 0");
    assert_int_equal(
        llmdd_push_kv_cache_async(dd, &l_kv, &idx, 0, -1, NULL, &o, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    model_copy(&r_kv, &m_kv, 0, 0, NT, 2 * 1024, 0, 1024);
    peer_notifies(got, sizeof(got), 5000);
    assert_string_equal(got, "OK 1 2:slot-2-landed");
    verify_all();

    /* A pull's notification goes to the source, once the bytes landed. */
    llmdd_xfer_opts po = {.notify = "pulled", .notify_len = 6};
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &idx, &l_kv, 1, -1, NULL, &po, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    model_copy(&m_kv, &r_kv, 0, 0, NT, 1 * 1024, 2 * 1024, 1024);
    peer_notifies(got, sizeof(got), 5000);
    assert_string_equal(got, "OK 1 2:pulled");

    /* Plain notifications: in order, each once. */
    for (int i = 0; i < 5; i++) {
        char m[8];
        snprintf(m, sizeof(m), "n%d", i);
        assert_int_equal(llmdd_send_notify(dd, PEER, m, strlen(m)),
                         LLM_SUCCESS);
    }
    char all[512] = "OK 0";
    for (int tries = 0; tries < 50 && strcmp(all, "OK 5 2:n0 2:n1 2:n2 2:n3 "
                                                  "2:n4") != 0;
         tries++) {
        /* They may arrive over several reads; gather them. */
        int have = atoi(all + 3);
        peer_notifies(got, sizeof(got), 2000);
        int more = atoi(got + 3);
        char *rest = strchr(got + 3, ' ');
        snprintf(all, sizeof(all), "OK %d%s%s", have + more,
                 strchr(all + 3, ' ') ? strchr(all + 3, ' ') : "",
                 rest ? rest : "");
        if (more == 0)
            break;
    }
    assert_string_equal(all, "OK 5 2:n0 2:n1 2:n2 2:n3 2:n4");
    verify_all();
}

static void
test_async_layerwise_push(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 0};
    llmdd_xfer_opts o = {.flags = LLMDD_XFER_LAYERWISE,
                         .notify = "all-layers",
                         .notify_len = 10};
    llmdd_request *req;
    char got[256];

    (void)state;
    /* 8 tensors, 2 a layer: layers 0..3, marked out of order. */
    assert_int_equal(
        llmdd_push_kv_cache_async(dd, &l_kv, &idx, 3, -1, NULL, &o, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_layer_ready(req, 4), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_request_layer_ready(req, 2), LLM_SUCCESS);
    assert_int_equal(llmdd_request_layer_ready(req, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_request_layer_ready(req, 2), LLM_SUCCESS);
    /* Two layers are not marked: it cannot be done, and never times out. */
    assert_int_equal(llmdd_request_wait(req, 50), LLM_WAIT_PROC_TIMEOUT);
    peer_notifies(got, sizeof(got), 0);
    assert_string_equal(got, "OK 0");
    assert_int_equal(llmdd_request_layer_ready(req, 3), LLM_SUCCESS);
    assert_int_equal(llmdd_request_layer_ready(req, 1), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    model_copy(&r_kv, &m_kv, 0, 0, NT, 0, 3 * 1024, 1024);
    peer_notifies(got, sizeof(got), 5000);
    assert_string_equal(got, "OK 1 2:all-layers");
    verify_all();

    /*
     * Cancelled with one of its three layers marked: the unmarked ones never
     * move. The marked one may have gone out, and a cancelled push's bytes
     * in flight may still land after cancel returned (docs/model.md), so it
     * goes to a cache of its own, whose marked tensors nobody reads; the
     * deallocation at the end waits until the peer is done with it.
     */
    int64_t fresh = remote_alloc(9);
    shadow m;
    shadow_init(&m, th_desc_kv(), 9);
    llmdd_cache_index to = {PEER, fresh, 0};
    llmdd_kv_ext_param ext = {{1, 3}, {1, 3}, 2};
    assert_int_equal(
        llmdd_push_kv_cache_async(dd, &l_kv, &to, 1, -1, &ext, &o, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_layer_ready(req, 3), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_request_layer_ready(req, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_request_cancel(req), LLM_SUCCESS);
    assert_int_equal(llmdd_request_cancel(req), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, 0), LLM_FAILED);
    llmdd_request_free(req);
    /* Layer 0 of the range is tensors 2,3; the unmarked layers, tensors
     * 4..7 of slot 0, still hold what the peer wrote. */
    llmdd_kv_ext_param unmarked = {{2, 3}, {2, 3}, 2};
    assert_int_equal(
        llmdd_pull_kv_cache(dd, &to, &s_kv, 0, -1, &unmarked), LLM_SUCCESS);
    for (uint32_t t = 4; t < NT; t++)
        assert_memory_equal((const void *)(uintptr_t)s_kv.tensor_addrs[t],
                            m.t[t], m.stride);
    shadow_free(&m);
    remote_dealloc(fresh);
    /* s_kv is scratch; the rest is as it was. */
    verify_all();
}

static void
test_async_bad_arguments(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 0};
    llmdd_request *req = (llmdd_request *)(uintptr_t)0x1;
    llmdd_xfer_opts lw = {.flags = LLMDD_XFER_LAYERWISE};
    llmdd_xfer_opts nullmsg = {.notify = NULL, .notify_len = 4};
    llmdd_xfer_opts big = {.notify = "x", .notify_len = LLMDD_NOTIFY_MAX + 1};
    llmdd_xfer_opts flag = {.flags = 0x4}; /* no such flag */
    llmdd_kv_ext_param three = {{-1, -1}, {-1, -1}, 3};
    uint64_t b = 0;

    (void)state;
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &idx, &l_kv, 0, -1, NULL, NULL, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &idx, &l_kv, 0, -1, NULL, &lw, &req),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_blocks_async(dd, &idx, &l_kv, &b, &b, 1,
                                                NULL, &nullmsg, &req),
                     LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_push_kv_cache_async(dd, &l_kv, &idx, 0, -1, NULL, &big, &req),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_push_kv_blocks_async(dd, &l_kv, &idx, &b, &b, 1,
                                                NULL, &flag, &req),
                     LLM_PARAM_INVALID);
    /* 8 tensors are not whole layers of 3. */
    assert_int_equal(
        llmdd_push_kv_cache_async(dd, &l_kv, &idx, 0, -1, &three, &lw, &req),
        LLM_PARAM_INVALID);
    /* The order of checks holds: an unlinked cluster after the options. */
    llmdd_cache_index far = {99, ids.kv, 0};
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &far, &l_kv, 0, -1, NULL, NULL, &req),
        LLM_NOT_YET_LINK);
    llmdd_cache_index gone = {PEER, 12345, 0};
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &gone, &l_kv, 0, -1, NULL, NULL, &req),
        LLM_KV_CACHE_NOT_EXIST);
    assert_true(req == (llmdd_request *)(uintptr_t)0x1); /* never written */

    /* A mark on a request posted without the flag; bad waits. */
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &idx, &s_kv, 0, -1, NULL, NULL, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_layer_ready(req, 0), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_request_wait(req, -2), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    llmdd_request_free(NULL);
    assert_int_equal(llmdd_request_wait(NULL, 0), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_request_cancel(NULL), LLM_PARAM_INVALID);

    /* Notifications. */
    llmdd_notify out[2];
    size_t n;
    assert_int_equal(llmdd_send_notify(dd, 99, "x", 1), LLM_NOT_YET_LINK);
    assert_int_equal(llmdd_send_notify(dd, PEER, NULL, 1), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_send_notify(dd, PEER, "x", LLMDD_NOTIFY_MAX + 1),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_get_notifies(dd, out, 2, NULL), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_get_notifies(dd, NULL, 2, &n), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_get_notifies(dd, NULL, 0, &n), LLM_SUCCESS);
    assert_int_equal(n, 0);
    verify_all();
}

/* Freed or cancelled while in flight: nothing writes afterwards. */
static void
test_async_cancel_and_free(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 0};
    llmdd_request *req[4];

    (void)state;
    /* One request a destination slot: requests in flight together must not
     * write the same bytes. */
    for (int i = 0; i < 4; i++)
        assert_int_equal(llmdd_pull_kv_cache_async(dd, &idx, &s_kv,
                                                   (uint32_t)i, -1, NULL,
                                                   NULL, &req[i]),
                         LLM_SUCCESS);
    for (int i = 0; i < 4; i += 2) {
        assert_int_equal(llmdd_request_cancel(req[i]), LLM_SUCCESS);
        llmdd_status st = llmdd_request_wait(req[i], 0);
        assert_true(st == LLM_SUCCESS || st == LLM_FAILED);
    }
    for (int i = 0; i < 4; i++)
        llmdd_request_free(req[i]);
    /* The link still works. */
    verify_all();
}

/* A layer-wise push waiting for marks ends when its source cache goes. */
static void
test_async_dealloc_ends_request(void **state)
{
    llmdd_cache_index idx = {PEER, ids.kv, 0};
    llmdd_xfer_opts o = {.flags = LLMDD_XFER_LAYERWISE};
    llmdd_cache src;
    llmdd_request *req;
    llmdd_cache_desc d = th_desc_kv();

    (void)state;
    assert_int_equal(llmdd_allocate_cache(dd, &d, &src), LLM_SUCCESS);
    assert_int_equal(
        llmdd_push_kv_cache_async(dd, &src, &idx, 0, -1, NULL, &o, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, src.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, 0), LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_request_layer_ready(req, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, 0), LLM_KV_CACHE_NOT_EXIST);
    llmdd_request_free(req);
    verify_all();
}

/* The desc of the peer helper's "alloc-big MIB TENSORS SEED": 4 slots. */
static llmdd_cache_desc
big_desc(uint32_t mib, uint32_t tensors)
{
    llmdd_cache_desc d = {.num_tensors = tensors,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, (int64_t)mib << 18}};
    return d;
}

/* A big_desc cache in the peer, filled with seed; returns its id. */
static int64_t
remote_big_new(uint32_t mib, uint32_t tensors, uint32_t seed)
{
    if (proc_mode) {
        char cmd[64], reply[64];
        snprintf(cmd, sizeof(cmd), "alloc-big %u %u %u", mib, tensors, seed);
        assert_int_equal(th_proc_cmd(&proc, cmd, reply, sizeof(reply)), 0);
        return atoll(reply + 3);
    }
    llmdd_cache_desc d = big_desc(mib, tensors);
    llmdd_cache c;
    assert_int_equal(llmdd_allocate_cache(peer, &d, &c), LLM_SUCCESS);
    th_fill(&c, seed);
    return c.cache_id;
}

static void
remote_big_free(int64_t rid)
{
    if (proc_mode) {
        char cmd[64];
        snprintf(cmd, sizeof(cmd), "dealloc %lld", (long long)rid);
        assert_int_equal(th_proc_cmd(&proc, cmd, NULL, 0), 0);
    } else {
        assert_int_equal(llmdd_deallocate_cache(peer, rid), LLM_SUCCESS);
    }
}

static void
test_large_pull(void **state)
{
    /* 64 MiB in 2 tensors of 32 MiB; one slot is 8 MiB a tensor. */
    llmdd_cache_desc d = big_desc(32, 2);
    llmdd_cache local;

    (void)state;
    int64_t rid = remote_big_new(32, 2, 5);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    uint64_t all[] = {0, 1, 2, 3};
    llmdd_cache_index idx = {PEER, rid, 0};
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &local, all, all, 4, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 2; t++)
        assert_int_equal(
            th_check_buf((const uint8_t *)(uintptr_t)local.tensor_addrs[t],
                         (uint64_t)32 << 20, 5, t),
            -1);
    assert_int_equal(llmdd_deallocate_cache(dd, local.cache_id), LLM_SUCCESS);
    remote_big_free(rid);
}

/*
 * 64 MiB each way in blocks of 8 MiB whose sources are out of order, so
 * that lanes of a striped transfer start and end inside runs and tensors:
 * every destination block holds its source block, byte for byte.
 */
static void
test_large_blocks_both_ways(void **state)
{
    const uint64_t blk = 8ull << 20;
    llmdd_cache_desc d = big_desc(32, 2);
    uint64_t sb[] = {3, 1, 0, 2}, db[] = {0, 1, 2, 3}, all[] = {0, 1, 2, 3};
    llmdd_cache src, back;

    (void)state;
    int64_t rid = remote_big_new(32, 2, 0);
    local_new(&src, NULL, d, 7);
    local_new(&back, NULL, d, 0);
    llmdd_cache_index idx = {PEER, rid, 0};
    /* Remote block db[k] gets source block sb[k]; the read-back keeps the
     * remote order. */
    assert_int_equal(llmdd_push_kv_blocks(dd, &src, &idx, sb, db, 4, NULL),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &back, all, all, 4, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 2; t++) {
        const uint8_t *s = (const uint8_t *)(uintptr_t)src.tensor_addrs[t];
        const uint8_t *b = (const uint8_t *)(uintptr_t)back.tensor_addrs[t];
        for (int k = 0; k < 4; k++)
            if (memcmp(b + db[k] * blk, s + sb[k] * blk, blk) != 0)
                fail_msg("tensor %u block %llu differs", t,
                         (unsigned long long)db[k]);
    }
    /* And a pull that scatters: local block db[k] from remote sb[k]. */
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &back, sb, db, 4, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 2; t++) {
        const uint8_t *s = (const uint8_t *)(uintptr_t)src.tensor_addrs[t];
        const uint8_t *b = (const uint8_t *)(uintptr_t)back.tensor_addrs[t];
        /* Remote block j holds source block sb[j] (j = db[j] here). */
        for (int k = 0; k < 4; k++)
            if (memcmp(b + db[k] * blk, s + sb[sb[k]] * blk, blk) != 0)
                fail_msg("tensor %u block %llu differs after the pull", t,
                         (unsigned long long)db[k]);
    }
    assert_int_equal(llmdd_deallocate_cache(dd, src.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, back.cache_id), LLM_SUCCESS);
    remote_big_free(rid);
}

/*
 * Lane threads end once idle for a while (striped runs only): after a
 * striped pull the process holds its lane threads; once they have been idle
 * for LLMDD__STREAM_LANE_IDLE_MS (5 s) it holds at least lanes - 1 fewer,
 * and the next striped pull starts them again and moves every byte.
 */
static void
test_lane_threads_idle(void **state)
{
    (void)state;
    int lanes = atoi(getenv("LLMDD_TEST_TCP_LANES")); /* main: >= 2 */
    llmdd_cache_desc d = big_desc(16, 1);
    llmdd_cache local;
    int64_t rid = remote_big_new(16, 1, 5);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    llmdd_cache_index idx = {PEER, rid, 0};
    uint64_t all[] = {0, 1, 2, 3};
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &local, all, all, 4, NULL),
                     LLM_SUCCESS);
    long busy = fu_proc_status(getpid(), "Threads");
    assert_true(busy > 0);
    assert_true(fu_settles(getpid(), 1 << 20, busy - (lanes - 1),
                           5000 + 5000 * FU_SLOW));
    memset((void *)(uintptr_t)local.tensor_addrs[0], 0, (size_t)16 << 20);
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &local, all, all, 4, NULL),
                     LLM_SUCCESS);
    assert_true(fu_proc_status(getpid(), "Threads") > busy - (lanes - 1));
    assert_int_equal(
        th_check_buf((const uint8_t *)(uintptr_t)local.tensor_addrs[0],
                     (uint64_t)16 << 20, 5, 0),
        -1);
    assert_int_equal(llmdd_deallocate_cache(dd, local.cache_id), LLM_SUCCESS);
    remote_big_free(rid);
}

int
main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s <transport> inproc|proc\n", argv[0]);
        return 2;
    }
    transport = argv[1];
    proc_mode = strcmp(argv[2], "proc") == 0;
    if (argc > 3) /* conformance_test <transport> <mode> <case glob> */
        cmocka_set_test_filter(argv[3]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_initial_state),
        cmocka_unit_test(test_pull_full_slot),
        cmocka_unit_test(test_pull_partial_size),
        cmocka_unit_test(test_pull_layer_range),
        cmocka_unit_test(test_pull_registered),
        cmocka_unit_test(test_pull_smaller_stride),
        cmocka_unit_test(test_pull_blocks_scattered),
        cmocka_unit_test(test_pull_blocks_duplicate_dst),
        cmocka_unit_test(test_pull_blocks_layer_range),
        cmocka_unit_test(test_pull_blocks_many_runs),
        cmocka_unit_test(test_blocks_more_than_a_tensor),
        cmocka_unit_test(test_pull_slot_into_blocks),
        cmocka_unit_test(test_pull_slot_into_blocks_short_tail),
        cmocka_unit_test(test_push_slot_into_blocks),
        cmocka_unit_test(test_push_slot),
        cmocka_unit_test(test_push_layers_and_size),
        cmocka_unit_test(test_push_blocks),
        cmocka_unit_test(test_rejected_calls_change_nothing),
        cmocka_unit_test(test_cache_made_after_link),
        cmocka_unit_test(test_cache_keys),
        cmocka_unit_test(test_async_pulls),
        cmocka_unit_test(test_async_push_with_notification),
        cmocka_unit_test(test_async_layerwise_push),
        cmocka_unit_test(test_async_bad_arguments),
        cmocka_unit_test(test_async_cancel_and_free),
        cmocka_unit_test(test_async_dealloc_ends_request),
        cmocka_unit_test(test_large_pull),
        cmocka_unit_test(test_large_blocks_both_ways),
        /* Last, and only where transfers stripe. */
        cmocka_unit_test(test_lane_threads_idle),
    };
    const char *lanes = getenv("LLMDD_TEST_TCP_LANES");
    size_t n = sizeof(tests) / sizeof(tests[0]);
    if (lanes == NULL || atoi(lanes) < 2)
        n--;
    return _cmocka_run_group_tests(argv[1], tests, n, setup, teardown);
}
