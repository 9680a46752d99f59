/*
 * The ucx transport's exchange messages (transport/ucx/ucx_wire.h): round
 * trips, and every truncation, bad count and out-of-region tensor rejected
 * without reading past the buffer (run it under ASan to see the latter).
 */
#include <stdlib.h>
#include <string.h>

#include "harness/harness.h"
#include "transport/ucx/ucx_wire.h"

static const uint8_t key_a[] = {1, 0, 0, 0, 0, 0, 0, 0, 0, 3, 7, 8, 9};
static const uint8_t key_b[] = {0, 0, 0, 0, 0, 0, 0, 0, 0};

/* Two tensors of 4 x 16 uint8 in one region, one tensor in another. */
static void
reply_sample(llmdd__ucx_reply *m, llmdd__ucx_region *g, uint64_t *taddr,
             uint32_t *treg)
{
    memset(m, 0, sizeof(*m));
    m->seq = 77;
    m->status = LLM_SUCCESS;
    m->desc.num_tensors = 3;
    m->desc.data_type = LLMDD_DT_UINT8;
    m->desc.num_dims = 2;
    m->desc.shape[0] = 4;
    m->desc.shape[1] = 16;
    m->batch_dim = 1;
    g[0] = (llmdd__ucx_region){0x10000, 128, key_a, sizeof(key_a)};
    g[1] = (llmdd__ucx_region){0x90000, 64, key_b, sizeof(key_b)};
    taddr[0] = 0x10000;
    taddr[1] = 0x10040;
    taddr[2] = 0x90000;
    treg[0] = 0;
    treg[1] = 0;
    treg[2] = 1;
    m->nregions = 2;
    m->regions = g;
    m->taddr = taddr;
    m->treg = treg;
}

static size_t
reply_encode(const llmdd__ucx_reply *m, uint8_t *buf, size_t cap)
{
    size_t need = llmdd__ucx_reply_size(m);

    assert_true(need > 0 && need <= cap);
    size_t n = llmdd__ucx_reply_encode(m, buf, cap);
    assert_int_equal(n, need);
    return n;
}

static void
test_hello_round_trip(void **state)
{
    uint8_t addr[300], buf[400];
    llmdd__ucx_hello h = {.version = 2,
                          .ucp_version = 0x010d01,
                          .flags = LLMDD_UCX_HELLO_RDMA,
                          .key = 0x0123456789abcdefull,
                          .addr = addr,
                          .addr_len = sizeof(addr)};
    llmdd__ucx_hello out;
    uint32_t st;

    (void)state;
    for (size_t i = 0; i < sizeof(addr); i++)
        addr[i] = (uint8_t)(i * 7);
    size_t n = llmdd__ucx_hello_encode(LLM_SUCCESS, &h, buf, sizeof(buf));
    assert_int_equal(n, 28 + sizeof(addr));
    assert_int_equal(llmdd__ucx_hello_decode(buf, n, &st, &out), 0);
    assert_int_equal(st, LLM_SUCCESS);
    assert_int_equal(out.ucp_version, 0x010d01);
    assert_int_equal(out.flags, LLMDD_UCX_HELLO_RDMA);
    assert_int_equal(out.key, 0x0123456789abcdefull);
    assert_int_equal(out.addr_len, sizeof(addr));
    assert_memory_equal(out.addr, addr, sizeof(addr));
    /* Every truncation and one trailing byte are rejected. */
    for (size_t k = 0; k < n; k++)
        assert_int_equal(llmdd__ucx_hello_decode(buf, k, &st, &out), -1);
    buf[n] = 0;
    assert_int_equal(llmdd__ucx_hello_decode(buf, n + 1, &st, &out), -1);
    /* A failure carries only its status. */
    n = llmdd__ucx_hello_encode(LLM_LINK_FAILED, NULL, buf, sizeof(buf));
    assert_int_equal(n, 4);
    assert_int_equal(llmdd__ucx_hello_decode(buf, n, &st, &out), 0);
    assert_int_equal(st, LLM_LINK_FAILED);
    assert_int_equal(out.addr_len, 0);
}

static void
test_hello_bad_length(void **state)
{
    uint8_t buf[64];
    llmdd__ucx_hello out;
    uint32_t st;

    (void)state;
    /* An address length of zero, and one over the cap. */
    memset(buf, 0, sizeof(buf));
    assert_int_equal(llmdd__ucx_hello_decode(buf, 28, &st, &out), -1);
    buf[24] = 0x01;
    buf[26] = 0x01; /* 65537 */
    assert_int_equal(llmdd__ucx_hello_decode(buf, 28, &st, &out), -1);
    /* A length the payload does not hold. */
    memset(buf, 0, sizeof(buf));
    buf[24] = 40;
    assert_int_equal(llmdd__ucx_hello_decode(buf, 44, &st, &out), -1);
    /* The encoder refuses an oversized address too. */
    llmdd__ucx_hello h = {.addr = buf, .addr_len = LLMDD_UCX_ADDR_MAX + 1};
    assert_int_equal(llmdd__ucx_hello_encode(LLM_SUCCESS, &h, buf, 64), 0);
}

