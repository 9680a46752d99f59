/*
 * The wire protocol (src/base/wire.h): every encoder and decoder round
 * trips, and every decoder rejects what docs/model.md says of bad input
 * it must: bad frame headers, oversize payloads, every truncation of a valid
 * message, trailing bytes, bad names, bad counts and overflowing totals.
 * Encoders refuse buffers that are too small. The byte codec under them all
 * (src/base/codec.h) is bounded both ways.
 */
#include <stdlib.h>
#include <string.h>

#include "base/codec.h"
#include "base/wire.h"
#include "harness/harness.h"

#define BUF 512

typedef int (*decode_fn)(const uint8_t *buf, size_t len, void *out);

/*
 * A valid payload of n bytes: every shorter prefix and the payload with one
 * more byte must be rejected. Each decode gets its own heap copy of exactly
 * `len` bytes so that ASan catches a read past the end.
 */
static void
assert_strict(const uint8_t *valid, size_t n, decode_fn dec, size_t outsize)
{
    void *out = malloc(outsize);

    assert_non_null(out);
    for (size_t len = 0; len < n; len++) {
        uint8_t *copy = malloc(len ? len : 1);
        assert_non_null(copy);
        memcpy(copy, valid, len);
        if (dec(copy, len, out) == 0)
            fail_msg("a truncation to %zu of %zu bytes was accepted", len, n);
        free(copy);
    }
    uint8_t *longer = malloc(n + 1);
    assert_non_null(longer);
    memcpy(longer, valid, n);
    longer[n] = 0;
    if (dec(longer, n + 1, out) == 0)
        fail_msg("a trailing byte after %zu bytes was accepted", n);
    assert_int_equal(dec(longer, n, out), 0);
    free(longer);
    free(out);
}

/* An encoder given less room than it needs writes nothing useful. */
typedef size_t (*encode_fn)(const void *m, uint8_t *buf, size_t cap);

static void
assert_encode_short(const void *m, encode_fn enc, size_t n)
{
    uint8_t buf[BUF];

    for (size_t cap = 0; cap < n; cap++)
        if (enc(m, buf, cap) != 0)
            fail_msg("encoded into %zu of the %zu bytes needed", cap, n);
    assert_int_equal(enc(m, buf, n), n);
}

/* ---- Frame headers. ---- */

static void
put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static void
put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

/* The codec: little-endian, bounded writes and reads, strict names. */
static void
test_codec(void **state)
{
    uint8_t b[32];
    llmdd__wbuf w = LLMDD__WBUF(b, 15);

    (void)state;
    llmdd__put_u8(&w, 0x01);
    llmdd__put_u16(&w, 0x0302);
    llmdd__put_u32(&w, 0x07060504);
    llmdd__put_u64(&w, 0x0f0e0d0c0b0a0908ull);
    assert_int_equal(llmdd__wdone(&w), 15);
    for (int i = 0; i < 15; i++)
        assert_int_equal(b[i], i + 1);
    llmdd__put_u8(&w, 0); /* one past the capacity */
    assert_true(w.err);
    assert_int_equal(llmdd__wdone(&w), 0);

    llmdd__rbuf r = LLMDD__RBUF(b, 15);
    assert_int_equal(llmdd__get_u8(&r), 0x01);
    assert_int_equal(llmdd__get_u16(&r), 0x0302);
    assert_int_equal(llmdd__get_u32(&r), 0x07060504);
    assert_true(llmdd__get_u64(&r) == 0x0f0e0d0c0b0a0908ull);
    assert_int_equal(llmdd__rdone(&r), 0);
    /* A short read gives zeros, sets err and stays failed. */
    r = LLMDD__RBUF(b, 3);
    assert_int_equal(llmdd__get_u32(&r), 0);
    assert_true(r.err);
    assert_int_equal(llmdd__get_u8(&r), 0);
    assert_int_equal(llmdd__get_left(&r), 0);
    assert_int_not_equal(llmdd__rdone(&r), 0);
    /* Trailing bytes fail rdone. */
    r = LLMDD__RBUF(b, 2);
    (void)llmdd__get_u8(&r);
    assert_int_not_equal(llmdd__rdone(&r), 0);

    /* Names: at most max bytes, printable, NUL-terminated on the way in. */
    char name[8];
    w = LLMDD__WBUF(b, sizeof(b));
    llmdd__put_name(&w, "shm", 7);
    assert_int_equal(llmdd__wdone(&w), 4);
    r = LLMDD__RBUF(b, 4);
    llmdd__get_name(&r, name, 7);
    assert_int_equal(llmdd__rdone(&r), 0);
    assert_string_equal(name, "shm");
    w = LLMDD__WBUF(b, sizeof(b));
    llmdd__put_name(&w, "12345678", 7);
    assert_int_equal(llmdd__wdone(&w), 0);
    const uint8_t long_name[] = {8, 'a', 'a', 'a', 'a', 'a', 'a', 'a', 'a'};
    r = LLMDD__RBUF(long_name, sizeof(long_name));
    llmdd__get_name(&r, name, 7);
    assert_true(r.err);
    assert_string_equal(name, "");
    const uint8_t space[] = {2, 'a', ' '};
    r = LLMDD__RBUF(space, sizeof(space));
    llmdd__get_name(&r, name, 7);
    assert_true(r.err);

    /* A desc reads back as written, with its batch dimension; a dim
     * count out of 1..MAX fails, and so does a batch dimension past the
     * dims (it is never written). */
    llmdd_cache_desc d = {.num_tensors = 2, .num_dims = 2, .shape = {3, -1}};
    llmdd_cache_desc e;
    uint32_t bd = 7;
    uint8_t db[LLMDD__DESC_MAX];
    w = LLMDD__WBUF(db, sizeof(db));
    llmdd__put_desc(&w, &d, 1);
    size_t n = llmdd__wdone(&w);
    assert_int_equal(n, 16 + 16 + 4);
    r = LLMDD__RBUF(db, n);
    llmdd__get_desc(&r, &e, &bd);
    assert_int_equal(llmdd__rdone(&r), 0);
    assert_memory_equal(&d, &e, sizeof(d));
    assert_int_equal(bd, 1);
    w = LLMDD__WBUF(db, sizeof(db));
    llmdd__put_desc(&w, &d, 2);
    assert_true(w.err);
    w = LLMDD__WBUF(db, sizeof(db));
    llmdd__put_desc(&w, &d, 0);
    n = llmdd__wdone(&w);
    for (uint32_t v = 2; v != 0; v = v == 2 ? UINT32_MAX : 0) {
        db[n - 4] = (uint8_t)v;
        db[n - 3] = (uint8_t)(v >> 8);
        db[n - 2] = (uint8_t)(v >> 16);
        db[n - 1] = (uint8_t)(v >> 24);
        r = LLMDD__RBUF(db, n);
        bd = 7;
        llmdd__get_desc(&r, &e, &bd);
        assert_true(r.err);
        assert_int_equal(bd, 0);
    }
    /* Short by the batch dimension's bytes (a version 2 desc). */
    r = LLMDD__RBUF(db, n - 4);
    llmdd__get_desc(&r, &e, &bd);
    assert_true(r.err);
    for (uint32_t dims = 0; dims <= LLMDD_MAX_DIMS + 1;
         dims += LLMDD_MAX_DIMS + 1) {
        db[12] = (uint8_t)dims;
        r = LLMDD__RBUF(db, sizeof(db));
        llmdd__get_desc(&r, &e, &bd);
        assert_true(r.err);
    }
}

