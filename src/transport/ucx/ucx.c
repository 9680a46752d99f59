/*
 * The ucx transport: one-sided reads and writes through UCX (ucp_get_nbx,
 * ucp_put_nbx), so that on an RDMA fabric a pull costs the serving side
 * nothing. docs/rdma.md covers setup, the exchange and the limits.
 *
 * Per link, UCP workers on one process-wide context: a serve worker that
 * only answers the peer (UCX 1.13 emulates RMA over tcp and shared memory
 * with active messages, which need progress on the serving side), and up to
 * UCX_EPS request slots, each a worker with one endpoint to the peer's serve
 * worker, owned by one transfer at a time. Keeping them apart means that
 * ending one of our endpoints (a timed-out transfer) never fails an endpoint
 * the peer or another transfer relies on: a forced close where UCX has peer
 * error handling, destroying the slot's worker where it has not (shared
 * memory). One progress thread per link drives every worker and sleeps on
 * their event fds; requesters post their operations and wait on a condition
 * variable that completions signal.
 *
 * The exchange runs over the link's data connections, opened by the client:
 * the first FWD connection starts with UCX_HELLO (serve-worker addresses) and
 * then carries the client's requests; the REV connection carries the
 * server's. A QUERY maps the cache with ucp_mem_map (lazily, per link and
 * cache) and answers with its packed remote keys. Before a cache's memory
 * goes away its owner sends REVOKE; the peer aborts transfers on that cache,
 * destroys its keys and acknowledges, or the owner drops the link.
 *
 * Locking: ucx_link.lock guards the link state and every call into its
 * workers (UCS_THREAD_MODE_SERIALIZED); UCX callbacks run with it held.
 * ucx_link.map_lock serializes memory mapping, which may be slow. Neither is
 * held across socket I/O.
 */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "core/internal.h"
#include "base/net.h"
#include "ctrl/wire.h"
#include "transport/ucx/ucx_wire.h"

#define UCX_EPS 4          /* request endpoints: concurrent transfers a link */
#define UCX_WINDOW 1024    /* operations in flight per transfer (2^n) */
#define UCX_WINDOW_BITS 10
#define UCX_AM_BYTES (8u << 20) /* active-message mode: bytes asked at once */
#define UCX_SERVE_MAX 4    /* connections served at once per link */
#define UCX_STALL_MS 5000  /* a serving side gives up on a peer this silent */
#define UCX_REVOKE_MS 5000 /* an owner waits this long for REVOKE_ACK */
#define UCX_CLOSE_WARN_MS 5000
#define UCX_SPIN_US 50   /* the progress thread polls this long after work */
#define UCX_SLICE_US 200 /* and holds the lock at most about this long */
#define UCX_FAIR_US 2000 /* busy this long with waiters: a real pause */
#define UCX_PAUSE_NS 100000
#define UCX_FLAG_HELLO 1u /* the first FWD connection: address exchange */
#define UCX_FLAG_REV 2u   /* the server's request connection */
#define UCX_SMALL_MSG 64
/* A pull of at least this many runs averaging under UCX_GATHER_SMALL bytes,
 * whose span per tensor is at most UCX_GATHER_DENSITY times the bytes asked
 * and at most UCX_GATHER_MAX, reads the span once (ucx_gather_span). */
#define UCX_GATHER_MIN_RUNS 64
#define UCX_GATHER_SMALL 4096
#define UCX_GATHER_DENSITY 4
#define UCX_GATHER_MAX (64ull << 20)
#define UCX_GATHER_BATCH (64ull << 20) /* bounce buffer per round */

/* ---- Process-wide state: the context and what UCX found. ---- */

static pthread_mutex_t ucx_glock = PTHREAD_MUTEX_INITIALIZER;
static ucp_context_h ucx_gctx; /* shared by every link; guarded by glock */
static int ucx_gctx_refs;

static struct {
    bool ok;        /* UCX initialises */
    bool rdma;      /* it found an RDMA-capable transport */
    bool peer_mode; /* and one with peer failure handling (tcp, IB) */
    bool tcp;       /* tcp is among the transports */
    int rma_env;    /* LLMDD_UCX_RMA: 1 always RMA, 0 never, -1 auto */
    char info[1024];
} ucx_probed;
static pthread_once_t ucx_probe_once = PTHREAD_ONCE_INIT;

/* Our defaults where tcp is in use: the environment variable, the key as
 * UCX knows it (ucp_config_modify), the value, and whether it applies only
 * without RDMA (the key also governs RDMA transports). */
static const struct {
    const char *env, *key, *value;
    bool no_rdma;
} ucx_defaults[] = {
    {"UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "256k", false},
    {"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "256k", false},
    /* UCX 1.13's tcp completes a zero-copy send twice when its peer dies
     * (uct_iface.h:884 "comp->count > 0") and aborts: copy instead. */
    {"UCX_ZCOPY_THRESH", "ZCOPY_THRESH", "inf", true},
};

static ucs_status_t
ucx_ctx_create(bool tuned, ucp_context_h *out)
{
    ucp_params_t p = {
        .field_mask =
            UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 1,
    };
    ucp_config_t *cfg;
    ucs_status_t st;

    /* NULL prefix and file: UCX_TLS and every other UCX_* pass through. */
    st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK)
        return st;
    /* Defaults for KV-sized transfers, each unless the environment sets
     * it: UCX emulates RMA over tcp with a message per segment, and 8 KiB
     * segments cost 4x the throughput of 256 KiB ones (docs/rdma.md). Only
     * where tcp is in use: UCX warns about keys no transport takes. */
    for (size_t i = 0; tuned && ucx_probed.tcp &&
                       i < sizeof(ucx_defaults) / sizeof(ucx_defaults[0]);
         i++)
        if (getenv(ucx_defaults[i].env) == NULL &&
            !(ucx_defaults[i].no_rdma && ucx_probed.rdma))
            ucp_config_modify(cfg, ucx_defaults[i].key, ucx_defaults[i].value);
    st = ucp_init(&p, cfg, out);
    ucp_config_release(cfg);
    return st;
}

static ucp_context_h
ucx_ctx_get(void)
{
    ucp_context_h ctx = NULL;

    pthread_mutex_lock(&ucx_glock);
    if (ucx_gctx == NULL) {
        ucs_status_t st = ucx_ctx_create(true, &ucx_gctx);
        if (st != UCS_OK) {
            log_error("ucx: ucp_init: %s", ucs_status_string(st));
            ucx_gctx = NULL;
        }
    }
    if (ucx_gctx != NULL) {
        ucx_gctx_refs++;
        ctx = ucx_gctx;
    }
    pthread_mutex_unlock(&ucx_glock);
    return ctx;
}

static void
ucx_ctx_put(void)
{
    pthread_mutex_lock(&ucx_glock);
    if (--ucx_gctx_refs == 0) {
        ucp_cleanup(ucx_gctx);
        ucx_gctx = NULL;
    }
    pthread_mutex_unlock(&ucx_glock);
}

/* rc_verbs, rc_mlx5, dc_mlx5, ud_verbs, ud_mlx5: the InfiniBand/RoCE ones.
 * With tcp, they are also those that handle peer failure in UCX 1.13. */
static bool
ucx_tl_is_rdma(const char *tl)
{
    static const char *const pre[] = {"rc", "dc", "ud"};

    for (size_t i = 0; i < sizeof(pre) / sizeof(pre[0]); i++)
        if (strncmp(tl, pre[i], 2) == 0 && (tl[2] == '\0' || tl[2] == '_'))
            return true;
    return false;
}

/*
 * Lists the resources a context selected (after UCX_TLS, UCX_NET_DEVICES)
 * from ucp_context_print_info, whose lines read
 * "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0".
 */
static void
ucx_probe_parse(const char *text, char *devs, size_t cap, bool *rdma,
                char *rdevs, size_t rcap)
{
    const char *line = text;

    while (line != NULL && *line != '\0') {
        const char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        char buf[256];
        if (n >= sizeof(buf))
            n = sizeof(buf) - 1;
        memcpy(buf, line, n);
        buf[n] = '\0';
        line = end ? end + 1 : NULL;
        if (strstr(buf, " resource ") == NULL || strstr(buf, "flags") == NULL)
            continue;
        char *name = strrchr(buf, ' ');
        if (name == NULL || strchr(name, '/') == NULL)
            continue;
        name++;
        size_t used = strlen(devs);
        snprintf(devs + used, cap - used, "%s%s", used ? " " : "", name);
        *strchr(name, '/') = '\0';
        if (strcmp(name, "tcp") == 0)
            ucx_probed.tcp = true;
        if (ucx_tl_is_rdma(name) || strcmp(name, "tcp") == 0)
            ucx_probed.peer_mode = true;
        if (ucx_tl_is_rdma(name)) {
            *rdma = true;
            used = strlen(rdevs);
            snprintf(rdevs + used, rcap - used, "%s%s", used ? " " : "", name);
        }
    }
}

static void
ucx_probe_run(void)
{
    const char *tls = getenv("UCX_TLS");
    const char *rma = getenv("LLMDD_UCX_RMA");
    char devs[512] = "", rdevs[128] = "";
    ucp_context_h ctx;
    char *text = NULL;
    size_t len = 0;

    ucx_probed.rma_env =
        rma == NULL || *rma == '\0' ? -1 : strcmp(rma, "0") != 0;
    ucs_status_t st = ucx_ctx_create(false, &ctx);
    if (st != UCS_OK) {
        snprintf(ucx_probed.info, sizeof(ucx_probed.info),
                 "UCX %s; UCX_TLS=%s; cannot initialise: %s",
                 ucp_get_version_string(), tls ? tls : "(unset)",
                 ucs_status_string(st));
        return;
    }
    FILE *f = open_memstream(&text, &len);
    if (f != NULL) {
        ucp_context_print_info(ctx, f);
        fclose(f);
    }
    ucp_cleanup(ctx);
    ucx_probe_parse(text, devs, sizeof(devs), &ucx_probed.rdma, rdevs,
                    sizeof(rdevs));
    free(text);
    ucx_probed.ok = true;
    snprintf(ucx_probed.info, sizeof(ucx_probed.info),
             "UCX %s; UCX_TLS=%s; devices: %s; RDMA: %s",
             ucp_get_version_string(), tls ? tls : "(unset)",
             devs[0] ? devs : "none",
             ucx_probed.rdma ? rdevs
                             : "none (auto picks tcp for other hosts)");
}

static const char *
ucx_info(void)
{
    pthread_once(&ucx_probe_once, ucx_probe_run);
    return ucx_probed.info;
}

/* ---- Per-link state. ---- */

typedef struct ucx_link ucx_link;

/* One transfer's operations in flight. */
typedef struct {
    ucx_link *ul;
    size_t outstanding; /* posted, not yet completed */
    size_t wake_at;     /* signal the requester at or below this */
    size_t bytes;       /* asked for with active messages, not yet answered */
    ucs_status_t status;
    llmdd_status refused; /* what the serving side answered, if not success */
} ucx_xstate;

/*
 * An active-message GET or PUT in flight (docs/rdma.md): found again by the
 * tag in the peer's DATA or ACK, whose low UCX_WINDOW_BITS are its index.
 */
typedef struct {
    uint8_t hdr[LLMDD_UCX_AMREQ_SIZE]; /* UCX reads it until the send goes */
    uint64_t tag;                      /* 0: free */
    uint8_t *dst;                      /* GET: where the bytes go */
    size_t len;
    ucx_xstate *xs;
} ucx_amop;

typedef struct {
    ucx_link *ul;
    ucp_worker_h w; /* the slot's request worker; NULL until first used */
    int efd;        /* its event fd, -1 without wakeup */
    ucp_ep_h ep;    /* NULL: none open */
    uint32_t gen;   /* bumped whenever the slot's endpoint is closed */
    bool busy;    /* a transfer owns it */
    bool failed;  /* its error callback fired */
    bool closing; /* we are closing it: errors on it are ours */
    bool peer_mode; /* created with UCP_ERR_HANDLING_MODE_PEER */
    bool ponged;    /* the peer answered our PING on this endpoint */
    ucx_amop *ops;  /* UCX_WINDOW, with the worker */
    uint16_t *free_ops;
    int nfree;
    uint64_t tags; /* issued */
} ucx_ep;

/* Owner side: one of our caches as this link's peer sees it. */
typedef struct ucx_reg {
    int64_t id;
    uint32_t nregions;
    ucp_mem_h *memh;
    void **rkey; /* packed, from ucp_rkey_pack */
    size_t *rkey_len;
    uint64_t *base, *len;
    uint32_t *treg; /* region of each tensor */
    int busy;       /* a QUERY is answering from it */
    int sending;    /* DATA replies that read it, not yet completed */
    bool mapped, sent, removed;
    struct ucx_reg *next;
} ucx_reg;

/* Requester side: rc->priv, the peer's cache as the QUERY described it. */
typedef struct ucx_rc {
    ucx_link *ul; /* NULL once the link is finished */
    int64_t id;
    uint32_t nregions, ntensors;
    uint8_t **rkey_buf;
    uint32_t *rkey_len;
    uint64_t *taddr;
    uint32_t *treg;
    ucp_rkey_h *rkeys[UCX_EPS]; /* unpacked per endpoint slot */
    uint32_t gen[UCX_EPS];
    int inflight; /* transfers using it */
    bool revoked; /* the owner took it back: no more transfers */
    struct ucx_rc *prev, *next;
} ucx_rc;

struct ucx_link {
    llmdd__link *link;
    pthread_mutex_t lock;
    pthread_cond_t cond; /* CLOCK_MONOTONIC; any state change */
    pthread_mutex_t map_lock;
    ucp_context_h ctx;
    ucp_worker_h sw; /* the serve worker; NULL once torn down */
    int sefd;        /* its event fd */
    bool wakeup;     /* workers have event fds */
    bool rma;        /* RMA, not active messages, moves the bytes */
    uint64_t key;    /* requests to our serve worker must carry it */
    uint64_t peer_key;  /* and ours to the peer's, this */
    bool stranger_seen; /* a request without the key was logged */
    int wake_fd;
    uint8_t *peer_addr; /* the peer's serve worker; NULL before UCX_HELLO */
    size_t peer_addr_len;
    ucx_ep eps[UCX_EPS];
    int users; /* transfers: the progress thread stays while any runs */
    int waiters; /* threads in ucx_wait_until */
    bool down, failed, drop_asked;
    bool progress_started, torn_down;
    ucx_reg *regs;
    ucx_rc *rcs;
    /* The request connection: FWD on the client, REV on the server. */
    int req_fd;
    bool req_busy;
    uint64_t seq;
    int serve[UCX_SERVE_MAX];
    int nserve;
    bool hello_done;
};

static uint64_t
ucx_cluster(const ucx_link *ul)
{
    return ul->link->peer.cluster_id;
}

/* Waits on ul->cond (lock held) until woken or the deadline; counted, so
 * that a busy progress thread lets go of the lock now and then (see
 * ucx_progress_main). */
static void
ucx_wait_until(ucx_link *ul, int64_t deadline)
{
    ul->waiters++;
    llmdd__cond_wait_until(&ul->cond, &ul->lock, deadline);
    ul->waiters--;
}

static int64_t
ucx_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void
ucx_wake(ucx_link *ul)
{
    uint64_t one = 1;

    (void)!write(ul->wake_fd, &one, sizeof(one));
}

/* ---- Remote keys, requester side. ---- */

/*
 * A packed key as UCX 1.13 lays it out: a 64-bit MD map, a memory type, then
 * one length-prefixed key per MD bit. ucp_ep_rkey_unpack trusts those
 * lengths, so they must stay inside the bytes the peer sent.
 */
static bool
ucx_rkey_sane(const uint8_t *k, uint32_t len)
{
    uint64_t map = 0;
    size_t pos = 9;

    if (len < 9)
        return false;
    for (int i = 0; i < 8; i++)
        map |= (uint64_t)k[i] << (8 * i);
    for (; map != 0; map &= map - 1) {
        if (pos >= len)
            return false;
        size_t n = k[pos++];
        if (len - pos < n)
            return false;
        pos += n;
    }
    return true;
}

/* Destroys the keys of slot s (lock held; no operation uses them). */
static void
ucx_rc_drop_keys(ucx_rc *p, int s)
{
    if (p->rkeys[s] == NULL)
        return;
    for (uint32_t i = 0; i < p->nregions; i++)
        if (p->rkeys[s][i] != NULL)
            ucp_rkey_destroy(p->rkeys[s][i]);
    free(p->rkeys[s]);
    p->rkeys[s] = NULL;
}

static void
ucx_rc_free(ucx_rc *p)
{
    for (uint32_t i = 0; p->rkey_buf != NULL && i < p->nregions; i++)
        free(p->rkey_buf[i]);
    free(p->rkey_buf);
    free(p->rkey_len);
    free(p->taddr);
    free(p->treg);
    free(p);
}

/* Unpacks p's keys on slot s's endpoint (lock held). */
static llmdd_status
ucx_rc_keys(ucx_link *ul, ucx_rc *p, int s)
{
    ucp_rkey_h *keys;

    if (p->rkeys[s] != NULL && p->gen[s] == ul->eps[s].gen)
        return LLM_SUCCESS;
    ucx_rc_drop_keys(p, s);
    keys = calloc(p->nregions, sizeof(*keys));
    if (keys == NULL)
        return LLM_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < p->nregions; i++) {
        ucs_status_t st =
            ucp_ep_rkey_unpack(ul->eps[s].ep, p->rkey_buf[i], &keys[i]);
        if (st != UCS_OK) {
            log_error("ucx: cluster %llu: remote key of cache %lld: %s",
                      (unsigned long long)ucx_cluster(ul), (long long)p->id,
                      ucs_status_string(st));
            for (uint32_t j = 0; j < i; j++)
                ucp_rkey_destroy(keys[j]);
            free(keys);
            return LLM_FAILED;
        }
    }
    p->rkeys[s] = keys;
    p->gen[s] = ul->eps[s].gen;
    return LLM_SUCCESS;
}

