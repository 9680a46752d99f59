/*
 * The shm transport beyond the conformance suite: which path each kind of
 * cache takes (memfd mapping, cross-memory attach, the tcp data plane), that
 * a cache deallocated on its owner becomes unreachable on the peer before its
 * pool pages are reused, that leases do not stall the owner after an unlink,
 * that socket files of killed servers get removed, and what happens when the
 * peer shares the kernel but not the socket's directory or the pid
 * namespace.
 *
 *   shm_test [test name]
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "harness/harness.h"
#include "transport/shm/shm.h"
#include "transport/shm/shm_int.h"

#define PEER 1
#define SELF 2
#define POOL "{\"memory_size\": 16777216, \"page_shift\": 16}"
/* Generous: the test machine may be busy, and no test here waits it out. */
#define WAIT "5000"
#define HEX32 "00112233445566778899aabbccddeeff"
#define HEX32_2 "ffeeddccbbaa99887766554433221100"

static llmdd *
self_new(const char *transport)
{
    llmdd_option o[] = {{"llm.Transport", transport},
                        {"llm.SyncKvCacheWaitTime", WAIT}};
    llmdd *dd;

    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_SUCCESS);
    return dd;
}

static void
local_kv(llmdd *dd, llmdd_cache *c)
{
    llmdd_cache_desc d = th_desc_kv();

    assert_int_equal(llmdd_allocate_cache(dd, &d, c), LLM_SUCCESS);
}

/* Pulls all 4 slots of remote kv-shaped cache `id` into c. */
static llmdd_status
pull_all(llmdd *dd, int64_t id, const llmdd_cache *c)
{
    uint64_t all[] = {0, 1, 2, 3};
    llmdd_cache_index idx = {PEER, id, 0};

    return llmdd_pull_kv_blocks(dd, &idx, c, all, all, 4, NULL);
}

static void
check_cache(const llmdd_cache *c, uint32_t seed)
{
    uint64_t size = th_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++)
        assert_int_equal(
            th_check_buf((const uint8_t *)(uintptr_t)c->tensor_addrs[t], size,
                         seed, t),
            -1);
}

static const char *const plain_args[] = {"--cluster", "1", "--wait", WAIT,
                                         NULL};

static void
proc_start(th_proc *p, const char *const *wrapper, const char *transport,
           const char *pool)
{
    const char *args[] = {"--cluster", "1",    "--wait", WAIT, "--transport",
                          transport, pool ? "--pool" : NULL, pool, NULL};

    assert_int_equal(th_proc_start(p, wrapper, args), 0);
}

/*
 * What a copy through the owner's memory checks once it is done
 * (llmdd__shm_owner_left): the owner's half-close shows on the socket
 * itself, before our reader thread has read it and set `down`; a look that
 * saw the socket open vouches for SHM_OPEN_MS, well within the SHM_BYE_MS
 * the owner waits after its half-close before it frees anything.
 */
static void
test_owner_left_reads_the_socket(void **state)
{
    int sv[2];
    shm_link sl = {.open_at = INT64_MIN / 2};

    (void)state;
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    assert_int_equal(pthread_mutex_init(&sl.lock, NULL), 0);
    sl.sock = sv[0];
    /* Never looked at: the socket is, and it is open. */
    int64_t before = llmdd__now_ms();
    assert_false(llmdd__shm_owner_left(&sl));
    assert_true(sl.open_at >= before);
    /* The owner half-closes; nobody has read that yet. */
    assert_int_equal(shutdown(sv[1], SHUT_WR), 0);
    assert_false(sl.down);
    /* Seen open just now: this copy ran on leased memory. */
    assert_false(llmdd__shm_owner_left(&sl));
    /* A copy that ends later than the look vouches for. */
    sl.open_at -= SHM_OPEN_MS;
    assert_true(llmdd__shm_owner_left(&sl));
    /* Once down, always left, however recent the look. */
    sl.open_at = llmdd__now_ms();
    sl.down = true;
    assert_true(llmdd__shm_owner_left(&sl));
    pthread_mutex_destroy(&sl.lock);
    close(sv[0]);
    close(sv[1]);
}

