/*
 * llmdd serve: a prompt node. Allocates a KV cache and a paged cache of the
 * requested shape, optionally fills them with the deterministic pattern,
 * prints their ids and shapes and the command that pulls from them, and
 * serves until SIGINT or SIGTERM.
 */
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static const char serve_usage[] =
    "Usage: llmdd serve --listen IP:PORT --cluster-id N [options]\n"
    "\n"
    "A prompt node: allocates a KV cache (id 1) and a paged cache (id 2) of\n"
    "the given shape, fills them when asked, prints their ids and shapes and\n"
    "the `llmdd pull` command for a second terminal, then serves decoders\n"
    "until SIGINT (Ctrl-C) or SIGTERM, and shuts down cleanly.\n"
    "\n"
    "Options:\n"
    "  -l, --listen IP:PORT  address to listen on (port 1..65535);\n"
    "                        [IPv6]:PORT for IPv6\n"
    "  -c, --cluster-id N    this node's cluster id (decoders name it)\n"
    "      --fill[=SEED]     fill the caches with the deterministic pattern\n"
    "                        (seed 1 unless given) so `llmdd pull --verify`\n"
    "                        can check them; without it they stay zero\n"
    "  -t, --transport NAME  auto (default), shm, tcp, ucx\n"
    "      --layers N        same as --num-layers\n" CLI_SHAPE_HELP
    "      --metrics IP:PORT serve Prometheus metrics over HTTP at\n"
    "                        http://IP:PORT/metrics (`llmdd stats` reads "
    "them)\n"
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

