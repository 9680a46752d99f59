/*
 * llmdd serve: a prompt node. Allocates a KV cache and a paged cache of the
 * requested shape, optionally fills them with the deterministic pattern,
 * prints their ids and shapes and the command that pulls from them, and
 * serves until SIGINT or SIGTERM.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

static const char serve_usage[] =
    "Usage: llmdd serve --listen IP:PORT --cluster-id N [options]\n"
    "\n"
    "A prompt node: allocates a KV cache (id 1) and a paged cache (id 2) of\n"
    "the given shape, fills them when asked, prints their ids and shapes and\n"
    "the `llmdd pull` command for a second terminal, then serves decoders\n"
    "until SIGINT (Ctrl-C) or SIGTERM, and shuts down cleanly (a second\n"
    "one exits at once). Links are logged as they come and go.\n"
    "\n"
    "Options:\n"
    "  -l, --listen IP:PORT  address to listen on; [IPv6]:PORT for IPv6;\n"
    "                        port 0: the kernel picks one (printed)\n"
    "  -c, --cluster-id N    this node's cluster id (decoders name it)\n"
    "      --fill[=SEED]     fill the caches with the deterministic pattern\n"
    "                        (seed 1 unless given) so `llmdd pull --verify`\n"
    "                        can check them; without it they stay zero\n"
    "  -t, --transport NAME  auto (default), shm, tcp, ucx\n"
    "      --metadata etcd://HOST:PORT[,HOST:PORT...]\n"
    "                        publish this node in etcd under its cluster id\n"
    "                        (llm.MetadataServer; --listen must not be a\n"
    "                        wildcard address)\n"
    "      --metadata-prefix P  the fleet's key prefix "
    "(llm.MetadataPrefix)\n" CLI_SHAPE_HELP
    "      --metrics IP:PORT serve Prometheus metrics over HTTP at\n"
    "                        http://IP:PORT/metrics (`llmdd stats` reads "
    "them);\n"
    "                        port 0: the kernel picks one, printed at start\n"
    "  -o, --option K=V      extra llmdd option (e.g. -o llm.AuthToken=s);\n"
    "                        see `llmdd info`\n"
    "  -h, --help            this text\n";

static void
serve_describe(const char *what, const char *unit, const llmdd_cache *c,
               bool filled)
{
    char d[96], b1[32], b2[32];
    uint64_t size = cli_desc_tensor_size(&c->desc) * c->desc.num_tensors;

    printf("  cache %" PRId64 ": %s, %" PRIu32 " tensors of %s, %s "
           "(%s per %s), %s\n",
           c->cache_id, what, c->desc.num_tensors,
           cli_fmt_desc(d, sizeof(d), &c->desc),
           cli_fmt_bytes(b1, sizeof(b1), size),
           cli_fmt_bytes(b2, sizeof(b2),
                         cli_desc_stride(&c->desc) * c->desc.num_tensors),
           unit, filled ? "filled" : "zeroed (not filled)");
}

typedef struct {
    cli_lib_opts lo;
    cli_shape shape;
    char ip[LLMDD_IP_LEN];
    uint16_t port;
    char mip[LLMDD_IP_LEN];
    uint16_t mport;
    uint64_t cluster;
    bool have_listen, have_cluster, have_metrics, fill;
    uint32_t seed;
} serve_cfg;

enum { OPT_FILL = CLI_OPT_FIRST_FREE, OPT_METRICS };

static int
serve_opt(void *ctx, int opt, const char *arg)
{
    serve_cfg *c = ctx;

    switch (opt) {
    case 'l':
        if (!cli_parse_hostport(arg, 0, c->ip, sizeof(c->ip), &c->port))
            return cli_usage_err(
                "--listen: \"%s\" is not IP:PORT or HOST:PORT with a "
                "port in 0..65535",
                arg);
        c->have_listen = true;
        break;
    case 'c':
        if (!cli_parse_u64(arg, 0, UINT64_MAX, &c->cluster))
            return cli_usage_err("--cluster-id: bad number \"%s\"", arg);
        c->have_cluster = true;
        break;
    case OPT_FILL:
        c->fill = true;
        if (arg != NULL && !cli_parse_u32(arg, 0, UINT32_MAX, &c->seed))
            return cli_usage_err("--fill: bad seed \"%s\"", arg);
        break;
    case OPT_METRICS:
        if (!cli_parse_hostport(arg, 0, c->mip, sizeof(c->mip), &c->mport))
            return cli_usage_err(
                "--metrics: \"%s\" is not IP:PORT or HOST:PORT with a "
                "port in 0..65535",
                arg);
        c->have_metrics = true;
        break;
    default:
        return cli_usage_err("bad option");
    }
    return 0;
}

static int
serve_parse(serve_cfg *c, int argc, char **argv)
{
    static const struct option longopts[] = {
        {"listen", required_argument, NULL, 'l'},
        {"cluster-id", required_argument, NULL, 'c'},
        {"fill", optional_argument, NULL, OPT_FILL},
        {"metrics", required_argument, NULL, OPT_METRICS},
        {"layers", required_argument, NULL, CLI_OPT_LAYERS},
        {NULL, 0, NULL, 0},
    };
    const cli_args a = {.usage = serve_usage, .lo = &c->lo, .shape = &c->shape};
    int rc = cli_args_parse(&a, longopts, "l:c:", serve_opt, c, argc, argv);

    if (rc != 0)
        return rc;
    if (!c->have_listen || !c->have_cluster)
        return cli_usage_err("--listen IP:PORT and --cluster-id N are "
                             "required");
    return cli_peer_args_check(&c->lo, &c->shape);
}

/*
 * Signals: the first SIGINT or SIGTERM asks for a clean shutdown (a byte on
 * stop_pipe, read when serving starts, or between tensors of a fill); a
 * second one exits at once, without cleanup (a later start removes what
 * shared memory a dead process left).
 */