static void
test_frame(void **state)
{
    uint8_t hdr[LLMDD_WIRE_HDR_LEN];
    llmdd__frame f;

    (void)state;
    for (uint16_t type = 1; type < WMSG_TYPE_MAX; type++) {
        llmdd__wire_frame_encode(hdr, type, type * 1000u);
        assert_int_equal(llmdd__wire_frame_decode(hdr, &f), 0);
        assert_int_equal(f.type, type);
        assert_int_equal(f.len, type * 1000u);
    }
    /* The layout is fixed: magic, version | type << 16, length (LE). */
    llmdd__wire_frame_encode(hdr, WMSG_READ, 0x01020304);
    static const uint8_t want[] = {0x4c, 0x4c, 0x44, 0x44, 3, 0, 22, 0,
                                   4,    3,    2,    1};
    assert_memory_equal(hdr, want, sizeof(want));

    llmdd__wire_frame_encode(hdr, WMSG_HELLO, LLMDD_WIRE_MAX_PAYLOAD);
    assert_int_equal(llmdd__wire_frame_decode(hdr, &f), 0);
    assert_int_equal(f.len, LLMDD_WIRE_MAX_PAYLOAD);
    llmdd__wire_frame_encode(hdr, WMSG_HELLO, 0);
    assert_int_equal(llmdd__wire_frame_decode(hdr, &f), 0);
    assert_int_equal(f.len, 0);

    /* Payload over the cap. */
    llmdd__wire_frame_encode(hdr, WMSG_HELLO, LLMDD_WIRE_MAX_PAYLOAD + 1);
    assert_int_equal(llmdd__wire_frame_decode(hdr, &f), -1);
    llmdd__wire_frame_encode(hdr, WMSG_HELLO, UINT32_MAX);
    assert_int_equal(llmdd__wire_frame_decode(hdr, &f), -1);

    /* Unknown types. */
    static const uint16_t bad_types[] = {0, WMSG_TYPE_MAX, 65, 0xffff};
    for (size_t i = 0; i < sizeof(bad_types) / sizeof(bad_types[0]); i++) {
        llmdd__wire_frame_encode(hdr, bad_types[i], 8);
        assert_int_equal(llmdd__wire_frame_decode(hdr, &f), -1);
    }

    /* Bad magic: any byte of it. */
    for (int b = 0; b < 4; b++) {
        llmdd__wire_frame_encode(hdr, WMSG_HELLO, 8);
        hdr[b] ^= 0x20;
        assert_int_equal(llmdd__wire_frame_decode(hdr, &f), -1);
    }
    /* Another version (2: llmdd 0.3; 1: 0.1 and 0.2) is refused and named,
     * so the handshake can log both versions. */
    uint16_t v = 0;
    llmdd__wire_frame_encode(hdr, WMSG_HELLO, 8);
    assert_false(llmdd__wire_frame_foreign(hdr, &v));
    static const uint16_t bad_versions[] = {0, 1, 2, 4, 0x100, 0xffff};
    for (size_t i = 0; i < sizeof(bad_versions) / sizeof(bad_versions[0]);
         i++) {
        llmdd__wire_frame_encode(hdr, WMSG_HELLO, 8);
        hdr[4] = (uint8_t)bad_versions[i];
        hdr[5] = (uint8_t)(bad_versions[i] >> 8);
        assert_int_equal(llmdd__wire_frame_decode(hdr, &f), -1);
        assert_true(llmdd__wire_frame_foreign(hdr, &v));
        assert_int_equal(v, bad_versions[i]);
    }
    /* Not llmdd's at all: no version to name. */
    llmdd__wire_frame_encode(hdr, WMSG_HELLO, 8);
    hdr[0] ^= 1;
    hdr[4] = 1;
    assert_false(llmdd__wire_frame_foreign(hdr, &v));
}

/* ---- HELLO ---- */

static int
dec_hello(const uint8_t *b, size_t n, void *o)
{
    return llmdd__wire_hello_decode(b, n, o);
}