static void
test_auto_picks_shm_and_memfd(void **state)
{
    llmdd__shm_stats a, b;
    llmdd_cache c;
    th_proc p;

    (void)state;
    proc_start(&p, NULL, "auto", NULL);
    llmdd *dd = self_new("auto");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                     LLM_SUCCESS);
    local_kv(dd, &c);
    llmdd__shm_stats_get(&a);
    assert_int_equal(pull_all(dd, p.ids.kv, &c), LLM_SUCCESS);
    check_cache(&c, 1);
    /* A push lands in the owner's memory, as the owner sees it. */
    th_fill(&c, 21);
    llmdd_cache_index idx = {PEER, p.ids.kv, 0};
    uint64_t all[] = {0, 1, 2, 3};
    assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                     LLM_SUCCESS);
    llmdd__shm_stats_get(&b);
    assert_int_equal(b.memfd_xfers - a.memfd_xfers, 2);
    assert_int_equal(b.cma_xfers, a.cma_xfers);
    assert_int_equal(b.stream_xfers, a.stream_xfers);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

static void
test_push_visible_to_owner(void **state)
{
    char cmd[64], reply[64];
    llmdd_cache c;
    th_proc p;

    (void)state;
    proc_start(&p, NULL, "shm", NULL);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                     LLM_SUCCESS);
    assert_int_equal(th_proc_cmd(&p, "alloc 30", reply, sizeof(reply)), 0);
    int64_t id = atoll(reply + 3);
    local_kv(dd, &c);
    assert_int_equal(pull_all(dd, id, &c), LLM_SUCCESS);
    check_cache(&c, 30);
    th_fill(&c, 31);
    llmdd_cache_index idx = {PEER, id, 0};
    uint64_t all[] = {0, 1, 2, 3};
    assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                     LLM_SUCCESS);
    snprintf(cmd, sizeof(cmd), "check %lld 31", (long long)id);
    assert_int_equal(th_proc_cmd(&p, cmd, reply, sizeof(reply)), 0);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

static void
test_registered_uses_cma(void **state)
{
    llmdd__shm_stats a, b;
    llmdd_cache c, back;
    th_proc p;

    (void)state;
    proc_start(&p, NULL, "shm", NULL);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                     LLM_SUCCESS);
    local_kv(dd, &c);
    local_kv(dd, &back);
    llmdd__shm_stats_get(&a);
    assert_int_equal(pull_all(dd, p.ids.reg, &c), LLM_SUCCESS);
    check_cache(&c, 2);
    th_fill(&c, 22);
    llmdd_cache_index idx = {PEER, p.ids.reg, 0};
    uint64_t all[] = {0, 1, 2, 3};
    assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                     LLM_SUCCESS);
    assert_int_equal(pull_all(dd, p.ids.reg, &back), LLM_SUCCESS);
    check_cache(&back, 22);
    llmdd__shm_stats_get(&b);
    assert_int_equal(b.cma_xfers - a.cma_xfers, 3);
    assert_int_equal(b.stream_xfers, a.stream_xfers);
    assert_int_equal(b.cma_refused, a.cma_refused);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/*
 * A large registered transfer moves over two threads (SHM_SPLIT_BYTES):
 * every byte of a 32 MiB pull and push lands where it belongs, the seam
 * between the halves included.
 */
