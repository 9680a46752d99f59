/*
 * A hostile peer of the ucx transport's serving side (active-message mode),
 * speaking to a real prompt process through its own UCP worker. It links
 * as a real client would (control handshake, UCX_HELLO, UCX_QUERY) and then:
 *
 * - PING, GET and PUT without the key the prompt sent in its HELLO get no
 *   answer, and the PUT changes no byte;
 * - with the key, a GET inside a cache returns exactly its bytes, and GETs
 *   and PUTs outside every cache described to us (past the end, straddling
 *   it, unmapped addresses) get LLM_KV_CACHE_NOT_EXIST and not one byte;
 * - a malformed GET header drops our link, and the prompt keeps serving.
 *
 *   ucx_hostile_test        (UCX_TLS=tcp; CMakeLists.txt sets it)
 */
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include "base/wire.h"
#include "harness/fault_util.h"
#include "transport/ucx/ucx_wire.h"

#define UCX_FLAG_HELLO 1u /* ucx.c: the data connection of the exchange */
#define QUIET_MS 300      /* how long "no answer" is watched for */

static th_proc prompt;
static int margin;

/* The last answer our worker got. */
static struct {
    int pongs;
    int answers;
    uint16_t id;
    uint64_t tag;
    uint32_t status;
    uint8_t data[4096];
    size_t len;
} got;

static ucs_status_t
on_answer(void *arg, const void *header, size_t hlen, void *data, size_t len,
          const ucp_am_recv_param_t *prm)
{
    (void)prm;
    got.answers++;
    got.id = (uint16_t)(uintptr_t)arg;
    got.len = len < sizeof(got.data) ? len : sizeof(got.data);
    memcpy(got.data, data, got.len);
    if (llmdd__ucx_ack_decode(header, hlen, &got.tag, &got.status) != 0)
        got.status = UINT32_MAX;
    return UCS_OK;
}

static ucs_status_t
on_pong(void *arg, const void *header, size_t hlen, void *data, size_t len,
        const ucp_am_recv_param_t *prm)
{
    (void)arg, (void)header, (void)hlen, (void)data, (void)len, (void)prm;
    got.pongs++;
    return UCS_OK;
}

typedef struct {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_ep_h ep;
    uint64_t key;  /* the prompt's */
    uint64_t base; /* the cache's first tensor */
    uint64_t last; /* its last tensor (4096 bytes, th_desc_kv) */
    uint64_t end;  /* one past its region */
    int ctrl, fd;
} attacker;

static void
progress_for(attacker *a, int ms, const int *until_count, int want)
{
    int64_t deadline = th_now_ms() + ms;

    while (th_now_ms() < deadline &&
           (until_count == NULL || *until_count < want))
        if (ucp_worker_progress(a->w) == 0)
            th_sleep_ms(1);
}

static void
send_am(attacker *a, unsigned id, const void *hdr, size_t hlen,
        const void *data, size_t len)
{
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_AM_SEND_FLAG_REPLY |
                                      UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t sp = ucp_am_send_nbx(a->ep, id, hdr, hlen, data, len, &p);

    assert_false(UCS_PTR_IS_ERR(sp));
    while (sp != NULL && ucp_request_check_status(sp) == UCS_INPROGRESS)
        ucp_worker_progress(a->w);
    if (sp != NULL)
        ucp_request_free(sp);
}

/* Sends a GET or PUT; returns whether an answer came, into `got`. */
static bool
request(attacker *a, bool put, uint64_t key, uint64_t addr, uint64_t len,
        const void *data)
{
    static uint64_t tag = 1;
    llmdd__ucx_amreq m = {.key = key, .tag = ++tag, .addr = addr, .len = len};
    uint8_t hdr[LLMDD_UCX_AMREQ_SIZE];
    int before = got.answers;

    assert_int_equal(llmdd__ucx_amreq_encode(&m, hdr, sizeof(hdr)),
                     sizeof(hdr));
    send_am(a, put ? LLMDD_UCX_AM_PUT : LLMDD_UCX_AM_GET, hdr, sizeof(hdr),
            data, put ? len : 0);
    progress_for(a, key == a->key ? 3000 + margin : QUIET_MS, &got.answers,
                 before + 1);
    if (got.answers == before)
        return false;
    assert_int_equal(got.tag, m.tag);
    assert_int_equal(got.id, put ? LLMDD_UCX_AM_ACK : LLMDD_UCX_AM_DATA);
    return true;
}

