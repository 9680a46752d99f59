/*
 * One peer never holds up another (docs/model.md, "Isolation"). This
 * process is the decoder; peer_helper processes and raw wire peers are the
 * others.
 *
 * - Notifications are flow-controlled per link: a peer flooding a decoder
 *   that does not drain gets LLM_SUCCESS exactly for what the decoder will
 *   deliver (its window) and then LLM_TIMEOUT, and keeps its link; another
 *   peer's notifications meanwhile go through at once; the decoder's key
 *   lookups to the flooding peer are answered, and its hang-up is noticed;
 *   once drained, every acknowledged notification is there, in order.
 * - Posted transfers: pulls stuck on a SIGSTOPped peer hold only that
 *   link's share of the workers; a healthy peer's pull is served at once.
 * - The control thread never waits on one peer: a raw peer that stops
 *   reading its control connection while asking key lookups, and to which
 *   the application sends notifications, delays neither another peer's
 *   key lookups nor new links.
 * - The side that accepts bounds what it serves: a prompt at a 256-fd limit
 *   (llm.MaxLinks=auto: 16 links) and 24 clients asking for 16 lanes each:
 *   16 link and pull, the rest get LLM_CLUSTER_NUM_EXCEED_LIMIT, none a
 *   timeout, and the prompt stays inside its descriptors.
 */
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "harness/fault_util.h"
#include "harness/mp.h"

#define MARGIN_MS (500 * FU_SLOW)

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static llmdd *
decoder(const char *wait_ms)
{
    llmdd_option o[] = {{"llm.SyncKvCacheWaitTime", wait_ms},
                        {"llm.Transport", "tcp"}};

    return mp_decoder(MP_SELF, o, 2);
}

/* "OK <sent> <status> <ms>" of the helper's notify command. */
typedef struct {
    unsigned sent;
    char status[40];
    long long ms;
} notified;

static notified
peer_notify(th_proc *p, unsigned n)
{
    char cmd[64], reply[128];
    notified r = {0};

    snprintf(cmd, sizeof(cmd), "notify %d %u", MP_SELF, n);
    assert_int_equal(th_proc_cmd(p, cmd, reply, sizeof(reply)), 0);
    assert_int_equal(sscanf(reply, "OK %u %39s %lld", &r.sent, r.status, &r.ms),
                     3);
    return r;
}

/*
 * Drains everything waiting. Sender c (1 or 2) must send "0", "1", ... in
 * order: next[c] is the number it must send next, advanced here.
 */
static void
drain(llmdd *dd, unsigned next[3])
{
    static llmdd_notify got[64];
    size_t n;

    do {
        assert_int_equal(llmdd_get_notifies(dd, got, 64, &n), LLM_SUCCESS);
        for (size_t i = 0; i < n; i++) {
            uint64_t c = got[i].cluster_id;
            assert_true(c == 1 || c == 2);
            char want[16];
            int len = snprintf(want, sizeof(want), "%u", next[c]++);
            assert_int_equal(got[i].len, (size_t)len);
            assert_memory_equal(got[i].msg, want, (size_t)len);
        }
    } while (n > 0);
}

