/*
 * Metrics: the hooks the transfer path, the control plane and the serving
 * side call, and the Prometheus text exposition (format 0.0.4) of one
 * instance. The core never names a transport here either: a transport is
 * its registry index, labelled with ops->name.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"

#define RELAXED memory_order_relaxed

static const char *const op_names[] = {
#define OP_NAME(id, name) name,
    LLMDD__METRICS_OPS(OP_NAME)
#undef OP_NAME
};

static const uint64_t bucket_ns[] = {
#define BUCKET_NS(ns, le) ns,
    LLMDD__METRICS_BUCKETS(BUCKET_NS)
#undef BUCKET_NS
};

static const char *const bucket_le[] = {
#define BUCKET_LE(ns, le) le,
    LLMDD__METRICS_BUCKETS(BUCKET_LE)
#undef BUCKET_LE
        "+Inf",
};

static const llmdd_status status_values[] = {
#define STATUS_VALUE(name, value) value,
    LLMDD_STATUS_MAP(STATUS_VALUE)
#undef STATUS_VALUE
};

static const char *const side_names[LLMDD__METRICS_NSIDE] = {"caller",
                                                             "served"};

/* The slot of a status: its place in LLMDD_STATUS_MAP, or the last one. */
static size_t
status_slot(llmdd_status st)
{
    enum {
#define STATUS_ENUM(name, value) SLOT_##name,
        LLMDD_STATUS_MAP(STATUS_ENUM)
#undef STATUS_ENUM
            SLOT_UNKNOWN
    };
    switch (st) {
#define STATUS_CASE(name, value)                                               \
    case value:                                                                \
        return SLOT_##name;
        LLMDD_STATUS_MAP(STATUS_CASE)
#undef STATUS_CASE
    default:
        return SLOT_UNKNOWN;
    }
}

/* The registry holds at most a handful: a scan is cheaper than a lookup. */
static size_t
tp_slot(const llmdd_transport_ops *ops)
{
    size_t n = llmdd__transport_count();

    if (ops == NULL)
        return LLMDD__METRICS_TP_NONE;
    for (size_t i = 0; i < n && i < LLMDD__METRICS_TP_LOCAL; i++)
        if (llmdd__transport_at(i) == ops)
            return i;
    return LLMDD__METRICS_TP_NONE;
}

static const char *
tp_name(size_t slot)
{
    if (slot == LLMDD__METRICS_TP_LOCAL)
        return "local";
    if (slot < llmdd__transport_count() && slot < LLMDD__METRICS_TP_LOCAL)
        return llmdd__transport_at(slot)->name;
    return "none";
}

static uint64_t
now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void
add(llmdd__counter *c, uint64_t v)
{
    atomic_fetch_add_explicit(c, v, RELAXED);
}

uint64_t
llmdd__metrics_begin(llmdd *dd)
{
    atomic_fetch_add_explicit(&dd->metrics.in_flight, 1, RELAXED);
    return now_ns();
}

void
llmdd__metrics_xfer(llmdd *dd, enum llmdd__metrics_op op,
                    const llmdd_transport_ops *ops, llmdd_status st,
                    uint64_t bytes, uint64_t t0_ns)
{
    llmdd__metrics *m = &dd->metrics;
    size_t tp = op == LLMDD__OP_COPY ? LLMDD__METRICS_TP_LOCAL : tp_slot(ops);
    size_t s = status_slot(st);

    add(&m->xfers[0][op][tp][s], 1);
    add(&m->bytes[0][op][tp][s], bytes);
    if (st == LLM_SUCCESS) {
        uint64_t ns = now_ns() - t0_ns;
        size_t b = 0;
        while (b < LLMDD__METRICS_NBUCKETS - 1 && ns > bucket_ns[b])
            b++;
        add(&m->hist[op][tp][b], 1);
        add(&m->hist_ns[op][tp], ns);
    }
    atomic_fetch_sub_explicit(&m->in_flight, 1, RELAXED);
}

void
llmdd__metrics_served(llmdd *dd, const llmdd_transport_ops *ops, bool write,
                      llmdd_status st, uint64_t bytes)
{
    enum llmdd__metrics_op op = write ? LLMDD__OP_PUSH : LLMDD__OP_PULL;
    size_t tp = tp_slot(ops), s = status_slot(st);

    add(&dd->metrics.xfers[1][op][tp][s], 1);
    add(&dd->metrics.bytes[1][op][tp][s], bytes);
}

