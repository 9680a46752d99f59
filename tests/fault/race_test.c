/*
 * Links that go away under running transfers, in one process so that TSan
 * sees both sides:
 *
 * - unlink (plain, forced, or forced from the prompt's side) while two
 *   threads pull and check every byte: each pull returns LLM_SUCCESS with the
 *   right bytes or LLM_NOT_YET_LINK, within the wait time plus a margin, and
 *   the link is made again each round;
 * - finalize of the prompt while the decoder's threads pull; the prompt is
 *   initialized again and the decoder links again; then finalize of the
 *   decoder with its link alive, which the prompt notices;
 * - a peer process that exits with our link alive.
 *
 *   race_test [transport]     (loop, tcp, shm or ucx; default tcp)
 * LLMDD_FAULT_ITERS sets the rounds of the unlink test.
 */
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "harness/fault_util.h"

#define PEER 1
#define SELF 2
#define PULLERS 2
#define WAIT_MS 1000
#define SEED 5

static const char *transport = "tcp";
static int margin;
static uint64_t rng;

typedef struct {
    llmdd *dd;
    int64_t remote; /* the prompt's cache id; atomic */
    bool stop;      /* atomic */
    pthread_t threads[PULLERS];
    /* Results, atomic: counted per status, and the broken promises. */
    int ok, not_linked, gone, other, corrupt, late;
    int64_t max_ms;
    llmdd_status other_st;
} pullers;

static llmdd_cache_desc
desc(void)
{
    llmdd_cache_desc d = {.num_tensors = 4,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, 1 << 18}};
    return d;
}

static void *
puller_main(void *arg)
{
    pullers *p = arg;
    llmdd_cache_desc d = desc();
    uint64_t stride = th_tensor_size(&d) / 4;
    llmdd_cache local;

    if (llmdd_allocate_cache(p->dd, &d, &local) != LLM_SUCCESS) {
        __atomic_add_fetch(&p->other, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    for (uint32_t n = 0; !__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE); n++) {
        uint32_t src = n % 4, dst = (n + 1) % 4;
        llmdd_cache_index idx = {PEER,
                                 __atomic_load_n(&p->remote, __ATOMIC_ACQUIRE),
                                 src};
        for (uint32_t t = 0; t < 4; t++)
            memset((uint8_t *)(uintptr_t)local.tensor_addrs[t] + dst * stride,
                   0xee, stride);
        int64_t t0 = th_now_ms();
        llmdd_status st = llmdd_pull_kv_cache(p->dd, &idx, &local, dst, -1,
                                              NULL);
        int64_t ms = th_now_ms() - t0;
        int64_t max = __atomic_load_n(&p->max_ms, __ATOMIC_RELAXED);
        while (ms > max && !__atomic_compare_exchange_n(
                               &p->max_ms, &max, ms, false, __ATOMIC_RELAXED,
                               __ATOMIC_RELAXED))
            ;
        if (ms > WAIT_MS + margin)
            __atomic_add_fetch(&p->late, 1, __ATOMIC_RELAXED);
        if (st == LLM_NOT_YET_LINK) {
            __atomic_add_fetch(&p->not_linked, 1, __ATOMIC_RELAXED);
            th_sleep_ms(1); /* leave the CPU to the relink */
            continue;
        }
        if (st == LLM_KV_CACHE_NOT_EXIST) {
            __atomic_add_fetch(&p->gone, 1, __ATOMIC_RELAXED);
            continue;
        }
        if (st != LLM_SUCCESS) {
            __atomic_store_n(&p->other_st, st, __ATOMIC_RELAXED);
            __atomic_add_fetch(&p->other, 1, __ATOMIC_RELAXED);
            continue;
        }
        __atomic_add_fetch(&p->ok, 1, __ATOMIC_RELAXED);
        for (uint32_t t = 0; t < 4; t++) {
            const uint8_t *b =
                (const uint8_t *)(uintptr_t)local.tensor_addrs[t] +
                dst * stride;
            for (uint64_t k = 0; k < stride; k++) {
                if (b[k] != th_byte(SEED, t, src * stride + k)) {
                    __atomic_add_fetch(&p->corrupt, 1, __ATOMIC_RELAXED);
                    break;
                }
            }
        }
    }
    llmdd_deallocate_cache(p->dd, local.cache_id);
    return NULL;
}

static void
pullers_start(pullers *p, llmdd *dd, int64_t remote)
{
    memset(p, 0, sizeof(*p));
    p->dd = dd;
    p->remote = remote;
    for (int i = 0; i < PULLERS; i++)
        assert_int_equal(pthread_create(&p->threads[i], NULL, puller_main, p),
                         0);
}

/*
 * allow_gone: LLM_KV_CACHE_NOT_EXIST is a right answer too, when the prompt
 * finalizes (its caches go first) under a pull.
 */
static void
pullers_stop(pullers *p, const char *what, bool allow_gone)
{
    __atomic_store_n(&p->stop, true, __ATOMIC_RELEASE);
    for (int i = 0; i < PULLERS; i++)
        pthread_join(p->threads[i], NULL);
    printf("race_test: %s: %d pulls ok, %d not linked, %d cache gone, "
           "%d other (%s), %d corrupt, %d late, slowest %lld ms\n",
           what, p->ok, p->not_linked, p->gone, p->other,
           llmdd_status_str(p->other_st), p->corrupt, p->late,
           (long long)p->max_ms);
    if (!allow_gone)
        assert_int_equal(p->gone, 0);
    assert_int_equal(p->corrupt, 0);
    assert_int_equal(p->late, 0);
    assert_int_equal(p->other, 0);
    assert_true(p->ok > 0);
}

/* The prompt: listening, one filled cache. */
static llmdd *
prompt_start(uint16_t *port, int64_t *cache)
{
    llmdd_option o = {"llm.Transport", transport};
    llmdd_cache_desc d = desc();
    llmdd_cache c;
    llmdd *dd;

    if (*cache == 0)
        assert_int_equal(llmdd_create(PEER, LLMDD_ROLE_PROMPT, &dd),
                         LLM_SUCCESS);
    else
        dd = NULL;
    return dd != NULL && th_init_listen(dd, "127.0.0.1", port, &o, 1) ==
                                 LLM_SUCCESS &&
                   llmdd_allocate_cache(dd, &d, &c) == LLM_SUCCESS
               ? (th_fill(&c, SEED), *cache = c.cache_id, dd)
               : NULL;
}

static llmdd *
decoder_start(void)
{
    char wait[16];
    llmdd_option o[2] = {{"llm.Transport", transport},
                         {"llm.SyncKvCacheWaitTime", wait}};
    llmdd *dd;

    snprintf(wait, sizeof(wait), "%d", WAIT_MS);
    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_SUCCESS);
    return dd;
}

