/*
 * Writes the seed corpus: valid messages made with the real encoders, for
 * each fuzz target, into DIR/<target>/. The committed corpus under
 * tests/fuzz/corpus/ was made with
 *   ./build/tests/fuzz/fuzz_gen_corpus tests/fuzz/corpus
 * Rerun it when the wire format changes.
 */
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "base/wire.h"
#include "fuzz/fuzz.h"
#ifdef LLMDD_HAVE_UCX
#include "transport/ucx/ucx_wire.h"
#endif

static const char *root;
static uint8_t msg[1 << 16];

static void
put(const char *target, const char *name, const uint8_t *data, size_t len)
{
    char path[4096];

    snprintf(path, sizeof(path), "%s/%s", root, target);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        perror(path);
        exit(1);
    }
    snprintf(path, sizeof(path), "%s/%s/%s", root, target, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* A wire seed: the selector byte of fuzz_wire.c, then the payload. */
static void
wire(const char *name, int sel, const uint8_t *p, size_t len)
{
    msg[0] = (uint8_t)sel;
    memcpy(msg + 1, p, len);
    put("wire", name, msg, len + 1);
}

/* A stream: frames appended one after another. */
typedef struct {
    uint8_t b[1 << 16];
    size_t len;
} stream;

static void
frame(stream *s, uint16_t type, const uint8_t *p, size_t len)
{
    llmdd__wire_frame_encode(s->b + s->len, type, (uint32_t)len);
    s->len += LLMDD_WIRE_HDR_LEN;
    memcpy(s->b + s->len, p, len);
    s->len += len;
}

static void
raw(stream *s, uint8_t byte, size_t n)
{
    memset(s->b + s->len, byte, n);
    s->len += n;
}

static llmdd__hello
hello_ctrl(void)
{
    llmdd__hello h;

    memset(&h, 0, sizeof(h));
    h.kind = CONN_CTRL;
    h.cluster_id = 2;
    h.role = LLMDD_ROLE_DECODER;
    h.pid = 4242;
    memset(h.boot_id, 0xb0, sizeof(h.boot_id));
    h.nonce = 0x1122334455667788ull;
    h.auth = 1;
    memset(h.cnonce, 0xc1, sizeof(h.cnonce));
    strcpy(h.transport, "auto");
    h.terms = (llmdd__link_terms){.hb_ms = 1000, .notify_window = 128};
    return h;
}

static llmdd__hello_reply
hello_reply(void)
{
    llmdd__hello_reply r;

    memset(&r, 0, sizeof(r));
    r.status = LLM_SUCCESS;
    r.cluster_id = 1;
    r.role = LLMDD_ROLE_PROMPT;
    r.pid = 4343;
    memset(r.boot_id, 0xb0, sizeof(r.boot_id));
    r.nonce = 99;
    r.auth = 1;
    memset(r.snonce, 0x5e, sizeof(r.snonce));
    memset(r.mac, 0x3a, sizeof(r.mac));
    strcpy(r.transport, "tcp");
    r.terms = (llmdd__link_terms){
        .hb_ms = 1000, .notify_window = 128, .conns_max = 5};
    return r;
}

static void
gen_wire_and_stream(void)
{
    uint64_t offs[4] = {0, 1024, 4000, 1}, lens[4] = {1024, 512, 1000, 7};
    llmdd_cache_desc d = {.num_tensors = 8,
                          .data_type = LLMDD_DT_FLOAT16,
                          .num_dims = 3,
                          .shape = {4, 16, 32}};
    llmdd__hello h = hello_ctrl(), hd;
    llmdd__hello_reply r = hello_reply();
    llmdd__confirm c;
    llmdd__result res;
    llmdd__rw_req rw = {.cache_id = 1,
                        .first = 0,
                        .count = 2,
                        .nruns = 2,
                        .offs = offs,
                        .lens = lens};
    uint8_t p[4096];
    size_t n;
    stream *s = calloc(1, sizeof(*s));

    memset(&hd, 0, sizeof(hd));
    hd.kind = CONN_DATA;
    memset(hd.token, 0x70, sizeof(hd.token));
    hd.flags = 1;
    memset(&c, 0, sizeof(c));
    strcpy(c.transport, "tcp");
    memset(c.mac, 0x4d, sizeof(c.mac));
    memset(&res, 0, sizeof(res));
    memset(res.token, 0x70, sizeof(res.token));

    llmdd__wire_frame_encode(p, WMSG_READ, 64);
    wire("frame_read", 0, p, LLMDD_WIRE_HDR_LEN);
    llmdd__wire_frame_encode(p, WMSG_HELLO, LLMDD_WIRE_MAX_PAYLOAD);
    wire("frame_hello_max", 0, p, LLMDD_WIRE_HDR_LEN);
    n = llmdd__wire_hello_encode(&h, p, sizeof(p));
    wire("hello_ctrl", 1, p, n);
    n = llmdd__wire_hello_encode(&hd, p, sizeof(p));
    wire("hello_data", 1, p, n);
    n = llmdd__wire_hello_reply_encode(&r, p, sizeof(p));
    wire("hello_reply", 2, p, n);
    n = llmdd__wire_confirm_encode(&c, p, sizeof(p));
    wire("confirm", 3, p, n);
    n = llmdd__wire_result_encode(&res, p, sizeof(p));
    wire("result", 4, p, n);
    n = llmdd__wire_u32_encode(LLM_LINK_FAILED, p, sizeof(p));
    wire("u32", 5, p, n);
    n = llmdd__wire_i64_encode(-5, p, sizeof(p));
    wire("i64", 6, p, n);
    n = llmdd__wire_desc_encode(LLM_SUCCESS, &d, 0, p, sizeof(p));
    wire("desc", 7, p, n);
    n = llmdd__wire_desc_encode(LLM_SUCCESS, &d, 2, p, sizeof(p));
    wire("desc_batch_dim", 7, p, n);
    n = llmdd__wire_desc_encode(LLM_KV_CACHE_NOT_EXIST, NULL, 0, p, sizeof(p));
    wire("desc_missing", 7, p, n);
    n = llmdd__wire_confirm_encode(&c, p, sizeof(p));
    wire("name", 12, p, 1 + p[0]); /* the confirm's transport name */
    n = llmdd__wire_read_reply_encode(LLM_SUCCESS, 2048, p, sizeof(p));
    wire("read_reply", 8, p, n);
    n = llmdd__wire_rw_encode(&rw, p, sizeof(p));
    wire("rw", 9, p, n);
    llmdd__key_query kq = {.seq = 3, .key_len = 9};
    memcpy(kq.key, "req-42/kv", 9);
    n = llmdd__wire_key_query_encode(&kq, p, sizeof(p));
    wire("key_query", 10, p, n);
    kq.key_len = LLMDD_WIRE_KEY_MAX;
    memset(kq.key, 'k', LLMDD_WIRE_KEY_MAX);
    n = llmdd__wire_key_query_encode(&kq, p, sizeof(p));
    wire("key_query_max", 10, p, n);
    llmdd__key_reply kr = {.seq = 3, .status = LLM_SUCCESS, .cache_id = 7,
                           .batch_index = 2};
    n = llmdd__wire_key_reply_encode(&kr, p, sizeof(p));
    wire("key_reply", 11, p, n);
    llmdd__layout_query lq = {.seq = 5, .cache_id = 3};
    n = llmdd__wire_layout_query_encode(&lq, p, sizeof(p));
    wire("layout_query", 13, p, n);
    llmdd__layout_reply lr = {
        .seq = 5,
        .status = LLM_SUCCESS,
        .layout = {.num_dims = 5,
                   .order = {LLMDD_KV_DIM_BLOCK, LLMDD_KV_DIM_PART,
                             LLMDD_KV_DIM_HEAD, LLMDD_KV_DIM_TOKEN,
                             LLMDD_KV_DIM_BYTES},
                   .block_size = 16, .num_heads = 2, .head_first = 2,
                   .total_heads = 8, .head_bytes = 64, .num_parts = 2,
                   .compat_tag = 0x1234}};
    n = llmdd__wire_layout_reply_encode(&lr, p, sizeof(p));
    wire("layout_reply", 14, p, n);
    memset(&lr.layout, 0, sizeof(lr.layout));
    lr.status = LLM_CACHE_INCOMPATIBLE;
    n = llmdd__wire_layout_reply_encode(&lr, p, sizeof(p));
    wire("layout_reply_none", 14, p, n);

    /* Server side of a control handshake, then an unlink. */
    s->len = 0;
    n = llmdd__wire_hello_encode(&h, p, sizeof(p));
    frame(s, WMSG_HELLO, p, n);
    n = llmdd__wire_confirm_encode(&c, p, sizeof(p));
    frame(s, WMSG_CONFIRM, p, n);
    frame(s, WMSG_UNLINK, NULL, 0);
    put("stream", "server_ctrl", s->b, s->len);

    /* Client side of the same handshake. */
    s->len = 0;
    n = llmdd__wire_hello_reply_encode(&r, p, sizeof(p));
    frame(s, WMSG_HELLO_REPLY, p, n);
    n = llmdd__wire_result_encode(&res, p, sizeof(p));
    frame(s, WMSG_RESULT, p, n);
    frame(s, WMSG_UNLINK_ACK, NULL, 0);
    put("stream", "client_ctrl", s->b, s->len);

    /* A data connection as its server sees it: query, read, write + data. */
    s->len = 0;
    n = llmdd__wire_hello_encode(&hd, p, sizeof(p));
    frame(s, WMSG_HELLO, p, n);
    n = llmdd__wire_i64_encode(1, p, sizeof(p));
    frame(s, WMSG_QUERY, p, n);
    n = llmdd__wire_rw_encode(&rw, p, sizeof(p));
    frame(s, WMSG_READ, p, n);
    rw.count = 1;
    rw.nruns = 1;
    lens[0] = 64;
    n = llmdd__wire_rw_encode(&rw, p, sizeof(p));
    frame(s, WMSG_WRITE, p, n);
    raw(s, 0xab, 64);
    put("stream", "server_data", s->b, s->len);

    /* ... and as its requester sees the answers. */
    s->len = 0;
    n = llmdd__wire_u32_encode(LLM_SUCCESS, p, sizeof(p));
    frame(s, WMSG_DATA_REPLY, p, n);
    n = llmdd__wire_desc_encode(LLM_SUCCESS, &d, 1, p, sizeof(p));
    frame(s, WMSG_QUERY_REPLY, p, n);
    n = llmdd__wire_read_reply_encode(LLM_SUCCESS, 96, p, sizeof(p));
    frame(s, WMSG_READ_REPLY, p, n);
    raw(s, 0xcd, 96);
    n = llmdd__wire_u32_encode(LLM_SUCCESS, p, sizeof(p));
    frame(s, WMSG_WRITE_REPLY, p, n);
    put("stream", "client_data", s->b, s->len);

    /* Requests against fuzz_rw.c's caches: in bounds, at the edge, out. */
    struct {
        const char *name;
        int64_t id;
        uint32_t first, count;
        uint64_t off, len, cnt, stride;
    } reqs[] = {
        {"alloc_slot", 1, 0, 3, 1000, 1000, 1, 0},
        {"alloc_edge", 1, 2, 1, 3999, 1, 1, 0},
        {"alloc_past", 1, 1, 2, 3000, 1001, 1, 0},
        {"reg_all", 2, 0, 2, 0, 24, 1, 0},
        {"reg_tensor_past", 2, 1, 2, 0, 8, 1, 0},
        {"unknown_id", 77, 0, 1, 0, 8, 1, 0},
        {"strided", 1, 0, 3, 0, 100, 10, 400},
        {"strided_edge", 1, 0, 1, 0, 100, 11, 390},
        {"strided_past", 1, 0, 1, 0, 100, 11, 400},
        {"strided_overflow", 1, 0, 1, 8, 8, 3, UINT64_C(1) << 63},
        {"strided_backwards", 1, 0, 1, 3000, 8, 4, UINT64_MAX - 999},
    };
    for (size_t i = 0; i < sizeof(reqs) / sizeof(reqs[0]); i++) {
        uint64_t o = reqs[i].off, l = reqs[i].len, c = reqs[i].cnt,
                 st = reqs[i].stride;
        llmdd__rw_req q = {.cache_id = reqs[i].id,
                           .first = reqs[i].first,
                           .count = reqs[i].count,
                           .nruns = 1,
                           .offs = &o,
                           .lens = &l,
                           .cnts = &c,
                           .strides = &st};
        n = llmdd__wire_rw_encode(&q, p, sizeof(p));
        put("rw", reqs[i].name, p, n);
    }

    /*
     * Requests that stay inside every tensor yet ask for more than a
     * tensor's worth of bytes (the serving side's bound): overlapping runs,
     * runs summing past the tensor, the same run thousands of times; and
     * two runs that make exactly one tensor, the most that may pass.
     */
    enum { MANY = 3000 }; /* fits fuzz_stream.c's 64 KiB input */
    uint64_t *mo = calloc(MANY, sizeof(*mo)), *ml = calloc(MANY, sizeof(*ml));
    uint8_t *big = malloc(64 + MANY * 16);
    if (mo == NULL || ml == NULL || big == NULL)
        exit(1);
    for (size_t i = 0; i < MANY; i++)
        ml[i] = 4000; /* the whole of fuzz_rw.c's allocated tensor */
    struct {
        const char *name;
        uint32_t count, nruns;
        uint64_t o0, l0, o1, l1;
    } amp[] = {
        {"alloc_exact_split", 3, 2, 2000, 2000, 0, 2000},
        {"alloc_overlap_past", 3, 2, 0, 4000, 3999, 1},
        {"alloc_sum_past", 1, 2, 0, 2001, 2000, 2000},
        {"alloc_many_whole", 3, MANY, 0, 4000, 0, 4000},
    };
    for (size_t i = 0; i < sizeof(amp) / sizeof(amp[0]); i++) {
        mo[0] = amp[i].o0;
        ml[0] = amp[i].l0;
        mo[1] = amp[i].o1;
        ml[1] = amp[i].l1;
        llmdd__rw_req q = {.cache_id = 1,
                           .first = 0,
                           .count = amp[i].count,
                           .nruns = amp[i].nruns,
                           .offs = mo,
                           .lens = ml};
        n = llmdd__wire_rw_encode(&q, big, 64 + MANY * 16);
        put("rw", amp[i].name, big, n);
    }
    /* The amplified READ and WRITE as a data connection carries them. */
    rw = (llmdd__rw_req){.cache_id = 1,
                         .first = 0,
                         .count = 3,
                         .nruns = MANY,
                         .offs = mo,
                         .lens = ml};
    s->len = 0;
    n = llmdd__wire_hello_encode(&hd, p, sizeof(p));
    frame(s, WMSG_HELLO, p, n);
    n = llmdd__wire_rw_encode(&rw, big, 64 + MANY * 16);
    frame(s, WMSG_READ, big, n);
    put("stream", "server_data_amplified_read", s->b, s->len);
    s->len = 0;
    n = llmdd__wire_hello_encode(&hd, p, sizeof(p));
    frame(s, WMSG_HELLO, p, n);
    rw.nruns = MANY / 2;
    n = llmdd__wire_rw_encode(&rw, big, 64 + MANY * 16);
    frame(s, WMSG_WRITE, big, n);
    raw(s, 0xab, 4000);
    put("stream", "server_data_amplified_write", s->b, s->len);
    free(big);
    free(ml);
    free(mo);
    free(s);
}

/* An options seed: the selector byte of fuzz_options.c, then the text. */
static void
opt(const char *name, int sel, const char *text, size_t len)
{
    msg[0] = (uint8_t)sel;
    memcpy(msg + 1, text, len);
    put("options", name, msg, len + 1);
}

/* Literals may hold NUL selector bytes: take their length from sizeof. */
#define OPT(name, sel, lit) opt(name, sel, lit, sizeof(lit) - 1)

static void
gen_options(void)
{
    OPT("listen_v4", 0, "127.0.0.1:26000");
    OPT("listen_v6", 0, "[::1]:26000");
    OPT("wait", 1, "1000");
    OPT("u32", 2, "4294967295");
    OPT("pool", 3, "{\"memory_size\": 1048576, \"page_shift\": 16}");
    OPT("ip_info", 4, "10.0.0.1");
    OPT("apply_all", 5,
        "\x00" "0.0.0.0:1\n"
        "\x01" "3\n"
        "\x02" "250\n"
        "\x03" "{\"memory_size\": 65536}\n"
        "\x04" "{\"memory_size\": 4096, \"page_shift\": 12}\n"
        "\x05" "tcp\n"
        "\x06" "s3cret\n"
        "\x07" "llm.Unknown=x");
    OPT("apply_bad", 5, "\x02" "0\n" "\x06" "t");
}

#ifdef LLMDD_HAVE_UCX
/* A ucx seed: the selector byte of fuzz_ucx.c, then the payload. */
static void
ucx(const char *name, int sel, const uint8_t *p, size_t len)
{
    msg[0] = (uint8_t)sel;
    memcpy(msg + 1, p, len);
    put("ucx", name, msg, len + 1);
}

static void
gen_ucx(void)
{
    static const uint8_t addr[24] = "ucp-worker-address-0123";
    static const uint8_t key[8] = "rkey-abc";
    llmdd__ucx_hello h = {.version = LLMDD_UCX_WIRE_VERSION,
                          .ucp_version = 1 << 16 | 13 << 8 | 1,
                          .flags = LLMDD_UCX_HELLO_RDMA,
                          .key = 0x5eed,
                          .addr = addr,
                          .addr_len = sizeof(addr)};
    llmdd__ucx_region g[2] = {{0x100000, 2 * 4096, key, sizeof(key)},
                              {0x900000, 4096, key, 4}};
    uint64_t taddr[3] = {0x100000, 0x101000, 0x900000};
    uint32_t treg[3] = {0, 0, 1};
    llmdd__ucx_amreq am = {
        .key = 0x5eed, .tag = 5 << 10 | 1, .addr = 0x101000, .len = 4096};
    llmdd__ucx_reply m = {.seq = 9,
                          .status = LLM_SUCCESS,
                          .desc = {.num_tensors = 3,
                                   .data_type = LLMDD_DT_UINT8,
                                   .num_dims = 2,
                                   .shape = {4, 1024}},
                          .batch_dim = 1,
                          .nregions = 2,
                          .regions = g,
                          .taddr = taddr,
                          .treg = treg};
    uint8_t p[4096];
    size_t n;

    n = llmdd__ucx_hello_encode(LLM_SUCCESS, &h, p, sizeof(p));
    ucx("hello", 0, p, n);
    n = llmdd__ucx_hello_encode(LLM_FEATURE_NOT_ENABLED, NULL, p, sizeof(p));
    ucx("hello_refused", 0, p, n);
    n = llmdd__ucx_req_encode(7, 1, p, sizeof(p));
    ucx("query", 1, p, n);
    n = llmdd__ucx_ack_encode(7, LLM_SUCCESS, p, sizeof(p));
    ucx("revoke_ack", 2, p, n);
    n = llmdd__ucx_amreq_encode(&am, p, sizeof(p));
    ucx("am_get", 3, p, n);
    n = llmdd__wire_i64_encode(0x5eed, p, sizeof(p));
    ucx("am_ping", 3, p, n);
    n = llmdd__ucx_reply_encode(&m, p, sizeof(p));
    ucx("reply", 4, p, n);
    m.status = LLM_KV_CACHE_NOT_EXIST;
    n = llmdd__ucx_reply_encode(&m, p, sizeof(p));
    ucx("reply_missing", 4, p, n);
}
#endif

int
main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    root = argv[1];
    if (mkdir(root, 0755) != 0 && errno != EEXIST) {
        perror(root);
        return 1;
    }
    gen_wire_and_stream();
    gen_options();
#ifdef LLMDD_HAVE_UCX
    gen_ucx();
#endif
    return 0;
}