static int stop_pipe[2] = {-1, -1};

static void *
serve_signals(void *arg)
{
    const sigset_t *sigs = arg;
    int sig, seen = 0;

    for (;;) {
        if (sigwait(sigs, &sig) != 0)
            continue;
        const char *name = sig == SIGINT ? "SIGINT" : "SIGTERM";
        if (seen++ == 0) {
            printf("llmdd serve: %s: shutting down (again to exit at once)\n",
                   name);
            char b = 1;
            (void)!write(stop_pipe[1], &b, 1);
            continue;
        }
        fprintf(stderr, "llmdd serve: second %s: exiting now\n", name);
        _exit(CLI_EXIT_FAIL);
    }
    return NULL;
}

static bool
serve_stopping(void)
{
    struct pollfd p = {.fd = stop_pipe[0], .events = POLLIN};
    return poll(&p, 1, 0) == 1;
}

/* The deterministic fill, tensor by tensor, with progress on a terminal;
 * false when a signal stopped it. */
static bool
serve_fill(const llmdd_cache *c, uint32_t seed, const char *what)
{
    uint64_t size = cli_desc_tensor_size(&c->desc);
    cli_progress *p = cli_progress_start(what, size * c->desc.num_tensors);
    bool done = true;

    for (uint32_t t = 0; t < c->desc.num_tensors && done; t++) {
        cli_fill((void *)(uintptr_t)c->tensor_addrs[t], size, seed, t, 0);
        cli_progress_set(p, size * (t + 1));
        done = !serve_stopping();
    }
    cli_progress_end(p);
    return done;
}