static size_t
enc_hello(const void *m, uint8_t *b, size_t cap)
{
    return llmdd__wire_hello_encode(m, b, cap);
}

static llmdd__hello
hello_ctrl(void)
{
    llmdd__hello h;

    memset(&h, 0, sizeof(h));
    h.kind = CONN_CTRL;
    h.cluster_id = 0x1122334455667788ull;
    h.role = 2;
    h.pid = 4242;
    for (int i = 0; i < 16; i++) {
        h.boot_id[i] = (uint8_t)(i + 1);
        h.cnonce[i] = (uint8_t)(0xf0 - i);
    }
    h.nonce = 0xdeadbeefcafef00dull;
    h.auth = 1;
    strcpy(h.transport, "tcp");
    h.terms = (llmdd__link_terms){.hb_ms = 1000, .notify_window = 128};
    return h;
}

/* Offset of the transport name's length byte in a CTRL hello. */
#define HELLO_NAME_AT (1 + 8 + 4 + 4 + 16 + 8 + 1 + 16)
/* The terms after the name: heartbeat interval, window, connections. */
#define TERMS_LEN 12

/*
 * Every out-of-range term, at its offset: the decoder refuses each. `at` is
 * where the terms start; `server` whether conns_max must be 2..17.
 */
static void
assert_terms_checked(const uint8_t *buf, size_t n, size_t at, bool server,
                     int (*dec)(const uint8_t *, size_t, void *), void *out)
{
    static const struct {
        size_t off;
        uint32_t v;
        bool ok;
    } cases[] = {
        {0, 0, true},       {0, 99, false},     {0, 100, true},
        {0, 60000, true},   {0, 60001, false},  {0, UINT32_MAX, false},
        {4, 0, false},      {4, 1, true},       {4, 4096, true},
        {4, 4097, false},
    };
    uint8_t bad[BUF];

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        memcpy(bad, buf, n);
        uint32_t v = cases[i].v;
        for (int b = 0; b < 4; b++)
            bad[at + cases[i].off + (size_t)b] = (uint8_t)(v >> (8 * b));
        assert_int_equal(dec(bad, n, out), cases[i].ok ? 0 : -1);
    }
    static const uint32_t conns[] = {0, 1, 2, 17, 18, 1000};
    for (size_t i = 0; i < sizeof(conns) / sizeof(conns[0]); i++) {
        memcpy(bad, buf, n);
        for (int b = 0; b < 4; b++)
            bad[at + 8 + (size_t)b] = (uint8_t)(conns[i] >> (8 * b));
        bool ok = server ? conns[i] >= 2 && conns[i] <= 17 : conns[i] == 0;
        assert_int_equal(dec(bad, n, out), ok ? 0 : -1);
    }
}
#define HELLO_AUTH_AT (1 + 8 + 4 + 4 + 16 + 8)

static void
test_hello_ctrl(void **state)
{
    llmdd__hello h = hello_ctrl(), out;
    uint8_t buf[BUF];

    (void)state;
    size_t n = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    assert_int_equal(n, HELLO_NAME_AT + 1 + 3 + TERMS_LEN);
    memset(&out, 0xee, sizeof(out));
    assert_int_equal(llmdd__wire_hello_decode(buf, n, &out), 0);
    assert_int_equal(out.kind, CONN_CTRL);
    assert_true(out.cluster_id == h.cluster_id);
    assert_int_equal(out.role, h.role);
    assert_int_equal(out.pid, h.pid);
    assert_memory_equal(out.boot_id, h.boot_id, 16);
    assert_true(out.nonce == h.nonce);
    assert_int_equal(out.auth, 1);
    assert_memory_equal(out.cnonce, h.cnonce, 16);
    assert_string_equal(out.transport, "tcp");
    assert_int_equal(out.terms.hb_ms, 1000);
    assert_int_equal(out.terms.notify_window, 128);
    assert_int_equal(out.terms.conns_max, 0);
    assert_strict(buf, n, dec_hello, sizeof(out));
    assert_encode_short(&h, enc_hello, n);

    /* An empty name and the longest one. */
    h.transport[0] = '\0';
    n = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    assert_int_equal(llmdd__wire_hello_decode(buf, n, &out), 0);
    assert_string_equal(out.transport, "");
    memset(h.transport, 'x', LLMDD_WIRE_NAME_MAX);
    h.transport[LLMDD_WIRE_NAME_MAX] = '\0';
    n = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    assert_int_equal(llmdd__wire_hello_decode(buf, n, &out), 0);
    assert_int_equal(strlen(out.transport), LLMDD_WIRE_NAME_MAX);
    /* A name without its NUL does not encode. */
    memset(h.transport, 'x', sizeof(h.transport));
    assert_int_equal(llmdd__wire_hello_encode(&h, buf, sizeof(buf)), 0);
}