static void
test_registered_large_split(void **state)
{
    char cmd[64], reply[64];
    llmdd__shm_stats a, b;
    llmdd_cache c;
    th_proc p;

    (void)state;
    proc_start(&p, NULL, "shm", NULL);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                     LLM_SUCCESS);
    /* 3 tensors of 12 MiB: the halves meet inside a run, not at a tensor. */
    assert_int_equal(th_proc_cmd(&p, "reg-big 12 3 41", reply, sizeof(reply)),
                     0);
    int64_t id = atoll(reply + 3);
    llmdd_cache_desc d = {.num_tensors = 3,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, 12 << 18}};
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    uint64_t size = th_tensor_size(&d), all[] = {0, 1, 2, 3};
    llmdd_cache_index idx = {PEER, id, 0};
    llmdd__shm_stats_get(&a);
    assert_int_equal(llmdd_pull_kv_blocks(dd, &idx, &c, all, all, 4, NULL),
                     LLM_SUCCESS);
    for (uint32_t t = 0; t < 3; t++)
        assert_int_equal(th_check_buf((uint8_t *)(uintptr_t)c.tensor_addrs[t],
                                      size, 41, t),
                         -1);
    th_fill(&c, 42);
    assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                     LLM_SUCCESS);
    snprintf(cmd, sizeof(cmd), "check %lld 42", (long long)id);
    assert_int_equal(th_proc_cmd(&p, cmd, reply, sizeof(reply)), 0);
    llmdd__shm_stats_get(&b);
    assert_int_equal(b.cma_split - a.cma_split, 2);
    assert_int_equal(b.cma_xfers - a.cma_xfers, 2);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/*
 * A 4 MiB copy through the owner's memfd of two tensors (one layer of K and
 * V) is shared with the instance's assist thread, kept from one transfer
 * to the next: every transfer is offered to it and every byte lands, the
 * seam between the tensors included. A finalized and initialized instance
 * starts the assist again.
 */
static void
test_memfd_split_on_assist(void **state)
{
    char cmd[64], reply[64];
    llmdd__shm_stats a, b;
    llmdd_cache c;
    th_proc p;
    llmdd_option o[] = {{"llm.Transport", "shm"},
                        {"llm.SyncKvCacheWaitTime", WAIT}};

    (void)state;
    proc_start(&p, NULL, "shm", NULL);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_proc_cmd(&p, "alloc-big 2 2 61", reply, sizeof(reply)),
                     0);
    int64_t id = atoll(reply + 3);
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, 2 << 18}};
    uint64_t size = th_tensor_size(&d), all[] = {0, 1, 2, 3};
    llmdd_cache_index idx = {PEER, id, 0};
    for (int round = 0; round < 2; round++) {
        assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
        llmdd__shm_stats_get(&a);
        for (int i = 0; i < 2; i++) {
            memset((void *)(uintptr_t)c.tensor_addrs[0], 0, size);
            memset((void *)(uintptr_t)c.tensor_addrs[1], 0, size);
            assert_int_equal(
                llmdd_pull_kv_blocks(dd, &idx, &c, all, all, 4, NULL),
                LLM_SUCCESS);
            for (uint32_t t = 0; t < 2; t++)
                assert_int_equal(
                    th_check_buf((uint8_t *)(uintptr_t)c.tensor_addrs[t], size,
                                 61, t),
                    -1);
        }
        th_fill(&c, 62 + (uint32_t)round);
        assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                         LLM_SUCCESS);
        snprintf(cmd, sizeof(cmd), "check %lld %d", (long long)id, 62 + round);
        assert_int_equal(th_proc_cmd(&p, cmd, reply, sizeof(reply)), 0);
        llmdd__shm_stats_get(&b);
        assert_int_equal(b.memfd_xfers - a.memfd_xfers, 3);
        assert_int_equal(b.copy_split - a.copy_split, 3);
        /* The owner's bytes back to seed 61 for the next round's pulls. */
        th_fill(&c, 61);
        assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
        llmdd_finalize(dd);
        assert_int_equal(llmdd_initialize(dd, o, 2), LLM_SUCCESS);
    }
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/* One of test_memfd_shared_concurrent's pulling threads. */
typedef struct {
    llmdd *dd;
    llmdd_cache_index idx;
    const llmdd_cache *c;
    uint64_t slot, slot_bytes;
    int64_t bad; /* -1: every byte right; else the first wrong offset */
    llmdd_status st;
} shared_puller;