int
cli_serve(int argc, char **argv)
{
    serve_cfg c;
    char err[1024], flags[256];
    cli_metrics_server *ms = NULL;
    llmdd *dd = NULL;
    llmdd_cache kv, paged;
    bool have_kv = false, have_paged = false;
    llmdd_status st;
    int rc;

    memset(&c, 0, sizeof(c));
    cli_lib_opts_init(&c.lo);
    cli_shape_default(&c.shape);
    c.seed = CLI_DEFAULT_SEED;
    rc = serve_parse(&c, argc, argv);
    if (rc != 0) {
        rc = rc < 0 ? CLI_EXIT_OK : rc;
        goto out;
    }
    rc = CLI_EXIT_FAIL;

    /* Library threads inherit this mask, so the signals reach sigwait. */
    static sigset_t sigs; /* the signal thread reads it until exit */
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    setvbuf(stdout, NULL, _IOLBF, 0);
    pthread_t sig_thread;
    if (pipe(stop_pipe) != 0 ||
        pthread_create(&sig_thread, NULL, serve_signals, &sigs) != 0) {
        cli_err("cannot start the signal thread");
        goto out;
    }
    pthread_detach(sig_thread);
    /* An operator sees links come and go (the library's info lines),
     * unless LLMDD_LOG_LEVEL says otherwise. */
    setenv("LLMDD_LOG_LEVEL", "info", 0);

    st = cli_instance(c.cluster, LLMDD_ROLE_PROMPT, &c.lo, c.ip, &c.port, &dd,
                      err, sizeof(err));
    if (st != LLM_SUCCESS) {
        cli_err("%s", err);
        goto out;
    }
    llmdd_cache_desc kvd = cli_shape_kv(&c.shape),
                     pd = cli_shape_paged(&c.shape);
    if ((st = llmdd_allocate_cache(dd, &kvd, &kv)) != LLM_SUCCESS) {
        cli_err_st(st, "llmdd_allocate_cache(KV cache)");
        goto out;
    }
    have_kv = true;
    if ((st = llmdd_allocate_cache(dd, &pd, &paged)) != LLM_SUCCESS) {
        cli_err_st(st, "llmdd_allocate_cache(paged cache)");
        goto out;
    }
    have_paged = true;
    if (c.have_metrics && (ms = cli_metrics_start(dd, c.mip, c.mport, err,
                                                  sizeof(err))) == NULL) {
        cli_err("%s", err);
        goto out;
    }
    if (c.fill) {
        char size[32];
        uint64_t all =
            cli_desc_tensor_size(&kv.desc) * kv.desc.num_tensors +
            cli_desc_tensor_size(&paged.desc) * paged.desc.num_tensors;
        printf("llmdd serve: filling %s of caches (Ctrl-C stops)\n",
               cli_fmt_bytes(size, sizeof(size), all));
    }
    if (c.fill &&
        (!serve_fill(&kv, cli_cache_seed(c.seed, kv.cache_id), "filling") ||
         !serve_fill(&paged, cli_cache_seed(c.seed, paged.cache_id),
                     "filling"))) {
        rc = CLI_EXIT_OK; /* stopped by a signal while filling */
        goto out;
    }

    char addr[LLMDD_IP_LEN + 16];
    cli_fmt_addr(addr, sizeof(addr), c.ip, c.port);
    printf("llmdd serve: cluster %" PRIu64 " (prompt), %s KV layout, "
           "listening on %s, transport %s\n",
           c.cluster, c.shape.model, addr, c.lo.transport);
    serve_describe("KV cache", "batch slot", &kv, c.fill);
    serve_describe("paged cache", "block", &paged, c.fill);
    cli_shape_flags(&c.shape, flags, sizeof(flags));
    char seedflag[32] = "";
    if (c.seed != CLI_DEFAULT_SEED)
        snprintf(seedflag, sizeof(seedflag), " --seed %" PRIu32, c.seed);
    uint64_t dec = c.cluster == UINT64_MAX ? c.cluster - 1 : c.cluster + 1;
    bool any = strcmp(c.ip, "0.0.0.0") == 0 || strcmp(c.ip, "::") == 0;
    if (c.lo.metadata[0] != '\0')
        printf("published in etcd; pull from it in another terminal (or "
               "host) with:\n"
               "  llmdd pull --metadata %s --cluster-id %" PRIu64
               " --remote-cluster-id %" PRIu64 "%s%s%s\n",
               c.lo.metadata, dec, c.cluster, flags, seedflag,
               c.fill ? " --verify" : "");
    else
        printf("pull from it in another terminal (or host) with:\n"
               "  llmdd pull --connect %s --cluster-id %" PRIu64
               " --remote-cluster-id %" PRIu64 "%s%s%s\n%s",
               addr, dec, c.cluster, flags, seedflag, c.fill ? " --verify" : "",
               any ? "  (from another host, put this host's address in "
                     "--connect)\n"
                   : "");
    if (ms != NULL)
        printf("metrics: http://%s/metrics\n",
               cli_fmt_addr(addr, sizeof(addr), c.mip, cli_metrics_port(ms)));
    printf("serving; Ctrl-C or SIGTERM stops it\n");

    char b;
    while (read(stop_pipe[0], &b, 1) < 0 && errno == EINTR)
        ;
    rc = CLI_EXIT_OK;
out:
    cli_metrics_stop(ms); /* it reads dd */
    if (have_paged &&
        (st = llmdd_deallocate_cache(dd, paged.cache_id)) != LLM_SUCCESS) {
        cli_err_st(st, "llmdd_deallocate_cache(%" PRId64 ")", paged.cache_id);
        rc = CLI_EXIT_FAIL;
    }
    if (have_kv &&
        (st = llmdd_deallocate_cache(dd, kv.cache_id)) != LLM_SUCCESS) {
        cli_err_st(st, "llmdd_deallocate_cache(%" PRId64 ")", kv.cache_id);
        rc = CLI_EXIT_FAIL;
    }
    llmdd_destroy(dd);
    if (rc == CLI_EXIT_OK && dd != NULL)
        printf("llmdd serve: stopped\n");
    cli_lib_opts_fini(&c.lo);
    return rc;
}