static void
test_hello_ctrl_bad(void **state)
{
    llmdd__hello h = hello_ctrl(), out;
    uint8_t buf[BUF], bad[BUF];

    (void)state;
    size_t n = llmdd__wire_hello_encode(&h, buf, sizeof(buf));

    /* auth is a boolean. */
    memcpy(bad, buf, n);
    bad[HELLO_AUTH_AT] = 2;
    assert_int_equal(llmdd__wire_hello_decode(bad, n, &out), -1);
    bad[HELLO_AUTH_AT] = 0;
    assert_int_equal(llmdd__wire_hello_decode(bad, n, &out), 0);

    /* A name longer than the cap, with the bytes present. */
    memcpy(bad, buf, HELLO_NAME_AT);
    bad[HELLO_NAME_AT] = LLMDD_WIRE_NAME_MAX + 1;
    memset(bad + HELLO_NAME_AT + 1, 'a', LLMDD_WIRE_NAME_MAX + 1);
    assert_int_equal(llmdd__wire_hello_decode(bad, HELLO_NAME_AT + 2 +
                                                       LLMDD_WIRE_NAME_MAX,
                                              &out),
                     -1);
    bad[HELLO_NAME_AT] = 255;
    assert_int_equal(llmdd__wire_hello_decode(bad, HELLO_NAME_AT + 256, &out),
                     -1);

    /* Non-printable bytes in the name, at each position. */
    static const uint8_t np[] = {0x00, 0x09, 0x20, 0x7f, 0x80, 0xff};
    for (size_t i = 0; i < sizeof(np); i++) {
        for (size_t pos = 0; pos < 3; pos++) {
            memcpy(bad, buf, n);
            bad[HELLO_NAME_AT + 1 + pos] = np[i];
            assert_int_equal(llmdd__wire_hello_decode(bad, n, &out), -1);
        }
    }

    /* The terms are claims: each must lie in its range. */
    assert_terms_checked(buf, n, n - TERMS_LEN, false, dec_hello, &out);

    /* Unknown connection kinds. */
    static const uint8_t kinds[] = {0, 3, 0xff};
    for (size_t i = 0; i < sizeof(kinds); i++) {
        memcpy(bad, buf, n);
        bad[0] = kinds[i];
        assert_int_equal(llmdd__wire_hello_decode(bad, n, &out), -1);
    }
}

static void
test_hello_data(void **state)
{
    llmdd__hello h, out;
    uint8_t buf[BUF];

    (void)state;
    memset(&h, 0, sizeof(h));
    h.kind = CONN_DATA;
    for (int i = 0; i < 16; i++)
        h.token[i] = (uint8_t)(i * 17);
    h.flags = 0x80000001u;
    size_t n = llmdd__wire_hello_encode(&h, buf, sizeof(buf));
    assert_int_equal(n, 1 + 16 + 4);
    assert_int_equal(llmdd__wire_hello_decode(buf, n, &out), 0);
    assert_int_equal(out.kind, CONN_DATA);
    assert_memory_equal(out.token, h.token, 16);
    assert_int_equal(out.flags, h.flags);
    assert_strict(buf, n, dec_hello, sizeof(out));
    assert_encode_short(&h, enc_hello, n);
}

/* ---- HELLO_REPLY ---- */

static int
dec_hello_reply(const uint8_t *b, size_t n, void *o)
{
    return llmdd__wire_hello_reply_decode(b, n, o);
}

static size_t
enc_hello_reply(const void *m, uint8_t *b, size_t cap)
{
    return llmdd__wire_hello_reply_encode(m, b, cap);
}

#define REPLY_AUTH_AT (4 + 8 + 4 + 4 + 16 + 8)
#define REPLY_NAME_AT (REPLY_AUTH_AT + 1 + 16 + 32)

static void
test_hello_reply(void **state)
{
    llmdd__hello_reply r, out;
    uint8_t buf[BUF], bad[BUF];

    (void)state;
    memset(&r, 0, sizeof(r));
    r.status = LLM_LINK_FAILED;
    r.cluster_id = 77;
    r.role = 1;
    r.pid = 99;
    r.nonce = UINT64_MAX;
    r.auth = 1;
    for (int i = 0; i < 16; i++) {
        r.boot_id[i] = (uint8_t)(0x10 + i);
        r.snonce[i] = (uint8_t)(0x40 + i);
    }
    for (int i = 0; i < 32; i++)
        r.mac[i] = (uint8_t)(0x80 + i);
    strcpy(r.transport, "loop");
    r.status = LLM_SUCCESS;
    r.terms = (llmdd__link_terms){
        .hb_ms = 0, .notify_window = 4096, .conns_max = 17};
    size_t n = llmdd__wire_hello_reply_encode(&r, buf, sizeof(buf));
    assert_int_equal(n, REPLY_NAME_AT + 1 + 4 + TERMS_LEN);
    assert_int_equal(llmdd__wire_hello_reply_decode(buf, n, &out), 0);
    assert_int_equal(out.terms.hb_ms, 0);
    assert_int_equal(out.terms.notify_window, 4096);
    assert_int_equal(out.terms.conns_max, 17);
    assert_terms_checked(buf, n, n - TERMS_LEN, true, dec_hello_reply, &out);
    /* A refusal carries no terms worth checking. */
    r.status = LLM_LINK_FAILED;
    r.terms = (llmdd__link_terms){0};
    n = llmdd__wire_hello_reply_encode(&r, buf, sizeof(buf));
    assert_int_equal(llmdd__wire_hello_reply_decode(buf, n, &out), 0);
    assert_int_equal(out.status, LLM_LINK_FAILED);
    assert_true(out.cluster_id == 77);
    assert_int_equal(out.role, 1);
    assert_int_equal(out.pid, 99);
    assert_true(out.nonce == UINT64_MAX);
    assert_int_equal(out.auth, 1);
    assert_memory_equal(out.boot_id, r.boot_id, 16);
    assert_memory_equal(out.snonce, r.snonce, 16);
    assert_memory_equal(out.mac, r.mac, 32);
    assert_string_equal(out.transport, "loop");
    assert_strict(buf, n, dec_hello_reply, sizeof(out));
    assert_encode_short(&r, enc_hello_reply, n);

    memcpy(bad, buf, n);
    bad[REPLY_AUTH_AT] = 2;
    assert_int_equal(llmdd__wire_hello_reply_decode(bad, n, &out), -1);
    memcpy(bad, buf, n);
    bad[REPLY_NAME_AT + 2] = 0x7f;
    assert_int_equal(llmdd__wire_hello_reply_decode(bad, n, &out), -1);
    memcpy(bad, buf, REPLY_NAME_AT);
    bad[REPLY_NAME_AT] = LLMDD_WIRE_NAME_MAX + 1;
    memset(bad + REPLY_NAME_AT + 1, 'a', LLMDD_WIRE_NAME_MAX + 1);
    assert_int_equal(llmdd__wire_hello_reply_decode(
                         bad, REPLY_NAME_AT + 2 + LLMDD_WIRE_NAME_MAX, &out),
                     -1);
    memset(r.transport, 'y', sizeof(r.transport));
    assert_int_equal(llmdd__wire_hello_reply_encode(&r, buf, sizeof(buf)), 0);
}

