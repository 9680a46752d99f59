/*
 * llmdd info: the version, the transports compiled in and whether each
 * works here (a real link and a verified pull between two instances of
 * this process), every option key and environment variable.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common.h"

static const char info_usage[] =
    "Usage: llmdd info [--no-probe]\n"
    "       llmdd info --metadata etcd://HOST:PORT[,...] [--metadata-prefix "
    "P]\n"
    "\n"
    "Prints the library version, the transports compiled in and whether\n"
    "each is usable here (two instances of this process link over it and\n"
    "pull a small verified cache), every option key with its default and\n"
    "meaning, and the environment variables.\n"
    "\n"
    "With --metadata it lists the clusters published in etcd under the\n"
    "prefix (default llmdd) instead: id, role, address, transports, pid.\n"
    "\n"
    "Options:\n"
    "      --no-probe  list the transports without trying them\n"
    "      --metadata etcd://HOST:PORT[,HOST:PORT...]  the etcd to list\n"
    "      --metadata-prefix P  the fleet's key prefix\n"
    "  -h, --help      this text\n";

typedef struct {
    bool probe;
    const char *metadata, *prefix;
} info_cfg;

static const struct {
    const char *name, *def, *meaning;
} info_env[] = {
    {"LLMDD_LOG_LEVEL", "warn",
     "error, warn, info or debug: what the library logs to stderr"},
    {"LLMDD_LOG_FORMAT", "text",
     "json: one JSON object a log line (ts, level, pid, tid, msg)"},
    {"UCX_TLS and other UCX_*", "UCX's own",
     "read by UCX itself when the ucx transport is used"},
    {"UCX_TCP_TX_SEG_SIZE", "256k (set by llmdd)",
     "ucx over tcp only: llmdd raises UCX's segment size for KV-sized "
     "transfers unless this is set"},
    {"UCX_TCP_RX_SEG_SIZE", "256k (set by llmdd)", "the same, receiving"},
};

/* Links two instances of this process over `name` and pulls 2 x 64 KiB. */
static bool
info_probe(const char *name, char *why, size_t cap, int64_t *ns)
{
    cli_lib_opts lo;
    llmdd *p = NULL, *d = NULL;
    llmdd_cache pc, dc;
    bool have_pc = false, have_dc = false, linked = false, ok = false;
    llmdd_cache_desc desc = {.num_tensors = 2,
                             .data_type = LLMDD_DT_UINT8,
                             .num_dims = 2,
                             .shape = {2, 65536}};
    uint16_t port = 0;
    llmdd_status st;
    int64_t t0 = cli_now_ns();

    cli_lib_opts_init(&lo);
    snprintf(lo.transport, sizeof(lo.transport), "%s", name);
    if (cli_instance(1, LLMDD_ROLE_PROMPT, &lo, "127.0.0.1", &port, &p, why,
                     cap) != LLM_SUCCESS ||
        cli_instance(2, LLMDD_ROLE_DECODER, &lo, NULL, NULL, &d, why, cap) !=
            LLM_SUCCESS)
        goto out;
    if ((st = llmdd_allocate_cache(p, &desc, &pc)) != LLM_SUCCESS) {
        cli_fmt_st(why, cap, st, "llmdd_allocate_cache");
        goto out;
    }
    have_pc = true;
    if ((st = llmdd_allocate_cache(d, &desc, &dc)) != LLM_SUCCESS) {
        cli_fmt_st(why, cap, st, "llmdd_allocate_cache");
        goto out;
    }
    have_dc = true;
    cli_fill_cache(&pc, cli_cache_seed(CLI_DEFAULT_SEED, pc.cache_id));
    if (cli_link(d, 1, "127.0.0.1", port, 2000, why, cap) != LLM_SUCCESS)
        goto out;
    linked = true;
    llmdd_cache_index idx = {1, pc.cache_id, 1};
    if ((st = llmdd_pull_kv_cache(d, &idx, &dc, 0, -1, NULL)) != LLM_SUCCESS) {
        cli_fmt_st(why, cap, st, "llmdd_pull_kv_cache");
        goto out;
    }
    cli_seg *segs;
    size_t n;
    if (!cli_segs_slot(&dc, 0, 0, 2, 0, 65536, 65536, &segs, &n)) {
        snprintf(why, cap, "out of memory");
        goto out;
    }
    cli_verdict v;
    cli_verify(segs, n, cli_cache_seed(CLI_DEFAULT_SEED, pc.cache_id), &v);
    free(segs);
    if (!v.ok) {
        snprintf(why, cap, "the pulled bytes differ from the source");
        goto out;
    }
    *ns = cli_now_ns() - t0;
    ok = true;
out:
    if (linked) {
        char ignored[256];
        cli_unlink(d, 1, "127.0.0.1", port, 2000, ignored, sizeof(ignored));
    }
    if (have_dc)
        llmdd_deallocate_cache(d, dc.cache_id);
    if (have_pc)
        llmdd_deallocate_cache(p, pc.cache_id);
    llmdd_destroy(d);
    llmdd_destroy(p);
    cli_lib_opts_fini(&lo);
    return ok;
}

