/*
 * The instance lifecycle and the rules that apply to every call: create,
 * initialize, finalize, destroy, set_role, roles as labels, the order in
 * which checks decide the status (docs/model.md), status strings and the
 * version.
 * Peers are in-process instances linked over 127.0.0.1.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "harness/harness.h"

#define C_PROMPT 1
#define C_DECODER 2
#define C_MIX 3
#define C_NOBODY 99 /* a cluster nobody linked */

/* ---- Helpers. ---- */

static bool
port_open(uint16_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(port)};
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    assert_true(fd >= 0);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    return ok;
}

static bool
all_zero(const llmdd_cache *c)
{
    uint64_t size = th_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)c->tensor_addrs[t];
        for (uint64_t i = 0; i < size; i++)
            if (p[i] != 0)
                return false;
    }
    return true;
}

static bool
holds_seed(const llmdd_cache *c, uint32_t seed)
{
    uint64_t size = th_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++)
        if (th_check_buf((const uint8_t *)(uintptr_t)c->tensor_addrs[t], size,
                         seed, t) >= 0)
            return false;
    return true;
}

/* Whether the instance reports `role` (its metrics' instance label). */
static bool
role_is(llmdd *dd, const char *role)
{
    char buf[16384], want[64];

    llmdd_metrics_text(dd, buf, sizeof(buf));
    snprintf(want, sizeof(want), "role=\"%s\"", role);
    return strstr(buf, want) != NULL;
}

/*
 * Every call of the public API but the lifecycle ones must return `want` on dd;
 * with `bad_args` each call also gets arguments that are invalid, to show
 * that the instance check comes first.
 */
static void
assert_every_call(llmdd *dd, llmdd_status want, bool bad_args)
{
    llmdd_cache_desc desc = th_desc_kv();
    llmdd_cache cache = {.cache_id = 1, .desc = desc};
    llmdd_cache_index idx = {C_PROMPT, 1, 0};
    llmdd_ip_info ipi = {"127.0.0.1", 1};
    llmdd_cluster_info ci = {.remote_cluster_id = C_PROMPT,
                             .remote_ip_infos = &ipi,
                             .num_remote_ip_infos = 1};
    llmdd_status rets[1];
    uint64_t addrs[8], blocks[1] = {0};
    int64_t id;
    uint8_t mem[64];

    for (int i = 0; i < 8; i++)
        addrs[i] = (uint64_t)(uintptr_t)mem;
    if (bad_args) {
        desc.num_tensors = 0;
        idx.cluster_id = C_DECODER;
    }
    assert_int_equal(llmdd_set_role(dd, bad_args ? 0 : LLMDD_ROLE_MIX, NULL,
                                    0),
                     want);
    assert_int_equal(llmdd_link_clusters(dd, bad_args ? NULL : &ci,
                                         bad_args ? 0 : 1, rets,
                                         bad_args ? 0 : 1000),
                     want);
    assert_int_equal(llmdd_unlink_clusters(dd, &ci, bad_args ? 17 : 1, rets,
                                           bad_args ? -1 : 1000, false),
                     want);
    assert_int_equal(llmdd_allocate_cache(dd, &desc, bad_args ? NULL : &cache),
                     want);
    assert_int_equal(llmdd_deallocate_cache(dd, bad_args ? -1 : 1), want);
    assert_int_equal(llmdd_register_kv_cache(dd, &desc, bad_args ? NULL : addrs,
                                             bad_args ? 0 : 8, &id),
                     want);
    assert_int_equal(llmdd_unregister_kv_cache(dd, bad_args ? 0 : 1), want);
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &cache, bad_args ? 99 : 0,
                                         bad_args ? 0 : -1, NULL),
                     want);
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &cache, blocks, blocks,
                                          bad_args ? 0 : 1, NULL),
                     want);
    assert_int_equal(llmdd_push_kv_cache(dd, &cache, &idx, 0,
                                         bad_args ? -5 : -1, NULL),
                     want);
    assert_int_equal(llmdd_push_kv_blocks(dd, &cache, &idx,
                                          bad_args ? NULL : blocks, blocks, 1,
                                          NULL),
                     want);
    assert_int_equal(llmdd_copy_kv_cache(dd, bad_args ? NULL : &cache, &cache,
                                         0, 1, 0, bad_args ? 0 : -1),
                     want);
    assert_int_equal(llmdd_copy_kv_blocks(dd, &cache, bad_args ? NULL : &cache,
                                          blocks, blocks, bad_args ? 0 : 1),
                     want);
}

/* ---- A prompt, a decoder and a mix instance, linked. ---- */

typedef struct {
    llmdd *p, *d, *m;
    uint16_t port;
    llmdd_cache p_kv, p_small, p_blocks; /* on P, seeds 1, 4, 3 */
    llmdd_cache d_kv, m_kv, m_blocks;    /* zeroed */
} trio;

static void
alloc_fill(llmdd *dd, llmdd_cache_desc d, llmdd_cache *c, uint32_t seed)
{
    assert_int_equal(llmdd_allocate_cache(dd, &d, c), LLM_SUCCESS);
    if (seed != 0)
        th_fill(c, seed);
}