/* ---- Memory mapping, owner side. ---- */

static void
ucx_reg_unmap(ucx_link *ul, ucx_reg *r)
{
    for (uint32_t i = 0; i < r->nregions; i++) {
        if (r->rkey != NULL && r->rkey[i] != NULL)
            ucp_rkey_buffer_release(r->rkey[i]);
        if (r->memh != NULL && r->memh[i] != NULL)
            ucp_mem_unmap(ul->ctx, r->memh[i]);
    }
    free(r->memh);
    free(r->rkey);
    free(r->rkey_len);
    free(r->base);
    free(r->len);
    free(r->treg);
    r->memh = NULL;
    r->rkey = NULL;
    r->rkey_len = NULL;
    r->base = r->len = NULL;
    r->treg = NULL;
    r->nregions = 0;
    r->mapped = false;
}

static int
ucx_addr_cmp(const void *a, const void *b, void *arg)
{
    const uint64_t *addrs = arg;
    uint64_t x = addrs[*(const uint32_t *)a], y = addrs[*(const uint32_t *)b];

    return x < y ? -1 : x > y;
}

/*
 * The regions to map: the whole allocation of an allocated cache; for
 * registered memory, the tensors merged where they touch or overlap, so a
 * cache carved out of one buffer needs one key.
 */
static int
ucx_reg_regions(ucx_reg *r, const llmdd__cache *c)
{
    uint32_t n = c->desc.num_tensors;

    r->treg = calloc(n, sizeof(*r->treg));
    r->base = calloc(n, sizeof(*r->base));
    r->len = calloc(n, sizeof(*r->len));
    if (r->treg == NULL || r->base == NULL || r->len == NULL)
        return -1;
    if (c->allocated) {
        r->base[0] = (uint64_t)(uintptr_t)c->mem.base;
        r->len[0] = c->mem.len;
        r->nregions = 1;
        return 0;
    }
    uint32_t *order = malloc(n * sizeof(*order));
    if (order == NULL)
        return -1;
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    qsort_r(order, n, sizeof(*order), ucx_addr_cmp, c->addrs);
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t a = c->addrs[order[i]], end = a + c->tensor_size;
        if (k > 0 && a <= r->base[k - 1] + r->len[k - 1]) {
            uint64_t cur = r->base[k - 1] + r->len[k - 1];
            if (end > cur)
                r->len[k - 1] = end - r->base[k - 1];
        } else {
            r->base[k] = a;
            r->len[k] = c->tensor_size;
            k++;
        }
        r->treg[order[i]] = k - 1;
    }
    free(order);
    r->nregions = k;
    return 0;
}

/* Maps cache c for this link and packs its keys. map_lock held. */
static llmdd_status
ucx_reg_map(ucx_link *ul, ucx_reg *r, const llmdd__cache *c)
{
    if (ucx_reg_regions(r, c) != 0)
        goto err_nomem;
    r->memh = calloc(r->nregions, sizeof(*r->memh));
    r->rkey = calloc(r->nregions, sizeof(*r->rkey));
    r->rkey_len = calloc(r->nregions, sizeof(*r->rkey_len));
    if (r->memh == NULL || r->rkey == NULL || r->rkey_len == NULL)
        goto err_nomem;
    for (uint32_t i = 0; i < r->nregions; i++) {
        ucp_mem_map_params_t mp = {
            .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                          UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            .address = (void *)(uintptr_t)r->base[i],
            .length = r->len[i],
        };
        ucs_status_t st = ucp_mem_map(ul->ctx, &mp, &r->memh[i]);
        if (st == UCS_OK)
            st = ucp_rkey_pack(ul->ctx, r->memh[i], &r->rkey[i],
                               &r->rkey_len[i]);
        if (st == UCS_OK &&
            (r->rkey_len[i] == 0 || r->rkey_len[i] > LLMDD_UCX_RKEY_MAX))
            st = UCS_ERR_EXCEEDS_LIMIT;
        if (st != UCS_OK) {
            log_error("ucx: cache %lld: mapping %llu bytes: %s",
                      (long long)c->id, (unsigned long long)r->len[i],
                      ucs_status_string(st));
            ucx_reg_unmap(ul, r);
            return LLM_FAILED;
        }
    }
    r->mapped = true;
    return LLM_SUCCESS;
err_nomem:
    ucx_reg_unmap(ul, r);
    return LLM_OUT_OF_MEMORY;
}