/* Links, waiting (bounded) for the prompt to notice the last link's end. */
static void
relink(llmdd *dd, uint16_t port)
{
    llmdd_status st =
        th_link_retry(dd, PEER, "127.0.0.1", port, 2000 * FU_SLOW);

    if (st != LLM_SUCCESS)
        fail_msg("link again: %s", llmdd_status_str(st));
}

static void
test_unlink_during_transfer(void **state)
{
    int rounds = (int)fu_env("LLMDD_FAULT_ITERS", FU_SLOW > 1 ? 10 : 30);
    int64_t cache = 0;
    uint16_t port;
    pullers p;

    (void)state;
    llmdd *prompt = prompt_start(&port, &cache);
    assert_non_null(prompt);
    llmdd *dd = decoder_start();
    relink(dd, port);
    pullers_start(&p, dd, cache);
    for (int r = 0; r < rounds; r++) {
        th_sleep_ms((int)(fu_rand(&rng) % 20));
        int64_t t0 = th_now_ms();
        llmdd_status st;
        switch (r % 3) {
        case 0:
            st = th_unlink(dd, PEER, "127.0.0.1", port, false, 2000);
            break;
        case 1:
            st = th_unlink(dd, PEER, "127.0.0.1", port, true, 2000);
            break;
        default:
            /* The prompt has no address of ours: forced, from its side. */
            st = th_unlink(prompt, SELF, "127.0.0.1", 1, true, 2000);
            break;
        }
        if (st != LLM_SUCCESS)
            fail_msg("round %d: unlink: %s", r, llmdd_status_str(st));
        if (th_now_ms() - t0 > 2000 + margin)
            fail_msg("round %d: unlink took %lld ms", r,
                     (long long)(th_now_ms() - t0));
        th_sleep_ms((int)(fu_rand(&rng) % 10));
        relink(dd, port);
    }
    /* The windows between relinks can be shorter than a first pull over a
     * fresh link (ucx under a sanitizer): the last link lives until a pull
     * went through it, or the bound passes. */
    int64_t until = th_now_ms() + 5000 * FU_SLOW;
    while (__atomic_load_n(&p.ok, __ATOMIC_ACQUIRE) == 0 && th_now_ms() < until)
        th_sleep_ms(5);
    pullers_stop(&p, "unlink during pulls", false);
    llmdd_destroy(dd);
    llmdd_destroy(prompt);
}