static void *
shared_pull_main(void *arg)
{
    shared_puller *w = arg;
    uint64_t from = w->slot * w->slot_bytes;

    w->bad = -1;
    for (int round = 0; round < 5 && w->st == LLM_SUCCESS && w->bad < 0;
         round++) {
        for (uint32_t t = 0; t < 2; t++)
            memset((uint8_t *)(uintptr_t)w->c->tensor_addrs[t] + from, 0,
                   w->slot_bytes);
        w->st = llmdd_pull_kv_blocks(w->dd, &w->idx, w->c, &w->slot, &w->slot,
                                     1, NULL);
        for (uint32_t t = 0; t < 2 && w->st == LLM_SUCCESS; t++) {
            const uint8_t *b =
                (const uint8_t *)(uintptr_t)w->c->tensor_addrs[t];
            for (uint64_t i = from; i < from + w->slot_bytes; i++)
                if (b[i] != th_byte(71, t, i)) {
                    w->bad = (int64_t)i;
                    break;
                }
        }
    }
    return NULL;
}

/*
 * Copies at once share the assist thread: four threads pull a slot each
 * (2 tensors of 2 MiB, so every copy is shared) from one owner, five
 * times; every byte of every slot lands, every copy was offered to the
 * assist thread, and it moved claims.
 */
static void
test_memfd_shared_concurrent(void **state)
{
    char reply[64];
    llmdd__shm_stats a, b;
    llmdd_cache c;
    th_proc p;
    pthread_t th[4];
    shared_puller w[4];

    (void)state;
    proc_start(&p, NULL, "shm", NULL);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_proc_cmd(&p, "alloc-big 8 2 71", reply, sizeof(reply)),
                     0);
    int64_t id = atoll(reply + 3);
    llmdd_cache_desc d = {.num_tensors = 2,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, 2 << 20}};
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    llmdd__shm_stats_get(&a);
    for (int i = 0; i < 4; i++) {
        w[i] = (shared_puller){.dd = dd,
                               .idx = {PEER, id, 0},
                               .c = &c,
                               .slot = (uint64_t)i,
                               .slot_bytes = 2 << 20,
                               .st = LLM_SUCCESS};
        assert_int_equal(pthread_create(&th[i], NULL, shared_pull_main, &w[i]),
                         0);
    }
    for (int i = 0; i < 4; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(w[i].st, LLM_SUCCESS);
        assert_int_equal(w[i].bad, -1);
    }
    llmdd__shm_stats_get(&b);
    assert_int_equal(b.memfd_xfers - a.memfd_xfers, 20);
    assert_int_equal(b.copy_split - a.copy_split, 20);
    assert_true(b.assist_claims > a.assist_claims);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/* Pool pages of a deallocated cache are reused: the peer cannot reach them
 * through the old cache id, neither to read nor to write. */
static void
test_pool_reuse_proc(void **state)
{
    char cmd[64], reply[64];
    llmdd_cache c;
    th_proc p;

    (void)state;
    proc_start(&p, NULL, "shm", POOL);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                     LLM_SUCCESS);
    assert_int_equal(th_proc_cmd(&p, "alloc 40", reply, sizeof(reply)), 0);
    int64_t x = atoll(reply + 3);
    local_kv(dd, &c);
    assert_int_equal(pull_all(dd, x, &c), LLM_SUCCESS);
    check_cache(&c, 40);

    snprintf(cmd, sizeof(cmd), "dealloc %lld", (long long)x);
    assert_int_equal(th_proc_cmd(&p, cmd, reply, sizeof(reply)), 0);
    assert_int_equal(th_proc_cmd(&p, "alloc 41", reply, sizeof(reply)), 0);
    int64_t y = atoll(reply + 3);

    th_fill(&c, 42);
    llmdd_cache_index idx = {PEER, x, 0};
    uint64_t all[] = {0, 1, 2, 3};
    assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(pull_all(dd, x, &c), LLM_KV_CACHE_NOT_EXIST);
    check_cache(&c, 42);
    snprintf(cmd, sizeof(cmd), "check %lld 41", (long long)y);
    assert_int_equal(th_proc_cmd(&p, cmd, reply, sizeof(reply)), 0);
    assert_int_equal(pull_all(dd, y, &c), LLM_SUCCESS);
    check_cache(&c, 41);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/* The same in one process, where the reuse of the very pages is visible. */