static int
trio_setup(void **state)
{
    trio *t = calloc(1, sizeof(*t));

    assert_non_null(t);
    assert_int_equal(llmdd_create(C_PROMPT, LLMDD_ROLE_PROMPT, &t->p),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_create(C_DECODER, LLMDD_ROLE_DECODER, &t->d),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_create(C_MIX, LLMDD_ROLE_MIX, &t->m), LLM_SUCCESS);
    assert_int_equal(th_init_listen(t->p, "127.0.0.1", &t->port, NULL, 0),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(t->d, NULL, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(t->m, NULL, 0), LLM_SUCCESS);
    alloc_fill(t->p, th_desc_kv(), &t->p_kv, 1);
    alloc_fill(t->p, th_desc_small(), &t->p_small, 4);
    alloc_fill(t->p, th_desc_blocks(), &t->p_blocks, 3);
    alloc_fill(t->d, th_desc_kv(), &t->d_kv, 0);
    alloc_fill(t->m, th_desc_kv(), &t->m_kv, 0);
    alloc_fill(t->m, th_desc_blocks(), &t->m_blocks, 0);
    assert_int_equal(th_link(t->d, C_PROMPT, "127.0.0.1", t->port, 2000),
                     LLM_SUCCESS);
    assert_int_equal(th_link(t->m, C_PROMPT, "127.0.0.1", t->port, 2000),
                     LLM_SUCCESS);
    *state = t;
    return 0;
}

static int
trio_teardown(void **state)
{
    trio *t = *state;

    llmdd_destroy(t->d);
    llmdd_destroy(t->m);
    llmdd_destroy(t->p);
    free(t);
    return 0;
}

/* Pulls every slot of P's kv cache into dst and checks it. */
static void
pull_all_and_check(llmdd *dd, const trio *t, const llmdd_cache *dst)
{
    for (uint32_t b = 0; b < 4; b++) {
        llmdd_cache_index idx = {C_PROMPT, t->p_kv.cache_id, b};
        assert_int_equal(llmdd_pull_kv_cache(dd, &idx, dst, b, -1, NULL),
                         LLM_SUCCESS);
    }
    assert_true(holds_seed(dst, 1));
}

/* ---- Tests. ---- */

static void
test_create_invalid(void **state)
{
    llmdd *const sentinel = (llmdd *)(uintptr_t)0x1234;
    llmdd *dd = sentinel;

    (void)state;
    static const int bad[] = {0, 4, -1, 100};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(llmdd_create(1, (llmdd_role)bad[i], &dd),
                         LLM_PARAM_INVALID);
        assert_ptr_equal(dd, sentinel);
    }
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_MIX, NULL), LLM_PARAM_INVALID);

    static const llmdd_role good[] = {LLMDD_ROLE_PROMPT, LLMDD_ROLE_DECODER,
                                      LLMDD_ROLE_MIX};
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(llmdd_create(UINT64_MAX, good[i], &dd), LLM_SUCCESS);
        assert_non_null(dd);
        assert_ptr_not_equal(dd, sentinel);
        llmdd_destroy(dd);
    }
}

static void
test_calls_before_initialize(void **state)
{
    llmdd *dd;

    (void)state;
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_every_call(dd, LLM_FAILED, false);
    assert_every_call(dd, LLM_FAILED, true);
    /* finalize and destroy of a never-initialized instance are fine. */
    llmdd_finalize(dd);
    llmdd_finalize(dd);
    assert_every_call(dd, LLM_FAILED, false);
    llmdd_destroy(dd);
}

static void
test_initialize_twice(void **state)
{
    char addr[32];
    uint16_t port = th_free_port();
    llmdd *dd;

    (void)state;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    llmdd_option listen = {"llm.ListenIpInfo", addr};
    llmdd_option bad = {"llm.SyncKvCacheWaitTime", "0"};
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, NULL, 0), LLM_SUCCESS);
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);

    /* Success with no effect: no listener, options not even parsed, the
     * cache still there. */
    assert_int_equal(llmdd_initialize(dd, &listen, 1), LLM_SUCCESS);
    assert_false(port_open(port));
    assert_int_equal(llmdd_initialize(dd, &bad, 1), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    llmdd_destroy(dd);
}

static void
test_finalize_and_reinitialize(void **state)
{
    char addr[32];
    uint16_t port;
    llmdd *dd;
    llmdd_cache c1, c2;
    llmdd_cache_desc d = th_desc_kv();

    (void)state;
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(th_init_listen(dd, "127.0.0.1", &port, NULL, 0),
                     LLM_SUCCESS);
    assert_true(port_open(port));
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c1), LLM_SUCCESS);

    llmdd_finalize(dd);
    llmdd_finalize(dd); /* harmless */
    assert_false(port_open(port));
    assert_every_call(dd, LLM_FAILED, false);
    assert_every_call(dd, LLM_FAILED, true);

    /* Usable again; what finalize released is gone, and ids go on. */
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    llmdd_option o = {"llm.ListenIpInfo", addr};
    assert_int_equal(llmdd_initialize(dd, &o, 1), LLM_SUCCESS);
    assert_true(port_open(port));
    assert_int_equal(llmdd_deallocate_cache(dd, c1.cache_id),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c2), LLM_SUCCESS);
    assert_true(c2.cache_id > c1.cache_id);
    assert_true(all_zero(&c2));
    llmdd_finalize(dd);
    llmdd_destroy(dd);
}

