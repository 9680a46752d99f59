/*
 * The ucx transport's exchange messages (docs/rdma.md). They travel in the
 * common frame (base/wire.h: magic, version, type, length) with the types
 * WMSG_UCX_*, over the link's data connections:
 *
 *   UCX_HELLO        version, the sender's UCP version, flags, the key its
 *                    serve worker wants in requests, its worker address
 *   UCX_HELLO_REPLY  status, then the same fields
 *   UCX_QUERY        seq, cache id
 *   UCX_QUERY_REPLY  seq, status, then the desc, the mapped regions (base,
 *                    length, packed remote key) and each tensor's address and
 *                    region
 *   UCX_REVOKE       seq, cache id: destroy your remote keys of that cache
 *   UCX_REVOKE_ACK   seq, status
 *
 * Where RMA would be emulated (no RDMA device on one side), transfers are
 * UCP active messages instead (docs/rdma.md), whose headers are:
 *
 *   GET, PUT         key, tag, address, length (PUT carries the bytes)
 *   DATA, ACK        tag, status (the same encoding as REVOKE_ACK; DATA
 *                    carries the bytes of a GET that succeeded)
 *   PING             key: a new endpoint's round trip (both modes)
 *   PONG             nothing
 *
 * A request whose key is not the one the serving side sent in its HELLO
 * (over the link's authenticated data connection) is dropped: UCX does not
 * authenticate who connects to a worker.
 *
 * Every field is little-endian and encoded one by one. Decoders take
 * untrusted bytes, check every count against the bytes present and a hard
 * cap before allocating, and check that every tensor lies inside its region.
 * Pure functions over their arguments; thread-safe.
 */
#ifndef LLMDD_TRANSPORT_UCX_WIRE_H
#define LLMDD_TRANSPORT_UCX_WIRE_H

#include <llmdd/llmdd.h>

#include "base/wire.h"

/* 3: UCX_QUERY_REPLY's desc carries its batch dimension. */
#define LLMDD_UCX_WIRE_VERSION 3
#define LLMDD_UCX_ADDR_MAX 65536u /* a worker address */
#define LLMDD_UCX_RKEY_MAX 4096u  /* one packed remote key */
#define LLMDD_UCX_AM_CHUNK (256u << 10) /* the most one GET or PUT moves */
#define LLMDD_UCX_HELLO_RDMA 1u /* flags: the sender has an RDMA transport */

/* Frame types, in the range base/wire.h reserves for ucx. */
enum {
    WMSG_UCX_HELLO = WMSG_UCX_FIRST,
    WMSG_UCX_HELLO_REPLY,
    WMSG_UCX_QUERY,
    WMSG_UCX_QUERY_REPLY,
    WMSG_UCX_REVOKE,
    WMSG_UCX_REVOKE_ACK,
    WMSG_UCX_END /* not a type */
};
_Static_assert(WMSG_UCX_END - 1 <= WMSG_UCX_LAST,
               "ucx frame types outside their range");

/* Active message ids. */
enum {
    LLMDD_UCX_AM_GET = 1,
    LLMDD_UCX_AM_PUT,
    LLMDD_UCX_AM_DATA,
    LLMDD_UCX_AM_ACK,
    LLMDD_UCX_AM_PING,
    LLMDD_UCX_AM_PONG
};

typedef struct {
    uint32_t version;     /* LLMDD_UCX_WIRE_VERSION */
    uint32_t ucp_version; /* major << 16 | minor << 8 | release */
    uint32_t flags;       /* LLMDD_UCX_HELLO_* */
    uint64_t key;         /* requests to the sender's serve worker carry it */
    const uint8_t *addr;  /* points into the decoded buffer */
    uint32_t addr_len;    /* 1..LLMDD_UCX_ADDR_MAX */
} llmdd__ucx_hello;

typedef struct {
    uint64_t base;
    uint64_t len;
    const uint8_t *rkey; /* points into the decoded buffer */
    uint32_t rkey_len;   /* 1..LLMDD_UCX_RKEY_MAX */
} llmdd__ucx_region;

typedef struct {
    uint64_t seq;
    uint32_t status;
    /* The rest only when status is LLM_SUCCESS. */
    llmdd_cache_desc desc;
    uint32_t batch_dim; /* < desc.num_dims */
    uint32_t nregions;  /* 1..desc.num_tensors */
    llmdd__ucx_region *regions;
    uint64_t *taddr; /* desc.num_tensors entries */
    uint32_t *treg;  /* the region of each tensor */
} llmdd__ucx_reply;

/* Encoders return the payload length, or 0 when buf (cap bytes) is short. */
size_t llmdd__ucx_hello_encode(uint32_t status, const llmdd__ucx_hello *h,
                               uint8_t *buf, size_t cap);
/* On a non-success status *out is zeroed. */
int llmdd__ucx_hello_decode(const uint8_t *buf, size_t len, uint32_t *status,
                            llmdd__ucx_hello *out);

/* The header of an active-message GET or PUT. */
typedef struct {
    uint64_t key;  /* the serving side's, from its HELLO */
    uint64_t tag;  /* the requester's; comes back in DATA or ACK */
    uint64_t addr; /* in the serving side's memory */
    uint64_t len;  /* 1..LLMDD_UCX_AM_CHUNK, not wrapping past addr */
} llmdd__ucx_amreq;

#define LLMDD_UCX_AMREQ_SIZE 32
#define LLMDD_UCX_PING_SIZE 8
#define LLMDD_UCX_AMREP_SIZE 12 /* DATA and ACK: llmdd__ucx_ack_* */

size_t llmdd__ucx_amreq_encode(const llmdd__ucx_amreq *m, uint8_t *buf,
                               size_t cap);
int llmdd__ucx_amreq_decode(const uint8_t *buf, size_t len,
                            llmdd__ucx_amreq *out);

/* PING: the key alone, llmdd__wire_i64_encode's 8 bytes. */

/* QUERY and REVOKE. */
size_t llmdd__ucx_req_encode(uint64_t seq, int64_t id, uint8_t *buf,
                             size_t cap);
int llmdd__ucx_req_decode(const uint8_t *buf, size_t len, uint64_t *seq,
                          int64_t *id);

/* REVOKE_ACK, and the DATA and ACK headers. */
size_t llmdd__ucx_ack_encode(uint64_t seq, uint32_t status, uint8_t *buf,
                             size_t cap);
int llmdd__ucx_ack_decode(const uint8_t *buf, size_t len, uint64_t *seq,
                          uint32_t *status);

/* The seq every reply (QUERY_REPLY, REVOKE_ACK) starts with. */
int llmdd__ucx_seq_peek(const uint8_t *buf, size_t len, uint64_t *seq);

/* QUERY_REPLY. The size a successful reply needs, 0 on overflow. */
size_t llmdd__ucx_reply_size(const llmdd__ucx_reply *m);
size_t llmdd__ucx_reply_encode(const llmdd__ucx_reply *m, uint8_t *buf,
                               size_t cap);
/*
 * Decodes into *out, allocating its arrays (llmdd__ucx_reply_free); region
 * keys point into buf. Rejects a desc that fails llmdd__desc_check, empty or
 * oversized keys, empty or wrapping regions, a tensor outside its region and
 * trailing bytes. On failure nothing is left allocated.
 */
int llmdd__ucx_reply_decode(const uint8_t *buf, size_t len,
                            llmdd__ucx_reply *out);
void llmdd__ucx_reply_free(llmdd__ucx_reply *m);

#endif