static void
test_pool_reuse_inproc(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "shm"},
                        {"llm.HostMemPoolConfig", POOL},
                        {"llm.SyncKvCacheWaitTime", WAIT}};
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache x, y, c;
    llmdd *owner;
    uint16_t port;

    (void)state;
    assert_int_equal(llmdd_create(PEER, LLMDD_ROLE_MIX, &owner), LLM_SUCCESS);
    assert_int_equal(th_init_listen(owner, "127.0.0.1", &port, o, 3),
                     LLM_SUCCESS);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", port, 5000), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(owner, &d, &x), LLM_SUCCESS);
    th_fill(&x, 50);
    uint64_t x0 = x.tensor_addrs[0];
    local_kv(dd, &c);
    assert_int_equal(pull_all(dd, x.cache_id, &c), LLM_SUCCESS);
    check_cache(&c, 50);

    assert_int_equal(llmdd_deallocate_cache(owner, x.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(owner, &d, &y), LLM_SUCCESS);
    assert_int_equal(y.tensor_addrs[0], x0); /* the same pages */
    th_fill(&y, 51);

    th_fill(&c, 52);
    llmdd_cache_index idx = {PEER, x.cache_id, 0};
    uint64_t all[] = {0, 1, 2, 3};
    assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(pull_all(dd, x.cache_id, &c), LLM_KV_CACHE_NOT_EXIST);
    check_cache(&c, 52);
    check_cache(&y, 51);
    llmdd_destroy(dd);
    llmdd_destroy(owner);
}

/* After an unlink the owner's leases go as soon as the peer let go: a
 * deallocation neither hangs nor waits for a timeout. */
static void
test_unlink_then_dealloc(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "shm"},
                        {"llm.SyncKvCacheWaitTime", WAIT}};
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache x, c;
    llmdd *owner;
    uint16_t port;

    (void)state;
    assert_int_equal(llmdd_create(PEER, LLMDD_ROLE_MIX, &owner), LLM_SUCCESS);
    assert_int_equal(th_init_listen(owner, "127.0.0.1", &port, o, 2),
                     LLM_SUCCESS);
    llmdd *dd = self_new("shm");
    for (int force = 0; force < 2; force++) {
        assert_int_equal(th_link(dd, PEER, "127.0.0.1", port, 5000),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_allocate_cache(owner, &d, &x), LLM_SUCCESS);
        th_fill(&x, 60);
        local_kv(dd, &c);
        assert_int_equal(pull_all(dd, x.cache_id, &c), LLM_SUCCESS);
        check_cache(&c, 60);
        /* The owner unlinks (force: no traffic), then deallocates. */
        assert_int_equal(th_unlink(owner, SELF, "127.0.0.1", port, force != 0,
                                   2000),
                         LLM_SUCCESS);
        int64_t t0 = th_now_ms();
        assert_int_equal(llmdd_deallocate_cache(owner, x.cache_id),
                         LLM_SUCCESS);
        assert_true(th_now_ms() - t0 < 1000);
        /* The peer notices the link is gone (polled: it learns it from its
         * sockets, asynchronously). */
        int64_t until = th_now_ms() + 3000;
        llmdd_status st;
        while ((st = pull_all(dd, x.cache_id, &c)) != LLM_NOT_YET_LINK &&
               th_now_ms() < until)
            usleep(10000);
        assert_int_equal(st, LLM_NOT_YET_LINK);
        assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    }
    llmdd_destroy(dd);
    llmdd_destroy(owner);
}

typedef struct {
    llmdd *dd;
    int64_t id;
    llmdd_status st;
    int done_fd; /* eventfd, written once the call returned */
} dealloc_job;