static ucx_reg *
ucx_reg_find(ucx_link *ul, int64_t id)
{
    for (ucx_reg *r = ul->regs; r != NULL; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

static void
ucx_reg_unlink(ucx_link *ul, ucx_reg *r)
{
    for (ucx_reg **pp = &ul->regs; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            return;
        }
    }
}

/* ---- Active-message transfers (docs/rdma.md). ---- */

/*
 * Where UCX would emulate RMA (no RDMA device on one side), a GET or PUT is
 * an active message to the peer's serve worker, answered by DATA or ACK on
 * the reply endpoint. UCX 1.13 aborts a process whose emulated get reply or
 * put completion meets a failed endpoint; active messages complete with an
 * error status instead. The serving side also checks every address against
 * the caches it described to this peer, which the emulation does not.
 */

/* The region of a cache described to this peer that holds [addr, addr +
 * len), or NULL. Lock held. */
static ucx_reg *
ucx_reg_holding(ucx_link *ul, uint64_t addr, uint64_t len)
{
    for (ucx_reg *r = ul->regs; r != NULL; r = r->next) {
        if (!r->sent || r->removed)
            continue; /* not yet described, or being taken back */
        for (uint32_t i = 0; i < r->nregions; i++)
            if (addr >= r->base[i] && addr - r->base[i] <= r->len[i] &&
                len <= r->len[i] - (addr - r->base[i]))
                return r;
    }
    return NULL;
}

/* A reply on its way: its header must outlive the send. */
typedef struct {
    uint8_t hdr[LLMDD_UCX_AMREP_SIZE];
    ucx_link *ul;
    ucx_reg *reg; /* DATA: read from it until the send completes */
} ucx_amrep;

static void
ucx_amrep_done(ucx_amrep *rep)
{
    if (rep->reg != NULL && --rep->reg->sending == 0)
        pthread_cond_broadcast(&rep->ul->cond);
    free(rep);
}

static void
ucx_amrep_sent(void *req, ucs_status_t status, void *user_data)
{
    (void)status; /* a dead requester: nothing to tell it */
    ucx_amrep_done(user_data);
    ucp_request_free(req);
}

/* The peer broke the protocol: drop the link (lock held, in progress). */
static void
ucx_am_broken(ucx_link *ul, const char *what)
{
    if (!ul->failed && !ul->down)
        log_error("ucx: cluster %llu sent a malformed %s",
                  (unsigned long long)ucx_cluster(ul), what);
    ul->failed = true;
    pthread_cond_broadcast(&ul->cond);
}

/* A request without our key: not from our peer (UCX authenticates no one
 * who connects to a worker). Dropped; logged once per link. Lock held. */
static void
ucx_am_stranger(ucx_link *ul, const char *what)
{
    if (!ul->stranger_seen)
        log_warn("ucx: cluster %llu: dropped a %s without the link's key",
                 (unsigned long long)ucx_cluster(ul), what);
    ul->stranger_seen = true;
}

/* Serving side: a GET or PUT from the peer. Lock held (in progress). */
static ucs_status_t
ucx_am_serve(ucx_link *ul, bool put, const void *header, size_t hlen,
             void *data, size_t len, const ucp_am_recv_param_t *prm)
{
    llmdd__ucx_amreq m;

    if (llmdd__ucx_amreq_decode(header, hlen, &m) != 0 ||
        !(prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        (prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        len != (put ? m.len : 0)) {
        ucx_am_broken(ul, put ? "PUT" : "GET");
        return UCS_OK;
    }
    if (m.key != ul->key) {
        ucx_am_stranger(ul, put ? "PUT" : "GET");
        return UCS_OK;
    }
    ucx_reg *r = ul->down ? NULL : ucx_reg_holding(ul, m.addr, m.len);
    ucx_amrep *rep = calloc(1, sizeof(*rep));
    if (rep == NULL)
        return UCS_OK; /* the requester times out */
    rep->ul = ul;
    if (r != NULL && put)
        memcpy((void *)(uintptr_t)m.addr, data, m.len);
    if (r != NULL && !put) {
        rep->reg = r;
        r->sending++;
    }
    llmdd_status st = r != NULL  ? LLM_SUCCESS
                      : ul->down ? LLM_NOT_YET_LINK
                                 : LLM_KV_CACHE_NOT_EXIST;
    llmdd__ucx_ack_encode(m.tag, st, rep->hdr, sizeof(rep->hdr));
    llmdd__metrics_served(ul->link->dd, ul->link->ops, put, st, m.len);
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_AM_SEND_FLAG_EAGER,
        .cb.send = ucx_amrep_sent,
        .user_data = rep,
    };
    ucs_status_ptr_t sp = ucp_am_send_nbx(
        prm->reply_ep, put ? LLMDD_UCX_AM_ACK : LLMDD_UCX_AM_DATA, rep->hdr,
        sizeof(rep->hdr), rep->reg != NULL ? (void *)(uintptr_t)m.addr : NULL,
        rep->reg != NULL ? m.len : 0, &p);
    if (!UCS_PTR_IS_PTR(sp))
        ucx_amrep_done(rep);
    return UCS_OK;
}

static ucs_status_t
ucx_am_get(void *arg, const void *header, size_t hlen, void *data, size_t len,
           const ucp_am_recv_param_t *prm)
{
    return ucx_am_serve(arg, false, header, hlen, data, len, prm);
}

/* Serving side: PING, answered on the same lane as the wireup reply, so a
 * PONG tells the requester that reply is gone (ucx_ep_wire). */
static ucs_status_t
ucx_am_ping(void *arg, const void *header, size_t hlen, void *data, size_t len,
            const ucp_am_recv_param_t *prm)
{
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_AM_SEND_FLAG_EAGER};
    ucx_link *ul = arg;
    uint64_t key;

    (void)data;
    if (llmdd__ucx_ping_decode(header, hlen, &key) != 0 || len != 0 ||
        !(prm->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
        ucx_am_broken(ul, "PING");
        return UCS_OK;
    }
    if (key != ul->key) {
        ucx_am_stranger(ul, "PING");
        return UCS_OK;
    }
    ucs_status_ptr_t sp =
        ucp_am_send_nbx(prm->reply_ep, LLMDD_UCX_AM_PONG, NULL, 0, NULL, 0, &p);
    if (UCS_PTR_IS_PTR(sp))
        ucp_request_free(sp); /* released once sent */
    return UCS_OK;
}

static ucs_status_t
ucx_am_put(void *arg, const void *header, size_t hlen, void *data, size_t len,
           const ucp_am_recv_param_t *prm)
{
    return ucx_am_serve(arg, true, header, hlen, data, len, prm);
}

/* Requesting side: DATA or ACK for one of slot e's operations. A tag no
 * operation holds is an aborted transfer's answer: dropped. Lock held. */
static ucs_status_t
ucx_am_answer(ucx_ep *e, bool data_msg, const void *header, size_t hlen,
              void *data, size_t len, const ucp_am_recv_param_t *prm)
{
    uint64_t tag;
    uint32_t st;

    if (llmdd__ucx_ack_decode(header, hlen, &tag, &st) != 0) {
        ucx_am_broken(e->ul, data_msg ? "DATA" : "ACK");
        return UCS_OK;
    }
    if (e->ops == NULL || tag == 0 || e->ops[tag & (UCX_WINDOW - 1)].tag != tag)
        return UCS_OK;
    ucx_amop *op = &e->ops[tag & (UCX_WINDOW - 1)];
    ucx_xstate *xs = op->xs;
    if (st == LLM_SUCCESS) {
        if (data_msg != (op->dst != NULL) ||
            (prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
            len != (data_msg ? op->len : 0)) {
            ucx_am_broken(e->ul, data_msg ? "DATA" : "ACK");
            st = LLM_FAILED;
        } else if (data_msg) {
            memcpy(op->dst, data, len);
        }
    } else if (st != LLM_KV_CACHE_NOT_EXIST && st != LLM_NOT_YET_LINK) {
        st = LLM_FAILED;
    }
    if (st != LLM_SUCCESS && xs->refused == LLM_SUCCESS)
        xs->refused = (llmdd_status)st;
    xs->bytes -= op->len;
    op->tag = 0;
    e->free_ops[e->nfree++] = (uint16_t)(op - e->ops);
    if (--xs->outstanding <= xs->wake_at)
        pthread_cond_broadcast(&e->ul->cond);
    return UCS_OK;
}

static ucs_status_t
ucx_am_data(void *arg, const void *header, size_t hlen, void *data, size_t len,
            const ucp_am_recv_param_t *prm)
{
    return ucx_am_answer(arg, true, header, hlen, data, len, prm);
}

static ucs_status_t
ucx_am_ack(void *arg, const void *header, size_t hlen, void *data, size_t len,
           const ucp_am_recv_param_t *prm)
{
    return ucx_am_answer(arg, false, header, hlen, data, len, prm);
}

static ucs_status_t
ucx_am_pong(void *arg, const void *header, size_t hlen, void *data, size_t len,
            const ucp_am_recv_param_t *prm)
{
    ucx_ep *e = arg;

    (void)header;
    (void)data;
    (void)prm;
    if (hlen != 0 || len != 0) {
        ucx_am_broken(e->ul, "PONG");
        return UCS_OK;
    }
    e->ponged = true;
    pthread_cond_broadcast(&e->ul->cond);
    return UCS_OK;
}

/* Installs handlers on a worker: ids[i] runs cbs[i] with arg. */
static ucs_status_t
ucx_am_install(ucp_worker_h w, const unsigned *ids,
               const ucp_am_recv_callback_t *cbs, int n, void *arg)
{
    for (int i = 0; i < n; i++) {
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                          UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                          UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = ids[i],
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = cbs[i],
            .arg = arg,
        };
        ucs_status_t st = ucp_worker_set_am_recv_handler(w, &hp);
        if (st != UCS_OK)
            return st;
    }
    return UCS_OK;
}

/* Gives back every operation of xs still waiting for an answer: whatever
 * comes for them later is dropped. Lock held. */
static void
ucx_am_forget(ucx_ep *e, ucx_xstate *xs)
{
    for (int i = 0; e->ops != NULL && i < UCX_WINDOW; i++) {
        if (e->ops[i].tag == 0 || e->ops[i].xs != xs)
            continue;
        e->ops[i].tag = 0;
        e->free_ops[e->nfree++] = (uint16_t)i;
        xs->outstanding--;
        xs->bytes -= e->ops[i].len;
    }
}

/* ---- Endpoints. ---- */

static void
ucx_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ucx_link *ul = arg;

    /* Runs inside worker progress, lock held: record, let others act. */
    for (int s = 0; s < UCX_EPS; s++) {
        if (ul->eps[s].ep != ep)
            continue;
        if (ul->eps[s].closing)
            return;
        ul->eps[s].failed = true;
    }
    if (!ul->failed && !ul->down)
        log_warn("ucx: cluster %llu: endpoint failed: %s",
                 (unsigned long long)ucx_cluster(ul),
                 ucs_status_string(status));
    ul->failed = true;
    pthread_cond_broadcast(&ul->cond);
}

/*
 * Opens slot s's endpoint to the peer's serve worker (lock held). Peer
 * failure handling when UCX has a transport for it; UCX 1.13's shared
 * memory transports have none, and then a dead peer shows through the
 * control connection instead.
 */
static llmdd_status
ucx_ep_open(ucx_link *ul, int s)
{
    ucx_ep *e = &ul->eps[s];
    ucs_status_t st;

    if (e->w == NULL) {
        ucp_worker_params_t wp = {
            .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            .thread_mode = UCS_THREAD_MODE_SERIALIZED};
        if ((st = ucp_worker_create(ul->ctx, &wp, &e->w)) != UCS_OK) {
            log_error("ucx: ucp_worker_create: %s", ucs_status_string(st));
            e->w = NULL;
            return LLM_FAILED;
        }
        e->efd = -1;
        static const unsigned ids[] = {LLMDD_UCX_AM_DATA, LLMDD_UCX_AM_ACK,
                                       LLMDD_UCX_AM_PONG};
        static const ucp_am_recv_callback_t cbs[] = {ucx_am_data, ucx_am_ack,
                                                     ucx_am_pong};
        if (e->ops == NULL) {
            e->ops = calloc(UCX_WINDOW, sizeof(*e->ops));
            e->free_ops = calloc(UCX_WINDOW, sizeof(*e->free_ops));
            for (int i = 0; e->free_ops != NULL && i < UCX_WINDOW; i++)
                e->free_ops[i] = (uint16_t)(UCX_WINDOW - 1 - i);
            e->nfree = UCX_WINDOW;
        }
        if (e->ops == NULL || e->free_ops == NULL ||
            (ul->wakeup && ucp_worker_get_efd(e->w, &e->efd) != UCS_OK) ||
            ucx_am_install(e->w, ids, cbs, 3, e) != UCS_OK) {
            log_error("ucx: cannot set up a request worker");
            ucp_worker_destroy(e->w);
            e->w = NULL;
            return LLM_FAILED;
        }
        ucx_wake(ul); /* the progress thread polls one more fd */
    }
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)ul->peer_addr,
        .err_mode = ucx_probed.peer_mode ? UCP_ERR_HANDLING_MODE_PEER
                                         : UCP_ERR_HANDLING_MODE_NONE,
        .err_handler = {.cb = ucx_ep_error, .arg = ul},
    };
    st = ucp_ep_create(e->w, &ep, &e->ep);
    if (st == UCS_ERR_UNREACHABLE &&
        ep.err_mode == UCP_ERR_HANDLING_MODE_PEER) {
        log_info("ucx: cluster %llu: no transport with peer failure "
                 "handling; relying on the control connection",
                 (unsigned long long)ucx_cluster(ul));
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        st = ucp_ep_create(e->w, &ep, &e->ep);
    }
    ul->eps[s].peer_mode = ep.err_mode == UCP_ERR_HANDLING_MODE_PEER;
    if (st != UCS_OK) {
        log_error("ucx: cannot reach cluster %llu: %s",
                  (unsigned long long)ucx_cluster(ul), ucs_status_string(st));
        ul->eps[s].ep = NULL;
        return LLM_LINK_FAILED;
    }
    ul->eps[s].failed = false;
    ul->eps[s].ponged = false;
    return LLM_SUCCESS;
}