#define INFO_PROBE_MS 15000

typedef struct {
    bool ok;
    int64_t ns;
    char why[1024];
} info_result;

static int
info_probe_main(void *arg, int in_fd, int out_fd)
{
    info_result r;

    (void)in_fd;
    memset(&r, 0, sizeof(r));
    r.ok = info_probe(arg, r.why, sizeof(r.why), &r.ns);
    return cli_msg_send(out_fd, 1, &r, sizeof(r), NULL, 0) == 0 ? CLI_EXIT_OK
                                                                : CLI_EXIT_FAIL;
}

/* Probes in a child process, so a transport that hangs or crashes costs
 * this command at most INFO_PROBE_MS. */
static bool
info_probe_bounded(const char *name, info_result *r)
{
    cli_node n = {.cmd_fd = -1, .rep_fd = -1};
    uint32_t type;
    void *p = NULL;
    size_t len;
    bool ok = false;

    memset(r, 0, sizeof(*r));
    if (cli_node_start(&n, name, false, info_probe_main, (void *)name) != 0) {
        snprintf(r->why, sizeof(r->why), "cannot start a probe process");
        return false;
    }
    if (cli_node_wait(&n, INFO_PROBE_MS) == 0) {
        cli_node_kill(&n);
        snprintf(r->why, sizeof(r->why),
                 "linking and pulling 128 KiB did not finish within %d s",
                 INFO_PROBE_MS / 1000);
    } else if (cli_msg_recv(n.rep_fd, &type, &p, &len) == 0 &&
               len == sizeof(*r)) {
        memcpy(r, p, sizeof(*r));
        ok = r->ok;
    } else {
        snprintf(r->why, sizeof(r->why), "the probe process crashed");
    }
    free(p);
    if (cli_node_stop(&n) != 0)
        ok = false;
    return ok;
}

enum { OPT_NO_PROBE = CLI_OPT_FIRST_FREE };

static int
info_opt(void *ctx, int opt, const char *arg)
{
    info_cfg *c = ctx;

    if (opt == OPT_NO_PROBE)
        c->probe = false;
    else if (opt == CLI_OPT_METADATA)
        c->metadata = arg;
    else if (opt == CLI_OPT_METADATA_PREFIX)
        c->prefix = arg;
    else
        return cli_usage_err("bad option");
    return 0;
}

static const char *const info_roles[] = {"?", "prompt", "decoder", "mix"};

/* Prints each entry of the library's JSON array; how many. */
static int
info_print_entries(const char *json)
{
    cJSON *arr = cJSON_Parse(json);
    const cJSON *e;
    int n = 0;

    cJSON_ArrayForEach(e, arr)
    {
        const char *id = cJSON_GetStringValue(
            cJSON_GetObjectItemCaseSensitive(e, "cluster_id"));
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(e, "role");
        const cJSON *pid = cJSON_GetObjectItemCaseSensitive(e, "pid");
        const cJSON *a = cJSON_GetArrayItem(
            cJSON_GetObjectItemCaseSensitive(e, "addrs"), 0);
        const char *ip =
            cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(a, "ip"));
        const cJSON *port = cJSON_GetObjectItemCaseSensitive(a, "port");
        char addr[LLMDD_IP_LEN + 16], tps[128] = "";
        const cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(e, "transports"))
        {
            const char *name = cJSON_GetStringValue(t);
            size_t l = strlen(tps);
            if (name != NULL && l + strlen(name) + 2 < sizeof(tps))
                snprintf(tps + l, sizeof(tps) - l, "%s%s", l ? "," : "",
                         name);
        }
        int r = cJSON_IsNumber(role) ? role->valueint : 0;
        cli_fmt_addr(addr, sizeof(addr), ip ? ip : "?",
                     cJSON_IsNumber(port) ? (uint16_t)port->valueint : 0);
        printf("  cluster %-20s %-8s %-24s transports %s, pid %d\n",
               id ? id : "?", info_roles[r >= 1 && r <= 3 ? r : 0], addr,
               tps[0] ? tps : "-", cJSON_IsNumber(pid) ? pid->valueint : 0);
        n++;
    }
    cJSON_Delete(arr);
    return n;
}

