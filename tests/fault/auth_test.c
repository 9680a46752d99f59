/*
 * llm.AuthToken: a prompt process with a token.
 *
 * - A decoder with the same token links and pulls through a relay that
 *   records every byte both ways (the handshake and the data connections):
 *   the token never appears in what crossed the wire.
 * - A decoder with no token or another token cannot link (LLM_LINK_FAILED)
 *   and cannot pull (LLM_NOT_YET_LINK).
 * - Raw peers without the token: a HELLO without auth is refused, a CONFIRM
 *   with a made-up MAC is refused, a data connection with a made-up link
 *   token is refused, and none of them ever receives a data byte.
 * - A client with a token refuses a server without one.
 *
 *   auth_test
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fault/fault_util.h"

#define PEER 1
#define TOKEN "llmdd-test-secret-5b1f0c9e7d"

static th_proc prompt;

static int
setup(void **state)
{
    const char *args[] = {"--cluster", "1", "--role", "prompt",
                          "--transport", "tcp", "--auth", TOKEN, NULL};

    (void)state;
    return th_proc_start(&prompt, NULL, args);
}

static int
teardown(void **state)
{
    (void)state;
    return th_proc_stop(&prompt) == 0 ? 0 : -1;
}

static llmdd *
decoder(uint64_t id, const char *token)
{
    llmdd_option o = {"llm.AuthToken", token};
    llmdd *dd;

    assert_int_equal(llmdd_create(id, LLMDD_ROLE_DECODER, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, &o, token != NULL), LLM_SUCCESS);
    return dd;
}

static bool
contains(const uint8_t *hay, size_t n, const char *needle)
{
    size_t k = strlen(needle);

    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(hay + i, needle, k) == 0)
            return true;
    return false;
}

static void
test_token_never_sent(void **state)
{
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache local;
    llmdd_cache_index idx = {PEER, prompt.ids.kv, 3};
    uint16_t port;
    size_t len;
    int conns;

    (void)state;
    fu_relay *r = fu_relay_start(prompt.port, &port);
    assert_non_null(r);
    llmdd *dd = decoder(2, TOKEN);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", port, 5000), LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &local, 0, -1, NULL),
                     LLM_SUCCESS);
    uint64_t stride = th_tensor_size(&d) / 4;
    for (uint32_t t = 0; t < d.num_tensors; t++)
        for (uint64_t k = 0; k < stride; k++)
            assert_int_equal(((uint8_t *)(uintptr_t)local.tensor_addrs[t])[k],
                             th_byte(1, t, 3 * stride + k));
    assert_int_equal(th_unlink(dd, PEER, "127.0.0.1", port, false, 2000),
                     LLM_SUCCESS);
    llmdd_destroy(dd);

    uint8_t *cap = fu_relay_stop(r, &len, &conns);
    printf("auth_test: %zu bytes over %d connections recorded; token "
           "found: %s\n",
           len, conns, contains(cap, len, TOKEN) ? "yes" : "no");
    /* The recording is real: the handshake and the pulled bytes are in it. */
    assert_true(conns >= 2);
    assert_true(len > stride * d.num_tensors);
    const uint8_t magic[4] = {0x4c, 0x4c, 0x44, 0x44}; /* "LLDD" */
    assert_non_null(memmem(cap, len, magic, sizeof(magic)));
    assert_false(contains(cap, len, TOKEN));
    /* Nor any long piece of it. */
    assert_false(contains(cap, len, "secret-5b1f"));
    free(cap);
}

static void
test_wrong_token(void **state)
{
    const char *tokens[] = {NULL, "llmdd-test-secret-5b1f0c9e7", "x"};
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache local;
    llmdd_cache_index idx = {PEER, prompt.ids.kv, 0};

    (void)state;
    for (size_t i = 0; i < sizeof(tokens) / sizeof(tokens[0]); i++) {
        llmdd *dd = decoder(10 + i, tokens[i]);
        assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
        assert_int_equal(th_link(dd, PEER, "127.0.0.1", prompt.port, 3000),
                         LLM_LINK_FAILED);
        assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &local, 0, -1, NULL),
                         LLM_NOT_YET_LINK);
        llmdd_destroy(dd);
    }
}