/*
 * Completion of a transfer's operation (and of a close): lock held. The
 * request is freed here, not when posted: ucp_request_free on a pending
 * request would also cancel this callback.
 */
static void
ucx_op_done(void *req, ucs_status_t status, void *user_data)
{
    ucx_xstate *xs = user_data;

    if (status != UCS_OK && xs->status == UCS_OK)
        xs->status = status;
    if (--xs->outstanding <= xs->wake_at)
        pthread_cond_broadcast(&xs->ul->cond);
    ucp_request_free(req);
}

/*
 * Closes slot s's endpoint (created in peer mode) with FORCE, which
 * completes every operation still on it with UCS_ERR_CANCELED, and destroys
 * the keys unpacked on it. Lock held. With `inline_progress` the caller
 * progresses the worker itself (no progress thread); otherwise the progress
 * thread does, while we wait.
 */
static void
ucx_ep_close(ucx_link *ul, int s, ucx_xstate *xs, bool inline_progress)
{
    ucx_xstate none = {.ul = ul};
    ucx_xstate cl = {.ul = ul, .outstanding = 1};
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_EP_CLOSE_FLAG_FORCE,
        .cb.send = ucx_op_done,
        .user_data = &cl,
    };
    int64_t warn = llmdd__now_ms() + UCX_CLOSE_WARN_MS;

    if (ul->eps[s].ep == NULL)
        return;
    if (xs == NULL)
        xs = &none;
    xs->wake_at = 0;
    ul->eps[s].closing = true;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ul->eps[s].ep, &p);
    if (!UCS_PTR_IS_PTR(req))
        cl.outstanding = 0;
    while (cl.outstanding > 0 || xs->outstanding > 0) {
        if (inline_progress) {
            ucp_worker_progress(ul->eps[s].w);
            continue;
        }
        ucp_worker_signal(ul->eps[s].w);
        ucx_wait_until(ul, llmdd__now_ms() + 100);
        if (llmdd__now_ms() > warn) {
            log_warn("ucx: cluster %llu: endpoint close is slow",
                     (unsigned long long)ucx_cluster(ul));
            warn = INT64_MAX;
        }
    }
    for (ucx_rc *p2 = ul->rcs; p2 != NULL; p2 = p2->next)
        ucx_rc_drop_keys(p2, s);
    ul->eps[s].ep = NULL;
    ul->eps[s].failed = false;
    ul->eps[s].closing = false;
    ul->eps[s].gen++;
}

/*
 * Destroys slot s's worker with whatever is still on it. The way out for
 * endpoints without peer error handling (UCX 1.13 shared memory), which
 * cannot be closed with FORCE and whose operations may wait on a peer that
 * is slow or gone: once the worker is gone, nothing of it writes into our
 * memory. Only the slot's owner (or teardown) calls it. Lock held.
 */
static void
ucx_slot_purge(ucx_link *ul, int s)
{
    ucx_ep *e = &ul->eps[s];

    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        ucx_rc_drop_keys(p, s);
    if (e->w == NULL)
        return;
    ucp_worker_destroy(e->w); /* and its endpoint */
    e->w = NULL;
    e->efd = -1;
    e->ep = NULL;
    e->failed = false;
    e->closing = false;
    e->gen++;
    ucx_wake(ul);
}

/*
 * Ends whatever slot s's owner left in flight (xs), so that nothing of it
 * touches our memory afterwards: a forced close where the endpoint has peer
 * error handling, else the slot's worker goes. Lock held.
 */
static void
ucx_slot_abort(ucx_link *ul, int s, ucx_xstate *xs)
{
    if (ul->eps[s].peer_mode)
        ucx_ep_close(ul, s, xs, false);
    else
        ucx_slot_purge(ul, s);
}

/*
 * Waits until the peer has answered a PING on slot s's new endpoint. UCX
 * 1.13 aborts a process that purges a wireup reply still queued for a
 * peer that died (ucp_request.c "got REP message"). The PONG comes behind
 * the peer's reply on the same lane, so once it is here the peer owes this
 * endpoint nothing and may die safely. The slot is the caller's (busy, or
 * the link not yet up). Lock held; the progress thread progresses.
 */
static llmdd_status
ucx_ep_wire(ucx_link *ul, int s, int64_t deadline)
{
    ucx_ep *e = &ul->eps[s];
    ucx_xstate xs = {.ul = ul};
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
        .cb.send = ucx_op_done,
        .user_data = &xs,
    };
    uint8_t hdr[LLMDD_UCX_PING_SIZE]; /* the send ends before we return */

    llmdd__ucx_ping_encode(ul->peer_key, hdr, sizeof(hdr));
    ucs_status_ptr_t sp = ucp_am_send_nbx(e->ep, LLMDD_UCX_AM_PING, hdr,
                                          sizeof(hdr), NULL, 0, &p);

    if (UCS_PTR_IS_ERR(sp))
        return LLM_NOT_YET_LINK;
    xs.outstanding = sp != NULL;
    while ((xs.outstanding > 0 || !e->ponged) && !ul->down && !e->failed &&
           xs.status == UCS_OK && llmdd__now_ms() < deadline) {
        ucp_worker_signal(e->w);
        ucx_wait_until(ul, deadline);
    }
    if (xs.outstanding == 0 && e->ponged)
        return LLM_SUCCESS;
    bool late = !ul->down && !e->failed && xs.status == UCS_OK;
    ucx_slot_abort(ul, s, &xs); /* completes or drops the PING */
    return late ? LLM_TIMEOUT : LLM_NOT_YET_LINK;
}

/*
 * Once the link is down and no transfer runs: closes every endpoint, frees
 * every key and destroys every worker, so UCX touches none of our memory
 * for this link any more; then unmaps what the peer could reach. Lock held.
 */
static void
ucx_teardown(ucx_link *ul, bool inline_progress)
{
    if (ul->torn_down)
        return;
    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        for (int s = 0; s < UCX_EPS; s++)
            ucx_rc_drop_keys(p, s);
    /* Nothing is in flight. Without peer error handling a forced close is
     * undefined on the remote side and a flush may wait on a dead peer:
     * those endpoints go with their worker. */
    for (int s = 0; s < UCX_EPS; s++) {
        if (ul->eps[s].ep != NULL && ul->eps[s].peer_mode)
            ucx_ep_close(ul, s, NULL, inline_progress);
        ucx_slot_purge(ul, s);
    }
    /* A QUERY still answering holds its entry: let it finish first. */
    for (;;) {
        bool busy = false;
        for (ucx_reg *r = ul->regs; r != NULL; r = r->next)
            busy = busy || r->busy > 0;
        if (!busy)
            break;
        ucx_wait_until(ul, llmdd__now_ms() + 100);
    }
    if (ul->sw != NULL)
        ucp_worker_destroy(ul->sw);
    ul->sw = NULL;
    ul->sefd = -1;
    while (ul->regs != NULL) {
        ucx_reg *r = ul->regs;
        ul->regs = r->next;
        ucx_reg_unmap(ul, r);
        free(r);
    }
    ul->torn_down = true;
    pthread_cond_broadcast(&ul->cond);
}

/* ---- The progress thread. ---- */

static void *
ucx_progress_main(void *arg)
{
    ucx_link *ul = arg;
    llmdd__link *link = ul->link;

    int64_t last_work = 0, busy_since = INT64_MAX;

    pthread_mutex_lock(&ul->lock);
    for (;;) {
        /* A slice at a time: the lock is the requesters' way in. */
        int64_t t0 = ucx_now_us();
        unsigned k, n = 0;
        do {
            k = ucp_worker_progress(ul->sw);
            for (int s = 0; s < UCX_EPS; s++)
                if (ul->eps[s].w != NULL)
                    k += ucp_worker_progress(ul->eps[s].w);
            n += k;
        } while (k > 0 && ucx_now_us() - t0 < UCX_SLICE_US);
        if (ul->failed && !ul->drop_asked) {
            /* link_drop calls link_shutdown, which takes the lock. */
            ul->drop_asked = true;
            pthread_mutex_unlock(&ul->lock);
            llmdd__link_drop(link, "UCX endpoint failed");
            pthread_mutex_lock(&ul->lock);
            continue;
        }
        if (ul->down && ul->users == 0)
            break;
        /* While data flows, keep polling a little (UCX_SPIN_US) rather than
         * pay a wakeup per fragment; when it stops, sleep on the fds. The
         * lock is let go each round so requesters can post. */
        int64_t t = ucx_now_us();
        if (n > 0)
            last_work = t;
        if (k > 0 || t - last_work < UCX_SPIN_US) {
            /* A mutex is not fair: a yield alone can starve a requester
             * whose wait ended (woken, or at its deadline) for as long as
             * data streams in. With someone waiting, pause now and then. */
            if (busy_since == INT64_MAX)
                busy_since = t;
            bool pause = ul->waiters > 0 && t - busy_since >= UCX_FAIR_US;
            pthread_mutex_unlock(&ul->lock);
            if (pause) {
                struct timespec ts = {0, UCX_PAUSE_NS};
                nanosleep(&ts, NULL);
                busy_since = ucx_now_us();
            } else {
                sched_yield();
            }
            pthread_mutex_lock(&ul->lock);
            continue;
        }
        busy_since = INT64_MAX;
        int timeout = -1, busy = 0;
        struct pollfd pfd[2 + UCX_EPS];
        nfds_t npfd = 0;
        pfd[npfd++] = (struct pollfd){.fd = ul->wake_fd, .events = POLLIN};
        if (!ul->wakeup) {
            timeout = 1; /* no wakeup support: poll gently */
        } else {
            busy = ucp_worker_arm(ul->sw) == UCS_ERR_BUSY;
            pfd[npfd++] = (struct pollfd){.fd = ul->sefd, .events = POLLIN};
            for (int s = 0; s < UCX_EPS && !busy; s++) {
                if (ul->eps[s].w == NULL)
                    continue;
                busy = ucp_worker_arm(ul->eps[s].w) == UCS_ERR_BUSY;
                pfd[npfd++] =
                    (struct pollfd){.fd = ul->eps[s].efd, .events = POLLIN};
            }
        }
        if (busy && n > 0)
            continue;
        if (busy)
            timeout = 1; /* events UCX will not progress yet: no spin */
        pthread_mutex_unlock(&ul->lock);
        if (poll(pfd, npfd, timeout) > 0 && (pfd[0].revents & POLLIN)) {
            uint64_t v;
            (void)!read(ul->wake_fd, &v, sizeof(v));
        }
        pthread_mutex_lock(&ul->lock);
    }
    ucx_teardown(ul, true);
    pthread_mutex_unlock(&ul->lock);
    llmdd__link_put(link);
    return NULL;
}

/* Starts the progress thread (once); it holds a link reference. */
static int
ucx_progress_start(ucx_link *ul)
{
    llmdd__link *link = ul->link;

    pthread_mutex_lock(&link->dd->lock);
    link->refs++;
    pthread_mutex_unlock(&link->dd->lock);
    pthread_mutex_lock(&ul->lock);
    ul->progress_started = true;
    pthread_mutex_unlock(&ul->lock);
    if (llmdd__spawn(link->dd, ucx_progress_main, ul) != 0) {
        pthread_mutex_lock(&ul->lock);
        ul->progress_started = false;
        pthread_mutex_unlock(&ul->lock);
        llmdd__link_put(link);
        return -1;
    }
    return 0;
}

/* ---- The exchange connections. ---- */

static bool
ucx_serve_track(ucx_link *ul, int fd, bool add)
{
    bool ok = true;

    pthread_mutex_lock(&ul->lock);
    if (add) {
        ok = !ul->down && ul->nserve < UCX_SERVE_MAX;
        if (ok)
            ul->serve[ul->nserve++] = fd;
    } else {
        for (int i = 0; i < ul->nserve; i++) {
            if (ul->serve[i] == fd) {
                ul->serve[i] = ul->serve[--ul->nserve];
                break;
            }
        }
    }
    pthread_mutex_unlock(&ul->lock);
    return ok;
}

