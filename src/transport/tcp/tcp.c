/*
 * The tcp transport: the socket data plane (transport/stream) and nothing
 * else. It reaches every peer. The client opens one requester connection
 * per lane plus one each way (at least TCP_CONNS), so that a small request
 * still finds a connection beside a striped transfer, up to what the
 * server said it serves (its llm.TcpLanes plus one): the side that accepts
 * bounds what it holds.
 */
#include "core/internal.h"
#include "transport/stream/stream.h"

#define TCP_CONNS 2
/*
 * llm.TcpLanes=auto: one lane to a loopback address, where no per-flow cap
 * exists and a second flow only competes for the same cores; four to any
 * other, which is what reached 99.5% of a 23 GB/s NIC (one flow: 46%) and
 * several times a cloud's per-flow cap (BENCHMARKS.md), at three more
 * connections a link (LLMDD__TCP_LANES_AUTO, core/options.h).
 */

/* The lanes our transfers to this peer stripe over (llm.TcpLanes). */
static int
tcp_lanes(const llmdd__link *link)
{
    int lanes = link->opts.tcp_lanes;
    if (lanes > 0)
        return lanes;
    return llmdd__sockaddr_loopback(&link->peer.addr) ? 1
                                                      : LLMDD__TCP_LANES_AUTO;
}

/*
 * The server bounds what it serves (link->terms.conns_max, from its own
 * llm.TcpLanes: what llm.MaxLinks=auto budgets); the client opens no more
 * than that each way, and stripes over one fewer.
 */
static llmdd_status
tcp_link_init(llmdd__link *link, bool client)
{
    int max = (int)link->terms.conns_max;
    int lanes = tcp_lanes(link);
    if (lanes > max - 1)
        lanes = max - 1;
    int conns = lanes + 1 > TCP_CONNS ? lanes + 1 : TCP_CONNS;
    if (!client || conns > max)
        conns = max;
    llmdd__stream *s = llmdd__stream_new(link, conns, conns, conns + 1);

    if (s == NULL)
        return LLM_OUT_OF_MEMORY;
    llmdd__stream_set_lanes(s, lanes);
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

static bool
tcp_quiesce(llmdd__link *link, int64_t deadline_ms)
{
    return llmdd__stream_quiesce(link->tp, deadline_ms);
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
          llmdd_cache_desc *desc, uint32_t *batch_dim, void **priv)
{
    *priv = NULL;
    return llmdd__stream_query(link->tp, id, deadline_ms, desc, batch_dim);
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
    .strided = true,
    .reaches = tcp_reaches,
    .link_init = tcp_link_init,
    .link_shutdown = tcp_link_shutdown,
    .quiesce = tcp_quiesce,
    .link_fini = tcp_link_fini,
    .accept_conn = tcp_accept_conn,
    .query = tcp_query,
    .remote_free = NULL,
    .xfer = tcp_xfer,
    .cache_removed = tcp_cache_removed,
    .reopen = tcp_reopen,
};