static void *
dealloc_main(void *arg)
{
    dealloc_job *j = arg;
    uint64_t one = 1;

    j->st = llmdd_deallocate_cache(j->dd, j->id);
    assert_int_equal(write(j->done_fd, &one, sizeof(one)), sizeof(one));
    return NULL;
}

/* More peers than the 64 links a deallocation used to tell. */
#define MANY 66

/*
 * A deallocation tells every linked peer, however many: it returns without
 * waiting for any of them to unlink, and the oldest link (the last in the
 * owner's table) can no longer reach the cache, even though a new cache
 * now sits on the same pool pages.
 */
static void
test_dealloc_tells_every_link(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "shm"},
                        {"llm.HostMemPoolConfig", POOL},
                        {"llm.SyncKvCacheWaitTime", WAIT}};
    llmdd_cache_desc d = th_desc_kv();
    static llmdd *peers[MANY];
    static llmdd_cache local[MANY];
    llmdd_cache x, y;
    llmdd *owner;
    uint16_t port;
    pthread_t t;

    (void)state;
    assert_int_equal(llmdd_create(PEER, LLMDD_ROLE_MIX, &owner), LLM_SUCCESS);
    assert_int_equal(th_init_listen(owner, "127.0.0.1", &port, o, 3),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(owner, &d, &x), LLM_SUCCESS);
    th_fill(&x, 70);
    uint64_t x0 = x.tensor_addrs[0]; /* x's array goes with the cache */
    for (int i = 0; i < MANY; i++) {
        assert_int_equal(
            llmdd_create(100 + (uint64_t)i, LLMDD_ROLE_MIX, &peers[i]),
            LLM_SUCCESS);
        assert_int_equal(llmdd_initialize(peers[i], o, 1), LLM_SUCCESS);
        assert_int_equal(th_link(peers[i], PEER, "127.0.0.1", port, 5000),
                         LLM_SUCCESS);
        local_kv(peers[i], &local[i]);
        assert_int_equal(pull_all(peers[i], x.cache_id, &local[i]),
                         LLM_SUCCESS);
    }
    check_cache(&local[0], 70);

    dealloc_job j = {.dd = owner, .id = x.cache_id};
    j.done_fd = eventfd(0, EFD_CLOEXEC);
    assert_true(j.done_fd >= 0);
    assert_int_equal(pthread_create(&t, NULL, dealloc_main, &j), 0);
    struct pollfd pfd = {.fd = j.done_fd, .events = POLLIN};
    int ready = poll(&pfd, 1, 10000);
    if (ready != 1) {
        /* A peer that was never told keeps its lease: only its unlink
         * lets the deallocation finish. */
        for (int i = 0; i < MANY; i++)
            llmdd_destroy(peers[i]);
        pthread_join(t, NULL);
        fail_msg("deallocate waited for the oldest links to end");
    }
    pthread_join(t, NULL);
    close(j.done_fd);
    assert_int_equal(j.st, LLM_SUCCESS);

    assert_int_equal(llmdd_allocate_cache(owner, &d, &y), LLM_SUCCESS);
    assert_int_equal(y.tensor_addrs[0], x0); /* the same pages */
    th_fill(&y, 71);
    assert_int_equal(pull_all(peers[0], x.cache_id, &local[0]),
                     LLM_KV_CACHE_NOT_EXIST);
    check_cache(&local[0], 70);
    for (int i = MANY - 1; i >= 0; i--)
        llmdd_destroy(peers[i]);
    llmdd_destroy(owner);
}

/*
 * Opens, read-write, every memfd of the owner that this process (the shm
 * peer) has mapped, the way any code running in the peer could: through
 * /proc/self/map_files. Returns how many; fds[] gets them.
 */