/* ---- CONFIRM and RESULT ---- */

static int
dec_confirm(const uint8_t *b, size_t n, void *o)
{
    return llmdd__wire_confirm_decode(b, n, o);
}

static size_t
enc_confirm(const void *m, uint8_t *b, size_t cap)
{
    return llmdd__wire_confirm_encode(m, b, cap);
}

static int
dec_result(const uint8_t *b, size_t n, void *o)
{
    return llmdd__wire_result_decode(b, n, o);
}

static size_t
enc_result(const void *m, uint8_t *b, size_t cap)
{
    return llmdd__wire_result_encode(m, b, cap);
}

static void
test_confirm_result(void **state)
{
    llmdd__confirm c, cout;
    llmdd__result r, rout;
    uint8_t buf[BUF], bad[BUF];

    (void)state;
    memset(&c, 0, sizeof(c));
    strcpy(c.transport, "shm");
    for (int i = 0; i < 32; i++)
        c.mac[i] = (uint8_t)(255 - i);
    size_t n = llmdd__wire_confirm_encode(&c, buf, sizeof(buf));
    assert_int_equal(n, 1 + 3 + 32);
    assert_int_equal(llmdd__wire_confirm_decode(buf, n, &cout), 0);
    assert_string_equal(cout.transport, "shm");
    assert_memory_equal(cout.mac, c.mac, 32);
    assert_strict(buf, n, dec_confirm, sizeof(cout));
    assert_encode_short(&c, enc_confirm, n);
    memcpy(bad, buf, n);
    bad[1] = ' ';
    assert_int_equal(llmdd__wire_confirm_decode(bad, n, &cout), -1);
    bad[0] = 200;
    assert_int_equal(llmdd__wire_confirm_decode(bad, n, &cout), -1);

    memset(&r, 0, sizeof(r));
    r.status = LLM_ALREADY_LINK;
    for (int i = 0; i < 16; i++)
        r.token[i] = (uint8_t)(i * 3);
    n = llmdd__wire_result_encode(&r, buf, sizeof(buf));
    assert_int_equal(n, 20);
    assert_int_equal(llmdd__wire_result_decode(buf, n, &rout), 0);
    assert_int_equal(rout.status, LLM_ALREADY_LINK);
    assert_memory_equal(rout.token, r.token, 16);
    assert_strict(buf, n, dec_result, sizeof(rout));
    assert_encode_short(&r, enc_result, n);
}

/* ---- Scalars and READ_REPLY ---- */

static int
dec_u32(const uint8_t *b, size_t n, void *o)
{
    return llmdd__wire_u32_decode(b, n, o);
}

static int
dec_i64(const uint8_t *b, size_t n, void *o)
{
    return llmdd__wire_i64_decode(b, n, o);
}

struct read_reply {
    uint32_t status;
    uint64_t total;
};

static int
dec_read_reply(const uint8_t *b, size_t n, void *o)
{
    struct read_reply *r = o;
    return llmdd__wire_read_reply_decode(b, n, &r->status, &r->total);
}

static void
test_scalars(void **state)
{
    uint8_t buf[BUF];
    uint32_t u;
    int64_t i;

    (void)state;
    assert_int_equal(llmdd__wire_u32_encode(0xa1b2c3d4u, buf, sizeof(buf)), 4);
    assert_int_equal(buf[0], 0xd4);
    assert_int_equal(llmdd__wire_u32_decode(buf, 4, &u), 0);
    assert_int_equal(u, 0xa1b2c3d4u);
    assert_strict(buf, 4, dec_u32, sizeof(u));
    for (size_t cap = 0; cap < 4; cap++)
        assert_int_equal(llmdd__wire_u32_encode(1, buf, cap), 0);

    static const int64_t vals[] = {0, 1, -1, INT64_MIN, INT64_MAX};
    for (size_t k = 0; k < sizeof(vals) / sizeof(vals[0]); k++) {
        assert_int_equal(llmdd__wire_i64_encode(vals[k], buf, sizeof(buf)), 8);
        assert_int_equal(llmdd__wire_i64_decode(buf, 8, &i), 0);
        assert_true(i == vals[k]);
    }
    assert_strict(buf, 8, dec_i64, sizeof(i));
    for (size_t cap = 0; cap < 8; cap++)
        assert_int_equal(llmdd__wire_i64_encode(1, buf, cap), 0);

    struct read_reply rr;
    assert_int_equal(
        llmdd__wire_read_reply_encode(LLM_TIMEOUT, 1ull << 40, buf, 64), 12);
    assert_int_equal(
        llmdd__wire_read_reply_decode(buf, 12, &rr.status, &rr.total), 0);
    assert_int_equal(rr.status, LLM_TIMEOUT);
    assert_true(rr.total == 1ull << 40);
    assert_strict(buf, 12, dec_read_reply, sizeof(rr));
    for (size_t cap = 0; cap < 12; cap++)
        assert_int_equal(llmdd__wire_read_reply_encode(0, 1, buf, cap), 0);
}

/* ---- QUERY_REPLY (desc) ---- */

struct desc_out {
    uint32_t status;
    llmdd_cache_desc d;
    uint32_t bd;
};

