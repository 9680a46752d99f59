/*
 * The ucx transport beyond the shared conformance suite: what
 * llmdd_transport_info reports, when "auto" picks ucx, the listening side
 * pulling and pushing, revoked keys, a peer killed in the middle of a large
 * pull, and a timed-out pull that leaves the caller's buffers alone. Run
 * once per UCX_TLS (CMakeLists.txt sets it).
 */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"
#include "harness/harness.h"

#define PEER 1
#define SELF 2
#define WAIT_MS 4000
#define BIG_MIB 64 /* per tensor; 2 tensors, 4 slots of 16 MiB each */

static bool
tls_is(const char *name)
{
    const char *tls = getenv("UCX_TLS");
    return tls != NULL && strcmp(tls, name) == 0;
}

/* Peeks at a byte a transfer is writing: the race is the point. */
__attribute__((no_sanitize("thread"))) static uint8_t
peek(const uint8_t *p)
{
    return *(volatile const uint8_t *)p;
}

static llmdd *
self_new(const char *transport, const char *wait)
{
    llmdd_option o[] = {{"llm.Transport", transport},
                        {"llm.SyncKvCacheWaitTime", wait}};
    llmdd *dd;

    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_SUCCESS);
    return dd;
}

static void
peer_start(th_proc *p, const char *transport)
{
    const char *args[] = {"--cluster", "1", "--transport", transport, NULL};
    assert_int_equal(th_proc_start(p, NULL, args), 0);
}

static const char *
link_transport(llmdd *dd, uint64_t cluster)
{
    llmdd__link *link = llmdd__link_get(dd, cluster);
    const char *name = link != NULL ? link->ops->name : "none";

    llmdd__link_put(link);
    return name;
}

static llmdd_cache_desc
big_desc(void)
{
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, (int64_t)BIG_MIB << 18}};
    return d;
}

static int64_t
peer_alloc_big(th_proc *p)
{
    char cmd[64], reply[64];

    snprintf(cmd, sizeof(cmd), "alloc-big %d 2 5", BIG_MIB);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    return atoll(reply + 3);
}

/* A small pull that must work: the link (or a new one) is usable. */
static void
pull_small_ok(llmdd *dd, const th_proc *p)
{
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;
    llmdd_cache_index idx = {PEER, p->ids.kv, 1};

    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &c, 0, -1, NULL),
                     LLM_SUCCESS);
    const uint8_t *t3 = (const uint8_t *)(uintptr_t)c.tensor_addrs[3];
    for (uint64_t i = 0; i < 1024; i++)
        assert_int_equal(t3[i], th_byte(1, 3, 1024 + i));
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
}

static void
test_info(void **state)
{
    (void)state;
    const char *info = llmdd_transport_info("ucx");
    assert_non_null(info);
    print_message("llmdd_transport_info(\"ucx\"): %s\n", info);
    assert_non_null(strstr(info, "UCX 1."));
    assert_non_null(strstr(info, "devices: "));
    assert_non_null(strstr(info, "RDMA: "));
    assert_non_null(strstr(llmdd_transport_list(), "ucx"));
    assert_null(llmdd_transport_info("nope"));
    assert_null(llmdd_transport_info(NULL));
}

/* Links with our transport `mine` to a peer started with `theirs`, both on
 * this host, checks whether the link is ucx, and pulls. */
static void
link_and_pull(const char *mine, const char *theirs, bool want_ucx)
{
    th_proc p;
    llmdd *dd = self_new(mine, "4000");

    peer_start(&p, theirs);
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000), LLM_SUCCESS);
    assert_int_equal(strcmp(link_transport(dd, PEER), "ucx") == 0, want_ucx);
    pull_small_ok(dd, &p);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/* Same kernel (and no RDMA here): never ucx under auto. */
static void
test_auto_keeps_one_host_off_ucx(void **state)
{
    (void)state;
    link_and_pull("auto", "auto", false);
}

static void
test_forced_ucx_links_on_one_host(void **state)
{
    (void)state;
    link_and_pull("ucx", "ucx", true);
}

/* A listener that forces ucx gets ucx from a linking side left on auto,
 * on one host too: the forced side wins, as for every transport. */
static void
test_listener_forcing_ucx_wins_over_auto(void **state)
{
    (void)state;
    link_and_pull("auto", "ucx", true);
}

/*
 * The listening side pulls from and pushes to the side that linked (its
 * requests travel the REV connection), then the linking side removes a
 * registered cache the other has used (its REVOKE travels FWD).
 */
