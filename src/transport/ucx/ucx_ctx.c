/*
 * The ucx transport's process-wide state: one UCP context shared by every
 * link, and what probing UCX found (its transports and devices), once.
 */
#include "transport/ucx/ucx_int.h"

/* ---- Process-wide state: the context and what UCX found. ---- */

static pthread_mutex_t ucx_glock = PTHREAD_MUTEX_INITIALIZER;
static ucp_context_h ucx_gctx; /* shared by every link; guarded by glock */
static int ucx_gctx_refs;

static ucx_probe ucx_probed;
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

ucp_context_h
llmdd__ucx_ctx_get(void)
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

void
llmdd__ucx_ctx_put(void)
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

const char *
llmdd__ucx_info(void)
{
    pthread_once(&ucx_probe_once, ucx_probe_run);
    return ucx_probed.info;
}

const ucx_probe *
llmdd__ucx_probe(void)
{
    pthread_once(&ucx_probe_once, ucx_probe_run);
    return &ucx_probed;
}
