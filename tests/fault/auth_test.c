/*
 * llm.AuthToken between processes (docs/model.md, links): a peer_helper prompt
 * process with a token, this process the decoder.
 *
 * - Equal tokens link, and every slot of an allocated and a registered
 *   cache pulls byte for byte.
 * - Through a relay that records every byte both ways (the handshake and
 *   the data connections), the token never appears in what crossed the
 *   wire.
 * - Another token, near misses included (a prefix, an extension, another
 *   case), cannot link (LLM_LINK_FAILED) nor pull (LLM_NOT_YET_LINK), and
 *   the peer keeps no half link: the right token still links afterwards.
 * - A token on one side only fails either way round, and the same decoder
 *   still links to the peer that matches it.
 * - Raw peers without the token: a HELLO without auth is refused, a CONFIRM
 *   with a made-up MAC is refused, a data connection with a made-up link
 *   token is refused, and none of them ever receives a data byte.
 *
 *   fault_auth [CASE]
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness/fault_util.h"
#include "harness/mp.h"

#define PEER 1
#define TOKEN "llmdd-test-secret-5b1f0c9e7d"

/* The prompt side over tcp: the relay and the raw peers speak tcp. */
static const char *const with_token[] = {
    "--role", "prompt", "--transport", "tcp", "--auth", TOKEN, NULL};
static const char *const without_token[] = {"--role", "prompt", NULL};

static int
teardown(void **state)
{
    (void)state;
    mp_reap_all();
    return 0;
}

static llmdd *
decoder(uint64_t id, const char *token)
{
    llmdd_option o = {"llm.AuthToken", token};

    return mp_decoder(id, &o, token != NULL ? 1 : 0);
}

static void
test_same_token(void **state)
{
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(PEER, with_token);
    dd = decoder(MP_SELF, TOKEN);
    assert_int_equal(th_link(dd, PEER, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, PEER, p->ids.kv, 1), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, PEER, p->ids.reg, 2), LLM_SUCCESS);
    assert_int_equal(th_unlink(dd, PEER, MP_IP, p->port, false, 2000),
                     LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
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
    uint16_t port;
    size_t len;
    int conns;

    (void)state;
    th_proc *prompt = mp_peer_start(PEER, with_token);
    llmdd_cache_index idx = {PEER, prompt->ids.kv, 3};
    fu_relay *r = fu_relay_start(prompt->port, &port);
    assert_non_null(r);
    llmdd *dd = decoder(MP_SELF, TOKEN);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &local), LLM_SUCCESS);
    assert_int_equal(th_link(dd, PEER, MP_IP, port, 5000), LLM_SUCCESS);
    assert_int_equal(llmdd_pull_kv_cache(dd, &idx, &local, 0, -1, NULL),
                     LLM_SUCCESS);
    uint64_t stride = th_tensor_size(&d) / 4;
    for (uint32_t t = 0; t < d.num_tensors; t++)
        for (uint64_t k = 0; k < stride; k++)
            assert_int_equal(((uint8_t *)(uintptr_t)local.tensor_addrs[t])[k],
                             th_byte(1, t, 3 * stride + k));
    assert_int_equal(th_unlink(dd, PEER, MP_IP, port, false, 2000),
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
    assert_int_equal(th_proc_stop(prompt), 0);
}

static void
test_token_mismatch(void **state)
{
    /* Near misses too: a prefix, an extension, another case. */
    static const char *const wrong[] = {"x", "llmdd-test-secret-5b1f0c9e7",
                                        TOKEN "2",
                                        "LLMDD-TEST-SECRET-5B1F0C9E7D"};
    th_proc *p;
    llmdd *dd;

    (void)state;
    p = mp_peer_start(PEER, with_token);
    for (size_t i = 0; i < sizeof(wrong) / sizeof(wrong[0]); i++) {
        dd = decoder(MP_SELF + i, wrong[i]);
        if (th_link(dd, PEER, MP_IP, p->port, 3000) != LLM_LINK_FAILED)
            fail_msg("token \"%s\" was not refused", wrong[i]);
        assert_int_equal(mp_pull_status(dd, PEER, p->ids.kv), LLM_NOT_YET_LINK);
        llmdd_destroy(dd);
    }
    /* The peer kept no half link: the right token still links. */
    dd = decoder(MP_SELF, TOKEN);
    assert_int_equal(th_link(dd, PEER, MP_IP, p->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, PEER, p->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);
    assert_int_equal(th_proc_stop(p), 0);
}

static void
test_token_one_side(void **state)
{
    th_proc *pa, *pn;
    llmdd *dd;

    (void)state;
    pa = mp_peer_start(1, with_token);
    pn = mp_peer_start(2, without_token);

    /* Only the server has a token. */
    dd = decoder(MP_SELF, NULL);
    assert_int_equal(th_link(dd, 1, MP_IP, pa->port, 2000), LLM_LINK_FAILED);
    assert_int_equal(mp_pull_status(dd, 1, pa->ids.kv), LLM_NOT_YET_LINK);
    /* The same decoder links to the server without one. */
    assert_int_equal(th_link(dd, 2, MP_IP, pn->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 2, pn->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);

    /* Only the client has a token. */
    dd = decoder(MP_SELF, TOKEN);
    assert_int_equal(th_link(dd, 2, MP_IP, pn->port, 2000), LLM_LINK_FAILED);
    assert_int_equal(mp_pull_status(dd, 2, pn->ids.kv), LLM_NOT_YET_LINK);
    assert_int_equal(th_link(dd, 1, MP_IP, pa->port, 2000), LLM_SUCCESS);
    assert_int_equal(mp_pull_check(dd, 1, pa->ids.kv, 1), LLM_SUCCESS);
    llmdd_destroy(dd);

    assert_int_equal(th_proc_stop(pa), 0);
    assert_int_equal(th_proc_stop(pn), 0);
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
    h.terms = FU_TERMS;
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
    th_proc *prompt = mp_peer_start(PEER, with_token);
    /* No auth flag: refused in the HELLO_REPLY. */
    int fd = fu_raw_link(prompt->port, 77, "tcp", token, &st);
    assert_int_equal(fd, -1);
    assert_int_equal(st, LLM_LINK_FAILED);

    /* The auth flag but a made-up MAC: refused, and no link token. */
    fd = fu_connect(prompt->port);
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
    assert_int_equal(fu_raw_data(prompt->port, token, 0, &st), -1);
    assert_int_equal(st, LLM_LINK_FAILED);

    /* READ straight away, without any HELLO: closed, no data. */
    fd = fu_connect(prompt->port);
    assert_true(fd >= 0);
    uint64_t off = 0, l = 64;
    llmdd__rw_req q = {.cache_id = prompt->ids.kv,
                       .count = 1,
                       .nruns = 1,
                       .offs = &off,
                       .lens = &l};
    len = llmdd__wire_rw_encode(&q, buf, sizeof(buf));
    assert_int_equal(fu_send_frame(fd, WMSG_READ, buf, len), 0);
    expect_eof_no_data(fd);
    close(fd);
    /* None of it hurt the prompt process: it still exits cleanly. */
    assert_int_equal(th_proc_stop(prompt), 0);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_same_token, teardown),
        cmocka_unit_test_teardown(test_token_never_sent, teardown),
        cmocka_unit_test_teardown(test_token_mismatch, teardown),
        cmocka_unit_test_teardown(test_token_one_side, teardown),
        cmocka_unit_test_teardown(test_raw_peers_without_token, teardown),
    };
    return cmocka_run_group_tests_name("auth", tests, NULL, NULL);
}