static void
test_notify_flood_is_flow_controlled(void **state)
{
    static const char *const args[] = {"--wait", "1000", NULL};
    char reply[64];
    unsigned next[3] = {0, 0, 0};

    (void)state;
    th_proc *s = mp_peer_start(1, args);
    th_proc *t = mp_peer_start(2, args);
    llmdd *dd = decoder("1000");
    assert_int_equal(th_link(dd, 1, MP_IP, s->port, 2000), LLM_SUCCESS);
    assert_int_equal(th_link(dd, 2, MP_IP, t->port, 2000), LLM_SUCCESS);
    assert_int_equal(th_proc_cmd(s, "key 1 0 flood-key", reply, sizeof(reply)),
                     0);

    /* The decoder does not drain: the window goes, then the sender waits
     * its wait time and gets LLM_TIMEOUT; the link stays. */
    notified r = peer_notify(s, 8000);
    assert_int_equal(r.sent, LLMDD_NOTIFY_WINDOW);
    assert_string_equal(r.status, "LLM_TIMEOUT");
    assert_in_range(r.ms, 900, 1000 + MARGIN_MS);
    assert_int_equal(llmdd_check_link(dd, 1, 1000), LLM_SUCCESS);

    /* Another peer is not paused, and the flooding link still answers. */
    notified rt = peer_notify(t, 10);
    assert_int_equal(rt.sent, 10);
    assert_string_equal(rt.status, "LLM_SUCCESS");
    llmdd_cache_index idx;
    assert_int_equal(llmdd_lookup_remote_key(dd, 1, "flood-key", 9, &idx),
                     LLM_SUCCESS);
    assert_int_equal(idx.cache_id, 1);

    /* Every acknowledged notification is delivered, in order, once. All
     * of S's have arrived (a lookup went through S's connection after its
     * notifications); T's sends returned on credit, so T's may still be on
     * the wire: they are waited for. */
    drain(dd, next);
    assert_int_equal(next[1], LLMDD_NOTIFY_WINDOW);
    int64_t t0 = th_now_ms();
    while (next[2] < 10 && th_now_ms() - t0 < 1000 + MARGIN_MS) {
        struct pollfd pfd = {.fd = llmdd_notify_fd(dd), .events = POLLIN};
        poll(&pfd, 1, 100);
        drain(dd, next);
    }
    assert_int_equal(next[1], LLMDD_NOTIFY_WINDOW);
    assert_int_equal(next[2], 10);

    /* Drained, the sender has credit again. */
    r = peer_notify(s, 100);
    assert_int_equal(r.sent, 100);
    next[1] = 0;
    t0 = th_now_ms();
    while (next[1] < 100 && th_now_ms() - t0 < 1000 + MARGIN_MS) {
        struct pollfd pfd = {.fd = llmdd_notify_fd(dd), .events = POLLIN};
        poll(&pfd, 1, 100);
        drain(dd, next);
    }
    assert_int_equal(next[1], 100);

    /* A hang-up on a link the decoder does not drain is noticed. */
    r = peer_notify(s, LLMDD_NOTIFY_WINDOW);
    assert_int_equal(r.sent, LLMDD_NOTIFY_WINDOW);
    mp_peer_kill(s);
    t0 = th_now_ms();
    while (llmdd_check_link(dd, 1, 200) != LLM_NOT_YET_LINK)
        if (th_now_ms() - t0 > 1000 + MARGIN_MS)
            fail_msg("the hang-up of a flooding peer went unnoticed");
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(t), 0);
}

