/*
 * Peers that stop answering: the caller times out instead of hanging.
 *
 * - A prompt process that stops reading (SIGSTOP: its sockets fill up and
 *   nothing answers): a pull and a 32 MiB push each return LLM_TIMEOUT
 *   within the wait time plus a margin; once the prompt runs again, the
 *   same link pulls correct bytes.
 * - A listener that accepts the TCP connection and never answers, or answers
 *   half a message: link returns LLM_TIMEOUT within its timeout.
 *
 *   stall_test [transport]     (default tcp)
 */
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness/fault_util.h"

#define PEER 1
#define SELF 2
#define WAIT_MS (600 * FU_SLOW)

static const char *transport = "tcp";
static int margin;

static void
expect_within(int64_t t0, int limit_ms, const char *what)
{
    int64_t ms = th_now_ms() - t0;

    printf("stall_test: %s returned after %lld ms (limit %d)\n", what,
           (long long)ms, limit_ms + margin);
    if (ms > limit_ms + margin)
        fail_msg("%s took %lld ms, limit %d + margin %d", what, (long long)ms,
                 limit_ms, margin);
}

static th_proc p;

/* A failed assertion must not leave the prompt stopped: it holds our
 * stderr, and a stopped process never sees its stdin close. */
static int
stopped_teardown(void **state)
{
    (void)state;
    if (p.pid > 0) {
        kill(p.pid, SIGCONT);
        th_proc_stop(&p);
    }
    return 0;
}

/* SIGSTOP and wait until every thread of the prompt has stopped. */
static void
stop_prompt(void)
{
    int status;

    assert_int_equal(kill(p.pid, SIGSTOP), 0);
    assert_int_equal(waitpid(p.pid, &status, WUNTRACED), p.pid);
    assert_true(WIFSTOPPED(status));
}

static void
test_stopped_prompt(void **state)
{
    const char *args[] = {"--cluster", "1", "--transport", transport, NULL};
    char wait[16], reply[64];
    /* The prompt stays stopped for several wait times and the link must
     * outlive it: the decoder allows its heartbeats that long. */
    llmdd_option opts[3] = {{"llm.SyncKvCacheWaitTime", wait},
                            {"llm.Transport", transport},
                            {"llm.HeartbeatMisses", "30"}};
    llmdd_cache_desc d = {.num_tensors = 4,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, 8 << 18}};
    uint64_t blocks[4] = {0, 1, 2, 3};
    llmdd_cache local;
    llmdd *dd;

    (void)state;
    snprintf(wait, sizeof(wait), "%d", WAIT_MS);
    assert_int_equal(th_proc_start(&p, NULL, args), 0);
    assert_int_equal(th_proc_cmd(&p, "alloc-big 8 4 5", reply, sizeof(reply)),
                     0);
    int64_t big = atoll(reply + 3);
    /* The push goes to a second cache: once the prompt runs again it serves
     * the stale pull and push at once, and on one cache those two would be
     * this test's own read/write race on the same bytes. */
    assert_int_equal(th_proc_cmd(&p, "alloc-big 8 4 6", reply, sizeof(reply)),
                     0);
    llmdd_cache_index push_idx = {PEER, atoll(reply + 3), 0};
    llmdd_cache_index idx = {PEER, big, 0};
    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, opts, 3), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", p.port, 5000),
                     LLM_SUCCESS);
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &idx, &local, blocks, blocks, 4, NULL),
        LLM_SUCCESS);
    assert_int_equal(llmdd_push_kv_blocks(dd, &local, &push_idx, blocks,
                                          blocks, 4, NULL),
                     LLM_SUCCESS);

    stop_prompt();
    int64_t t0 = th_now_ms();
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &idx, &local, blocks, blocks, 4, NULL),
        LLM_TIMEOUT);
    expect_within(t0, WAIT_MS, "pull from a stopped prompt");
    t0 = th_now_ms();
    assert_int_equal(
        llmdd_push_kv_blocks(dd, &local, &push_idx, blocks, blocks, 4, NULL),
        LLM_TIMEOUT);
    expect_within(t0, WAIT_MS, "32 MiB push into a stopped prompt");
    /* A new cache id needs a QUERY, which the stopped prompt never answers. */
    idx.cache_id = big + 1000;
    t0 = th_now_ms();
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &idx, &local, blocks, blocks, 4, NULL),
        LLM_TIMEOUT);
    expect_within(t0, WAIT_MS, "query of a stopped prompt");
    idx.cache_id = big;
    kill(p.pid, SIGCONT);

    /* The link survived: correct bytes again. */
    uint64_t size = th_tensor_size(&d);
    for (uint32_t t = 0; t < 4; t++)
        memset((void *)(uintptr_t)local.tensor_addrs[t], 0, size);
    assert_int_equal(
        llmdd_pull_kv_blocks(dd, &idx, &local, blocks, blocks, 4, NULL),
        LLM_SUCCESS);
    for (uint32_t t = 0; t < 4; t++)
        assert_int_equal(th_check_buf((uint8_t *)(uintptr_t)
                                          local.tensor_addrs[t],
                                      size, 5, t),
                         -1);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_cmd(&p, "ping", NULL, 0), 0);
    assert_int_equal(th_proc_stop(&p), 0);
}

struct mute_server {
    int lfd;
    int mode; /* 0: silent; 1: half a HELLO_REPLY */
    int conn;
};

static void *
mute_main(void *arg)
{
    struct mute_server *m = arg;
    uint8_t buf[256];

    m->conn = accept(m->lfd, NULL, NULL);
    if (m->conn >= 0 && m->mode == 1) {
        uint16_t type;
        size_t len;
        if (fu_recv_frame(m->conn, &type, buf, sizeof(buf), &len, 5000) == 0) {
            llmdd__wire_frame_encode(buf, WMSG_HELLO_REPLY, 100);
            fu_send_all(m->conn, buf, LLMDD_WIRE_HDR_LEN + 10);
        }
    }
    return NULL;
}

static void
mute_link(int mode)
{
    struct mute_server m = {.mode = mode, .conn = -1};
    llmdd *dd;
    uint16_t port;
    pthread_t t;

    m.lfd = th_socket(true, &port); /* accepts happen in the test */
    assert_int_equal(pthread_create(&t, NULL, mute_main, &m), 0);
    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_DECODER, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, NULL, 0), LLM_SUCCESS);
    int64_t t0 = th_now_ms();
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", port, 500), LLM_TIMEOUT);
    expect_within(t0, 500, mode ? "link to a half-answering listener"
                                : "link to a silent listener");
    pthread_join(t, NULL);
    if (m.conn >= 0)
        close(m.conn);
    close(m.lfd);
    llmdd_destroy(dd);
}

static void
test_silent_listener(void **state)
{
    (void)state;
    mute_link(0);
}

static void
test_half_answer(void **state)
{
    (void)state;
    mute_link(1);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_stopped_prompt, stopped_teardown),
        cmocka_unit_test(test_silent_listener),
        cmocka_unit_test(test_half_answer),
    };

    if (argc > 1)
        transport = argv[1];
    if (strstr(llmdd_transport_list(), transport) == NULL) {
        printf("stall_test: transport %s not built in; skipped\n", transport);
        return TH_SKIP;
    }
    margin = fu_margin_ms();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