static int
dec_desc(const uint8_t *b, size_t n, void *o)
{
    struct desc_out *d = o;
    return llmdd__wire_desc_decode(b, n, &d->status, &d->d, &d->bd);
}

static void
test_desc(void **state)
{
    llmdd_cache_desc d = th_desc_kv();
    struct desc_out out;
    uint8_t buf[BUF], bad[BUF];

    (void)state;
    d.placement = LLMDD_PLACEMENT_DEVICE;
    d.shape[1] = INT64_MAX;
    size_t n = llmdd__wire_desc_encode(LLM_SUCCESS, &d, 2, buf, sizeof(buf));
    assert_int_equal(n, 4 + 16 + 3 * 8 + 4);
    assert_int_equal(
        llmdd__wire_desc_decode(buf, n, &out.status, &out.d, &out.bd), 0);
    assert_int_equal(out.status, LLM_SUCCESS);
    assert_memory_equal(&out.d, &d, sizeof(d));
    assert_int_equal(out.bd, 2);
    assert_strict(buf, n, dec_desc, sizeof(out));
    for (size_t cap = 0; cap < n; cap++)
        assert_int_equal(llmdd__wire_desc_encode(LLM_SUCCESS, &d, 2, buf, cap),
                         0);

    /* All 31 dimensions. */
    llmdd_cache_desc full = th_desc_kv();
    full.num_dims = LLMDD_MAX_DIMS;
    for (int k = 0; k < LLMDD_MAX_DIMS; k++)
        full.shape[k] = k + 1;
    n = llmdd__wire_desc_encode(LLM_SUCCESS, &full, LLMDD_MAX_DIMS - 1, buf,
                                sizeof(buf));
    assert_int_equal(n, 4 + 16 + LLMDD_MAX_DIMS * 8 + 4);
    assert_int_equal(
        llmdd__wire_desc_decode(buf, n, &out.status, &out.d, &out.bd), 0);
    assert_memory_equal(&out.d, &full, sizeof(full));
    assert_int_equal(out.bd, LLMDD_MAX_DIMS - 1);

    /* The batch dimension must name a dim: 3 of 3 dims, and all ones. */
    n = llmdd__wire_desc_encode(LLM_SUCCESS, &d, 0, buf, sizeof(buf));
    memcpy(bad, buf, n);
    put32(bad + n - 4, 3);
    out.bd = 9;
    assert_int_equal(
        llmdd__wire_desc_decode(bad, n, &out.status, &out.d, &out.bd), -1);
    assert_int_equal(out.bd, 9);
    put32(bad + n - 4, UINT32_MAX);
    assert_int_equal(
        llmdd__wire_desc_decode(bad, n, &out.status, &out.d, &out.bd), -1);
    put32(bad + n - 4, 1);
    assert_int_equal(
        llmdd__wire_desc_decode(bad, n, &out.status, &out.d, &out.bd), 0);
    assert_int_equal(out.bd, 1);
    /* A version 2 reply (no batch dimension) is short. */
    assert_int_equal(
        llmdd__wire_desc_decode(bad, n - 4, &out.status, &out.d, &out.bd), -1);
    assert_int_equal(
        llmdd__wire_desc_encode(LLM_SUCCESS, &d, 3, buf, sizeof(buf)), 0);

    /* num_dims 0 and 32 (with the bytes for 32 present). */
    n = llmdd__wire_desc_encode(LLM_SUCCESS, &d, 2, buf, sizeof(buf));
    memcpy(bad, buf, n);
    put32(bad + 16, 0);
    assert_int_equal(
        llmdd__wire_desc_decode(bad, 20, &out.status, &out.d, &out.bd), -1);
    assert_int_equal(
        llmdd__wire_desc_decode(bad, n, &out.status, &out.d, &out.bd), -1);
    memset(bad + 20, 1, 32 * 8);
    put32(bad + 16, LLMDD_MAX_DIMS + 1);
    assert_int_equal(
        llmdd__wire_desc_decode(bad, 20 + 32 * 8, &out.status, &out.d, &out.bd),
        -1);
    put32(bad + 16, UINT32_MAX);
    assert_int_equal(
        llmdd__wire_desc_decode(bad, 20 + 32 * 8, &out.status, &out.d, &out.bd),
        -1);

    /* A failure status carries no desc: 4 bytes exactly. */
    n = llmdd__wire_desc_encode(LLM_KV_CACHE_NOT_EXIST, &d, 0, buf,
                                sizeof(buf));
    assert_int_equal(n, 4);
    assert_int_equal(
        llmdd__wire_desc_decode(buf, n, &out.status, &out.d, &out.bd), 0);
    assert_int_equal(out.status, LLM_KV_CACHE_NOT_EXIST);
    assert_strict(buf, n, dec_desc, sizeof(out));
}

/* ---- READ / WRITE requests ---- */

static uint64_t *rw_offs, *rw_lens, *rw_cnts, *rw_strides;

static int
dec_rw(const uint8_t *b, size_t n, void *o)
{
    llmdd__rw_req *r = o;
    r->offs = rw_offs;
    r->lens = rw_lens;
    r->cnts = rw_cnts;
    r->strides = rw_strides;
    return llmdd__wire_rw_decode(b, n, r);
}

static int
rw_setup(void **state)
{
    (void)state;
    rw_offs = calloc(LLMDD_WIRE_MAX_RUNS + 1, sizeof(uint64_t));
    rw_lens = calloc(LLMDD_WIRE_MAX_RUNS + 1, sizeof(uint64_t));
    rw_cnts = calloc(LLMDD_WIRE_MAX_RUNS + 1, sizeof(uint64_t));
    rw_strides = calloc(LLMDD_WIRE_MAX_RUNS + 1, sizeof(uint64_t));
    return rw_offs && rw_lens && rw_cnts && rw_strides ? 0 : -1;
}