/* The peer closes fd without sending one byte. */
static void
expect_eof_no_data(int fd)
{
    uint8_t b;
    struct pollfd p = {.fd = fd, .events = POLLIN};

    assert_int_equal(poll(&p, 1, 3000), 1);
    ssize_t n = recv(fd, &b, 1, MSG_DONTWAIT);
    if (n > 0)
        fail_msg("the peer sent data");
    assert_true(n == 0 || errno == ECONNRESET);
}

static size_t
hello(uint8_t *buf, size_t cap, uint8_t auth)
{
    llmdd__hello h;

    memset(&h, 0, sizeof(h));
    h.kind = CONN_CTRL;
    h.cluster_id = 77;
    h.role = LLMDD_ROLE_DECODER;
    h.auth = auth;
    memset(h.cnonce, 0x11, sizeof(h.cnonce));
    memset(h.boot_id, 0x42, sizeof(h.boot_id));
    strcpy(h.transport, "tcp");
    return llmdd__wire_hello_encode(&h, buf, cap);
}

static void
test_raw_peers_without_token(void **state)
{
    uint8_t buf[512], token[16];
    llmdd__hello_reply rep;
    llmdd__result res;
    uint16_t type;
    size_t len;
    uint32_t st;

    (void)state;
    /* No auth flag: refused in the HELLO_REPLY. */
    int fd = fu_raw_link(prompt.port, 77, "tcp", token, &st);
    assert_int_equal(fd, -1);
    assert_int_equal(st, LLM_LINK_FAILED);

    /* The auth flag but a made-up MAC: refused, and no link token. */
    fd = fu_connect(prompt.port);
    assert_true(fd >= 0);
    len = hello(buf, sizeof(buf), 1);
    assert_int_equal(fu_send_frame(fd, WMSG_HELLO, buf, len), 0);
    assert_int_equal(fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000),
                     0);
    assert_int_equal(type, WMSG_HELLO_REPLY);
    assert_int_equal(llmdd__wire_hello_reply_decode(buf, len, &rep), 0);
    assert_int_equal(rep.status, LLM_SUCCESS);
    llmdd__confirm c;
    memset(&c, 0, sizeof(c));
    strcpy(c.transport, "tcp");
    memcpy(c.mac, rep.mac, sizeof(c.mac)); /* replaying the server's MAC */
    len = llmdd__wire_confirm_encode(&c, buf, sizeof(buf));
    assert_int_equal(fu_send_frame(fd, WMSG_CONFIRM, buf, len), 0);
    assert_int_equal(fu_recv_frame(fd, &type, buf, sizeof(buf), &len, 3000),
                     0);
    assert_int_equal(type, WMSG_RESULT);
    assert_int_equal(llmdd__wire_result_decode(buf, len, &res), 0);
    assert_int_equal(res.status, LLM_LINK_FAILED);
    static const uint8_t zero[16];
    assert_memory_equal(res.token, zero, 16);
    expect_eof_no_data(fd);
    close(fd);

    /* A data connection with a guessed link token: refused, then closed. */
    memset(token, 0, sizeof(token));
    assert_int_equal(fu_raw_data(prompt.port, token, 0, &st), -1);
    assert_int_equal(st, LLM_LINK_FAILED);

    /* READ straight away, without any HELLO: closed, no data. */
    fd = fu_connect(prompt.port);
    assert_true(fd >= 0);
    uint64_t off = 0, l = 64;
    llmdd__rw_req q = {.cache_id = prompt.ids.kv, .count = 1, .nruns = 1,
                       .offs = &off, .lens = &l};
    len = llmdd__wire_rw_encode(&q, buf, sizeof(buf));
    assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);
    expect_eof_no_data(fd);
    close(fd);
}

static void
test_server_without_token(void **state)
{
    const char *args[] = {"--cluster", "5", "--transport", "tcp", NULL};
    th_proc open_prompt;

    (void)state;
    assert_int_equal(th_proc_start(&open_prompt, NULL, args), 0);
    llmdd *dd = decoder(2, TOKEN);
    assert_int_equal(th_link(dd, 5, "127.0.0.1", open_prompt.port, 3000),
                     LLM_LINK_FAILED);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(&open_prompt), 0);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_token_never_sent),
        cmocka_unit_test(test_wrong_token),
        cmocka_unit_test(test_raw_peers_without_token),
        cmocka_unit_test(test_server_without_token),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