/* The first 8 bytes of every reply: the request's seq. */
static int
ucx_reply_seq(const uint8_t *buf, size_t len, uint64_t *seq)
{
    if (len < 8)
        return -1;
    *seq = 0;
    for (int i = 0; i < 8; i++)
        *seq |= (uint64_t)buf[i] << (8 * i);
    return 0;
}

/*
 * Sends a QUERY or REVOKE on the request connection and receives its reply
 * into buf (cap bytes). A deadline that passes before any byte of the reply
 * arrived leaves the connection usable: a late reply is skipped by its seq,
 * whatever its type and size. Any other failure leaves the stream position
 * unknown and drops the link.
 */
static llmdd_status
ucx_call(ucx_link *ul, uint16_t type, int64_t id, uint16_t rtype,
         uint8_t *buf, size_t cap, size_t *rlen, int64_t deadline)
{
    llmdd__link *link = ul->link;
    llmdd *dd = link->dd;
    uint8_t req[UCX_SMALL_MSG];
    llmdd_status st = LLM_SUCCESS;
    bool broken = false;
    uint8_t *in = buf;
    uint64_t seq;
    int fd;

    /* Stale replies may be larger than this call's. */
    if (cap < LLMDD_WIRE_MAX_PAYLOAD &&
        (in = malloc(LLMDD_WIRE_MAX_PAYLOAD)) == NULL)
        return LLM_OUT_OF_MEMORY;
    pthread_mutex_lock(&ul->lock);
    while (!ul->down && (ul->req_busy || ul->req_fd < 0)) {
        if (llmdd__now_ms() >= deadline) {
            st = LLM_TIMEOUT;
            break;
        }
        ucx_wait_until(ul, deadline);
    }
    if (st == LLM_SUCCESS && ul->down)
        st = LLM_NOT_YET_LINK;
    if (st != LLM_SUCCESS) {
        pthread_mutex_unlock(&ul->lock);
        goto out_free;
    }
    ul->req_busy = true;
    fd = ul->req_fd;
    seq = ++ul->seq;
    pthread_mutex_unlock(&ul->lock);

    size_t n = llmdd__ucx_req_encode(seq, id, req, sizeof(req));
    if (llmdd__send_msg(dd->stop_fd, fd, type, req, n, deadline) != 0) {
        broken = true;
        goto out;
    }
    for (;;) {
        uint64_t rseq;
        uint16_t t;
        bool to;
        int w = llmdd__wait_fd(dd->stop_fd, fd, POLLIN, deadline);
        if (w == 0) {
            st = LLM_TIMEOUT;
            break;
        }
        if (w < 0 ||
            llmdd__recv_msg(dd->stop_fd, fd, &t, in, LLMDD_WIRE_MAX_PAYLOAD,
                            rlen, deadline, &to) != 0 ||
            (t != WMSG_UCX_QUERY_REPLY && t != WMSG_UCX_REVOKE_ACK) ||
            ucx_reply_seq(in, *rlen, &rseq) != 0 || rseq > seq) {
            broken = true;
            break;
        }
        if (rseq < seq)
            continue; /* the late reply to a request that timed out */
        if (t != rtype || *rlen > cap)
            broken = true;
        else if (in != buf)
            memcpy(buf, in, *rlen);
        break;
    }
out:
    pthread_mutex_lock(&ul->lock);
    ul->req_busy = false;
    pthread_cond_broadcast(&ul->cond);
    pthread_mutex_unlock(&ul->lock);
    if (broken) {
        st = llmdd__now_ms() >= deadline ? LLM_TIMEOUT : LLM_NOT_YET_LINK;
        llmdd__link_drop(link, "ucx exchange connection lost");
    }
out_free:
    if (in != buf)
        free(in);
    return st;
}

static int
ucx_send_status(llmdd *dd, int fd, uint16_t type, uint64_t seq, uint32_t st)
{
    uint8_t out[UCX_SMALL_MSG];
    size_t n = type == WMSG_UCX_REVOKE_ACK
                   ? llmdd__ucx_ack_encode(seq, st, out, sizeof(out))
                   : llmdd__ucx_reply_encode(
                         &(llmdd__ucx_reply){.seq = seq, .status = st}, out,
                         sizeof(out));

    return llmdd__send_msg(dd->stop_fd, fd, type, out, n,
                           llmdd__now_ms() + UCX_STALL_MS);
}

/* Builds and sends a successful QUERY_REPLY from a mapped entry. */
static int
ucx_send_reply(llmdd *dd, int fd, uint64_t seq, const llmdd__cache *c,
               const ucx_reg *r)
{
    llmdd__ucx_region *g = calloc(r->nregions, sizeof(*g));
    llmdd__ucx_reply m = {.seq = seq,
                          .status = LLM_SUCCESS,
                          .desc = c->desc,
                          .nregions = r->nregions,
                          .regions = g,
                          .taddr = c->addrs,
                          .treg = r->treg};
    uint8_t *buf = NULL;
    int rc;

    if (g == NULL)
        return ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq,
                               LLM_OUT_OF_MEMORY);
    for (uint32_t i = 0; i < r->nregions; i++)
        g[i] = (llmdd__ucx_region){.base = r->base[i],
                                   .len = r->len[i],
                                   .rkey = r->rkey[i],
                                   .rkey_len = (uint32_t)r->rkey_len[i]};
    size_t need = llmdd__ucx_reply_size(&m);
    if (need == 0 || need > LLMDD_WIRE_MAX_PAYLOAD ||
        (buf = malloc(need)) == NULL) {
        if (need > LLMDD_WIRE_MAX_PAYLOAD || need == 0)
            log_error("ucx: cache %lld: %u tensors do not fit one reply",
                      (long long)c->id, c->desc.num_tensors);
        free(g);
        return ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, LLM_FAILED);
    }
    size_t n = llmdd__ucx_reply_encode(&m, buf, need);
    rc = n == 0 ? ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, LLM_FAILED)
                : llmdd__send_msg(dd->stop_fd, fd, WMSG_UCX_QUERY_REPLY, buf, n,
                                  llmdd__now_ms() + UCX_STALL_MS);
    free(buf);
    free(g);
    return rc;
}

static int
ucx_serve_query(ucx_link *ul, int fd, const uint8_t *buf, size_t len)
{
    llmdd *dd = ul->link->dd;
    llmdd_status st = LLM_KV_CACHE_NOT_EXIST;
    llmdd__cache *c;
    ucx_reg *r = NULL;
    bool dead = false;
    uint64_t seq;
    int64_t id;
    int rc;

    if (llmdd__ucx_req_decode(buf, len, &seq, &id) != 0)
        return -1;
    c = llmdd__cache_get(dd, id);
    if (c == NULL)
        return ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, st);

    pthread_mutex_lock(&ul->lock);
    if (!ul->down) {
        r = ucx_reg_find(ul, id);
        if (r == NULL && (r = calloc(1, sizeof(*r))) != NULL) {
            r->id = id;
            r->next = ul->regs;
            ul->regs = r;
        }
        if (r != NULL)
            r->busy++;
    }
    pthread_mutex_unlock(&ul->lock);
    if (r == NULL) {
        st = LLM_NOT_YET_LINK;
        goto reply;
    }
    pthread_mutex_lock(&ul->map_lock);
    st = r->mapped ? LLM_SUCCESS : ucx_reg_map(ul, r, c);
    pthread_mutex_unlock(&ul->map_lock);

    /* The owner may have removed it meanwhile: then cache_removed either
     * waits for us (the entry is busy) or has passed and never saw it. */
    pthread_mutex_lock(&dd->lock);
    dead = c->dead;
    pthread_mutex_unlock(&dd->lock);
    if (dead)
        st = LLM_KV_CACHE_NOT_EXIST;
    if (st == LLM_SUCCESS) {
        pthread_mutex_lock(&ul->lock);
        r->sent = true; /* before sending: cache_removed must revoke */
        pthread_mutex_unlock(&ul->lock);
    }
reply:
    if (st == LLM_SUCCESS) {
        rc = ucx_send_reply(dd, fd, seq, c, r);
    } else {
        rc = ucx_send_status(dd, fd, WMSG_UCX_QUERY_REPLY, seq, st);
    }
    ucx_reg *orphan = NULL;
    if (r != NULL) {
        pthread_mutex_lock(&ul->lock);
        if (--r->busy == 0 && dead && !r->removed) {
            ucx_reg_unlink(ul, r);
            orphan = r;
        }
        pthread_cond_broadcast(&ul->cond);
        pthread_mutex_unlock(&ul->lock);
    }
    if (orphan != NULL) {
        ucx_reg_unmap(ul, orphan);
        free(orphan);
    }
    llmdd__cache_put(dd, c);
    return rc;
}

/* The owner takes cache `id` back: abort transfers on it, drop its keys. */
static int
ucx_serve_revoke(ucx_link *ul, int fd, const uint8_t *buf, size_t len)
{
    llmdd__link *link = ul->link;
    int64_t deadline = llmdd__now_ms() + UCX_REVOKE_MS - 1000;
    uint32_t st = LLM_SUCCESS;
    uint64_t seq;
    int64_t id;

    if (llmdd__ucx_req_decode(buf, len, &seq, &id) != 0)
        return -1;
    pthread_mutex_lock(&ul->lock);
    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        if (p->id == id)
            p->revoked = true;
    pthread_cond_broadcast(&ul->cond);
    for (;;) {
        bool busy = false;
        for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
            busy = busy || (p->id == id && p->inflight > 0);
        if (!busy)
            break;
        if (llmdd__now_ms() >= deadline) {
            st = LLM_TIMEOUT;
            break;
        }
        ucx_wait_until(ul, deadline);
    }
    if (st == LLM_SUCCESS)
        for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
            if (p->id == id)
                for (int s = 0; s < UCX_EPS; s++)
                    ucx_rc_drop_keys(p, s);
    pthread_mutex_unlock(&ul->lock);
    llmdd__link_forget(link, id);
    return ucx_send_status(link->dd, fd, WMSG_UCX_REVOKE_ACK, seq, st);
}

/* Answers the peer's requests on fd until it closes or the link goes down. */
static void
ucx_serve(ucx_link *ul, int fd)
{
    llmdd__link *link = ul->link;
    llmdd *dd = link->dd;
    uint8_t buf[UCX_SMALL_MSG];

    if (!ucx_serve_track(ul, fd, true)) {
        close(fd);
        return;
    }
    for (;;) {
        uint16_t type;
        size_t len;
        bool to;
        int rc = -1;

        /* Idle connections wait for as long as the link lives. */
        if (llmdd__wait_fd(dd->stop_fd, fd, POLLIN, INT64_MAX) != 1 ||
            llmdd__recv_msg(dd->stop_fd, fd, &type, buf, sizeof(buf), &len,
                            llmdd__now_ms() + UCX_STALL_MS, &to) != 0)
            break;
        if (type == WMSG_UCX_QUERY)
            rc = ucx_serve_query(ul, fd, buf, len);
        else if (type == WMSG_UCX_REVOKE)
            rc = ucx_serve_revoke(ul, fd, buf, len);
        if (rc != 0)
            break;
    }
    ucx_serve_track(ul, fd, false);
    close(fd);
    pthread_mutex_lock(&ul->lock);
    bool down = ul->down;
    pthread_mutex_unlock(&ul->lock);
    if (!down)
        llmdd__link_drop(link, "ucx exchange connection closed");
}

struct ucx_serve_arg {
    ucx_link *ul;
    int fd;
};

static void *
ucx_serve_main(void *p)
{
    struct ucx_serve_arg a = *(struct ucx_serve_arg *)p;
    llmdd__link *link = a.ul->link;

    free(p);
    ucx_serve(a.ul, a.fd);
    llmdd__link_put(link);
    return NULL;
}