/* llmdd info --metadata: the published clusters, one a line. */
static int
info_metadata(const info_cfg *c)
{
    size_t len = 0, cap = 0;
    char *buf = NULL;
    llmdd_status st =
        llmdd_metadata_list(c->metadata, c->prefix, 5000, NULL, 0, &len);

    /* Entries may arrive between two calls: ask again, with room for
     * what the last answer needed, until the list fits. */
    for (int tries = 0; st == LLM_SUCCESS && len >= cap; tries++) {
        char *more = tries < 8 ? realloc(buf, len + 4096) : NULL;
        if (more == NULL) {
            st = LLM_OUT_OF_MEMORY;
            break;
        }
        buf = more;
        cap = len + 4096;
        st = llmdd_metadata_list(c->metadata, c->prefix, 5000, buf, cap, &len);
    }
    if (st != LLM_SUCCESS) {
        cli_err_st(st, "llmdd_metadata_list(%s)", c->metadata);
        free(buf);
        return CLI_EXIT_FAIL;
    }
    printf("Clusters published under %s/clusters/ in %s:\n",
           c->prefix ? c->prefix : "llmdd", c->metadata);
    int n = info_print_entries(buf);
    printf("%d cluster%s\n", n, n == 1 ? "" : "s");
    free(buf);
    return CLI_EXIT_OK;
}

int
cli_info(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"no-probe", no_argument, NULL, OPT_NO_PROBE},
        {"metadata", required_argument, NULL, CLI_OPT_METADATA},
        {"metadata-prefix", required_argument, NULL, CLI_OPT_METADATA_PREFIX},
        {NULL, 0, NULL, 0},
    };
    const cli_args a = {.usage = info_usage};
    info_cfg cfg = {.probe = true};
    int rc = cli_args_parse(&a, longopts, NULL, info_opt, &cfg, argc, argv);

    if (rc != 0)
        return rc < 0 ? CLI_EXIT_OK : rc;
    if (cfg.metadata != NULL)
        return info_metadata(&cfg);
    if (cfg.prefix != NULL)
        return cli_usage_err("--metadata-prefix goes with --metadata");
    bool probe = cfg.probe;
    /* The probes' own links and pulls are not the user's: their warnings
     * (UCX's over tcp, say) would read as problems of this host. A failed
     * probe prints its status on its own line. */
    setenv("LLMDD_LOG_LEVEL", "error", 0);
    printf("llmdd %s (library); tool built against the %d.%d.%d header\n",
           llmdd_version(), LLMDD_VERSION_MAJOR, LLMDD_VERSION_MINOR,
           LLMDD_VERSION_PATCH);
    printf("\nTransports built in, in auto's order of preference: %s\n",
           llmdd_transport_list());
    for (size_t i = 0; i < cli_ntransports; i++) {
        const char *name = cli_transports[i].name;
        char t[32];
        info_result res;

        if (!cli_transport_built(name)) {
            printf("  %-5s not built in (%s)\n", name, cli_transports[i].what);
            continue;
        }
        if (!probe) {
            printf("  %-5s built in (%s)\n", name, cli_transports[i].what);
            continue;
        }
        fflush(stdout);
        if (info_probe_bounded(name, &res))
            printf("  %-5s usable here: linked and pulled 128 KiB, verified, "
                   "in %s (%s)\n",
                   name, cli_fmt_ns(t, sizeof(t), res.ns),
                   cli_transports[i].what);
        else
            printf("  %-5s built in but NOT usable here: %s\n", name, res.why);
    }
    for (size_t i = 0; i < cli_ntransports; i++) {
        const char *about = llmdd_transport_info(cli_transports[i].name);
        if (about != NULL)
            printf("  %-5s %s\n", cli_transports[i].name, about);
    }

    printf("\nOption keys (llmdd_initialize, llmdd_set_role; `-o KEY=VALUE` "
           "on the tool):\n");
    const llmdd_option_doc *o;
    for (size_t i = 0; (o = llmdd_option_info(i)) != NULL; i++) {
        printf("  %-24s default: %s\n  %-24s value:   %s\n  %-24s %s\n", o->key,
               o->default_text, "", o->values, "", o->meaning);
        /* The tool's own default, on top of the library's. */
        if (strcmp(o->key, CLI_WAIT_KEY) == 0)
            printf("  %-24s the tool sets %s unless -o overrides it\n", "",
                   CLI_WAIT_MS);
    }
    printf("\nEnvironment variables:\n");
    for (size_t i = 0; i < sizeof(info_env) / sizeof(info_env[0]); i++)
        printf("  %-24s default: %s\n  %-24s %s\n", info_env[i].name,
               info_env[i].def, "", info_env[i].meaning);
    printf("\nExit status of every command: 0 success, 1 a library call or a "
           "check failed,\n2 bad usage.\n");
    return CLI_EXIT_OK;
}