static void
test_stalled_link_holds_its_share(void **state)
{
    static const char *const args[] = {"--transport", "tcp", "--role",
                                       "prompt", NULL};
    llmdd_request *stuck[16], *ok;
    llmdd_cache scratch;
    llmdd_cache_desc d = th_desc_kv();

    (void)state;
    th_proc *a = mp_peer_start(1, args);
    th_proc *b = mp_peer_start(2, args);
    llmdd *dd = decoder("3000");
    /* The stopped peer is judged by the wait time here, not heartbeats. */
    assert_int_equal(llmdd_allocate_cache(dd, &d, &scratch), LLM_SUCCESS);
    assert_int_equal(th_link(dd, 1, MP_IP, a->port, 2000), LLM_SUCCESS);
    assert_int_equal(th_link(dd, 2, MP_IP, b->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, a->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 2, b->ids.kv, 1), LLM_SUCCESS);

    mp_peer_stop(a);
    llmdd_cache_index from_a = {1, a->ids.kv, 0}, from_b = {2, b->ids.kv, 0};
    for (int i = 0; i < 16; i++)
        assert_int_equal(llmdd_pull_kv_cache_async(dd, &from_a, &scratch,
                                                   (uint32_t)(i % 3), -1,
                                                   NULL, NULL, &stuck[i]),
                         LLM_SUCCESS);
    int64_t t0 = th_now_ms();
    assert_int_equal(llmdd_pull_kv_cache_async(dd, &from_b, &scratch, 3, -1,
                                               NULL, NULL, &ok),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(ok, -1), LLM_SUCCESS);
    int64_t ms = th_now_ms() - t0;
    fprintf(stderr, "# a healthy peer's pull beside 16 stuck ones: %lld ms\n",
            (long long)ms);
    assert_true(ms < 300 + MARGIN_MS); /* not behind the 3000 ms ones */
    llmdd_request_free(ok);
    for (int i = 0; i < 16; i++) {
        llmdd_status st = llmdd_request_wait(stuck[i], -1);
        assert_true(st == LLM_TIMEOUT || st == LLM_NOT_YET_LINK);
        llmdd_request_free(stuck[i]);
    }
    th_proc_kill(a, SIGCONT);
    llmdd_destroy(dd);
}

/* A raw peer that asks key lookups and never reads a byte. */
static void *
deaf_asker(void *arg)
{
    int fd = *(int *)arg;
    llmdd__key_query q = {.key_len = 3};
    uint8_t buf[256];

    memcpy(q.key, "abc", 3);
    for (uint64_t seq = 1; seq < 100000; seq++) {
        q.seq = seq;
        size_t n = llmdd__wire_key_query_encode(&q, buf, sizeof(buf));
        if (fu_send_frame(fd, WMSG_KEY_QUERY, buf, n) != 0)
            break; /* dropped: its problem */
    }
    return NULL;
}

typedef struct {
    llmdd *dd;
    uint64_t to;
    atomic_bool stop;
    llmdd_status first_fail;
    int sent;
} sender;

/* The application notifies the deaf peer until a send fails. */
static void *
sender_main(void *arg)
{
    sender *s = arg;
    static char msg[LLMDD_NOTIFY_MAX];

    while (!atomic_load(&s->stop)) {
        llmdd_status st = llmdd_send_notify(s->dd, s->to, msg, sizeof(msg));
        if (st != LLM_SUCCESS) {
            s->first_fail = st;
            break;
        }
        s->sent++;
    }
    return NULL;
}