/* Our serve worker's address as a HELLO payload; *out is malloc'd. */
static size_t
ucx_hello_make(ucx_link *ul, uint32_t status, uint8_t **out)
{
    unsigned maj, min, rel;
    ucp_address_t *addr = NULL;
    size_t alen = 0, n = 0;
    uint8_t *buf = NULL;

    *out = NULL;
    ucp_get_version(&maj, &min, &rel);
    if (status == LLM_SUCCESS) {
        pthread_mutex_lock(&ul->lock);
        ucs_status_t st = ucp_worker_get_address(ul->sw, &addr, &alen);
        pthread_mutex_unlock(&ul->lock);
        if (st != UCS_OK || alen == 0 || alen > LLMDD_UCX_ADDR_MAX) {
            log_error("ucx: worker address: %s", ucs_status_string(st));
            if (st == UCS_OK)
                ucp_worker_release_address(ul->sw, addr);
            return 0;
        }
    }
    llmdd__ucx_hello h = {.version = LLMDD_UCX_WIRE_VERSION,
                          .ucp_version = maj << 16 | min << 8 | rel,
                          .flags = ucx_probed.rdma ? LLMDD_UCX_HELLO_RDMA : 0,
                          .key = ul->key,
                          .addr = (const uint8_t *)addr,
                          .addr_len = (uint32_t)alen};
    size_t cap = 32 + alen;
    if ((buf = malloc(cap)) != NULL)
        n = llmdd__ucx_hello_encode(status, &h, buf, cap);
    if (addr != NULL) {
        pthread_mutex_lock(&ul->lock);
        ucp_worker_release_address(ul->sw, addr);
        pthread_mutex_unlock(&ul->lock);
    }
    if (n == 0)
        free(buf);
    else
        *out = buf;
    return n;
}

/* Takes the peer's HELLO: stores its address, opens the first endpoint. */
static llmdd_status
ucx_hello_take(ucx_link *ul, const uint8_t *buf, size_t len)
{
    llmdd__ucx_hello h;
    uint32_t status;
    unsigned maj, min, rel;

    if (llmdd__ucx_hello_decode(buf, len, &status, &h) != 0) {
        log_error("ucx: cluster %llu sent a malformed hello",
                  (unsigned long long)ucx_cluster(ul));
        return LLM_LINK_FAILED;
    }
    if (status != LLM_SUCCESS)
        return LLM_LINK_FAILED;
    if (h.version != LLMDD_UCX_WIRE_VERSION) {
        log_error("ucx: cluster %llu speaks exchange version %u, not %u",
                  (unsigned long long)ucx_cluster(ul), h.version,
                  LLMDD_UCX_WIRE_VERSION);
        return LLM_LINK_FAILED;
    }
    ucp_get_version(&maj, &min, &rel);
    if (h.ucp_version >> 8 != (maj << 8 | min))
        log_warn("ucx: cluster %llu runs UCX %u.%u, we run %u.%u",
                 (unsigned long long)ucx_cluster(ul), h.ucp_version >> 16,
                 (h.ucp_version >> 8) & 0xff, maj, min);
    uint8_t *addr = malloc(h.addr_len);
    if (addr == NULL)
        return LLM_OUT_OF_MEMORY;
    memcpy(addr, h.addr, h.addr_len);
    pthread_mutex_lock(&ul->lock);
    llmdd_status st = LLM_LINK_FAILED;
    if (!ul->down && ul->peer_addr == NULL) {
        ul->peer_addr = addr;
        ul->peer_addr_len = h.addr_len;
        ul->peer_key = h.key;
        addr = NULL;
        /* RMA only where both sides have RDMA: elsewhere UCX 1.13 would
         * emulate it, and aborts on a peer that dies (see above). */
        ul->rma = ucx_probed.rma_env >= 0
                      ? ucx_probed.rma_env == 1
                      : ucx_probed.rdma && (h.flags & LLMDD_UCX_HELLO_RDMA);
        log_info("ucx: cluster %llu: transfers use %s",
                 (unsigned long long)ucx_cluster(ul),
                 ul->rma ? "RMA" : "active messages");
        /* The client's endpoints open now (an unreachable peer, with no
         * common transport, fails the link); the server's when it first
         * transfers. */
        st = ul->link->client ? ucx_ep_open(ul, 0) : LLM_SUCCESS;
        pthread_cond_broadcast(&ul->cond);
    }
    pthread_mutex_unlock(&ul->lock);
    free(addr);
    return st;
}

/* Server side of UCX_HELLO, then serves the connection. */
static void
ucx_accept_hello(ucx_link *ul, int fd)
{
    llmdd *dd = ul->link->dd;
    int64_t deadline = llmdd__now_ms() + UCX_STALL_MS;
    size_t cap = 32 + LLMDD_UCX_ADDR_MAX;
    uint8_t *buf = malloc(cap), *out = NULL;
    llmdd_status st = LLM_LINK_FAILED;
    uint16_t type;
    size_t len, n;
    bool to;

    pthread_mutex_lock(&ul->lock);
    bool first = !ul->hello_done && !ul->down;
    ul->hello_done = true;
    pthread_mutex_unlock(&ul->lock);
    if (buf == NULL || !first ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, cap, &len, deadline,
                        &to) != 0 ||
        type != WMSG_UCX_HELLO)
        goto err;
    st = ucx_hello_take(ul, buf, len);
    if (st == LLM_SUCCESS && ucx_progress_start(ul) != 0)
        st = LLM_FAILED;
    n = ucx_hello_make(ul, st, &out);
    if (n == 0 ||
        llmdd__send_msg(dd->stop_fd, fd, WMSG_UCX_HELLO_REPLY, out, n,
                        deadline) != 0 ||
        st != LLM_SUCCESS)
        goto err;
    free(out);
    free(buf);
    ucx_serve(ul, fd);
    return;
err:
    free(out);
    free(buf);
    close(fd);
    /* The client fails its link call; our half must not linger. */
    llmdd__link_drop(ul->link, "ucx hello failed");
}

/* ---- Ops. ---- */

static bool
ucx_reaches(const llmdd__link *link)
{
    pthread_once(&ucx_probe_once, ucx_probe_run);
    if (!ucx_probed.ok)
        return false;
    /* The server only checks that it can serve what the client chose. */
    if (!link->client)
        return true;
    /* Client side: named by either side, ucx reaches any peer; under auto
     * it is for other hosts with RDMA. */
    if (link->forced)
        return true;
    return ucx_probed.rdma && memcmp(link->peer.boot_id, llmdd__boot_id(),
                                     LLMDD_BOOT_ID_LEN) != 0;
}

/* Once per process: what a forced ucx over UCX 1.13's tcp still risks. */
static pthread_once_t ucx_warn_once = PTHREAD_ONCE_INIT;

static void
ucx_warn_tcp(void)
{
    unsigned maj, min, rel;

    ucp_get_version(&maj, &min, &rel);
    if (ucx_probed.tcp && !ucx_probed.rdma &&
        (maj << 8 | min) <= (1u << 8 | 13))
        log_warn("ucx: UCX %u.%u over tcp aborts a process whose peer dies "
                 "while their link is being made (docs/rdma.md); prefer "
                 "llm.Transport=auto or tcp here",
                 maj, min);
}

static ucx_link *
ucx_link_new(llmdd__link *link)
{
    ucx_link *ul = calloc(1, sizeof(*ul));

    if (ul == NULL)
        return NULL;
    ul->link = link;
    ul->req_fd = -1;
    ul->wake_fd = -1;
    ul->sefd = -1;
    for (int s = 0; s < UCX_EPS; s++) {
        ul->eps[s].ul = ul;
        ul->eps[s].efd = -1;
    }
    pthread_mutex_init(&ul->lock, NULL);
    pthread_mutex_init(&ul->map_lock, NULL);
    llmdd__cond_init(&ul->cond);
    return ul;
}

static llmdd_status
ucx_workers_init(ucx_link *ul)
{
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t st;

    ul->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (ul->wake_fd < 0 || llmdd__random(&ul->key, sizeof(ul->key)) != 0)
        return LLM_FAILED;
    pthread_once(&ucx_probe_once, ucx_probe_run);
    pthread_once(&ucx_warn_once, ucx_warn_tcp);
    if ((ul->ctx = ucx_ctx_get()) == NULL)
        return LLM_LINK_FAILED;
    if ((st = ucp_worker_create(ul->ctx, &wp, &ul->sw)) != UCS_OK) {
        log_error("ucx: ucp_worker_create: %s", ucs_status_string(st));
        return LLM_LINK_FAILED;
    }
    static const unsigned ids[] = {LLMDD_UCX_AM_GET, LLMDD_UCX_AM_PUT,
                                   LLMDD_UCX_AM_PING};
    static const ucp_am_recv_callback_t cbs[] = {ucx_am_get, ucx_am_put,
                                                 ucx_am_ping};
    if ((st = ucx_am_install(ul->sw, ids, cbs, 3, ul)) != UCS_OK) {
        log_error("ucx: active message handlers: %s", ucs_status_string(st));
        return LLM_LINK_FAILED;
    }
    ul->wakeup = ucp_worker_get_efd(ul->sw, &ul->sefd) == UCS_OK;
    if (!ul->wakeup) {
        log_warn("ucx: no wakeup support; progress polls every millisecond");
        ul->sefd = -1;
    }
    return LLM_SUCCESS;
}

static llmdd_status
ucx_link_init(llmdd__link *link, bool client)
{
    ucx_link *ul = ucx_link_new(link);
    llmdd *dd = link->dd;
    int64_t deadline = link->deadline_ms;
    uint8_t *out = NULL, *buf = NULL;
    llmdd_status st;
    uint16_t type;
    size_t n, len;
    bool to = false; /* a failed send leaves it unset */

    if (ul == NULL)
        return LLM_OUT_OF_MEMORY;
    link->tp = ul;
    if ((st = ucx_workers_init(ul)) != LLM_SUCCESS || !client)
        return st;

    /* FWD: the address exchange, then our requests. */
    int fd = llmdd__data_connect(link, UCX_FLAG_HELLO, deadline);
    if (fd < 0)
        return llmdd__now_ms() >= deadline ? LLM_TIMEOUT : LLM_LINK_FAILED;
    pthread_mutex_lock(&ul->lock);
    ul->req_fd = fd;
    pthread_mutex_unlock(&ul->lock);
    st = LLM_LINK_FAILED;
    size_t cap = 32 + LLMDD_UCX_ADDR_MAX;
    if ((n = ucx_hello_make(ul, LLM_SUCCESS, &out)) == 0 ||
        (buf = malloc(cap)) == NULL)
        goto out;
    if (llmdd__send_msg(dd->stop_fd, fd, WMSG_UCX_HELLO, out, n, deadline) !=
            0 ||
        llmdd__recv_msg(dd->stop_fd, fd, &type, buf, cap, &len, deadline,
                        &to) != 0 ||
        type != WMSG_UCX_HELLO_REPLY) {
        st = to ? LLM_TIMEOUT : LLM_LINK_FAILED;
        log_error("ucx: hello with cluster %llu %s",
                  (unsigned long long)link->peer.cluster_id,
                  to ? "timed out" : "failed");
        goto out;
    }
    if ((st = ucx_hello_take(ul, buf, len)) != LLM_SUCCESS)
        goto out;
    if (ucx_progress_start(ul) != 0) {
        st = LLM_FAILED;
        goto out;
    }

    /* REV: the server's requests, which we serve. */
    int rev = llmdd__data_connect(link, UCX_FLAG_REV, deadline);
    struct ucx_serve_arg *a = rev < 0 ? NULL : malloc(sizeof(*a));
    if (a == NULL) {
        if (rev >= 0)
            close(rev);
        st = LLM_LINK_FAILED;
        goto out;
    }
    a->ul = ul;
    a->fd = rev;
    pthread_mutex_lock(&dd->lock);
    link->refs++;
    pthread_mutex_unlock(&dd->lock);
    if (llmdd__spawn(dd, ucx_serve_main, a) != 0) {
        close(rev);
        free(a);
        llmdd__link_put(link);
        st = LLM_LINK_FAILED;
        goto out;
    }

    /* Every endpoint wired before the link is up: see ucx_ep_wire. */
    pthread_mutex_lock(&ul->lock);
    for (int s = 0; s < UCX_EPS && st == LLM_SUCCESS; s++)
        if (ul->eps[s].ep == NULL)
            st = ucx_ep_open(ul, s); /* their wireups run at once */
    for (int s = 0; s < UCX_EPS && st == LLM_SUCCESS; s++)
        st = ucx_ep_wire(ul, s, deadline);
    pthread_mutex_unlock(&ul->lock);
    if (st == LLM_NOT_YET_LINK)
        st = LLM_LINK_FAILED;
out:
    free(buf);
    free(out);
    return st;
}