static void
test_destroy(void **state)
{
    llmdd *a, *b;
    uint16_t port;

    (void)state;
    llmdd_destroy(NULL);
    llmdd_finalize(NULL);

    /* Destroy with caches, a registered buffer and live links on both
     * sides: nothing may leak or hang. */
    uint8_t *mem = malloc(4096 * 8);
    uint64_t addrs[8];
    int64_t id;
    llmdd_cache c;
    llmdd_cache_desc d = th_desc_kv();

    assert_non_null(mem);
    for (int i = 0; i < 8; i++)
        addrs[i] = (uint64_t)(uintptr_t)(mem + 4096 * i);
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_PROMPT, &a), LLM_SUCCESS);
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_DECODER, &b), LLM_SUCCESS);
    assert_int_equal(th_init_listen(a, "127.0.0.1", &port, NULL, 0),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(b, NULL, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(a, &d, &c), LLM_SUCCESS);
    assert_int_equal(llmdd_register_kv_cache(a, &d, addrs, 8, &id),
                     LLM_SUCCESS);
    assert_int_equal(th_link(b, 1, "127.0.0.1", port, 2000), LLM_SUCCESS);
    llmdd_destroy(a);
    /* The survivor notices and stays usable. */
    llmdd_cache local;
    assert_int_equal(llmdd_allocate_cache(b, &d, &local), LLM_SUCCESS);
    llmdd_cache_index idx = {1, c.cache_id, 0};
    llmdd_status st = LLM_SUCCESS;
    for (int i = 0; i < 200; i++) {
        st = llmdd_pull_kv_cache(b, &idx, &local, 0, -1, NULL);
        if (st == LLM_NOT_YET_LINK)
            break;
        th_sleep_ms(10);
    }
    assert_int_equal(st, LLM_NOT_YET_LINK);
    llmdd_destroy(b);
    free(mem);
}

static void
test_set_role_invalid(void **state)
{
    trio *t = *state;

    assert_int_equal(llmdd_set_role(t->d, (llmdd_role)0, NULL, 0),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_set_role(t->d, (llmdd_role)4, NULL, 0),
                     LLM_PARAM_INVALID);
    /* Still a decoder, still linked. */
    pull_all_and_check(t->d, t, &t->d_kv);
}

static void
test_set_role_with_links(void **state)
{
    trio *t = *state;
    llmdd_status st = LLM_FAILED;

    /* Both ends of a link count, client and server. */
    assert_int_equal(llmdd_set_role(t->d, LLMDD_ROLE_MIX, NULL, 0),
                     LLM_EXIST_LINK);
    assert_int_equal(llmdd_set_role(t->p, LLMDD_ROLE_MIX, NULL, 0),
                     LLM_EXIST_LINK);
    /* The failed call changed nothing: D is still a decoder. */
    assert_true(role_is(t->d, "decoder"));

    assert_int_equal(th_unlink(t->d, C_PROMPT, "127.0.0.1", t->port, false,
                               2000),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_role(t->d, LLMDD_ROLE_MIX, NULL, 0),
                     LLM_SUCCESS);
    assert_true(role_is(t->d, "mix"));
    assert_int_equal(llmdd_set_role(t->p, LLMDD_ROLE_PROMPT, NULL, 0),
                     LLM_EXIST_LINK); /* M is still linked to P */
    assert_int_equal(th_unlink(t->m, C_PROMPT, "127.0.0.1", t->port, false,
                               2000),
                     LLM_SUCCESS);
    /* P drops its side when the UNLINK arrives, just after it acks. */
    for (int i = 0; i < 200; i++) {
        st = llmdd_set_role(t->p, LLMDD_ROLE_PROMPT, NULL, 0);
        if (st != LLM_EXIST_LINK)
            break;
        th_sleep_ms(10);
    }
    assert_int_equal(st, LLM_SUCCESS);
}

