/*
 * Fuzz target: every message decoder of base/wire.c, and the byte codec's
 * name reader (base/codec.h) on its own. The first input byte
 * picks the decoder, the rest is the payload. Besides memory safety it checks
 * the decoders' contract: whatever decodes re-encodes to the very same bytes
 * (the encoding is canonical), and a failed decode writes no output.
 */
#include <stdlib.h>
#include <string.h>

#include "core/layout.h"
#include "core/slices.h"
#include "base/codec.h"
#include "base/wire.h"
#include "fuzz/fuzz.h"

static uint64_t offs[LLMDD_WIRE_MAX_RUNS], lens[LLMDD_WIRE_MAX_RUNS],
    cnts[LLMDD_WIRE_MAX_RUNS], strides[LLMDD_WIRE_MAX_RUNS];
static uint8_t out[LLMDD_WIRE_MAX_PAYLOAD];

/* Re-encoding a decoded message must give back the input exactly. */
static void
same(const uint8_t *in, size_t len, size_t n)
{
    FUZZ_CHECK(n == len);
    FUZZ_CHECK(memcmp(in, out, len) == 0);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const uint8_t *p = data + 1;
    size_t len = size - 1;

    switch (data[0] % 15) {
    case 0: {
        llmdd__frame f = {.type = 0xdead, .len = 0xbeef};
        if (len < LLMDD_WIRE_HDR_LEN)
            return 0;
        if (llmdd__wire_frame_decode(p, &f) != 0) {
            FUZZ_CHECK(f.type == 0xdead && f.len == 0xbeef);
            return 0;
        }
        FUZZ_CHECK(f.len <= LLMDD_WIRE_MAX_PAYLOAD);
        FUZZ_CHECK(f.type > 0 && f.type < WMSG_TYPE_MAX);
        llmdd__wire_frame_encode(out, f.type, f.len);
        same(p, LLMDD_WIRE_HDR_LEN, LLMDD_WIRE_HDR_LEN);
        break;
    }
    case 1: {
        llmdd__hello h, z;
        memset(&h, 0x5a, sizeof(h));
        z = h;
        if (llmdd__wire_hello_decode(p, len, &h) != 0) {
            FUZZ_CHECK(memcmp(&h, &z, sizeof(h)) == 0);
            return 0;
        }
        FUZZ_CHECK(h.kind == CONN_CTRL || h.kind == CONN_DATA);
        FUZZ_CHECK(strlen(h.transport) <= LLMDD_WIRE_NAME_MAX);
        same(p, len, llmdd__wire_hello_encode(&h, out, sizeof(out)));
        break;
    }
    case 2: {
        llmdd__hello_reply r;
        if (llmdd__wire_hello_reply_decode(p, len, &r) != 0)
            return 0;
        FUZZ_CHECK(strlen(r.transport) <= LLMDD_WIRE_NAME_MAX);
        same(p, len, llmdd__wire_hello_reply_encode(&r, out, sizeof(out)));
        break;
    }
    case 3: {
        llmdd__confirm c;
        if (llmdd__wire_confirm_decode(p, len, &c) != 0)
            return 0;
        same(p, len, llmdd__wire_confirm_encode(&c, out, sizeof(out)));
        break;
    }
    case 4: {
        llmdd__result r;
        if (llmdd__wire_result_decode(p, len, &r) != 0)
            return 0;
        same(p, len, llmdd__wire_result_encode(&r, out, sizeof(out)));
        break;
    }
    case 5: {
        uint32_t v = 7;
        if (llmdd__wire_u32_decode(p, len, &v) != 0) {
            FUZZ_CHECK(v == 7);
            return 0;
        }
        same(p, len, llmdd__wire_u32_encode(v, out, sizeof(out)));
        break;
    }
    case 6: {
        int64_t v = 7;
        if (llmdd__wire_i64_decode(p, len, &v) != 0) {
            FUZZ_CHECK(v == 7);
            return 0;
        }
        same(p, len, llmdd__wire_i64_encode(v, out, sizeof(out)));
        break;
    }
    case 7: {
        llmdd_cache_desc d;
        uint32_t st = 7, bd = 99;
        if (llmdd__wire_desc_decode(p, len, &st, &d, &bd) != 0) {
            FUZZ_CHECK(st == 7 && bd == 99);
            return 0;
        }
        if (st == LLM_SUCCESS)
            FUZZ_CHECK(d.num_dims >= 1 && d.num_dims <= LLMDD_MAX_DIMS &&
                       bd < d.num_dims);
        same(p, len, llmdd__wire_desc_encode(st, &d, bd, out, sizeof(out)));
        /* The core's check must cope with whatever a peer describes. */
        uint64_t tsize, stride;
        llmdd__slot_geom g;
        if (st == LLM_SUCCESS &&
            llmdd__desc_check(&d, &tsize, &stride) == LLM_SUCCESS) {
            FUZZ_CHECK(stride > 0 && stride <= tsize &&
                       tsize % stride == 0 && tsize <= INT64_MAX);
            /* And its slots, along whichever dim the peer named. */
            FUZZ_CHECK(llmdd__slot_geom_make(&d, bd, &g) == LLM_SUCCESS &&
                       llmdd__slot_bytes(&g) * g.slots == tsize &&
                       g.pitch * g.rows == tsize);
        }
        break;
    }
    case 8: {
        uint32_t st = 7;
        uint64_t total = 7;
        if (llmdd__wire_read_reply_decode(p, len, &st, &total) != 0) {
            FUZZ_CHECK(st == 7 && total == 7);
            return 0;
        }
        same(p, len,
             llmdd__wire_read_reply_encode(st, total, out, sizeof(out)));
        break;
    }
    case 9: {
        llmdd__rw_req r = {
            .offs = offs, .lens = lens, .cnts = cnts, .strides = strides};
        if (llmdd__wire_rw_decode(p, len, &r) != 0)
            return 0;
        FUZZ_CHECK(r.count > 0 && r.nruns > 0 &&
                   r.nruns <= LLMDD_WIRE_MAX_RUNS);
        FUZZ_CHECK(r.total <= INT64_MAX);
        uint64_t sum = 0;
        for (uint32_t i = 0; i < r.nruns; i++) {
            FUZZ_CHECK(lens[i] > 0 && lens[i] < LLMDD_WIRE_RUN_STRIDED &&
                       cnts[i] > 0);
            sum += lens[i] * cnts[i];
        }
        FUZZ_CHECK(sum * r.count == r.total);
        same(p, len, llmdd__wire_rw_encode(&r, out, sizeof(out)));
        break;
    }
    case 10: {
        llmdd__key_query q;
        if (llmdd__wire_key_query_decode(p, len, &q) != 0)
            return 0;
        FUZZ_CHECK(q.key_len >= 1 && q.key_len <= LLMDD_WIRE_KEY_MAX);
        same(p, len, llmdd__wire_key_query_encode(&q, out, sizeof(out)));
        break;
    }
    case 11: {
        llmdd__key_reply r;
        if (llmdd__wire_key_reply_decode(p, len, &r) != 0)
            return 0;
        same(p, len, llmdd__wire_key_reply_encode(&r, out, sizeof(out)));
        break;
    }
    case 13: {
        llmdd__layout_query q;
        if (llmdd__wire_layout_query_decode(p, len, &q) != 0)
            return 0;
        same(p, len, llmdd__wire_layout_query_encode(&q, out, sizeof(out)));
        break;
    }
    case 14: {
        llmdd__layout_reply r, z;
        memset(&r, 0x5a, sizeof(r));
        z = r;
        if (llmdd__wire_layout_reply_decode(p, len, &r) != 0) {
            FUZZ_CHECK(memcmp(&r, &z, sizeof(r)) == 0);
            return 0;
        }
        FUZZ_CHECK(len == LLMDD_WIRE_LAYOUT_REPLY_LEN);
        same(p, len, llmdd__wire_layout_reply_encode(&r, out, sizeof(out)));
        /* A peer's layout is a claim: the check must refuse, not wrap, an
         * extent product past 64 bits, and a layout it accepts plans a
         * slice over its own first block with every offset inside it. */
        const llmdd_kv_layout *l = &r.layout;
        uint64_t blk = (uint64_t)l->block_size * l->num_heads;
        if (r.status != LLM_SUCCESS || blk == 0 ||
            __builtin_mul_overflow(blk, (uint64_t)l->head_bytes, &blk) ||
            __builtin_mul_overflow(blk, (uint64_t)l->num_parts, &blk) ||
            llmdd__layout_check(l, blk, NULL) != LLM_SUCCESS ||
            blk > (1u << 16))
            break;
        uint64_t zero = 0;
        llmdd_block_table t = {&zero, 1, 0};
        llmdd__plan2 pl = {0};
        if (llmdd__plan_slice(&pl, l, &t, l, &t, 0, l->block_size,
                              l->head_first,
                              l->head_first + l->num_heads) == 0) {
            FUZZ_CHECK(llmdd__plan2_bytes(&pl) == blk);
            for (size_t i = 0; i < pl.n; i++)
                FUZZ_CHECK(pl.runs[i].src_off +
                               (pl.runs[i].count - 1) * pl.runs[i].src_stride +
                               pl.runs[i].len <=
                           blk);
        }
        llmdd__plan2_free(&pl);
        break;
    }
    case 12: {
        char name[LLMDD_WIRE_NAME_MAX + 1];
        llmdd__rbuf r = LLMDD__RBUF(p, len);
        llmdd__get_name(&r, name, LLMDD_WIRE_NAME_MAX);
        if (llmdd__rdone(&r) != 0)
            return 0;
        llmdd__wbuf w = LLMDD__WBUF(out, sizeof(out));
        llmdd__put_name(&w, name, LLMDD_WIRE_NAME_MAX);
        same(p, len, llmdd__wdone(&w));
        break;
    }
    }
    return 0;
}
