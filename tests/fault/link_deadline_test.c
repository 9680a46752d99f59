/*
 * A link whose data connection cannot be opened: a fake server in this
 * process answers the control handshake like a tcp peer and then holds
 * every data connection without a word. The link call must end at its
 * timeout with LLM_TIMEOUT (docs/model.md, "Link timeouts"), not LLM_LINK_FAILED; a fake server
 * that refuses the data connection at once still gives LLM_LINK_FAILED.
 *
 *   link_deadline_test
 */
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness/fault_util.h"

#define PEER 1
#define SELF 2
#define HOLD_MAX 16

typedef struct {
    int lfd;
    int stop[2];
    bool refuse; /* answer data connections with a refusal */
    uint16_t port;
    pthread_t th;
    int failed; /* the client's handshake was not what we expected */
} fake;

static int margin;

static int
fake_handshake(fake *f, int fd)
{
    uint8_t buf[512];
    uint16_t type;
    size_t len;
    llmdd__hello h;

    if (fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        type != WMSG_HELLO || llmdd__wire_hello_decode(buf, len, &h) != 0)
        return -1;
    if (h.kind == CONN_DATA) {
        if (!f->refuse)
            return 0; /* held: never answered */
        len = llmdd__wire_u32_encode(LLM_LINK_FAILED, buf, sizeof(buf));
        return fu_send_frame(fd, WMSG_DATA_REPLY, buf, len);
    }
    llmdd__hello_reply rep;
    memset(&rep, 0, sizeof(rep));
    rep.status = LLM_SUCCESS;
    rep.cluster_id = PEER;
    rep.role = LLMDD_ROLE_PROMPT;
    rep.pid = 1;
    rep.nonce = 77;
    memset(rep.boot_id, 0x42, sizeof(rep.boot_id)); /* another host */
    strcpy(rep.transport, "tcp");
    rep.terms = FU_SERVER_TERMS;
    len = llmdd__wire_hello_reply_encode(&rep, buf, sizeof(buf));
    if (fu_send_frame(fd, WMSG_HELLO_REPLY, buf, len) != 0 ||
        fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 5000) != 0 ||
        type != WMSG_CONFIRM)
        return -1;
    llmdd__result res;
    memset(&res, 0, sizeof(res));
    res.status = LLM_SUCCESS;
    memset(res.token, 0x7e, sizeof(res.token));
    len = llmdd__wire_result_encode(&res, buf, sizeof(buf));
    return fu_send_frame(fd, WMSG_RESULT, buf, len);
}

/* Accepts and answers until told to stop; then closes everything. */
static void *
fake_main(void *arg)
{
    fake *f = arg;
    int held[HOLD_MAX], nheld = 0;

    for (;;) {
        struct pollfd p[2] = {{.fd = f->stop[0], .events = POLLIN},
                              {.fd = f->lfd, .events = POLLIN}};
        if (poll(p, 2, -1) < 0)
            continue;
        if (p[0].revents != 0)
            break;
        int fd = accept(f->lfd, NULL, NULL);
        if (fd < 0)
            continue;
        if (fake_handshake(f, fd) != 0)
            f->failed++;
        if (nheld < HOLD_MAX)
            held[nheld++] = fd;
        else
            close(fd);
    }
    while (nheld > 0)
        close(held[--nheld]);
    return NULL;
}

static void
fake_start(fake *f, bool refuse)
{
    memset(f, 0, sizeof(*f));
    f->refuse = refuse;
    f->lfd = th_socket(true, &f->port);
    assert_int_equal(pipe(f->stop), 0);
    assert_int_equal(pthread_create(&f->th, NULL, fake_main, f), 0);
}

static void
fake_stop(fake *f)
{
    assert_int_equal(write(f->stop[1], "x", 1), 1);
    pthread_join(f->th, NULL);
    close(f->stop[0]);
    close(f->stop[1]);
    close(f->lfd);
    assert_int_equal(f->failed, 0);
}

/* Links to the fake server with timeout_ms; returns the cluster's status. */
static llmdd_status
link_fake(fake *f, int timeout_ms, int *took_ms)
{
    llmdd_option opt = {"llm.Transport", "tcp"};
    llmdd *dd;

    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_DECODER, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, &opt, 1), LLM_SUCCESS);
    int64_t t0 = th_now_ms();
    llmdd_status st = th_link(dd, PEER, "127.0.0.1", f->port, timeout_ms);
    *took_ms = (int)(th_now_ms() - t0);
    llmdd_destroy(dd);
    return st;
}

static void
test_data_connection_times_out(void **state)
{
    const int timeout = 500;
    fake f;
    int ms;

    (void)state;
    fake_start(&f, false);
    llmdd_status st = link_fake(&f, timeout, &ms);
    printf("link_deadline_test: data connection held: %s after %d ms\n",
           llmdd_status_str(st), ms);
    fake_stop(&f);
    assert_int_equal(st, LLM_TIMEOUT);
    assert_true(ms >= timeout && ms < timeout + 1000 + margin);
}

static void
test_data_connection_refused(void **state)
{
    fake f;
    int ms;

    (void)state;
    fake_start(&f, true);
    llmdd_status st = link_fake(&f, 5000, &ms);
    printf("link_deadline_test: data connection refused: %s after %d ms\n",
           llmdd_status_str(st), ms);
    fake_stop(&f);
    assert_int_equal(st, LLM_LINK_FAILED);
    assert_true(ms < 5000);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_data_connection_times_out),
        cmocka_unit_test(test_data_connection_refused),
    };

    margin = fu_margin_ms();
    signal(SIGPIPE, SIG_IGN);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