/* The active-message GET/PUT header: exact size, a length of 1 up to one
 * chunk, no range that wraps. */
static void
test_amreq(void **state)
{
    llmdd__ucx_amreq m = {.key = 0xfeedfacecafebeefull,
                          .tag = 7 << 10 | 3,
                          .addr = 0x7f0000001000,
                          .len = LLMDD_UCX_AM_CHUNK};
    llmdd__ucx_amreq out;
    uint8_t buf[32];

    (void)state;
    size_t n = llmdd__ucx_amreq_encode(&m, buf, sizeof(buf));
    assert_int_equal(n, LLMDD_UCX_AMREQ_SIZE);
    assert_int_equal(llmdd__ucx_amreq_decode(buf, n, &out), 0);
    assert_int_equal(out.key, m.key);
    assert_int_equal(out.tag, m.tag);
    assert_int_equal(out.addr, m.addr);
    assert_int_equal(out.len, m.len);
    for (size_t k = 0; k < n; k++)
        assert_int_equal(llmdd__ucx_amreq_decode(buf, k, &out), -1);
    assert_int_equal(llmdd__ucx_amreq_decode(buf, n + 1, &out), -1);
    assert_int_equal(llmdd__ucx_amreq_encode(&m, buf, n - 1), 0);

    uint64_t bad[][2] = {
        {0x1000, 0}, {0x1000, LLMDD_UCX_AM_CHUNK + 1}, {UINT64_MAX - 10, 100}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        m.addr = bad[i][0];
        m.len = bad[i][1];
        n = llmdd__ucx_amreq_encode(&m, buf, sizeof(buf));
        assert_int_equal(llmdd__ucx_amreq_decode(buf, n, &out), -1);
    }

    /* PING: the key, exactly (the common single-integer codec). */
    int64_t key = 0;
    n = llmdd__wire_i64_encode((int64_t)m.key, buf, sizeof(buf));
    assert_int_equal(n, LLMDD_UCX_PING_SIZE);
    assert_int_equal(llmdd__wire_i64_decode(buf, n, &key), 0);
    assert_int_equal((uint64_t)key, m.key);
    assert_int_equal(llmdd__wire_i64_decode(buf, n - 1, &key), -1);
    assert_int_equal(llmdd__wire_i64_decode(buf, n + 1, &key), -1);
    assert_int_equal(llmdd__wire_i64_decode(NULL, 0, &key), -1);
}

static void
test_req_and_ack(void **state)
{
    uint8_t buf[32];
    uint64_t seq;
    uint32_t st;
    int64_t id;

    (void)state;
    size_t n = llmdd__ucx_req_encode(5, -3, buf, sizeof(buf));
    assert_int_equal(n, 16);
    assert_int_equal(llmdd__ucx_req_decode(buf, n, &seq, &id), 0);
    assert_int_equal(seq, 5);
    assert_int_equal(id, -3);
    assert_int_equal(llmdd__ucx_req_decode(buf, n - 1, &seq, &id), -1);
    assert_int_equal(llmdd__ucx_req_decode(buf, n + 1, &seq, &id), -1);
    assert_int_equal(llmdd__ucx_req_encode(5, 1, buf, 15), 0);

    n = llmdd__ucx_ack_encode(9, LLM_TIMEOUT, buf, sizeof(buf));
    assert_int_equal(n, 12);
    assert_int_equal(llmdd__ucx_ack_decode(buf, n, &seq, &st), 0);
    assert_int_equal(seq, 9);
    assert_int_equal(st, LLM_TIMEOUT);
    assert_int_equal(llmdd__ucx_ack_decode(buf, n - 1, &seq, &st), -1);
}

static void
test_reply_round_trip(void **state)
{
    llmdd__ucx_region g[2];
    uint64_t taddr[3];
    uint32_t treg[3];
    llmdd__ucx_reply m, out;
    uint8_t buf[512];

    (void)state;
    reply_sample(&m, g, taddr, treg);
    size_t n = reply_encode(&m, buf, sizeof(buf));
    assert_int_equal(llmdd__ucx_reply_decode(buf, n, &out), 0);
    assert_int_equal(out.seq, 77);
    assert_int_equal(out.status, LLM_SUCCESS);
    assert_int_equal(out.desc.num_tensors, 3);
    assert_int_equal(out.desc.shape[1], 16);
    assert_int_equal(out.batch_dim, 1);
    assert_int_equal(out.nregions, 2);
    assert_int_equal(out.regions[0].base, 0x10000);
    assert_int_equal(out.regions[1].len, 64);
    assert_int_equal(out.regions[0].rkey_len, sizeof(key_a));
    assert_memory_equal(out.regions[0].rkey, key_a, sizeof(key_a));
    assert_int_equal(out.taddr[1], 0x10040);
    assert_int_equal(out.treg[2], 1);
    llmdd__ucx_reply_free(&out);

    /* Every truncation fails and leaves nothing allocated (LSan). */
    for (size_t k = 0; k < n; k++)
        assert_int_equal(llmdd__ucx_reply_decode(buf, k, &out), -1);
    buf[n] = 0;
    assert_int_equal(llmdd__ucx_reply_decode(buf, n + 1, &out), -1);
}