static void
test_set_role_listen(void **state)
{
    char addr[32];
    uint16_t port = th_free_port();
    llmdd *x, *y;
    llmdd_status st;

    (void)state;
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    llmdd_option listen = {"llm.ListenIpInfo", addr};
    assert_int_equal(llmdd_create(10, LLMDD_ROLE_DECODER, &x), LLM_SUCCESS);
    assert_int_equal(llmdd_create(11, LLMDD_ROLE_DECODER, &y), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(x, NULL, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(y, NULL, 0), LLM_SUCCESS);
    assert_int_equal(th_link(y, 10, "127.0.0.1", port, 1000),
                     LLM_LINK_FAILED);

    /* set_role with llm.ListenIpInfo starts listening there. */
    assert_int_equal(llmdd_set_role(x, LLMDD_ROLE_PROMPT, &listen, 1),
                     LLM_SUCCESS);
    assert_int_equal(th_link(y, 10, "127.0.0.1", port, 2000), LLM_SUCCESS);
    assert_int_equal(th_unlink(y, 10, "127.0.0.1", port, false, 2000),
                     LLM_SUCCESS);
    for (int i = 0; i < 200; i++) {
        st = llmdd_set_role(x, LLMDD_ROLE_PROMPT, &listen, 1);
        if (st != LLM_EXIST_LINK)
            break;
        th_sleep_ms(10);
    }
    assert_int_equal(st, LLM_SUCCESS); /* restarted on the same address */
    assert_int_equal(th_link(y, 10, "127.0.0.1", port, 2000), LLM_SUCCESS);
    assert_int_equal(th_unlink(y, 10, "127.0.0.1", port, true, 2000),
                     LLM_SUCCESS);

    /* A bad option: LLM_PARAM_INVALID and nothing changes. */
    llmdd_option bad = {"llm.SyncKvCacheWaitTime", "x"};
    for (int i = 0; i < 200; i++) {
        st = llmdd_set_role(x, LLMDD_ROLE_DECODER, &bad, 1);
        if (st != LLM_EXIST_LINK)
            break;
        th_sleep_ms(10);
    }
    assert_int_equal(st, LLM_PARAM_INVALID);
    assert_true(port_open(port));

    /* Without it, it stops listening. */
    assert_int_equal(llmdd_set_role(x, LLMDD_ROLE_DECODER, NULL, 0),
                     LLM_SUCCESS);
    assert_false(port_open(port));
    assert_int_equal(th_link(y, 10, "127.0.0.1", port, 1000),
                     LLM_LINK_FAILED);
    llmdd_destroy(y);
    llmdd_destroy(x);
}

/*
 * Roles label an instance and have no effect on transfers: a decoder pushes,
 * a prompt pulls, over the one link between them (what the reference's own
 * samples do). Every byte that moved is checked, and nothing else changed.
 */
static void
test_roles_are_labels(void **state)
{
    trio *t = *state;
    uint64_t blocks[] = {0, 1, 2}, dst[] = {5, 6, 7};
    llmdd_cache_index kv = {C_PROMPT, t->p_kv.cache_id, 0};
    llmdd_cache_index bl = {C_PROMPT, t->p_blocks.cache_id, 0};
    llmdd_cache d_blocks, p_scratch;

    alloc_fill(t->d, th_desc_blocks(), &d_blocks, 7);
    alloc_fill(t->p, th_desc_blocks(), &p_scratch, 0);

    /* A mix instance does both, as before. */
    pull_all_and_check(t->m, t, &t->m_kv);
    llmdd_cache_index mbl = {C_PROMPT, t->p_blocks.cache_id, 0};
    assert_int_equal(
        llmdd_pull_kv_blocks(t->m, &mbl, &t->m_blocks, blocks, blocks, 3, NULL),
        LLM_SUCCESS);
    assert_int_equal(
        llmdd_push_kv_blocks(t->m, &t->m_blocks, &mbl, blocks, blocks, 3, NULL),
        LLM_SUCCESS);
    assert_true(holds_seed(&t->p_blocks, 3));

    /* A decoder pulls and pushes. */
    pull_all_and_check(t->d, t, &t->d_kv);
    th_fill(&t->d_kv, 9);
    for (uint32_t b = 0; b < 4; b++) {
        kv.batch_index = b;
        assert_int_equal(llmdd_push_kv_cache(t->d, &t->d_kv, &kv, b, -1, NULL),
                         LLM_SUCCESS);
    }
    assert_true(holds_seed(&t->p_kv, 9));
    assert_int_equal(
        llmdd_push_kv_blocks(t->d, &d_blocks, &bl, blocks, blocks, 3, NULL),
        LLM_SUCCESS);
    uint64_t bsize = th_tensor_size(&d_blocks.desc), stride = bsize / 64;
    for (uint32_t i = 0; i < d_blocks.desc.num_tensors; i++) {
        const uint8_t *p =
            (const uint8_t *)(uintptr_t)t->p_blocks.tensor_addrs[i];
        for (uint64_t k = 0; k < bsize; k++)
            assert_int_equal(p[k], th_byte(k < 3 * stride ? 7 : 3, i, k));
    }

    /* A prompt pulls, from the decoder that linked to it. */
    llmdd_cache_index dbl = {C_DECODER, d_blocks.cache_id, 0};
    assert_int_equal(
        llmdd_pull_kv_blocks(t->p, &dbl, &p_scratch, blocks, dst, 3, NULL),
        LLM_SUCCESS);
    for (uint32_t i = 0; i < p_scratch.desc.num_tensors; i++) {
        const uint8_t *p =
            (const uint8_t *)(uintptr_t)p_scratch.tensor_addrs[i];
        for (uint64_t k = 0; k < bsize; k++)
            assert_int_equal(p[k], k >= 5 * stride && k < 8 * stride
                                       ? th_byte(7, i, k - 5 * stride)
                                       : 0);
    }
    llmdd_cache p_kv2;
    alloc_fill(t->p, th_desc_kv(), &p_kv2, 0);
    for (uint32_t b = 0; b < 4; b++) {
        llmdd_cache_index dkv = {C_DECODER, t->d_kv.cache_id, b};
        assert_int_equal(llmdd_pull_kv_cache(t->p, &dkv, &p_kv2, b, -1, NULL),
                         LLM_SUCCESS);
    }
    assert_true(holds_seed(&p_kv2, 9));
}

/*
 * A link is known by its cluster id: a non-force unlink with no address
 * (or with one that is not the peer's) tells the peer and ends the link on
 * both sides; the server side of a link can end it the same way.
 */
static void
test_unlink_by_id(void **state)
{
    trio *t = *state;
    llmdd_cluster_info ci = {.remote_cluster_id = C_PROMPT};
    llmdd_status ret = LLM_FAILED;
    llmdd_cache_index idx = {C_PROMPT, t->p_kv.cache_id, 0};
    llmdd_cache_index back = {C_DECODER, t->d_kv.cache_id, 0};

    assert_int_equal(llmdd_unlink_clusters(t->d, &ci, 1, &ret, 2000, false),
                     LLM_SUCCESS);
    assert_int_equal(ret, LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache(t->d, &idx, &t->d_kv, 0, -1, NULL),
                     LLM_NOT_YET_LINK);
    /* The peer heard it: its side goes too (just after it acked). */
    llmdd_status st = LLM_SUCCESS;
    for (int i = 0; i < 500 && st != LLM_NOT_YET_LINK; i++) {
        st = llmdd_pull_kv_cache(t->p, &back, &t->p_small, 0, 512, NULL);
        if (st != LLM_NOT_YET_LINK)
            th_sleep_ms(10);
    }
    assert_int_equal(st, LLM_NOT_YET_LINK);

    /* An address given is not used: a wrong one still ends the link. */
    llmdd_ip_info wrong = {"127.0.0.1", 1};
    ci.remote_ip_infos = &wrong;
    ci.num_remote_ip_infos = 1;
    assert_int_equal(llmdd_unlink_clusters(t->m, &ci, 1, &ret, 2000, false),
                     LLM_SUCCESS);
    assert_int_equal(ret, LLM_SUCCESS);
    idx.batch_index = 1;
    assert_int_equal(llmdd_pull_kv_cache(t->m, &idx, &t->m_kv, 0, -1, NULL),
                     LLM_NOT_YET_LINK);

    /* The server side ends a link by id too; unlinking again is success. */
    assert_int_equal(th_link(t->d, C_PROMPT, "127.0.0.1", t->port, 2000),
                     LLM_SUCCESS);
    llmdd_cluster_info to_d = {.remote_cluster_id = C_DECODER};
    assert_int_equal(llmdd_unlink_clusters(t->p, &to_d, 1, &ret, 2000, false),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_unlink_clusters(t->p, &to_d, 1, &ret, 2000, false),
                     LLM_SUCCESS);
    st = LLM_SUCCESS;
    for (int i = 0; i < 500 && st != LLM_NOT_YET_LINK; i++) {
        st = llmdd_pull_kv_cache(t->d, &idx, &t->d_kv, 0, -1, NULL);
        if (st != LLM_NOT_YET_LINK)
            th_sleep_ms(10);
    }
    assert_int_equal(st, LLM_NOT_YET_LINK);
}

/* The instance's live links, both directions (its metrics' gauge). */
static unsigned
links_of(llmdd *dd)
{
    static char text[65536];
    unsigned n = 0;
    const char *p = text;

    llmdd_metrics_text(dd, text, sizeof(text));
    while ((p = strstr(p, "llmdd_links{direction=")) != NULL) {
        p = strchr(p, '}') + 1;
        n += (unsigned)strtoul(p, NULL, 10);
    }
    return n;
}

/*
 * A non-force unlink removes the link on both sides before it returns: the
 * peer takes its side out of its table before it acknowledges, so at once
 * it holds no link, may switch roles, and a new link call works.
 */
static void
test_unlink_both_sides_at_once(void **state)
{
    trio *t = *state;
    llmdd_cluster_info ci = {.remote_cluster_id = C_PROMPT};
    llmdd_status ret;

    assert_int_equal(
        th_unlink(t->m, C_PROMPT, "127.0.0.1", t->port, false, 2000),
        LLM_SUCCESS);
    for (int i = 0; i < 100; i++) {
        assert_int_equal(links_of(t->p), 1); /* D's */
        assert_int_equal(llmdd_unlink_clusters(t->d, &ci, 1, &ret, 2000, false),
                         LLM_SUCCESS);
        assert_int_equal(links_of(t->p), 0);
        assert_int_equal(links_of(t->d), 0);
        assert_int_equal(th_link(t->d, C_PROMPT, "127.0.0.1", t->port, 2000),
                         LLM_SUCCESS);
    }
    assert_int_equal(llmdd_unlink_clusters(t->d, &ci, 1, &ret, 2000, false),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_role(t->p, LLMDD_ROLE_DECODER, NULL, 0),
                     LLM_SUCCESS);
}

/* One uint8 tensor of 4 slots of 64 bytes. */
static llmdd_cache_desc
desc_one_tensor(void)
{
    llmdd_cache_desc d = {.num_tensors = 1,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, 64}};
    return d;
}