static int
peer_memfds(int *fds, int cap)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int n = 0;

    assert_non_null(f);
    while (n < cap && fgets(line, sizeof(line), f) != NULL) {
        unsigned long lo, hi;
        char path[96];
        if (strstr(line, "/memfd:llmdd-") == NULL ||
            sscanf(line, "%lx-%lx", &lo, &hi) != 2)
            continue;
        snprintf(path, sizeof(path), "/proc/self/map_files/%lx-%lx", lo, hi);
        fds[n] = open(path, O_RDWR | O_CLOEXEC);
        assert_true(fds[n] >= 0);
        n++;
    }
    fclose(f);
    return n;
}

/*
 * The peer receives the owner's memfd. Shrinking it must fail: it would
 * make the owner's next touch of those pages (a check, the zeroing on
 * deallocate) die of SIGBUS. With and without a pool.
 */
static void
test_memfd_sealed(void **state)
{
    char cmd[64], reply[64];
    int fds[8];

    (void)state;
    for (int pooled = 0; pooled < 2; pooled++) {
        llmdd_cache_desc d = th_desc_kv();
        uint64_t size = th_tensor_size(&d), addrs[8];
        llmdd_cache c = {.desc = d, .tensor_addrs = addrs};
        th_proc p;

        proc_start(&p, NULL, "shm", pooled ? POOL : NULL);
        llmdd *dd = self_new("shm");
        assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                         LLM_SUCCESS);
        /* Registered memory: the only memfds mapped here are the owner's. */
        uint8_t *mem = calloc(d.num_tensors, size);
        assert_non_null(mem);
        for (uint32_t t = 0; t < d.num_tensors; t++)
            addrs[t] = (uint64_t)(uintptr_t)(mem + t * size);
        assert_int_equal(
            llmdd_register_kv_cache(dd, &d, addrs, d.num_tensors, &c.cache_id),
            LLM_SUCCESS);
        assert_int_equal(th_proc_cmd(&p, "alloc 80", reply, sizeof(reply)), 0);
        int64_t id = atoll(reply + 3);
        assert_int_equal(pull_all(dd, id, &c), LLM_SUCCESS);
        check_cache(&c, 80);

        int n = peer_memfds(fds, 8);
        assert_true(n >= 1);
        for (int i = 0; i < n; i++) {
            errno = 0;
            assert_int_equal(ftruncate(fds[i], 0), -1);
            assert_int_equal(errno, EPERM);
            close(fds[i]);
        }
        /* The owner still reads its pages, and zeroes them on deallocate. */
        snprintf(cmd, sizeof(cmd), "check %lld 80", (long long)id);
        assert_int_equal(th_proc_cmd(&p, cmd, reply, sizeof(reply)), 0);
        snprintf(cmd, sizeof(cmd), "dealloc %lld", (long long)id);
        assert_int_equal(th_proc_cmd(&p, cmd, reply, sizeof(reply)), 0);
        assert_int_equal(pull_all(dd, id, &c), LLM_KV_CACHE_NOT_EXIST);
        llmdd_destroy(dd);
        free(mem);
        assert_int_equal(th_proc_stop(&p), 0);
    }
}

/* Links on auto to a peer that cannot use our socket, and checks that a
 * pull is byte-exact and went over the data plane, not a memfd. */
static void
auto_pull_on_data_plane(const th_proc *p, int timeout_ms)
{
    llmdd__shm_stats a, b;
    llmdd_cache c;
    llmdd *dd = self_new("auto");

    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p->port, timeout_ms),
                     LLM_SUCCESS);
    local_kv(dd, &c);
    llmdd__shm_stats_get(&a);
    assert_int_equal(pull_all(dd, p->ids.kv, &c), LLM_SUCCESS);
    check_cache(&c, 1);
    llmdd__shm_stats_get(&b);
    assert_int_equal(b.stream_xfers - a.stream_xfers, 1);
    assert_int_equal(b.memfd_xfers, a.memfd_xfers);
    llmdd_destroy(dd);
}

/* The peer shares the kernel but has its own /tmp: auto falls back to the
 * tcp data plane, a forced shm fails to link. */