static void
ucx_accept_conn(llmdd__link *link, int fd, uint32_t flags)
{
    ucx_link *ul = link->tp;

    if (flags == UCX_FLAG_REV) {
        pthread_mutex_lock(&ul->lock);
        bool take = !ul->down && ul->req_fd < 0 && !link->client;
        if (take) {
            ul->req_fd = fd;
            pthread_cond_broadcast(&ul->cond);
        }
        pthread_mutex_unlock(&ul->lock);
        if (!take)
            close(fd);
        return;
    }
    if (flags == UCX_FLAG_HELLO && !link->client) {
        ucx_accept_hello(ul, fd); /* serves in this counted thread */
        return;
    }
    close(fd);
}

static void
ucx_link_shutdown(llmdd__link *link)
{
    ucx_link *ul = link->tp;

    if (ul == NULL)
        return;
    pthread_mutex_lock(&ul->lock);
    ul->down = true;
    if (ul->req_fd >= 0)
        shutdown(ul->req_fd, SHUT_RDWR);
    for (int i = 0; i < ul->nserve; i++)
        shutdown(ul->serve[i], SHUT_RDWR);
    pthread_cond_broadcast(&ul->cond);
    pthread_mutex_unlock(&ul->lock);
    if (ul->wake_fd >= 0)
        ucx_wake(ul);
}

static void
ucx_link_fini(llmdd__link *link)
{
    ucx_link *ul = link->tp;

    /* Every thread that used the link is gone. */
    pthread_mutex_lock(&ul->lock);
    ul->down = true;
    ucx_teardown(ul, true);
    for (ucx_rc *p = ul->rcs; p != NULL; p = p->next)
        p->ul = NULL; /* remote_free runs after us */
    ul->rcs = NULL;
    pthread_mutex_unlock(&ul->lock);
    if (ul->ctx != NULL)
        ucx_ctx_put();
    if (ul->req_fd >= 0)
        close(ul->req_fd);
    if (ul->wake_fd >= 0)
        close(ul->wake_fd);
    free(ul->peer_addr);
    for (int s = 0; s < UCX_EPS; s++) {
        free(ul->eps[s].ops);
        free(ul->eps[s].free_ops);
    }
    pthread_cond_destroy(&ul->cond);
    pthread_mutex_destroy(&ul->map_lock);
    pthread_mutex_destroy(&ul->lock);
    free(ul);
    link->tp = NULL;
}

static void
ucx_rc_unlist(ucx_link *ul, ucx_rc *p)
{
    if (p->prev != NULL)
        p->prev->next = p->next;
    else if (ul->rcs == p)
        ul->rcs = p->next;
    if (p->next != NULL)
        p->next->prev = p->prev;
    p->prev = p->next = NULL;
}

/* Copies a decoded reply into p; every key is checked first. */
static llmdd_status
ucx_rc_fill(ucx_rc *p, const llmdd__ucx_reply *m)
{
    p->nregions = m->nregions;
    p->ntensors = m->desc.num_tensors;
    p->rkey_buf = calloc(m->nregions, sizeof(*p->rkey_buf));
    p->rkey_len = calloc(m->nregions, sizeof(*p->rkey_len));
    p->taddr = malloc(p->ntensors * sizeof(*p->taddr));
    p->treg = malloc(p->ntensors * sizeof(*p->treg));
    if (p->rkey_buf == NULL || p->rkey_len == NULL || p->taddr == NULL ||
        p->treg == NULL)
        return LLM_OUT_OF_MEMORY;
    for (uint32_t i = 0; i < m->nregions; i++) {
        const llmdd__ucx_region *g = &m->regions[i];
        if (!ucx_rkey_sane(g->rkey, g->rkey_len))
            return LLM_FAILED;
        if ((p->rkey_buf[i] = malloc(g->rkey_len)) == NULL)
            return LLM_OUT_OF_MEMORY;
        memcpy(p->rkey_buf[i], g->rkey, g->rkey_len);
        p->rkey_len[i] = g->rkey_len;
    }
    memcpy(p->taddr, m->taddr, p->ntensors * sizeof(*p->taddr));
    memcpy(p->treg, m->treg, p->ntensors * sizeof(*p->treg));
    return LLM_SUCCESS;
}

static llmdd_status
ucx_query(llmdd__link *link, int64_t id, int64_t deadline,
          llmdd__remote_cache *out)
{
    ucx_link *ul = link->tp;
    llmdd__ucx_reply m;
    llmdd_status st;
    uint8_t *buf;
    size_t len;
    ucx_rc *p = calloc(1, sizeof(*p));

    if (p == NULL)
        return LLM_OUT_OF_MEMORY;
    p->id = id;
    /* Listed from the start, so that a REVOKE racing the reply marks it. */
    pthread_mutex_lock(&ul->lock);
    p->ul = ul;
    p->next = ul->rcs;
    if (ul->rcs != NULL)
        ul->rcs->prev = p;
    ul->rcs = p;
    pthread_mutex_unlock(&ul->lock);

    buf = malloc(LLMDD_WIRE_MAX_PAYLOAD);
    st = buf == NULL ? LLM_OUT_OF_MEMORY
                     : ucx_call(ul, WMSG_UCX_QUERY, id, WMSG_UCX_QUERY_REPLY,
                                buf, LLMDD_WIRE_MAX_PAYLOAD, &len, deadline);
    if (st == LLM_SUCCESS) {
        if (llmdd__ucx_reply_decode(buf, len, &m) != 0) {
            log_error("ucx: cluster %llu sent a malformed reply for cache "
                      "%lld",
                      (unsigned long long)link->peer.cluster_id,
                      (long long)id);
            st = LLM_FAILED;
        } else {
            if (m.status == LLM_SUCCESS)
                st = ucx_rc_fill(p, &m);
            else
                st = m.status == LLM_KV_CACHE_NOT_EXIST ||
                             m.status == LLM_NOT_YET_LINK
                         ? (llmdd_status)m.status
                         : LLM_FAILED;
            if (st == LLM_FAILED && m.status == LLM_SUCCESS)
                log_error("ucx: cluster %llu sent a bad key for cache %lld",
                          (unsigned long long)link->peer.cluster_id,
                          (long long)id);
            if (st == LLM_SUCCESS) {
                uint64_t stride;
                out->desc = m.desc;
                llmdd__desc_check(&m.desc, &out->tensor_size, &stride);
                out->stride = stride;
            }
            llmdd__ucx_reply_free(&m);
        }
    }
    free(buf);
    pthread_mutex_lock(&ul->lock);
    if (st == LLM_SUCCESS && p->revoked)
        st = LLM_KV_CACHE_NOT_EXIST;
    if (st != LLM_SUCCESS)
        ucx_rc_unlist(ul, p);
    else
        out->priv = p;
    pthread_mutex_unlock(&ul->lock);
    if (st != LLM_SUCCESS)
        ucx_rc_free(p);
    return st;
}

static void
ucx_remote_free(llmdd__remote_cache *rc)
{
    ucx_rc *p = rc->priv;

    if (p == NULL)
        return;
    rc->priv = NULL;
    ucx_link *ul = p->ul;
    if (ul != NULL) {
        pthread_mutex_lock(&ul->lock);
        for (int s = 0; s < UCX_EPS; s++)
            ucx_rc_drop_keys(p, s);
        ucx_rc_unlist(ul, p);
        pthread_mutex_unlock(&ul->lock);
    }
    ucx_rc_free(p);
}

/* ---- Transfers. ---- */

/*
 * Waits (lock held) until at most `max` operations and `max_bytes` bytes
 * asked with active messages are in flight. Fails on the deadline, a down
 * link, a failed endpoint or operation, a refusal, or a revoke.
 */
static llmdd_status
ucx_xwait(ucx_link *ul, ucx_rc *p, int s, ucx_xstate *xs, size_t max,
          size_t max_bytes, int64_t deadline)
{
    for (;;) {
        if (ul->down)
            return LLM_NOT_YET_LINK;
        if (xs->status != UCS_OK || ul->eps[s].failed)
            return LLM_NOT_YET_LINK;
        if (xs->refused != LLM_SUCCESS)
            return xs->refused;
        if (p->revoked)
            return LLM_KV_CACHE_NOT_EXIST;
        if (xs->outstanding <= max && xs->bytes <= max_bytes)
            return LLM_SUCCESS;
        if (llmdd__now_ms() >= deadline)
            return LLM_TIMEOUT;
        xs->wake_at = max;
        /* Make the progress thread look: posting may leave work queued. */
        ucp_worker_signal(ul->eps[s].w);
        ucx_wait_until(ul, deadline);
    }
}

/* Claims an endpoint slot for one transfer (lock held). */
static llmdd_status
ucx_xbegin(ucx_link *ul, ucx_rc *p, int64_t deadline, int *slot)
{
    for (;;) {
        if (ul->down || ul->sw == NULL)
            return LLM_NOT_YET_LINK;
        if (p->revoked)
            return LLM_KV_CACHE_NOT_EXIST;
        int s = -1;
        if (ul->peer_addr != NULL) {
            /* An open idle endpoint first, then an empty slot. */
            for (int i = 0; i < UCX_EPS && s < 0; i++)
                if (!ul->eps[i].busy && ul->eps[i].ep != NULL &&
                    !ul->eps[i].failed)
                    s = i;
            for (int i = 0; i < UCX_EPS && s < 0; i++)
                if (!ul->eps[i].busy && ul->eps[i].ep == NULL)
                    s = i;
        }
        if (s >= 0) {
            llmdd_status st = LLM_SUCCESS;
            ul->eps[s].busy = true;
            if (ul->eps[s].ep == NULL &&
                (st = ucx_ep_open(ul, s)) == LLM_SUCCESS)
                st = ucx_ep_wire(ul, s, deadline);
            if (st == LLM_SUCCESS)
                st = ucx_rc_keys(ul, p, s);
            if (st != LLM_SUCCESS) {
                ul->eps[s].busy = false;
                pthread_cond_broadcast(&ul->cond);
                return st == LLM_LINK_FAILED ? LLM_NOT_YET_LINK : st;
            }
            *slot = s;
            return LLM_SUCCESS;
        }
        if (llmdd__now_ms() >= deadline)
            return LLM_TIMEOUT;
        ucx_wait_until(ul, deadline);
    }
}

/* One transfer's claim on an endpoint and its operations in flight. */
typedef struct {
    ucx_link *ul;
    ucx_rc *p;
    int s;
    ucp_ep_h ep;
    int64_t deadline;
    ucx_xstate xs;
    ucp_request_param_t prm;
    bool am; /* active messages, not RMA */
} ucx_xctx;

/* Posts one GET or PUT active message per chunk of the range, each once
 * the window has room (lock held). */