/*
 * tensor_num_per_layer is used only by layer ranges and layer-wise pushes:
 * with both ranges default, a NULL ext, the default ext (tnpl 2) and any
 * other tnpl behave the same, also on a cache of one tensor.
 */
static void
test_default_ext_one_tensor(void **state)
{
    trio *t = *state;
    llmdd_kv_ext_param def = LLMDD_KV_EXT_PARAM_DEFAULT;
    llmdd_kv_ext_param tnpl0 = {{-1, -1}, {-1, -1}, 0};
    llmdd_kv_ext_param tnpl9 = {{-1, -1}, {-1, -1}, 9};
    const llmdd_kv_ext_param *exts[] = {NULL, &def, &tnpl0, &tnpl9};
    llmdd_cache src, dst;
    uint64_t sb[] = {3}, db[] = {1};

    alloc_fill(t->p, desc_one_tensor(), &src, 5);
    alloc_fill(t->d, desc_one_tensor(), &dst, 0);
    llmdd_cache_index idx = {C_PROMPT, src.cache_id, 0};
    for (uint32_t b = 0; b < 4; b++) {
        idx.batch_index = b;
        assert_int_equal(llmdd_pull_kv_cache(t->d, &idx, &dst, b, -1, exts[b]),
                         LLM_SUCCESS);
    }
    assert_true(holds_seed(&dst, 5));
    idx.batch_index = 0;
    for (size_t i = 0; i < 4; i++) {
        memset((void *)(uintptr_t)dst.tensor_addrs[0], 0, 4 * 64);
        assert_int_equal(
            llmdd_pull_kv_blocks(t->d, &idx, &dst, sb, db, 1, exts[i]),
            LLM_SUCCESS);
        const uint8_t *p = (const uint8_t *)(uintptr_t)dst.tensor_addrs[0];
        for (uint64_t k = 0; k < 4 * 64; k++)
            assert_int_equal(
                p[k], k >= 64 && k < 128 ? th_byte(5, 0, k + 2 * 64) : 0);
    }
    /* The same for a push, and for a posted one. */
    th_fill(&dst, 6);
    llmdd_cache_index to = {C_PROMPT, src.cache_id, 2};
    assert_int_equal(llmdd_push_kv_cache(t->d, &dst, &to, 2, -1, &def),
                     LLM_SUCCESS);
    llmdd_request *req = NULL;
    to.batch_index = 0;
    assert_int_equal(llmdd_push_kv_blocks_async(t->d, &dst, &to, sb, sb, 1,
                                                &tnpl0, NULL, &req),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    const uint8_t *p = (const uint8_t *)(uintptr_t)src.tensor_addrs[0];
    for (uint64_t k = 0; k < 4 * 64; k++)
        assert_int_equal(p[k], th_byte(k >= 128 ? 6 : 5, 0, k));

    /* A layer-wise push uses tnpl: it must fit the one tensor. */
    llmdd_xfer_opts lw = {.flags = LLMDD_XFER_LAYERWISE};
    req = NULL;
    assert_int_equal(
        llmdd_push_kv_cache_async(t->d, &dst, &to, 0, -1, &def, &lw, &req),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_push_kv_cache_async(t->d, &dst, &to, 0, -1, &tnpl0, &lw, &req),
        LLM_PARAM_INVALID);
    assert_null(req);
    llmdd_kv_ext_param one = {{-1, -1}, {-1, -1}, 1};
    assert_int_equal(
        llmdd_push_kv_cache_async(t->d, &dst, &to, 0, -1, &one, &lw, &req),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_layer_ready(req, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(req, -1), LLM_SUCCESS);
    llmdd_request_free(req);
    for (uint64_t k = 0; k < 64; k++)
        assert_int_equal(p[k], th_byte(6, 0, k));
}

/*
 * The check order of docs/model.md: instance -> own arguments ->
 * local cache exists -> local indices and ranges -> link -> remote cache
 * exists -> remote indices, ranges and strides. Each case below fails two
 * checks at once; the earlier one must decide.
 */
static void
test_status_order_pull(void **state)
{
    trio *t = *state;
    llmdd_cache unknown = {.cache_id = 12345, .desc = th_desc_kv()};
    llmdd_cache_index nobody = {C_NOBODY, 777, 0};
    llmdd_cache_index p_kv = {C_PROMPT, t->p_kv.cache_id, 0};
    llmdd_cache_index p_unknown = {C_PROMPT, 777, 100};
    llmdd_kv_ext_param bad_shape = {{-1, 5}, {-1, -1}, 2};
    llmdd_kv_ext_param tnpl0 = {{0, 0}, {-1, -1}, 0};
    llmdd_kv_ext_param dst_over = {{0, 0}, {4, 4}, 2};
    llmdd_kv_ext_param src_over = {{4, 4}, {0, 0}, 2};
    llmdd_kv_ext_param widths = {{0, 0}, {0, 1}, 2};
    uint64_t b0[] = {0}, b64[] = {64};
    llmdd *d = t->d;

    /* No role check: a prompt's pull is decided by its arguments. */
    assert_int_equal(llmdd_pull_kv_cache(t->p, &nobody, &unknown, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);

    /* Own arguments before the local cache. */
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &unknown, 0, 0, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &unknown, 0, -2, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache(d, &nobody, &unknown, 0, -1, &bad_shape),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &unknown, 0, -1, &tnpl0),
                     LLM_PARAM_INVALID);
    llmdd_cache_index self = {C_DECODER, 1, 0};
    assert_int_equal(llmdd_pull_kv_cache(d, &self, &unknown, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_blocks(d, &nobody, &unknown, b0, b0, 0,
                                          NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_blocks(d, &nobody, &unknown, NULL, b0, 1,
                                          NULL),
                     LLM_PARAM_INVALID);
    llmdd_cache_index bi1 = {C_NOBODY, 777, 1};
    assert_int_equal(llmdd_pull_kv_blocks(d, &bi1, &unknown, b0, b0, 1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, NULL, &unknown, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, NULL, 0, -1, NULL),
                     LLM_PARAM_INVALID);

    /* The local cache before local indices and the link. */
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &unknown, 99, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_pull_kv_blocks(d, &nobody, &unknown, b64, b64, 1,
                                          NULL),
                     LLM_KV_CACHE_NOT_EXIST);

    /* Local indices, sizes and ranges before the link. */
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &t->d_kv, 4, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &t->d_kv, 0, 1025, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache(d, &nobody, &t->d_kv, 0, -1, &dst_over),
        LLM_PARAM_INVALID);
    llmdd_kv_ext_param tnpl9 = {{-1, -1}, {0, 0}, 9};
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &t->d_kv, 0, -1, &tnpl9),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_blocks(d, &nobody, &t->d_kv, b0, b64, 1,
                                          NULL),
                     LLM_PARAM_INVALID);

    /* The link before the remote cache. */
    assert_int_equal(llmdd_pull_kv_cache(d, &nobody, &t->d_kv, 0, -1, NULL),
                     LLM_NOT_YET_LINK);
    assert_int_equal(
        llmdd_pull_kv_cache(d, &nobody, &t->d_kv, 0, -1, &src_over),
        LLM_NOT_YET_LINK);
    assert_int_equal(llmdd_pull_kv_blocks(d, &nobody, &t->d_kv, b64, b0, 1,
                                          NULL),
                     LLM_NOT_YET_LINK);

    /* The remote cache before remote indices. */
    assert_int_equal(llmdd_pull_kv_cache(d, &p_unknown, &t->d_kv, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    p_unknown.batch_index = 0;
    assert_int_equal(llmdd_pull_kv_blocks(d, &p_unknown, &t->d_kv, b64, b0, 1,
                                          NULL),
                     LLM_KV_CACHE_NOT_EXIST);

    /* Remote indices, ranges and strides. */
    llmdd_cache_index p_bi4 = {C_PROMPT, t->p_kv.cache_id, 4};
    assert_int_equal(llmdd_pull_kv_cache(d, &p_bi4, &t->d_kv, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, &p_kv, &t->d_kv, 0, -1, &src_over),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, &p_kv, &t->d_kv, 0, -1, &widths),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_blocks(d, &p_kv, &t->d_kv, b64, b0, 1,
                                          NULL),
                     LLM_PARAM_INVALID);
    /* P's small cache has stride 512; D's kv has 1024. */
    llmdd_cache_index p_small = {C_PROMPT, t->p_small.cache_id, 0};
    assert_int_equal(llmdd_pull_kv_cache(d, &p_small, &t->d_kv, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(d, &p_small, &t->d_kv, 0, 513, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_blocks(d, &p_small, &t->d_kv, b0, b0, 1,
                                          NULL),
                     LLM_PARAM_INVALID);

    /* Nothing moved anywhere. */
    assert_true(all_zero(&t->d_kv));
    assert_true(holds_seed(&t->p_kv, 1));

    /* And the boundary cases that are valid do move. */
    assert_int_equal(llmdd_pull_kv_cache(d, &p_small, &t->d_kv, 3, 512, NULL),
                     LLM_SUCCESS);
    assert_false(all_zero(&t->d_kv));
}

/* The check order of llmdd_pull_kv_cache_to_blocks, one case a step. */
static void
test_status_order_slot_into_blocks(void **state)
{
    trio *t = *state;
    llmdd_cache unknown = {.cache_id = 12345};
    llmdd_cache_index nobody = {C_NOBODY, 777, 0};
    llmdd_cache_index self = {C_DECODER, 1, 0};
    llmdd_cache_index p_unknown = {C_PROMPT, 777, 9};
    llmdd_cache_index p_kv = {C_PROMPT, t->p_kv.cache_id, 3};
    llmdd_kv_ext_param bad_shape = {{-1, 5}, {-1, -1}, 2};
    uint64_t b4[] = {0, 1, 2, 3}, b64[] = {0, 1, 64, 3};
    llmdd_xfer_opts lw = {.flags = LLMDD_XFER_LAYERWISE};
    llmdd_request *req = NULL;
    llmdd_cache blk;
    llmdd *d = t->d;

    alloc_fill(d, th_desc_blocks(), &blk, 0);
    /* Own arguments first. */
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &nobody, &unknown, b4, 0, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &nobody, &unknown, NULL, 4, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &nobody, NULL, b4, 4, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &self, &unknown, b4, 4, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &nobody, &unknown, b4, 4, &bad_shape),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache_to_blocks_async(
                         d, &nobody, &unknown, b4, 4, NULL, &lw, &req),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache_to_blocks_async(
                         d, &nobody, &unknown, b4, 4, NULL, NULL, NULL),
                     LLM_PARAM_INVALID);
    /* The local cache, its blocks, the link. */
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &nobody, &unknown, b64, 4, NULL),
        LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &nobody, &blk, b64, 4, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &nobody, &blk, b4, 3, NULL),
        LLM_NOT_YET_LINK);
    /* The remote cache, then its slot and the block count. */
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(d, &p_unknown, &blk, b4, 3, NULL),
        LLM_KV_CACHE_NOT_EXIST);
    p_kv.batch_index = 4;
    assert_int_equal(llmdd_pull_kv_cache_to_blocks(d, &p_kv, &blk, b4, 4, NULL),
                     LLM_PARAM_INVALID);
    p_kv.batch_index = 3;
    assert_int_equal(llmdd_pull_kv_cache_to_blocks(d, &p_kv, &blk, b4, 3, NULL),
                     LLM_PARAM_INVALID);
    assert_null(req);
    assert_true(all_zero(&blk));
    /* 1024-byte slots into 256-byte blocks: 4 blocks. */
    assert_int_equal(llmdd_pull_kv_cache_to_blocks(d, &p_kv, &blk, b4, 4, NULL),
                     LLM_SUCCESS);
    for (uint32_t i = 0; i < 8; i++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)blk.tensor_addrs[i];
        for (uint64_t k = 0; k < 64 * 256; k++)
            assert_int_equal(p[k], k < 1024 ? th_byte(1, i, 3 * 1024 + k) : 0);
    }
}