static void
test_no_socket(void **state)
{
    const char *wrap[] = {
        "unshare",
        "--mount",
        "sh",
        "-c",
        "mount -t tmpfs llmdd-test /tmp && exec \"$0\" \"$@\"",
        NULL};
    th_proc p;

    (void)state;
    if (th_proc_start(&p, wrap, plain_args) != 0)
        skip(); /* no mount namespaces here (not root?) */
    auto_pull_on_data_plane(&p, 5000);

    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 3000),
                     LLM_LINK_FAILED);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/* Makes a socket file named like a server's, `age_s` seconds old. */
static void
fake_socket(char *path, size_t cap, pid_t pid, const char *hex, int age_s)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);

    snprintf(path, cap, "/tmp/llmdd-%d-%s.sock", (int)pid, hex);
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
    unlink(path);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    close(fd);
    struct timespec t[2] = {{time(NULL) - age_s, 0}, {time(NULL) - age_s, 0}};
    assert_int_equal(utimensat(AT_FDCWD, path, t, AT_SYMLINK_NOFOLLOW), 0);
}

/* Socket files of servers that were killed before their client connected
 * are removed by the next server; nothing else is. */
static void
test_stale_socket_swept(void **state)
{
    char stale[128], young[128], alive[128];
    th_proc p;

    (void)state;
    pid_t dead = fork();
    if (dead == 0)
        _exit(0);
    assert_true(dead > 0);
    assert_int_equal(waitpid(dead, NULL, 0), dead);
    fake_socket(stale, sizeof(stale), dead, HEX32, 3600);
    fake_socket(young, sizeof(young), dead, HEX32_2, 0);
    fake_socket(alive, sizeof(alive), getpid(), HEX32, 3600);
    proc_start(&p, NULL, "shm", NULL);
    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                     LLM_SUCCESS);
    assert_int_not_equal(access(stale, F_OK), 0);
    assert_int_equal(access(young, F_OK), 0);
    assert_int_equal(access(alive, F_OK), 0);
    unlink(young);
    unlink(alive);
    llmdd_destroy(dd);
    th_proc_stop(&p);
}

/*
 * A peer in another pid namespace is not "same host" for shm: a forced shm
 * fails to link, tcp links, and auto links too. The peer is pid 1 there, a
 * pid that exists here as well, so our side may think shm reaches it while
 * the peer cannot see our pid: auto must still link and move the bytes.
 */
static void
test_other_pid_namespace(void **state)
{
    const char *wrap[] = {"unshare", "--pid", "--fork", "--kill-child", NULL};
    th_proc p;

    (void)state;
    if (th_proc_start(&p, wrap, plain_args) != 0)
        skip(); /* no pid namespaces here (not root?) */
    llmdd *dd = self_new("shm");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 3000),
                     LLM_LINK_FAILED);
    llmdd_destroy(dd);
    dd = self_new("tcp");
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 3000),
                     LLM_SUCCESS);
    llmdd_destroy(dd);
    /* The socket's SO_PEERCRED check fails: the data plane carries it. */
    auto_pull_on_data_plane(&p, 3000);
    th_proc_stop(&p);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_owner_left_reads_the_socket),
        cmocka_unit_test(test_auto_picks_shm_and_memfd),
        cmocka_unit_test(test_push_visible_to_owner),
        cmocka_unit_test(test_registered_uses_cma),
        cmocka_unit_test(test_registered_large_split),
        cmocka_unit_test(test_memfd_split_on_assist),
        cmocka_unit_test(test_memfd_shared_concurrent),
        cmocka_unit_test(test_pool_reuse_proc),
        cmocka_unit_test(test_pool_reuse_inproc),
        cmocka_unit_test(test_unlink_then_dealloc),
        cmocka_unit_test(test_dealloc_tells_every_link),
        cmocka_unit_test(test_memfd_sealed),
        cmocka_unit_test(test_stale_socket_swept),
        cmocka_unit_test(test_no_socket),
        cmocka_unit_test(test_other_pid_namespace),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("shm", tests, NULL, NULL);
}