static int
rw_teardown(void **state)
{
    (void)state;
    free(rw_offs);
    free(rw_lens);
    free(rw_cnts);
    free(rw_strides);
    return 0;
}

/* A raw request: header and nruns (off, len) pairs. */
static size_t
rw_raw(uint8_t *buf, int64_t id, uint32_t first, uint32_t count,
       uint32_t nruns, const uint64_t *offs, const uint64_t *lens,
       size_t npairs)
{
    put64(buf, (uint64_t)id);
    put32(buf + 8, first);
    put32(buf + 12, count);
    put32(buf + 16, nruns);
    for (size_t i = 0; i < npairs; i++) {
        put64(buf + 20 + 16 * i, offs[i]);
        put64(buf + 28 + 16 * i, lens[i]);
    }
    return 20 + 16 * npairs;
}

static int
rw_decode(const uint8_t *buf, size_t n, llmdd__rw_req *r)
{
    return dec_rw(buf, n, r);
}

static void
test_rw_roundtrip(void **state)
{
    uint64_t offs[] = {0, 4096, UINT64_MAX - 10}, lens[] = {1, 100, 10};
    llmdd__rw_req m = {.cache_id = -3,
                       .first = 2,
                       .count = 4,
                       .nruns = 3,
                       .offs = offs,
                       .lens = lens};
    llmdd__rw_req out;
    uint8_t buf[BUF];

    (void)state;
    size_t n = llmdd__wire_rw_encode(&m, buf, sizeof(buf));
    assert_int_equal(n, 20 + 3 * 16);
    assert_int_equal(rw_decode(buf, n, &out), 0);
    assert_true(out.cache_id == -3);
    assert_int_equal(out.first, 2);
    assert_int_equal(out.count, 4);
    assert_int_equal(out.nruns, 3);
    assert_memory_equal(out.offs, offs, sizeof(offs));
    assert_memory_equal(out.lens, lens, sizeof(lens));
    assert_true(out.total == 4 * 111);
    assert_strict(buf, n, dec_rw, sizeof(out));
    for (size_t cap = 0; cap < n; cap++)
        assert_int_equal(llmdd__wire_rw_encode(&m, buf, cap), 0);
}

static void
test_rw_limits(void **state)
{
    llmdd__rw_req out;
    uint64_t off0[] = {0, 0}, len1[] = {1, 1};
    uint8_t buf[BUF];
    size_t n;

    (void)state;
    /* nruns 0, count 0, lens 0. */
    n = rw_raw(buf, 1, 0, 1, 0, NULL, NULL, 0);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    n = rw_raw(buf, 1, 0, 0, 1, off0, len1, 1);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    uint64_t len0[] = {5, 0};
    n = rw_raw(buf, 1, 0, 1, 2, off0, len0, 2);
    assert_int_equal(rw_decode(buf, n, &out), -1);

    /* nruns not matching the bytes present, either way. */
    n = rw_raw(buf, 1, 0, 1, 2, off0, len1, 1);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    n = rw_raw(buf, 1, 0, 1, 1, off0, len1, 2);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    n = rw_raw(buf, 1, 0, 1, UINT32_MAX, off0, len1, 2);
    assert_int_equal(rw_decode(buf, n, &out), -1);

    /* Totals: the sum of lens, and count times it, must fit in int64. */
    uint64_t sum_wrap[] = {UINT64_MAX, 1};
    n = rw_raw(buf, 1, 0, 1, 2, off0, sum_wrap, 2);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    uint64_t half[] = {1ull << 62, 1ull << 62};
    n = rw_raw(buf, 1, 0, 1, 2, off0, half, 2);
    assert_int_equal(rw_decode(buf, n, &out), -1); /* exactly 2^63 */
    n = rw_raw(buf, 1, 0, 1, 1, off0, half, 1);
    assert_int_equal(rw_decode(buf, n, &out), 0);
    n = rw_raw(buf, 1, 0, 2, 1, off0, half, 1);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    n = rw_raw(buf, 1, 0, UINT32_MAX, 1, off0, half, 1);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    uint64_t max[] = {INT64_MAX};
    n = rw_raw(buf, 1, 0, 1, 1, off0, max, 1);
    assert_int_equal(rw_decode(buf, n, &out), 0);
    assert_true(out.total == INT64_MAX);
}

/* Strided runs: 32 bytes each beside 16-byte plain ones, and their limits. */
static void
test_rw_strided(void **state)
{
    uint64_t offs[] = {0, 64, 8}, lens[] = {16, 256, 4}, cnts[] = {1, 1000, 2},
             strides[] = {0, 512, UINT64_MAX};
    llmdd__rw_req m = {.cache_id = 5,
                       .first = 0,
                       .count = 2,
                       .nruns = 3,
                       .offs = offs,
                       .lens = lens,
                       .cnts = cnts,
                       .strides = strides};
    llmdd__rw_req out;
    uint8_t buf[BUF];

    (void)state;
    size_t n = llmdd__wire_rw_encode(&m, buf, sizeof(buf));
    assert_int_equal(n, 20 + 16 + 32 + 32);
    assert_int_equal(rw_decode(buf, n, &out), 0);
    assert_int_equal(out.nruns, 3);
    assert_memory_equal(out.offs, offs, sizeof(offs));
    assert_memory_equal(out.lens, lens, sizeof(lens));
    assert_memory_equal(out.cnts, cnts, sizeof(cnts));
    assert_true(out.strides[1] == 512 && out.strides[2] == UINT64_MAX);
    assert_true(out.total == 2 * (16 + 256000 + 8));
    assert_strict(buf, n, dec_rw, sizeof(out));

    /* A strided run of fewer than two elements is not canonical. */
    for (uint64_t c = 0; c < 2; c++) {
        put64(buf + 20 + 16 + 16, c);
        assert_int_equal(rw_decode(buf, n, &out), -1);
    }
    /* count x len past 64 bits, and a total past INT64_MAX. */
    uint64_t one_off[] = {0}, big_len[] = {1ull << 40},
             big_cnt[] = {1ull << 24}, st[] = {0};
    m = (llmdd__rw_req){.cache_id = 1,
                        .count = 1,
                        .nruns = 1,
                        .offs = one_off,
                        .lens = big_len,
                        .cnts = big_cnt,
                        .strides = st};
    n = llmdd__wire_rw_encode(&m, buf, sizeof(buf));
    assert_int_equal(rw_decode(buf, n, &out), -1);
    big_cnt[0] = 1ull << 22; /* 2^62: fits; twice it does not */
    n = llmdd__wire_rw_encode(&m, buf, sizeof(buf));
    assert_int_equal(rw_decode(buf, n, &out), 0);
    m.count = 2;
    n = llmdd__wire_rw_encode(&m, buf, sizeof(buf));
    assert_int_equal(rw_decode(buf, n, &out), -1);
    /* The flag without the count and stride that must follow. */
    m.count = 1;
    n = llmdd__wire_rw_encode(&m, buf, sizeof(buf));
    assert_int_equal(rw_decode(buf, n - 8, &out), -1);
}