static llmdd_status
ucx_am_post(ucx_xctx *c, bool write, uint8_t *local, uint64_t raddr, size_t len)
{
    ucx_ep *e = &c->ul->eps[c->s];
    ucp_request_param_t prm = c->prm;

    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    while (len > 0) {
        size_t n = len < LLMDD_UCX_AM_CHUNK ? len : LLMDD_UCX_AM_CHUNK;
        /* Room for the operation and its send request. */
        llmdd_status st = ucx_xwait(c->ul, c->p, c->s, &c->xs, UCX_WINDOW - 2,
                                    UCX_AM_BYTES - n, c->deadline);
        if (st != LLM_SUCCESS)
            return st;
        uint16_t i = e->free_ops[--e->nfree];
        ucx_amop *op = &e->ops[i];
        op->tag = ++e->tags << UCX_WINDOW_BITS | i;
        op->dst = write ? NULL : local;
        op->len = n;
        op->xs = &c->xs;
        llmdd__ucx_amreq m = {
            .key = c->ul->peer_key, .tag = op->tag, .addr = raddr, .len = n};
        llmdd__ucx_amreq_encode(&m, op->hdr, sizeof(op->hdr));
        c->xs.outstanding++;
        c->xs.bytes += n;
        ucs_status_ptr_t sp = ucp_am_send_nbx(
            c->ep, write ? LLMDD_UCX_AM_PUT : LLMDD_UCX_AM_GET, op->hdr,
            sizeof(op->hdr), write ? local : NULL, write ? n : 0, &prm);
        if (UCS_PTR_IS_ERR(sp))
            c->xs.status = UCS_PTR_STATUS(sp);
        else if (sp != NULL)
            c->xs.outstanding++; /* ucx_op_done frees it */
        local += n;
        raddr += n;
        len -= n;
    }
    return LLM_SUCCESS;
}

/* Posts one get or put once the window has room (lock held). */
static llmdd_status
ucx_post(ucx_xctx *c, bool write, void *local, uint64_t raddr,
         ucp_rkey_h key, size_t len)
{
    if (c->am)
        return ucx_am_post(c, write, local, raddr, len);
    llmdd_status st = ucx_xwait(c->ul, c->p, c->s, &c->xs, UCX_WINDOW - 1,
                                SIZE_MAX, c->deadline);

    if (st != LLM_SUCCESS)
        return st;
    ucs_status_ptr_t sp = write
                              ? ucp_put_nbx(c->ep, local, len, raddr, key,
                                            &c->prm)
                              : ucp_get_nbx(c->ep, local, len, raddr, key,
                                            &c->prm);
    if (UCS_PTR_IS_ERR(sp))
        c->xs.status = UCS_PTR_STATUS(sp);
    else if (sp != NULL)
        c->xs.outstanding++; /* ucx_op_done frees it */
    return LLM_SUCCESS;
}

/* Every run of every tensor as its own operation. */
static llmdd_status
ucx_xfer_runs(ucx_xctx *c, const llmdd__xfer *x)
{
    ucp_rkey_h *keys = c->p->rkeys[c->s];
    llmdd_status st = LLM_SUCCESS;

    for (uint32_t t = 0; t < x->count && st == LLM_SUCCESS; t++) {
        uint32_t rt = x->remote_first + t;
        ucp_rkey_h key = keys[c->p->treg[rt]];
        for (size_t r = 0; r < x->nruns && st == LLM_SUCCESS; r++)
            st = ucx_post(c, x->write, x->local[t] + x->runs[r].local_off,
                          c->p->taddr[rt] + x->runs[r].remote_off, key,
                          (size_t)x->runs[r].len);
    }
    /* An RMA put is complete at the peer only once the endpoint is
     * flushed; an active-message PUT once it is acknowledged. */
    if (st == LLM_SUCCESS && x->write && !c->am && c->xs.status == UCS_OK) {
        ucs_status_ptr_t sp = ucp_ep_flush_nbx(c->ep, &c->prm);
        if (UCS_PTR_IS_ERR(sp))
            c->xs.status = UCS_PTR_STATUS(sp);
        else if (sp != NULL)
            c->xs.outstanding++;
    }
    if (st == LLM_SUCCESS)
        st = ucx_xwait(c->ul, c->p, c->s, &c->xs, 0, 0, c->deadline);
    return st;
}

/*
 * Whether a pull is many small runs close together (paged blocks): then one
 * read of their span per tensor and local copies beat an operation per run,
 * above all where UCX emulates RMA with a message per operation.
 */
static bool
ucx_gather_span(const llmdd__xfer *x, uint64_t *lo_out, uint64_t *span_out)
{
    uint64_t lo = UINT64_MAX, hi = 0, bytes = 0;

    if (x->write || x->nruns < UCX_GATHER_MIN_RUNS)
        return false;
    for (size_t r = 0; r < x->nruns; r++) {
        const llmdd__xrun *run = &x->runs[r];
        lo = run->remote_off < lo ? run->remote_off : lo;
        hi = run->remote_off + run->len > hi ? run->remote_off + run->len : hi;
        if (__builtin_add_overflow(bytes, run->len, &bytes))
            bytes = UINT64_MAX;
    }
    if (bytes / x->nruns >= UCX_GATHER_SMALL || hi - lo > UCX_GATHER_MAX ||
        (hi - lo) / UCX_GATHER_DENSITY > bytes)
        return false;
    *lo_out = lo;
    *span_out = hi - lo;
    return true;
}

/*
 * The gathered pull: spans of a batch of tensors land in a bounce buffer,
 * then the runs are copied out in order, so a later run wins as it would
 * run by run. Lock held; dropped for the copies.
 */
static llmdd_status
ucx_xfer_gather(ucx_xctx *c, const llmdd__xfer *x, uint64_t lo,
                uint64_t span, uint8_t **bounce_out)
{
    ucp_rkey_h *keys = c->p->rkeys[c->s];
    uint32_t batch = span >= UCX_GATHER_BATCH
                         ? 1
                         : (uint32_t)(UCX_GATHER_BATCH / span);
    llmdd_status st = LLM_SUCCESS;

    if (batch > x->count)
        batch = x->count;
    uint8_t *bounce = malloc((size_t)batch * span);
    if (bounce == NULL)
        return LLM_OUT_OF_MEMORY;
    *bounce_out = bounce; /* freed by the caller, after any close */
    for (uint32_t t0 = 0; t0 < x->count && st == LLM_SUCCESS; t0 += batch) {
        uint32_t n = x->count - t0 < batch ? x->count - t0 : batch;
        for (uint32_t i = 0; i < n && st == LLM_SUCCESS; i++) {
            uint32_t rt = x->remote_first + t0 + i;
            st = ucx_post(c, false, bounce + (size_t)i * span,
                          c->p->taddr[rt] + lo, keys[c->p->treg[rt]],
                          (size_t)span);
        }
        if (st == LLM_SUCCESS)
            st = ucx_xwait(c->ul, c->p, c->s, &c->xs, 0, 0, c->deadline);
        if (st != LLM_SUCCESS)
            break;
        pthread_mutex_unlock(&c->ul->lock);
        for (uint32_t i = 0; i < n; i++) {
            const uint8_t *src = bounce + (size_t)i * span - lo;
            uint8_t *dst = x->local[t0 + i];
            for (size_t r = 0; r < x->nruns; r++)
                memcpy(dst + x->runs[r].local_off, src + x->runs[r].remote_off,
                       (size_t)x->runs[r].len);
        }
        pthread_mutex_lock(&c->ul->lock);
    }
    return st;
}

/*
 * Ends a transfer that failed with operations possibly in flight, so that
 * none writes into the caller's buffers after we return. Lock held.
 */
static void
ucx_xabort(ucx_xctx *c)
{
    ucx_link *ul = c->ul;
    ucx_ep *e = &ul->eps[c->s];

    ucx_am_forget(e, &c->xs);
    if (c->xs.outstanding == 0 && !e->failed && c->xs.status == UCS_OK)
        return; /* nothing in flight: the endpoint stays usable */
    ucx_slot_abort(ul, c->s, &c->xs);
    c->xs.outstanding = 0;
}

static llmdd_status
ucx_xfer(llmdd__link *link, const llmdd__xfer *x)
{
    ucx_link *ul = link->tp;
    ucx_xctx c = {.ul = ul, .p = x->remote->priv, .deadline = x->deadline_ms};
    uint8_t *bounce = NULL;
    uint64_t lo, span;
    llmdd_status st;

    if (c.p == NULL)
        return LLM_KV_CACHE_NOT_EXIST;
    c.xs.ul = ul;
    c.prm = (ucp_request_param_t){
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = ucx_op_done,
        .user_data = &c.xs,
    };
    pthread_mutex_lock(&ul->lock);
    if ((st = ucx_xbegin(ul, c.p, x->deadline_ms, &c.s)) != LLM_SUCCESS) {
        pthread_mutex_unlock(&ul->lock);
        return st;
    }
    ul->users++;
    c.p->inflight++;
    c.ep = ul->eps[c.s].ep;
    c.am = !ul->rma;
    if (ucx_gather_span(x, &lo, &span))
        st = ucx_xfer_gather(&c, x, lo, span, &bounce);
    else
        st = ucx_xfer_runs(&c, x);
    if (st != LLM_SUCCESS && c.xs.status != UCS_OK && !ul->down)
        log_error("ucx: cluster %llu: %s failed: %s",
                  (unsigned long long)link->peer.cluster_id,
                  x->write ? "put" : "get", ucs_status_string(c.xs.status));
    if (st != LLM_SUCCESS)
        ucx_xabort(&c);
    bool peer_failed = st == LLM_NOT_YET_LINK && !ul->down;
    ul->eps[c.s].busy = false;
    c.p->inflight--;
    /* The progress thread leaves a down link once no transfer needs it. */
    bool wake = --ul->users == 0 && ul->down;
    pthread_cond_broadcast(&ul->cond);
    pthread_mutex_unlock(&ul->lock);
    free(bounce);
    if (peer_failed)
        llmdd__link_drop(link, "UCX operation failed");
    if (wake)
        ucx_wake(ul);
    return st;
}

/* ---- Cache removal, owner side. ---- */

static void
ucx_cache_removed(llmdd__link *link, const llmdd__cache *cache)
{
    ucx_link *ul = link->tp;
    uint8_t buf[UCX_SMALL_MSG];
    size_t len;

    if (ul == NULL)
        return;
    pthread_mutex_lock(&ul->lock);
    ucx_reg *r = ucx_reg_find(ul, cache->id);
    if (r == NULL) {
        pthread_mutex_unlock(&ul->lock);
        return;
    }
    r->removed = true;
    while (r->busy > 0)
        ucx_wait_until(ul, INT64_MAX); /* a reply in flight, bounded */
    ucx_reg_unlink(ul, r);
    bool sent = r->sent;
    /* DATA replies still reading it (active messages) end first. */
    int64_t until = llmdd__now_ms() + UCX_STALL_MS;
    while (r->sending > 0 && llmdd__now_ms() < until)
        ucx_wait_until(ul, until);
    bool released = r->sending == 0;
    pthread_mutex_unlock(&ul->lock);

    if (sent && released) {
        uint64_t seq;
        uint32_t ack = LLM_FAILED;
        llmdd_status st = ucx_call(ul, WMSG_UCX_REVOKE, cache->id,
                                   WMSG_UCX_REVOKE_ACK, buf, sizeof(buf),
                                   &len, llmdd__now_ms() + UCX_REVOKE_MS);
        if (st == LLM_SUCCESS &&
            llmdd__ucx_ack_decode(buf, len, &seq, &ack) != 0)
            ack = LLM_FAILED;
        released = st == LLM_SUCCESS && ack == LLM_SUCCESS;
    }
    if (!released) {
        llmdd__link_drop(link, "peer did not release a removed cache");
        /* Nothing may reach the memory once we return: wait until the
         * workers are gone (transfers abort once the link is down). */
        until = llmdd__now_ms() + UCX_STALL_MS;
        pthread_mutex_lock(&ul->lock);
        while (ul->progress_started && !ul->torn_down &&
               llmdd__now_ms() < until)
            ucx_wait_until(ul, until);
        if (!ul->torn_down && ul->progress_started)
            log_error("ucx: cluster %llu: workers still up after a "
                      "failed revoke",
                      (unsigned long long)link->peer.cluster_id);
        pthread_mutex_unlock(&ul->lock);
    }
    ucx_reg_unmap(ul, r);
    free(r);
}

const llmdd_transport_ops llmdd__ucx_ops = {
    .name = "ucx",
    .reaches = ucx_reaches,
    .link_init = ucx_link_init,
    .link_shutdown = ucx_link_shutdown,
    .link_fini = ucx_link_fini,
    .accept_conn = ucx_accept_conn,
    .query = ucx_query,
    .remote_free = ucx_remote_free,
    .xfer = ucx_xfer,
    .cache_removed = ucx_cache_removed,
    .info = ucx_info,
};