static void
test_finalize_with_links_alive(void **state)
{
    int64_t cache = 0;
    uint16_t port;
    pullers p;

    (void)state;
    llmdd *prompt = prompt_start(&port, &cache);
    assert_non_null(prompt);
    llmdd *dd = decoder_start();
    relink(dd, port);
    pullers_start(&p, dd, cache);
    th_sleep_ms(50);

    /* The prompt goes away under the decoder's pulls... */
    int64_t t0 = th_now_ms();
    llmdd_finalize(prompt);
    int64_t ms = th_now_ms() - t0;
    printf("race_test: prompt finalize with a live link took %lld ms\n",
           (long long)ms);
    assert_true(ms <= WAIT_MS + margin);

    /* ... and comes back, with a new cache id; the decoder links again. */
    llmdd_option o = {"llm.Transport", transport};
    llmdd_cache_desc d = desc();
    llmdd_cache c;
    assert_int_equal(th_init_listen(prompt, "127.0.0.1", &port, &o, 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(prompt, &d, &c), LLM_SUCCESS);
    th_fill(&c, SEED);
    __atomic_store_n(&p.remote, c.cache_id, __ATOMIC_RELEASE);
    relink(dd, port);
    int ok = __atomic_load_n(&p.ok, __ATOMIC_RELAXED);
    int64_t deadline = th_now_ms() + 2000 * FU_SLOW;
    while (__atomic_load_n(&p.ok, __ATOMIC_RELAXED) < ok + 10 &&
           th_now_ms() < deadline)
        th_sleep_ms(5);
    pullers_stop(&p, "prompt finalized under pulls", true);
    assert_true(p.not_linked > 0);

    /* The decoder finalizes with its link alive; the prompt notices. */
    llmdd_finalize(dd);
    deadline = th_now_ms() + 2000 * FU_SLOW;
    llmdd__link *l;
    while ((l = llmdd__link_get(prompt, SELF)) != NULL &&
           th_now_ms() < deadline) {
        llmdd__link_put(l);
        th_sleep_ms(5);
    }
    assert_null(l);
    llmdd_destroy(dd);
    llmdd_destroy(prompt);
}

static void
test_peer_exits_with_link(void **state)
{
    const char *args[] = {"--cluster", "1", "--transport", transport, NULL};
    th_proc proc;

    (void)state;
    if (strcmp(transport, "loop") == 0)
        skip(); /* loop reaches only peers in this process */
    assert_int_equal(th_proc_start(&proc, NULL, args), 0);
    llmdd *dd = decoder_start();
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache local;
    llmdd_cache_index idx = {PEER, proc.ids.kv, 1};
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    relink(dd, proc.port);
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &local, 0, -1, NULL),
                     LLM_SUCCESS);
    /* "quit": the peer destroys its instance with our link alive. */
    assert_int_equal(th_proc_stop(&proc), 0);
    int64_t t0 = th_now_ms();
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &local, 0, -1, NULL),
                     LLM_NOT_YET_LINK);
    assert_true(th_now_ms() - t0 <= WAIT_MS + margin);
    llmdd_destroy(dd);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unlink_during_transfer),
        cmocka_unit_test(test_finalize_with_links_alive),
        cmocka_unit_test(test_peer_exits_with_link),
    };

    if (argc > 1)
        transport = argv[1];
    if (strstr(llmdd_transport_list(), transport) == NULL) {
        printf("race_test: transport %s not built in; skipped\n", transport);
        return TH_SKIP;
    }
    margin = fu_margin_ms();
    rng = fu_seed();
    printf("race_test: transport %s, LLMDD_FAULT_SEED=%llu\n", transport,
           (unsigned long long)rng);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