static void
test_status_order_push(void **state)
{
    trio *t = *state;
    llmdd_cache unknown = {.cache_id = 12345, .desc = th_desc_kv()};
    llmdd_cache_index nobody = {C_NOBODY, 777, 0};
    llmdd_cache_index p_kv = {C_PROMPT, t->p_kv.cache_id, 0};
    llmdd_kv_ext_param src_over = {{4, 4}, {0, 0}, 2};
    llmdd_kv_ext_param dst_over = {{0, 0}, {4, 4}, 2};
    uint64_t b0[] = {0}, b64[] = {64};
    llmdd *m = t->m;

    th_fill(&t->m_kv, 8);
    /* No role check: a decoder's push is decided by its arguments. */
    assert_int_equal(llmdd_push_kv_cache(t->d, &unknown, &nobody, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    /* Own arguments, then the local (source) cache. */
    assert_int_equal(llmdd_push_kv_cache(m, &unknown, &nobody, 0, 0, NULL),
                     LLM_PARAM_INVALID);
    llmdd_cache_index bi1 = {C_NOBODY, 777, 1};
    assert_int_equal(llmdd_push_kv_blocks(m, &unknown, &bi1, b0, b0, 1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_push_kv_cache(m, &unknown, &nobody, 9, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    /* For a push the local side is the source: its range is src. */
    assert_int_equal(
        llmdd_push_kv_cache(m, &t->m_kv, &nobody, 0, -1, &src_over),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_push_kv_cache(m, &t->m_kv, &nobody, 0, -1, &dst_over),
        LLM_NOT_YET_LINK);
    assert_int_equal(llmdd_push_kv_blocks(m, &t->m_blocks, &nobody, b64, b0,
                                          1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_push_kv_blocks(m, &t->m_blocks, &nobody, b0, b64,
                                          1, NULL),
                     LLM_NOT_YET_LINK);
    /* Linked: the remote cache, then remote indices. */
    llmdd_cache_index p_unknown = {C_PROMPT, 777, 9};
    assert_int_equal(llmdd_push_kv_cache(m, &t->m_kv, &p_unknown, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_push_kv_cache(m, &t->m_kv, &p_kv, 0, -1, &dst_over),
                     LLM_PARAM_INVALID);
    p_kv.batch_index = 4;
    assert_int_equal(llmdd_push_kv_cache(m, &t->m_kv, &p_kv, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    llmdd_cache_index p_bl = {C_PROMPT, t->p_blocks.cache_id, 0};
    assert_int_equal(llmdd_push_kv_blocks(m, &t->m_blocks, &p_bl, b0, b64, 1,
                                          NULL),
                     LLM_PARAM_INVALID);
    assert_true(holds_seed(&t->p_kv, 1));
    assert_true(holds_seed(&t->p_blocks, 3));
}

static void
test_status_str(void **state)
{
    static const struct {
        llmdd_status st;
        const char *name;
    } all[] = {
#define S(x) {x, #x}
        S(LLM_SUCCESS),
        S(LLM_FAILED),
        S(LLM_WAIT_PROC_TIMEOUT),
        S(LLM_KV_CACHE_NOT_EXIST),
        S(LLM_REPEAT_REQUEST),
        S(LLM_REQUEST_ALREADY_COMPLETED),
        S(LLM_PARAM_INVALID),
        S(LLM_ENGINE_FINALIZED),
        S(LLM_NOT_YET_LINK),
        S(LLM_ALREADY_LINK),
        S(LLM_LINK_FAILED),
        S(LLM_UNLINK_FAILED),
        S(LLM_NOTIFY_PROMPT_UNLINK_FAILED),
        S(LLM_CLUSTER_NUM_EXCEED_LIMIT),
        S(LLM_PROCESSING_LINK),
        S(LLM_DEVICE_OUT_OF_MEMORY),
        S(LLM_PREFIX_ALREADY_EXIST),
        S(LLM_PREFIX_NOT_EXIST),
        S(LLM_SEQ_LEN_OVER_LIMIT),
        S(LLM_NO_FREE_BLOCK),
        S(LLM_BLOCKS_OUT_OF_MEMORY),
        S(LLM_CACHE_INCOMPATIBLE),
        S(LLM_CACHE_KEY_ALREADY_EXIST),
        S(LLM_COPY_CACHE_FAILED),
        S(LLM_CACHE_ID_ALREADY_EXIST),
        S(LLM_EXIST_LINK),
        S(LLM_FEATURE_NOT_ENABLED),
        S(LLM_TIMEOUT),
        S(LLM_LINK_BUSY),
        S(LLM_OUT_OF_MEMORY),
#undef S
    };

    (void)state;
    /* The numbers are fixed by the public header. */
    assert_int_equal(LLM_SUCCESS, 0);
    assert_int_equal(LLM_FAILED, 0xFFFFFFFFu);
    assert_int_equal(LLM_WAIT_PROC_TIMEOUT, 0x5010B001u);
    assert_int_equal(LLM_PARAM_INVALID, 0x5010B005u);
    assert_int_equal(LLM_EXIST_LINK, 0x5010B018u);
    assert_int_equal(LLM_OUT_OF_MEMORY, 0x5010B01Cu);
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (i >= 2)
            assert_int_equal(all[i].st, 0x5010B001u + (i - 2));
        assert_string_equal(llmdd_status_str(all[i].st), all[i].name);
    }
    static const llmdd_status unknown[] = {1, 2, 0x5010B000u, 0x5010B01Du,
                                           0x5010B0FFu, 0x12345678u,
                                           0xFFFFFFFEu};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++)
        assert_string_equal(llmdd_status_str(unknown[i]),
                            "LLM_UNKNOWN_STATUS");
}

static void
test_version(void **state)
{
    char want[32];

    (void)state;
    assert_non_null(llmdd_version());
    snprintf(want, sizeof(want), "%d.%d.%d", LLMDD_VERSION_MAJOR,
             LLMDD_VERSION_MINOR, LLMDD_VERSION_PATCH);
    assert_string_equal(llmdd_version(), want);
    assert_non_null(llmdd_transport_list());
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_invalid),
        cmocka_unit_test(test_calls_before_initialize),
        cmocka_unit_test(test_initialize_twice),
        cmocka_unit_test(test_finalize_and_reinitialize),
        cmocka_unit_test(test_destroy),
        cmocka_unit_test_setup_teardown(test_set_role_invalid, trio_setup,
                                        trio_teardown),
        cmocka_unit_test_setup_teardown(test_set_role_with_links, trio_setup,
                                        trio_teardown),
        cmocka_unit_test(test_set_role_listen),
        cmocka_unit_test_setup_teardown(test_unlink_by_id, trio_setup,
                                        trio_teardown),
        cmocka_unit_test_setup_teardown(test_unlink_both_sides_at_once,
                                        trio_setup, trio_teardown),
        cmocka_unit_test_setup_teardown(test_default_ext_one_tensor, trio_setup,
                                        trio_teardown),
        cmocka_unit_test_setup_teardown(test_roles_are_labels, trio_setup,
                                        trio_teardown),
        cmocka_unit_test_setup_teardown(test_status_order_pull, trio_setup,
                                        trio_teardown),
        cmocka_unit_test_setup_teardown(test_status_order_slot_into_blocks,
                                        trio_setup, trio_teardown),
        cmocka_unit_test_setup_teardown(test_status_order_push, trio_setup,
                                        trio_teardown),
        cmocka_unit_test(test_status_str),
        cmocka_unit_test(test_version),
    };
    return cmocka_run_group_tests_name("instance", tests, NULL, NULL);
}
