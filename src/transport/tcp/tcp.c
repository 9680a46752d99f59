/*
 * The tcp transport: the socket data plane (transport/stream) and nothing
 * else. It reaches every peer. Each link gets TCP_FWD_CONNS connections for
 * the client's requests and TCP_REV_CONNS for the server's.
 */
#include "core/internal.h"
#include "transport/stream/stream.h"

#define TCP_FWD_CONNS 2
#define TCP_REV_CONNS 2

static llmdd_status
tcp_link_init(llmdd__link *link, bool client)
{
    llmdd__stream *s = llmdd__stream_new(link, TCP_FWD_CONNS, TCP_REV_CONNS);

    if (s == NULL)
        return LLM_OUT_OF_MEMORY;
    link->tp = s;
    return client ? llmdd__stream_connect(s) : LLM_SUCCESS;
}

static void
tcp_accept_conn(llmdd__link *link, int fd, uint32_t flags)
{
    llmdd__stream_accept(link->tp, fd, flags);
}

static void
tcp_link_shutdown(llmdd__link *link)
{
    llmdd__stream_shutdown(link->tp);
}

static void
tcp_link_fini(llmdd__link *link)
{
    llmdd__stream_free(link->tp);
    link->tp = NULL;
}

static void
tcp_reopen(llmdd__link *link)
{
    llmdd__stream_reopen(link->tp);
}

static void
tcp_cache_removed(llmdd__link *link, const llmdd__cache *cache)
{
    llmdd__stream_cache_removed(link->tp, cache);
}

static llmdd_status
tcp_query(llmdd__link *link, int64_t id, int64_t deadline_ms,
          llmdd_cache_desc *desc, void **priv)
{
    *priv = NULL;
    return llmdd__stream_query(link->tp, id, deadline_ms, desc);
}

static llmdd_status
tcp_xfer(llmdd__link *link, const llmdd__xfer *x)
{
    return llmdd__stream_xfer(link->tp, x);
}

static bool
tcp_reaches(const llmdd__link *link)
{
    (void)link;
    return true;
}

const llmdd_transport_ops llmdd__tcp_ops = {
    .name = "tcp",
    .reaches = tcp_reaches,
    .link_init = tcp_link_init,
    .link_shutdown = tcp_link_shutdown,
    .link_fini = tcp_link_fini,
    .accept_conn = tcp_accept_conn,
    .query = tcp_query,
    .remote_free = NULL,
    .xfer = tcp_xfer,
    .cache_removed = tcp_cache_removed,
    .reopen = tcp_reopen,
};