int
cli_serve(int argc, char **argv)
{
    enum { OPT_FILL = CLI_OPT_FIRST_FREE, OPT_METRICS };
    static const struct option longopts[] = {
        {"listen", required_argument, NULL, 'l'},
        {"cluster-id", required_argument, NULL, 'c'},
        {"fill", optional_argument, NULL, OPT_FILL},
        {"metrics", required_argument, NULL, OPT_METRICS},
        {"transport", required_argument, NULL, 't'},
        {"option", required_argument, NULL, 'o'},
        {"help", no_argument, NULL, 'h'},
        {"layers", required_argument, NULL, CLI_OPT_LAYERS},
        CLI_SHAPE_LONGOPTS,
        {NULL, 0, NULL, 0},
    };
    cli_lib_opts lo;
    cli_shape shape;
    char ip[LLMDD_IP_LEN], err[1024], flags[256];
    uint16_t port = 0, mport = 0;
    char mip[LLMDD_IP_LEN];
    bool have_metrics = false;
    cli_metrics_server *ms = NULL;
    uint64_t cluster = 0;
    bool have_listen = false, have_cluster = false, fill = false;
    uint32_t seed = CLI_DEFAULT_SEED;
    llmdd *dd = NULL;
    llmdd_cache kv, paged;
    bool have_kv = false, have_paged = false;
    llmdd_status st;
    int rc = CLI_EXIT_USAGE, opt, k;

    cli_lib_opts_init(&lo);
    cli_shape_default(&shape);
    while ((opt = getopt_long(argc, argv, "l:c:t:o:m:h", longopts, NULL)) !=
           -1) {
        switch (opt) {
        case 'h':
            fputs(serve_usage, stdout);
            rc = CLI_EXIT_OK;
            goto out;
        case 'l':
            if (!cli_parse_hostport(optarg, ip, sizeof(ip), &port)) {
                cli_usage_err("--listen: \"%s\" is not IP:PORT with a port "
                              "in 1..65535",
                              optarg);
                goto out;
            }
            have_listen = true;
            break;
        case 'c':
            if (!cli_parse_u64(optarg, 0, UINT64_MAX, &cluster)) {
                cli_usage_err("--cluster-id: bad number \"%s\"", optarg);
                goto out;
            }
            have_cluster = true;
            break;
        case OPT_FILL:
            fill = true;
            if (optarg != NULL &&
                !cli_parse_u32(optarg, 0, UINT32_MAX, &seed)) {
                cli_usage_err("--fill: bad seed \"%s\"", optarg);
                goto out;
            }
            break;
        case OPT_METRICS:
            if (!cli_parse_hostport(optarg, mip, sizeof(mip), &mport)) {
                cli_usage_err("--metrics: \"%s\" is not IP:PORT with a port "
                              "in 1..65535",
                              optarg);
                goto out;
            }
            have_metrics = true;
            break;
        case 't':
            if (!cli_set_transport(&lo, optarg))
                goto out;
            break;
        case 'o':
            if (!cli_add_option(&lo, optarg)) {
                cli_usage_err("-o wants KEY=VALUE, got \"%s\"", optarg);
                goto out;
            }
            break;
        case 'm':
            opt = CLI_OPT_MODEL;
            /* fall through */
        default:
            k = cli_shape_opt(&shape, opt, optarg);
            if (k == 0)
                cli_usage_err("bad option");
            if (k <= 0)
                goto out;
            break;
        }
    }
    if (optind < argc) {
        cli_usage_err("unexpected argument \"%s\"", argv[optind]);
        goto out;
    }
    if (!have_listen || !have_cluster) {
        cli_usage_err("--listen IP:PORT and --cluster-id N are required");
        goto out;
    }
    if (strcmp(lo.transport, "loop") == 0) {
        cli_usage_err("--transport loop only reaches an instance in the same "
                      "process; `llmdd demo --transport loop` shows it");
        goto out;
    }
    if (!cli_shape_check(&shape))
        goto out;
    rc = CLI_EXIT_FAIL;

    /* Library threads inherit this mask, so the signals reach sigwait. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    setvbuf(stdout, NULL, _IOLBF, 0);

    st = cli_instance(cluster, LLMDD_ROLE_PROMPT, &lo, ip, &port, &dd, err,
                      sizeof(err));
    if (st != LLM_SUCCESS) {
        cli_err("%s", err);
        goto out;
    }
    llmdd_cache_desc kvd = cli_shape_kv(&shape), pd = cli_shape_paged(&shape);
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
    if (have_metrics &&
        (ms = cli_metrics_start(dd, mip, mport, err, sizeof(err))) == NULL) {
        cli_err("%s", err);
        goto out;
    }
    if (fill) {
        cli_fill_cache(&kv, cli_cache_seed(seed, kv.cache_id));
        cli_fill_cache(&paged, cli_cache_seed(seed, paged.cache_id));
    }

    char addr[LLMDD_IP_LEN + 16];
    cli_fmt_addr(addr, sizeof(addr), ip, port);
    printf("llmdd serve: cluster %" PRIu64 " (prompt), %s KV layout, "
           "listening on %s, transport %s\n",
           cluster, shape.model, addr, lo.transport);
    serve_describe("KV cache", "batch slot", &kv, fill);
    serve_describe("paged cache", "block", &paged, fill);
    cli_shape_flags(&shape, flags, sizeof(flags));
    char seedflag[32] = "";
    if (seed != CLI_DEFAULT_SEED)
        snprintf(seedflag, sizeof(seedflag), " --seed %" PRIu32, seed);
    uint64_t dec = cluster == UINT64_MAX ? cluster - 1 : cluster + 1;
    bool any = strcmp(ip, "0.0.0.0") == 0 || strcmp(ip, "::") == 0;
    printf("pull from it in another terminal (or host) with:\n"
           "  llmdd pull --connect %s --cluster-id %" PRIu64
           " --remote-cluster-id %" PRIu64 "%s%s%s\n%s",
           addr, dec, cluster, flags, seedflag, fill ? " --verify" : "",
           any ? "  (from another host, put this host's address in "
                 "--connect)\n"
               : "");
    if (ms != NULL)
        printf("metrics: http://%s/metrics\n",
               cli_fmt_addr(addr, sizeof(addr), mip, mport));
    printf("serving; Ctrl-C or SIGTERM stops it\n");

    int sig = 0;
    while (sigwait(&sigs, &sig) != 0)
        ;
    printf("llmdd serve: %s: shutting down\n",
           sig == SIGINT ? "SIGINT" : "SIGTERM");
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
    cli_lib_opts_fini(&lo);
    return rc;
}