static void
test_reply_status_only(void **state)
{
    llmdd__ucx_reply m = {.seq = 3, .status = LLM_KV_CACHE_NOT_EXIST}, out;
    uint8_t buf[32];

    (void)state;
    size_t n = reply_encode(&m, buf, sizeof(buf));
    assert_int_equal(n, 12);
    assert_int_equal(llmdd__ucx_reply_decode(buf, n, &out), 0);
    assert_int_equal(out.status, LLM_KV_CACHE_NOT_EXIST);
    assert_null(out.regions);
}

/* Encodes a sample altered by `edit` and expects the decoder to refuse. */
static void
expect_rejected(void (*edit)(llmdd__ucx_reply *m))
{
    llmdd__ucx_region g[2];
    uint64_t taddr[3];
    uint32_t treg[3];
    llmdd__ucx_reply m, out;
    uint8_t buf[512];

    reply_sample(&m, g, taddr, treg);
    edit(&m);
    size_t n = llmdd__ucx_reply_encode(&m, buf, sizeof(buf));
    assert_true(n > 0);
    assert_int_equal(llmdd__ucx_reply_decode(buf, n, &out), -1);
}

static void
edit_tensor_past_region(llmdd__ucx_reply *m)
{
    m->taddr[1] = 0x10041; /* 64 bytes from here end 1 byte past it */
}

static void
edit_tensor_before_region(llmdd__ucx_reply *m)
{
    m->taddr[0] = 0xffff;
}

static void
edit_bad_region_index(llmdd__ucx_reply *m)
{
    m->treg[2] = 2;
}

static void
edit_wrapping_region(llmdd__ucx_reply *m)
{
    m->regions[1].base = UINT64_MAX - 10;
    m->taddr[2] = UINT64_MAX - 10;
}

static void
edit_bad_desc(llmdd__ucx_reply *m)
{
    m->desc.shape[1] = 0;
}

static void
edit_more_regions_than_tensors(llmdd__ucx_reply *m)
{
    m->desc.num_tensors = 1;
}

static void
test_reply_rejects(void **state)
{
    (void)state;
    expect_rejected(edit_tensor_past_region);
    expect_rejected(edit_tensor_before_region);
    expect_rejected(edit_bad_region_index);
    expect_rejected(edit_wrapping_region);
    expect_rejected(edit_bad_desc);
    expect_rejected(edit_more_regions_than_tensors);
}

static void
put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void
test_reply_counts_checked_before_allocating(void **state)
{
    llmdd__ucx_region g[2];
    uint64_t taddr[3];
    uint32_t treg[3];
    llmdd__ucx_reply m, out;
    uint8_t buf[512];

    (void)state;
    reply_sample(&m, g, taddr, treg);
    size_t n = reply_encode(&m, buf, sizeof(buf));
    /* num_tensors sits after seq, status and placement; the batch
     * dimension and nregions after the desc's dims. Huge counts must fail
     * on the bytes present, not on malloc. */
    uint8_t copy[512];
    memcpy(copy, buf, n);
    put32(copy + 16, 0xffffffffu);
    assert_int_equal(llmdd__ucx_reply_decode(copy, n, &out), -1);
    memcpy(copy, buf, n);
    put32(copy + 48, 0xffffffffu);
    assert_int_equal(llmdd__ucx_reply_decode(copy, n, &out), -1);
    /* A batch dimension past the desc's two dims. */
    memcpy(copy, buf, n);
    put32(copy + 44, 2);
    assert_int_equal(llmdd__ucx_reply_decode(copy, n, &out), -1);
    /* A key length of zero and one over the cap. */
    memcpy(copy, buf, n);
    put32(copy + 52 + 16, 0);
    assert_int_equal(llmdd__ucx_reply_decode(copy, n, &out), -1);
    memcpy(copy, buf, n);
    put32(copy + 52 + 16, LLMDD_UCX_RKEY_MAX + 1);
    assert_int_equal(llmdd__ucx_reply_decode(copy, n, &out), -1);
}

static void
test_reply_encoder_refuses_bad_keys(void **state)
{
    llmdd__ucx_region g[2];
    uint64_t taddr[3];
    uint32_t treg[3];
    llmdd__ucx_reply m;
    uint8_t buf[512];

    (void)state;
    reply_sample(&m, g, taddr, treg);
    g[0].rkey_len = 0;
    assert_int_equal(llmdd__ucx_reply_encode(&m, buf, sizeof(buf)), 0);
    g[0].rkey_len = sizeof(key_a);
    assert_int_equal(llmdd__ucx_reply_encode(&m, buf, 20), 0);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello_round_trip),
        cmocka_unit_test(test_hello_bad_length),
        cmocka_unit_test(test_amreq),
        cmocka_unit_test(test_req_and_ack),
        cmocka_unit_test(test_reply_round_trip),
        cmocka_unit_test(test_reply_status_only),
        cmocka_unit_test(test_reply_rejects),
        cmocka_unit_test(test_reply_counts_checked_before_allocating),
        cmocka_unit_test(test_reply_encoder_refuses_bad_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
