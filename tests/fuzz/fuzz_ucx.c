/*
 * Fuzz target: the ucx transport's exchange decoders (transport/ucx/
 * ucx_wire.c), which read a peer's HELLO, QUERY/REVOKE, REVOKE_ACK (also
 * the DATA and ACK headers), QUERY_REPLY (regions, remote keys, tensor
 * addresses) and active-message GET/PUT and PING headers. The first byte picks
 * the decoder. Checks: whatever decodes re-encodes to the same bytes, every
 * tensor of a reply lies inside its region, and a rejected reply leaves
 * nothing allocated (LeakSanitizer).
 */
#include <string.h>

#include "core/layout.h"
#include "fuzz/fuzz.h"
#include "transport/ucx/ucx_wire.h"

static uint8_t out[1 << 20];

static void
same(const uint8_t *in, size_t len, size_t n)
{
    FUZZ_CHECK(n == len);
    FUZZ_CHECK(memcmp(in, out, len) == 0);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size - 1 > sizeof(out))
        return 0;
    const uint8_t *p = data + 1;
    size_t len = size - 1;

    switch (data[0] % 5) {
    case 0: {
        llmdd__ucx_hello h;
        uint32_t st;
        if (llmdd__ucx_hello_decode(p, len, &st, &h) != 0)
            return 0;
        if (st == LLM_SUCCESS)
            FUZZ_CHECK(h.addr_len >= 1 && h.addr_len <= LLMDD_UCX_ADDR_MAX &&
                       h.addr >= p && h.addr + h.addr_len <= p + len);
        same(p, len, llmdd__ucx_hello_encode(st, &h, out, sizeof(out)));
        break;
    }
    case 1: {
        uint64_t seq;
        int64_t id;
        if (llmdd__ucx_req_decode(p, len, &seq, &id) != 0)
            return 0;
        same(p, len, llmdd__ucx_req_encode(seq, id, out, sizeof(out)));
        break;
    }
    case 2: {
        uint64_t seq;
        uint32_t st;
        if (llmdd__ucx_ack_decode(p, len, &seq, &st) != 0)
            return 0;
        same(p, len, llmdd__ucx_ack_encode(seq, st, out, sizeof(out)));
        break;
    }
    case 3: {
        llmdd__ucx_amreq m;
        int64_t key; /* PING: the common single-integer codec */
        if (llmdd__wire_i64_decode(p, len, &key) == 0)
            same(p, len, llmdd__wire_i64_encode(key, out, sizeof(out)));
        if (llmdd__ucx_amreq_decode(p, len, &m) != 0)
            return 0;
        FUZZ_CHECK(m.len >= 1 && m.len <= LLMDD_UCX_AM_CHUNK &&
                   m.addr + m.len > m.addr);
        same(p, len, llmdd__ucx_amreq_encode(&m, out, sizeof(out)));
        break;
    }
    default: {
        llmdd__ucx_reply m;
        uint64_t tsize, stride;
        if (llmdd__ucx_reply_decode(p, len, &m) != 0)
            return 0;
        if (m.status == LLM_SUCCESS) {
            FUZZ_CHECK(llmdd__desc_check(&m.desc, &tsize, &stride) ==
                       LLM_SUCCESS);
            FUZZ_CHECK(m.nregions >= 1 && m.nregions <= m.desc.num_tensors);
            FUZZ_CHECK(m.batch_dim < m.desc.num_dims);
            for (uint32_t i = 0; i < m.nregions; i++)
                FUZZ_CHECK(m.regions[i].rkey >= p &&
                           m.regions[i].rkey + m.regions[i].rkey_len <=
                               p + len);
            for (uint32_t t = 0; t < m.desc.num_tensors; t++) {
                const llmdd__ucx_region *g = &m.regions[m.treg[t]];
                FUZZ_CHECK(m.treg[t] < m.nregions);
                FUZZ_CHECK(m.taddr[t] >= g->base &&
                           m.taddr[t] - g->base <= g->len &&
                           tsize <= g->len - (m.taddr[t] - g->base));
            }
            FUZZ_CHECK(llmdd__ucx_reply_size(&m) == len);
        }
        same(p, len, llmdd__ucx_reply_encode(&m, out, sizeof(out)));
        llmdd__ucx_reply_free(&m);
        break;
    }
    }
    return 0;
}
