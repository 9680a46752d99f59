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
clock_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * Stamps. A 4 KiB shm pull takes about half a microsecond, and two reads of
 * the vDSO clock (kvm-clock: 25 to 60 ns each) would add far more than the
 * 5% the metrics may cost it. Where the TSC is invariant (x86-64, CPUID
 * 0x80000007 EDX bit 8), a stamp is the TSC instead, and its rate is
 * calibrated against CLOCK_MONOTONIC over the first 2^26 ticks (tens of
 * milliseconds) of the process, without ever waiting: until then stamps come
 * from the clock. A stamp's top bit says which it is, so a call that began
 * before calibration finished ends on the same clock.
 */
#define STAMP_TSC (1ull << 63)
#define CALIB_TICKS (1ull << 26)

#if defined(__x86_64__)
#include <cpuid.h>
#include <x86intrin.h>

static struct {
    pthread_once_t once;
    bool invariant;
    uint64_t tsc0, ns0;
    _Atomic uint64_t mult; /* ns per tick, 32.32 fixed point; 0: not yet */
} tsc = {.once = PTHREAD_ONCE_INIT};

static void
tsc_init(void)
{
    unsigned a, b, c, d;

    tsc.invariant =
        __get_cpuid(0x80000007u, &a, &b, &c, &d) && (d & (1u << 8)) != 0;
    tsc.ns0 = clock_ns();
    tsc.tsc0 = __rdtsc();
}

static uint64_t
stamp(void)
{
    uint64_t mult = atomic_load_explicit(&tsc.mult, RELAXED);

    if (mult != 0)
        return __rdtsc() | STAMP_TSC;
    pthread_once(&tsc.once, tsc_init);
    if (tsc.invariant) {
        uint64_t t = __rdtsc(), ns = clock_ns();
        if (t - tsc.tsc0 >= CALIB_TICKS && ns > tsc.ns0) {
            /* Threads that race here store the same rate, give or take. */
            unsigned __int128 m = (unsigned __int128)(ns - tsc.ns0) << 32;
            atomic_store_explicit(&tsc.mult, (uint64_t)(m / (t - tsc.tsc0)),
                                  RELAXED);
        }
        return ns;
    }
    return clock_ns();
}

/* Nanoseconds since stamp s. */
static uint64_t
since(uint64_t s)
{
    if ((s & STAMP_TSC) == 0)
        return clock_ns() - s;
    uint64_t t = __rdtsc(), t0 = s & ~STAMP_TSC;
    if (t < t0) /* another core's TSC, a hair behind */
        return 0;
    unsigned __int128 ns =
        (unsigned __int128)(t - t0) * atomic_load_explicit(&tsc.mult, RELAXED);
    return (uint64_t)(ns >> 32);
}
#else
static uint64_t
stamp(void)
{
    return clock_ns();
}

static uint64_t
since(uint64_t s)
{
    return clock_ns() - s;
}
#endif

static void
add(llmdd__counter *c, uint64_t v)
{
    atomic_fetch_add_explicit(c, v, RELAXED);
}

/* In flight: calls begun minus calls ended (every ended call is counted in
 * xfers[0] under some status), so each call pays for one counter, not two. */
uint64_t
llmdd__metrics_begin(llmdd *dd)
{
    add(&dd->metrics->begun, 1);
    return stamp();
}

void
llmdd__metrics_xfer(llmdd *dd, enum llmdd__metrics_op op,
                    const llmdd_transport_ops *ops, llmdd_status st,
                    uint64_t bytes, uint64_t t0)
{
    llmdd__metrics *m = dd->metrics;
    size_t tp = op == LLMDD__OP_COPY ? LLMDD__METRICS_TP_LOCAL : tp_slot(ops);
    size_t s = status_slot(st);

    /* A success is counted by its histogram bucket alone (count_of). */
    if (st == LLM_SUCCESS) {
        uint64_t ns = since(t0);
        size_t b = 0;
        while (b < LLMDD__METRICS_NBUCKETS - 1 && ns > bucket_ns[b])
            b++;
        add(&m->hist[op][tp][b], 1);
        add(&m->hist_ns[op][tp], ns);
    } else {
        add(&m->xfers[0][op][tp][s], 1);
    }
    add(&m->bytes[0][op][tp][s], bytes);
}

void
llmdd__metrics_served(llmdd *dd, const llmdd_transport_ops *ops, bool write,
                      llmdd_status st, uint64_t bytes)
{
    enum llmdd__metrics_op op = write ? LLMDD__OP_PUSH : LLMDD__OP_PULL;
    size_t tp = tp_slot(ops), s = status_slot(st);

    add(&dd->metrics->xfers[1][op][tp][s], 1);
    add(&dd->metrics->bytes[1][op][tp][s], bytes);
}

void
llmdd__metrics_link_attempt(llmdd *dd, llmdd_status st)
{
    add(&dd->metrics->link_attempts[status_slot(st)], 1);
}

void
llmdd__metrics_link_event(llmdd *dd, bool up)
{
    add(up ? &dd->metrics->links_up : &dd->metrics->links_down, 1);
}

void
llmdd__metrics_heartbeat_drop(llmdd *dd)
{
    add(&dd->metrics->heartbeat_drops, 1);
}

void
llmdd__metrics_breach(llmdd *dd)
{
    add(&dd->metrics->breaches, 1);
}

void
llmdd__metrics_notify(llmdd *dd, bool sent)
{
    add(sent ? &dd->metrics->notify_sent : &dd->metrics->notify_recv, 1);
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

/* Calls that succeeded are the histogram's count; the rest are counted. */
static uint64_t
count_of(llmdd__metrics *m, size_t side, size_t op, size_t tp, size_t s)
{
    uint64_t n = 0;

    if (side != 0 || s != status_slot(LLM_SUCCESS))
        return get(&m->xfers[side][op][tp][s]);
    for (size_t b = 0; b < LLMDD__METRICS_NBUCKETS; b++)
        n += get(&m->hist[op][tp][b]);
    return n;
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
                    uint64_t n = count_of(m, side, op, tp, s);
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

static uint64_t
in_flight(llmdd__metrics *m)
{
    uint64_t ended = 0;
    /* Ended first: a call counted there was counted in begun before. */
    for (size_t op = 0; op < LLMDD__OP_COUNT; op++)
        for (size_t tp = 0; tp < LLMDD__METRICS_NTP; tp++)
            for (size_t s = 0; s < LLMDD__METRICS_NSTATUS; s++)
                ended += count_of(m, 0, op, tp, s);
    uint64_t begun = get(&m->begun);
    return begun > ended ? begun - ended : 0;
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
    m = dd->metrics;
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
    out(&o, "llmdd_transfers_in_flight %" PRIu64 "\n", in_flight(m));

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
    family(&o, "llmdd_heartbeat_drops_total", "counter",
           "Links dropped because the peer was silent for its heartbeat "
           "interval times llm.HeartbeatMisses.");
    out(&o, "llmdd_heartbeat_drops_total %" PRIu64 "\n",
        get(&m->heartbeat_drops));
    family(&o, "llmdd_protocol_breaches_total", "counter",
           "Links dropped because the peer broke the protocol (malformed or "
           "unasked frames, heartbeats or notifications past their limits).");
    out(&o, "llmdd_protocol_breaches_total %" PRIu64 "\n", get(&m->breaches));

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