static void
test_rw_max_runs(void **state)
{
    /* The cap itself, with every byte present, and one above it. */
    size_t max = LLMDD_WIRE_MAX_RUNS;
    size_t n = 20 + 16 * (max + 1);
    uint8_t *buf = malloc(n);
    llmdd__rw_req out;

    (void)state;
    assert_non_null(buf);
    assert_true(20 + 16 * max <= LLMDD_WIRE_MAX_PAYLOAD);
    for (size_t i = 0; i <= max; i++) {
        put64(buf + 20 + 16 * i, i * 8);
        put64(buf + 28 + 16 * i, 8);
    }
    put64(buf, 9);
    put32(buf + 8, 0);
    put32(buf + 12, 1);
    put32(buf + 16, (uint32_t)max);
    assert_int_equal(rw_decode(buf, 20 + 16 * max, &out), 0);
    assert_int_equal(out.nruns, max);
    assert_true(out.total == 8 * max);
    put32(buf + 16, (uint32_t)max + 1);
    assert_int_equal(rw_decode(buf, n, &out), -1);
    free(buf);
}

static void
test_key_messages(void **state)
{
    llmdd__key_query q = {.seq = 7, .key_len = 3}, q2;
    llmdd__key_reply r = {.seq = 9, .status = LLM_SUCCESS, .cache_id = -2,
                          .batch_index = 5},
                     r2;
    uint8_t buf[256];

    (void)state;
    memcpy(q.key, "abc", 3);
    size_t n = llmdd__wire_key_query_encode(&q, buf, sizeof(buf));
    assert_int_equal(n, 8 + 4 + 3);
    assert_int_equal(llmdd__wire_key_query_decode(buf, n, &q2), 0);
    assert_int_equal(q2.seq, 7);
    assert_int_equal(q2.key_len, 3);
    assert_memory_equal(q2.key, "abc", 3);
    /* Every truncation and one byte more are rejected. */
    for (size_t k = 0; k < n; k++)
        assert_int_equal(llmdd__wire_key_query_decode(buf, k, &q2), -1);
    assert_int_equal(llmdd__wire_key_query_decode(buf, n + 1, &q2), -1);
    /* A length of 0 or past the bound is rejected, whatever follows. */
    buf[8] = 0;
    assert_int_equal(llmdd__wire_key_query_decode(buf, n, &q2), -1);
    buf[8] = LLMDD_WIRE_KEY_MAX + 1;
    memset(buf + 12, 'x', LLMDD_WIRE_KEY_MAX + 1);
    assert_int_equal(llmdd__wire_key_query_decode(buf,
                                                  12 + LLMDD_WIRE_KEY_MAX + 1,
                                                  &q2),
                     -1);
    q.key_len = 0;
    assert_int_equal(llmdd__wire_key_query_encode(&q, buf, sizeof(buf)), 0);
    q.key_len = LLMDD_WIRE_KEY_MAX + 1;
    assert_int_equal(llmdd__wire_key_query_encode(&q, buf, sizeof(buf)), 0);

    n = llmdd__wire_key_reply_encode(&r, buf, sizeof(buf));
    assert_int_equal(n, 24);
    assert_int_equal(llmdd__wire_key_reply_decode(buf, n, &r2), 0);
    assert_int_equal(r2.seq, 9);
    assert_int_equal(r2.cache_id, -2);
    assert_int_equal(r2.batch_index, 5);
    for (size_t k = 0; k < n; k++)
        assert_int_equal(llmdd__wire_key_reply_decode(buf, k, &r2), -1);
    assert_int_equal(llmdd__wire_key_reply_encode(&r, buf, 23), 0);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codec),
        cmocka_unit_test(test_frame),
        cmocka_unit_test(test_hello_ctrl),
        cmocka_unit_test(test_hello_ctrl_bad),
        cmocka_unit_test(test_hello_data),
        cmocka_unit_test(test_hello_reply),
        cmocka_unit_test(test_confirm_result),
        cmocka_unit_test(test_scalars),
        cmocka_unit_test(test_desc),
        cmocka_unit_test(test_rw_roundtrip),
        cmocka_unit_test(test_rw_limits),
        cmocka_unit_test(test_rw_strided),
        cmocka_unit_test(test_rw_max_runs),
        cmocka_unit_test(test_key_messages),
    };
    return cmocka_run_group_tests_name("wire", tests, rw_setup, rw_teardown);
}