static void
test_listener_pulls_and_pushes(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "ucx"},
                        {"llm.SyncKvCacheWaitTime", "4000"}};
    llmdd_cache_desc d = th_desc_kv();
    uint64_t size = th_tensor_size(&d);
    llmdd *srv, *cli;
    uint16_t port;
    llmdd_cache mine, theirs;
    uint64_t addrs[8];
    int64_t reg;

    (void)state;
    assert_int_equal(llmdd_create(PEER, LLMDD_ROLE_MIX, &srv), LLM_SUCCESS);
    assert_int_equal(th_init_listen(srv, "127.0.0.1", &port, o, 2),
                     LLM_SUCCESS);
    cli = self_new("ucx", "4000");
    assert_int_equal(th_link(cli, PEER, "127.0.0.1", port, 5000), LLM_SUCCESS);

    /* The client's caches: one allocated, one registered user memory. */
    assert_int_equal(llmdd_allocate_cache(cli, &d, &theirs), LLM_SUCCESS);
    th_fill(&theirs, 21);
    uint8_t *mem = aligned_alloc(4096, size * 8);
    assert_non_null(mem);
    for (uint32_t t = 0; t < 8; t++) {
        addrs[t] = (uint64_t)(uintptr_t)(mem + t * size);
        th_fill_buf(mem + t * size, size, 22, t);
    }
    assert_int_equal(llmdd_register_kv_cache(cli, &d, addrs, 8, &reg),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(srv, &d, &mine), LLM_SUCCESS);

    /* Pull slot 2 of the registered cache into slot 0. */
    llmdd_cache_index ri = {SELF, reg, 2};
    assert_int_equal(llmdd_pull_kv_cache(srv, &ri, &mine, 0, -1, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 8; t++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)mine.tensor_addrs[t];
        for (uint64_t i = 0; i < 1024; i++)
            assert_int_equal(p[i], th_byte(22, t, 2 * 1024 + i));
    }
    /* Push it on into slot 3 of the client's allocated cache. */
    llmdd_cache_index ai = {SELF, theirs.cache_id, 3};
    assert_int_equal(llmdd_push_kv_cache(srv, &mine, &ai, 0, -1, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 8; t++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)theirs.tensor_addrs[t];
        for (uint64_t i = 0; i < 1024; i++)
            assert_int_equal(p[3 * 1024 + i], th_byte(22, t, 2 * 1024 + i));
        assert_int_equal(p[0], th_byte(21, t, 0)); /* slot 0 untouched */
    }

    /* Once the owner lets go, the keys the server holds are revoked. */
    assert_int_equal(llmdd_unregister_kv_cache(cli, reg), LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache(srv, &ri, &mine, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    free(mem);
    assert_int_equal(llmdd_deallocate_cache(cli, theirs.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_push_kv_cache(srv, &mine, &ai, 0, -1, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    llmdd_destroy(cli);
    llmdd_destroy(srv);
}

struct pull_job {
    llmdd *dd;
    llmdd_cache_index idx;
    const llmdd_cache *dst;
    llmdd_status st;
    int64_t returned_ms;
    volatile bool done;
};

static void *
pull_main(void *arg)
{
    struct pull_job *j = arg;
    uint64_t all[] = {0, 1, 2, 3};

    j->st = llmdd_pull_kv_blocks(j->dd, &j->idx, j->dst, all, all, 4, NULL);
    j->returned_ms = th_now_ms();
    __atomic_store_n(&j->done, true, __ATOMIC_RELEASE);
    return NULL;
}

static void
test_peer_killed_mid_pull(void **state)
{
    llmdd_cache_desc d = big_desc();
    llmdd_cache local;
    pthread_t th;
    th_proc p, p2;
    llmdd *dd = self_new("ucx", "4000");

    (void)state;
    peer_start(&p, "ucx");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000), LLM_SUCCESS);
    int64_t rid = peer_alloc_big(&p);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    const uint8_t *first = (const uint8_t *)(uintptr_t)local.tensor_addrs[0];
    struct pull_job j = {.dd = dd, .idx = {PEER, rid, 0}, .dst = &local};

    int64_t start = th_now_ms();
    assert_int_equal(pthread_create(&th, NULL, pull_main, &j), 0);
    /* Bytes arriving in the destination: the pull is under way. */
    while (!__atomic_load_n(&j.done, __ATOMIC_ACQUIRE) && peek(first) == 0) {
        struct timespec ts = {0, 100 * 1000};
        nanosleep(&ts, NULL);
    }
    bool killed_mid = !__atomic_load_n(&j.done, __ATOMIC_ACQUIRE);
    th_proc_kill(&p, SIGKILL);
    int64_t killed_at = th_now_ms();
    pthread_join(th, NULL);
    print_message("pull returned %s %lld ms after the kill (%s)\n",
                  llmdd_status_str(j.st),
                  (long long)(j.returned_ms - killed_at),
                  killed_mid ? "killed mid-transfer" : "finished first");

    /* A status, within the wait time, never a hang. */
    assert_true(j.returned_ms - start <= WAIT_MS + 1000);
    if (j.st == LLM_SUCCESS) {
        /* Shared memory may finish the copy as the peer dies: then it is
         * whole. Over tcp a kill mid-transfer must fail it. */
        assert_false(tls_is("tcp") && killed_mid);
        for (uint32_t t = 0; t < 2; t++)
            assert_int_equal(
                th_check_buf((const uint8_t *)(uintptr_t)local.tensor_addrs[t],
                             (uint64_t)BIG_MIB << 20, 5, t),
                -1);
    } else {
        assert_int_equal(j.st, LLM_NOT_YET_LINK);
    }
    th_proc_stop(&p);

    /* The instance stays usable and links again. */
    peer_start(&p2, "ucx");
    /* The dead link leaves the table once the control thread saw EOF. */
    assert_int_equal(th_link_retry(dd, PEER, "127.0.0.1", p2.port, 5000),
                     LLM_SUCCESS);
    pull_small_ok(dd, &p2);
    assert_int_equal(llmdd_deallocate_cache(dd, local.cache_id), LLM_SUCCESS);
    llmdd_destroy(dd);
    th_proc_stop(&p2);
}

static void
set_wait(llmdd *dd, uint32_t ms)
{
    pthread_mutex_lock(&dd->lock);
    dd->opts.wait_ms = ms;
    pthread_mutex_unlock(&dd->lock);
}

static void
test_timeout_leaves_buffers_alone(void **state)
{
    llmdd_cache_desc d = big_desc();
    llmdd_cache local;
    th_proc p;
    llmdd *dd = self_new("ucx", "4000");
    uint64_t all[] = {0, 1, 2, 3};

    (void)state;
    peer_start(&p, "ucx");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000), LLM_SUCCESS);
    int64_t rid = peer_alloc_big(&p);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    llmdd_cache_index idx = {PEER, rid, 0};

    /* Learn the remote cache first, so the short wait covers data alone. */
    llmdd_cache_index one = {PEER, rid, 0};
    assert_int_equal(llmdd_pull_kv_cache(dd, &one, &local, 0, 64, NULL),
                     LLM_SUCCESS);
    memset((void *)(uintptr_t)local.tensor_addrs[0], 0, 64);
    memset((void *)(uintptr_t)local.tensor_addrs[1], 0, 64);

    set_wait(dd, 20);
    int64_t start = th_now_ms();
    llmdd_status st = llmdd_pull_kv_blocks(dd, &idx, &local, all, all, 4, NULL);
    int64_t took = th_now_ms() - start;
    print_message("128 MiB pull with a 20 ms wait: %s after %lld ms\n",
                  llmdd_status_str(st), (long long)took);
    assert_true(took <= 20 + 1000);
    if (tls_is("tcp"))
        assert_int_equal(st, LLM_TIMEOUT); /* emulated RMA: far slower */
    {
        /* Nothing lands after the call returned, whatever it returned
         * (over sm the pull may finish inside its 20 ms). */
        uint64_t len = (uint64_t)BIG_MIB << 20;
        uint8_t *snap = malloc(2 * len);
        assert_non_null(snap);
        memcpy(snap, (void *)(uintptr_t)local.tensor_addrs[0], len);
        memcpy(snap + len, (void *)(uintptr_t)local.tensor_addrs[1], len);
        th_sleep_ms(300);
        assert_memory_equal(snap, (void *)(uintptr_t)local.tensor_addrs[0],
                            len);
        assert_memory_equal(snap + len,
                            (void *)(uintptr_t)local.tensor_addrs[1], len);
        free(snap);
    }
    /* The link still works, and so does the full pull given time (UCX
     * 1.13 emulates RMA over shared memory, slowly, for memory it did not
     * allocate). */
    set_wait(dd, 30000);
    pull_small_ok(dd, &p);
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &local, all, all, 4, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 2; t++)
        assert_int_equal(
            th_check_buf((const uint8_t *)(uintptr_t)local.tensor_addrs[t],
                         (uint64_t)BIG_MIB << 20, 5, t),
            -1);
    assert_int_equal(llmdd_deallocate_cache(dd, local.cache_id), LLM_SUCCESS);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

int
main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]); /* one test by name */
    if (strstr(llmdd_transport_list(), "ucx") == NULL) {
        fprintf(stderr, "ucx_test: the ucx transport is not built in\n");
        return TH_SKIP;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_info),
        cmocka_unit_test(test_auto_keeps_one_host_off_ucx),
        cmocka_unit_test(test_forced_ucx_links_on_one_host),
        cmocka_unit_test(test_listener_forcing_ucx_wins_over_auto),
        cmocka_unit_test(test_listener_pulls_and_pushes),
        cmocka_unit_test(test_peer_killed_mid_pull),
        cmocka_unit_test(test_timeout_leaves_buffers_alone),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