void
llmdd__metrics_link_attempt(llmdd *dd, llmdd_status st)
{
    add(&dd->metrics.link_attempts[status_slot(st)], 1);
}

void
llmdd__metrics_link_event(llmdd *dd, bool up)
{
    add(up ? &dd->metrics.links_up : &dd->metrics.links_down, 1);
}

/* ---- The text exposition. ---- */

/* snprintf's convention over many appends: len counts what the whole text
 * needs; at most cap bytes are written, always NUL-terminated. */
typedef struct {
    char *buf;
    size_t cap;
    size_t len;
} out_buf;

__attribute__((format(printf, 2, 3))) static void
out(out_buf *o, const char *fmt, ...)
{
    va_list ap;
    size_t room = o->len < o->cap ? o->cap - o->len : 0;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(room > 0 ? o->buf + o->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        o->len += (size_t)n;
}

static void
family(out_buf *o, const char *name, const char *type, const char *help)
{
    out(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static uint64_t
get(llmdd__counter *c)
{
    return atomic_load_explicit(c, RELAXED);
}

static const char *
status_name(size_t slot)
{
    if (slot >= sizeof(status_values) / sizeof(status_values[0]))
        return "LLM_UNKNOWN_STATUS";
    return llmdd_status_str(status_values[slot]);
}

/* One by-status counter family; series that never moved are left out. */
static void
xfer_family(out_buf *o, llmdd__metrics *m, bool bytes)
{
    const char *name =
        bytes ? "llmdd_transfer_bytes_total" : "llmdd_transfers_total";

    family(o, name, "counter",
           bytes ? "Bytes the transfers cover, by side, operation, transport "
                   "and final status."
                 : "Transfers by side (caller: this instance called it; "
                   "served: a peer's request this instance answered), "
                   "operation, transport and final status.");
    for (size_t side = 0; side < LLMDD__METRICS_NSIDE; side++)
        for (size_t op = 0; op < LLMDD__OP_COUNT; op++)
            for (size_t tp = 0; tp < LLMDD__METRICS_NTP; tp++)
                for (size_t s = 0; s < LLMDD__METRICS_NSTATUS; s++) {
                    uint64_t n = get(&m->xfers[side][op][tp][s]);
                    if (n == 0)
                        continue;
                    out(o,
                        "%s{side=\"%s\",op=\"%s\",transport=\"%s\","
                        "status=\"%s\"} %" PRIu64 "\n",
                        name, side_names[side], op_names[op], tp_name(tp),
                        status_name(s),
                        bytes ? get(&m->bytes[side][op][tp][s]) : n);
                }
}

static void
hist_family(out_buf *o, llmdd__metrics *m)
{
    const char *name = "llmdd_transfer_duration_seconds";

    family(o, name, "histogram",
           "Latency of the transfers this instance called that succeeded, "
           "by operation and transport.");
    for (size_t op = 0; op < LLMDD__OP_COUNT; op++)
        for (size_t tp = 0; tp < LLMDD__METRICS_NTP; tp++) {
            uint64_t b[LLMDD__METRICS_NBUCKETS], cum = 0;
            /* One read of each bucket: _count is the +Inf bucket's value,
             * whatever lands meanwhile. */
            for (size_t i = 0; i < LLMDD__METRICS_NBUCKETS; i++) {
                b[i] = get(&m->hist[op][tp][i]);
                cum += b[i];
            }
            if (cum == 0)
                continue;
            cum = 0;
            for (size_t i = 0; i < LLMDD__METRICS_NBUCKETS; i++) {
                cum += b[i];
                out(o,
                    "%s_bucket{op=\"%s\",transport=\"%s\",le=\"%s\"} "
                    "%" PRIu64 "\n",
                    name, op_names[op], tp_name(tp), bucket_le[i], cum);
            }
            uint64_t ns = get(&m->hist_ns[op][tp]);
            out(o,
                "%s_sum{op=\"%s\",transport=\"%s\"} %" PRIu64 ".%09" PRIu64
                "\n",
                name, op_names[op], tp_name(tp), ns / UINT64_C(1000000000),
                ns % UINT64_C(1000000000));
            out(o, "%s_count{op=\"%s\",transport=\"%s\"} %" PRIu64 "\n", name,
                op_names[op], tp_name(tp), cum);
        }
}

/* What the registries hold now, read under dd->lock. */
typedef struct {
    uint64_t links_out, links_in;
    uint64_t caches[2], cache_bytes[2]; /* allocated, registered */
    uint64_t cluster_id;
    llmdd_role role;
} gauges;

static void
gauges_read(llmdd *dd, gauges *g)
{
    memset(g, 0, sizeof(*g));
    pthread_mutex_lock(&dd->lock);
    g->cluster_id = dd->cluster_id;
    g->role = dd->role;
    for (const llmdd__link *l = dd->links; l != NULL; l = l->next)
        *(l->client ? &g->links_out : &g->links_in) += 1;
    for (size_t i = 0; i < dd->ncaches; i++) {
        const llmdd__cache *c = dd->caches[i];
        size_t k = c->allocated ? 0 : 1;
        g->caches[k]++;
        g->cache_bytes[k] +=
            c->allocated ? c->mem.len : c->tensor_size * c->desc.num_tensors;
    }
    pthread_mutex_unlock(&dd->lock);
}

static const char *
role_name(llmdd_role r)
{
    return r == LLMDD_ROLE_PROMPT    ? "prompt"
           : r == LLMDD_ROLE_DECODER ? "decoder"
                                     : "mix";
}

size_t
llmdd_metrics_text(llmdd *dd, char *buf, size_t cap)
{
    out_buf o = {.buf = buf, .cap = cap};
    llmdd__metrics *m;
    gauges g;

    if (buf != NULL && cap > 0)
        buf[0] = '\0';
    else
        o.cap = 0; /* a NULL buffer only measures */
    if (dd == NULL)
        return 0;
    m = &dd->metrics;
    gauges_read(dd, &g);

    family(&o, "llmdd_instance_info", "gauge",
           "Always 1; the labels name the instance.");
    out(&o,
        "llmdd_instance_info{cluster_id=\"%" PRIu64 "\",role=\"%s\","
        "version=\"%s\"} 1\n",
        g.cluster_id, role_name(g.role), llmdd_version());
    xfer_family(&o, m, false);
    xfer_family(&o, m, true);
    hist_family(&o, m);
    family(&o, "llmdd_transfers_in_flight", "gauge",
           "Transfer and copy calls running now.");
    int64_t fl = atomic_load_explicit(&m->in_flight, RELAXED);
    out(&o, "llmdd_transfers_in_flight %" PRId64 "\n", fl < 0 ? 0 : fl);

    family(&o, "llmdd_links", "gauge",
           "Live links (out: this instance linked; in: the peer linked).");
    out(&o, "llmdd_links{direction=\"out\"} %" PRIu64 "\n", g.links_out);
    out(&o, "llmdd_links{direction=\"in\"} %" PRIu64 "\n", g.links_in);
    family(&o, "llmdd_link_attempts_total", "counter",
           "llmdd_link_clusters attempts of this instance, by final status.");
    for (size_t s = 0; s < LLMDD__METRICS_NSTATUS; s++) {
        uint64_t n = get(&m->link_attempts[s]);
        if (n != 0)
            out(&o, "llmdd_link_attempts_total{status=\"%s\"} %" PRIu64 "\n",
                status_name(s), n);
    }
    family(&o, "llmdd_links_established_total", "counter",
           "Links that became usable, either direction.");
    out(&o, "llmdd_links_established_total %" PRIu64 "\n", get(&m->links_up));
    family(&o, "llmdd_links_dropped_total", "counter",
           "Links that went away: unlinked, peer gone, finalize.");
    out(&o, "llmdd_links_dropped_total %" PRIu64 "\n", get(&m->links_down));

    static const char *const kinds[2] = {"allocated", "registered"};
    family(&o, "llmdd_caches", "gauge", "Caches in the registry, by kind.");
    for (size_t k = 0; k < 2; k++)
        out(&o, "llmdd_caches{kind=\"%s\"} %" PRIu64 "\n", kinds[k],
            g.caches[k]);
    family(&o, "llmdd_cache_bytes", "gauge",
           "Bytes of the caches in the registry, by kind (allocated: "
           "reserved memory; registered: the tensors' bytes).");
    for (size_t k = 0; k < 2; k++)
        out(&o, "llmdd_cache_bytes{kind=\"%s\"} %" PRIu64 "\n", kinds[k],
            g.cache_bytes[k]);

    family(&o, "llmdd_notifications_sent_total", "counter",
           "Notifications sent to peers.");
    out(&o, "llmdd_notifications_sent_total %" PRIu64 "\n",
        get(&m->notify_sent));
    family(&o, "llmdd_notifications_received_total", "counter",
           "Notifications received from peers.");
    out(&o, "llmdd_notifications_received_total %" PRIu64 "\n",
        get(&m->notify_recv));
    return o.len;
}