static void
attacker_start(attacker *a)
{
    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                       .features = UCP_FEATURE_AM};
    ucp_worker_params_t wp = {.field_mask = 0};
    ucp_config_t *cfg;
    uint8_t buf[LLMDD_UCX_ADDR_MAX + 64];
    uint16_t type;
    size_t len;
    uint32_t st;

    memset(a, 0, sizeof(*a));
    assert_int_equal(ucp_config_read(NULL, NULL, &cfg), UCS_OK);
    assert_int_equal(ucp_init(&cp, cfg, &a->ctx), UCS_OK);
    ucp_config_release(cfg);
    assert_int_equal(ucp_worker_create(a->ctx, &wp, &a->w), UCS_OK);
    const unsigned ids[] = {LLMDD_UCX_AM_DATA, LLMDD_UCX_AM_ACK,
                            LLMDD_UCX_AM_PONG};
    for (int i = 0; i < 3; i++) {
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                          UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                          UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = ids[i],
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = ids[i] == LLMDD_UCX_AM_PONG ? on_pong : on_answer,
            .arg = (void *)(uintptr_t)ids[i],
        };
        assert_int_equal(ucp_worker_set_am_recv_handler(a->w, &hp), UCS_OK);
    }

    /* The control handshake and the exchange, as a real client. */
    uint8_t token[16];
    a->ctrl = fu_raw_link(prompt.port, 4242, "ucx", token, &st);
    assert_true(a->ctrl >= 0);
    a->fd = fu_raw_data(prompt.port, token, UCX_FLAG_HELLO, &st);
    assert_true(a->fd >= 0);
    ucp_address_t *addr;
    size_t alen;
    assert_int_equal(ucp_worker_get_address(a->w, &addr, &alen), UCS_OK);
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    llmdd__ucx_hello h = {.version = LLMDD_UCX_WIRE_VERSION,
                          .ucp_version = maj << 16 | min << 8 | rel,
                          .key = 0x1234,
                          .addr = (const uint8_t *)addr,
                          .addr_len = (uint32_t)alen};
    len = llmdd__ucx_hello_encode(LLM_SUCCESS, &h, buf, sizeof(buf));
    ucp_worker_release_address(a->w, addr);
    assert_true(len > 0);
    assert_int_equal(fu_send_frame(a->fd, WMSG_UCX_HELLO, buf, len), 0);
    assert_int_equal(
        fu_recv_frame(a->fd, &type, buf, sizeof(buf), &len, 5000 + margin), 0);
    assert_int_equal(type, WMSG_UCX_HELLO_REPLY);
    assert_int_equal(llmdd__ucx_hello_decode(buf, len, &st, &h), 0);
    assert_int_equal(st, LLM_SUCCESS);
    a->key = h.key;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = (const ucp_address_t *)h.addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
    };
    assert_int_equal(ucp_ep_create(a->w, &ep, &a->ep), UCS_OK);

    /* Where the prompt's standard kv cache lies. */
    len = llmdd__ucx_req_encode(1, prompt.ids.kv, buf, sizeof(buf));
    assert_int_equal(fu_send_frame(a->fd, WMSG_UCX_QUERY, buf, len), 0);
    assert_int_equal(
        fu_recv_frame(a->fd, &type, buf, sizeof(buf), &len, 5000 + margin), 0);
    assert_int_equal(type, WMSG_UCX_QUERY_REPLY);
    llmdd__ucx_reply r;
    assert_int_equal(llmdd__ucx_reply_decode(buf, len, &r), 0);
    assert_int_equal(r.status, LLM_SUCCESS);
    assert_int_equal(r.desc.num_tensors, 8);
    a->base = r.taddr[0];
    a->last = r.taddr[7];
    const llmdd__ucx_region *g = &r.regions[r.treg[0]];
    a->end = g->base + g->len;
    llmdd__ucx_reply_free(&r);
}

static void
attacker_stop(attacker *a)
{
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t sp = ucp_ep_close_nbx(a->ep, &p);

    while (UCS_PTR_IS_PTR(sp) && ucp_request_check_status(sp) == UCS_INPROGRESS)
        ucp_worker_progress(a->w);
    if (UCS_PTR_IS_PTR(sp))
        ucp_request_free(sp);
    ucp_worker_destroy(a->w);
    ucp_cleanup(a->ctx);
    close(a->fd);
    close(a->ctrl);
}