static void
test_ctrl_thread_never_waits_on_a_peer(void **state)
{
    llmdd_option o[] = {{"llm.SyncKvCacheWaitTime", "5000"},
                        {"llm.Transport", "tcp"}};
    uint8_t token[16];
    uint32_t st;
    uint16_t port;
    llmdd *p, *c;

    (void)state;
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_PROMPT, &p), LLM_SUCCESS);
    assert_int_equal(th_init_listen(p, "127.0.0.1", &port, o, 2), LLM_SUCCESS);
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache kv;
    assert_int_equal(llmdd_allocate_cache(p, &d, &kv), LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(p, kv.cache_id, 0, "k", 1),
                     LLM_SUCCESS);

    int deaf = fu_raw_link(port, 77, "tcp", token, &st);
    assert_true(deaf >= 0);
    int small = 4096;
    setsockopt(deaf, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sender sd = {.dd = p, .to = 77};
    atomic_init(&sd.stop, false);
    pthread_t ts, ta;
    assert_int_equal(pthread_create(&ts, NULL, sender_main, &sd), 0);
    assert_int_equal(pthread_create(&ta, NULL, deaf_asker, &deaf), 0);

    /* Meanwhile a healthy peer links and looks keys up, again and again. */
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_DECODER, &c), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(c, o, 2), LLM_SUCCESS);
    int64_t worst = 0, t_end = th_now_ms() + 2000;
    assert_int_equal(th_link(c, 1, "127.0.0.1", port, 1000 * FU_SLOW),
                     LLM_SUCCESS);
    while (th_now_ms() < t_end) {
        llmdd_cache_index idx;
        int64_t t0 = th_now_ms();
        assert_int_equal(llmdd_lookup_remote_key(c, 1, "k", 1, &idx),
                         LLM_SUCCESS);
        if (th_now_ms() - t0 > worst)
            worst = th_now_ms() - t0;
    }
    /* And a new link, while the deaf peer still stalls its own. */
    assert_int_equal(th_unlink(c, 1, "127.0.0.1", port, false, 1000 * FU_SLOW),
                     LLM_SUCCESS);
    int64_t t0 = th_now_ms();
    assert_int_equal(th_link(c, 1, "127.0.0.1", port, 1000 * FU_SLOW),
                     LLM_SUCCESS);
    int64_t link_ms = th_now_ms() - t0;
    atomic_store(&sd.stop, true);
    shutdown(deaf, SHUT_RDWR);
    assert_int_equal(pthread_join(ta, NULL), 0);
    assert_int_equal(pthread_join(ts, NULL), 0);
    fprintf(stderr,
            "# beside a deaf peer: worst key lookup %lld ms, link %lld ms; "
            "the application's sends to it: %d, then %s\n",
            (long long)worst, (long long)link_ms, sd.sent,
            llmdd_status_str(sd.first_fail));
    assert_true(worst < 200 + MARGIN_MS);
    assert_true(link_ms < 200 + MARGIN_MS);
    /* The window went, then the sends waited for credit, not the socket. */
    assert_true(sd.sent <= LLMDD_NOTIFY_WINDOW);
    close(deaf);
    llmdd_destroy(c);
    llmdd_destroy(p);
}

#define CLIENTS 24

static void
test_accepting_side_bounds_what_it_serves(void **state)
{
    static const char *const args[] = {"--role", "prompt", "--transport",
                                       "tcp", "--nofile", "256", NULL};
    llmdd_option o[] = {{"llm.Transport", "tcp"}, {"llm.TcpLanes", "16"}};
    llmdd *c[CLIENTS];
    int ok = 0, refused = 0;

    (void)state;
    th_proc *p = mp_peer_start(1, args);
    for (int i = 0; i < CLIENTS; i++) {
        c[i] = mp_decoder(MP_SELF + (uint64_t)i, o, 2);
        llmdd_status st = th_link(c[i], 1, MP_IP, p->port, 3000);
        if (st == LLM_SUCCESS) {
            ok++;
            assert_int_equal(mp_pull_check(c[i], 1, p->ids.kv, 1),
                             LLM_SUCCESS);
        } else if (st == LLM_CLUSTER_NUM_EXCEED_LIMIT) {
            refused++;
        } else {
            fail_msg("client %d: %s (not a refusal)", i, llmdd_status_str(st));
        }
    }
    fprintf(stderr, "# %d linked, %d refused; the prompt holds %d fds\n", ok,
            refused, fu_fd_count(p->pid));
    assert_int_equal(ok, 16); /* (256 - 64) / (2 x 4 + 4) */
    assert_int_equal(refused, CLIENTS - 16);
    assert_true(fu_fd_count(p->pid) < 256);
    for (int i = 0; i < CLIENTS; i++)
        llmdd_destroy(c[i]);
    assert_int_equal(th_proc_stop(p), 0);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_notify_flood_is_flow_controlled,
                                  teardown),
        cmocka_unit_test_teardown(test_stalled_link_holds_its_share,
                                  teardown),
        cmocka_unit_test_teardown(test_ctrl_thread_never_waits_on_a_peer,
                                  teardown),
        cmocka_unit_test_teardown(test_accepting_side_bounds_what_it_serves,
                                  teardown),
    };

    th_test_filter(argc, argv);
    return cmocka_run_group_tests_name("fault.isolation", tests, NULL, NULL);
}