static void
ping(attacker *a, uint64_t key)
{
    uint8_t hdr[LLMDD_UCX_PING_SIZE];

    llmdd__wire_i64_encode((int64_t)key, hdr, sizeof(hdr));
    send_am(a, LLMDD_UCX_AM_PING, hdr, sizeof(hdr), NULL, 0);
}

static void
test_requests_need_the_key(void **state)
{
    const uint8_t junk[64] = {0xee};
    attacker a;

    (void)state;
    attacker_start(&a);
    ping(&a, a.key ^ 1);
    progress_for(&a, QUIET_MS, &got.pongs, 1);
    assert_int_equal(got.pongs, 0);
    ping(&a, a.key);
    progress_for(&a, 3000 + margin, &got.pongs, 1);
    assert_int_equal(got.pongs, 1);

    /* No key, no answer; and the PUT wrote nothing. */
    assert_false(request(&a, false, a.key + 1, a.base, 64, NULL));
    assert_false(request(&a, true, 0, a.base, sizeof(junk), junk));
    assert_true(request(&a, false, a.key, a.base, 64, NULL));
    assert_int_equal(got.status, LLM_SUCCESS);
    assert_int_equal(got.len, 64);
    for (uint32_t k = 0; k < 64; k++)
        assert_int_equal(got.data[k], th_byte(1, 0, k));
    attacker_stop(&a);
    assert_int_equal(th_proc_cmd(&prompt, "ping", NULL, 0), 0);
}

static void
test_ranges_outside_the_caches(void **state)
{
    const uint8_t junk[64] = {0xee};
    struct {
        uint64_t addr, len;
    } bad[] = {
        {0, 0},       /* filled in: one past the region */
        {0, 0},       /* straddling its end */
        {0x1000, 64}, /* nothing of ours */
        {UINT64_MAX - 64, 64},
    };
    attacker a;

    (void)state;
    attacker_start(&a);
    bad[0].addr = a.end;
    bad[0].len = 1;
    bad[1].addr = a.end - 32;
    bad[1].len = 64;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        for (int put = 0; put < 2; put++) {
            assert_true(request(&a, put, a.key, bad[i].addr, bad[i].len, junk));
            assert_int_equal(got.status, LLM_KV_CACHE_NOT_EXIST);
            assert_int_equal(got.len, 0);
        }
    }
    /* The last tensor's last bytes are as they were. */
    assert_true(request(&a, false, a.key, a.last + 4096 - 64, 64, NULL));
    assert_int_equal(got.status, LLM_SUCCESS);
    assert_int_equal(got.len, 64);
    for (uint32_t k = 0; k < 64; k++)
        assert_int_equal(got.data[k], th_byte(1, 7, 4096 - 64 + k));
    attacker_stop(&a);
    assert_int_equal(th_proc_cmd(&prompt, "ping", NULL, 0), 0);
}

/* A short header, and a range that wraps past the end of the address
 * space: each drops the link it came on; the prompt keeps serving. */
static void
test_malformed_header_drops_the_link(void **state)
{
    uint8_t hdr[LLMDD_UCX_AMREQ_SIZE] = {0};
    attacker a;

    (void)state;
    for (int i = 0; i < 2; i++) {
        attacker_start(&a);
        llmdd__ucx_amreq m = {
            .key = a.key, .tag = 1, .addr = UINT64_MAX - 63, .len = 64};
        llmdd__ucx_amreq_encode(&m, hdr, sizeof(hdr));
        send_am(&a, LLMDD_UCX_AM_GET, hdr,
                i == 0 ? sizeof(hdr) - 1 : sizeof(hdr), NULL, 0);
        progress_for(&a, 200, NULL, 0);
        assert_true(fu_closed_within(a.ctrl, 5000 + margin));
        attacker_stop(&a);
        assert_int_equal(th_proc_cmd(&prompt, "ping", NULL, 0), 0);
    }
}

static int
setup(void **state)
{
    const char *args[] = {"--cluster",   "1",   "--role", "prompt",
                          "--transport", "ucx", NULL};

    (void)state;
    margin = fu_margin_ms();
    return th_proc_start(&prompt, NULL, args);
}

static int
teardown(void **state)
{
    (void)state;
    return th_proc_stop(&prompt) == 0 ? 0 : -1;
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_requests_need_the_key),
        cmocka_unit_test(test_ranges_outside_the_caches),
        cmocka_unit_test(test_malformed_header_drops_the_link),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
