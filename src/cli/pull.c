/*
 * llmdd pull: a decoder node. Links to a prompt node (`llmdd serve`), pulls
 * a batch slot, a layer range or a set of paged blocks, verifies what
 * arrived against the deterministic fill, reports and unlinks.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define PULL_MAX_BLOCKS (1u << 20)

static const char pull_usage[] =
    "Usage: llmdd pull --connect IP:PORT --cluster-id N --remote-cluster-id M\n"
    "       llmdd pull --metadata etcd://HOST:PORT --cluster-id N\n"
    "                  --remote-cluster-id M\n"
    "                  [--cache-id ID] [--batch-index B] [--layers A:B]\n"
    "                  [--blocks LIST] [--verify] [options]\n"
    "\n"
    "A decoder node: links to the prompt node at IP:PORT (`llmdd serve`),\n"
    "pulls what was asked into a cache of the same shape, verifies it\n"
    "against the deterministic fill when asked, reports and unlinks.\n"
    "Without --blocks it pulls batch slot B (default 0) of the KV cache,\n"
    "all layers or layers A..B; with --blocks it pulls those paged blocks\n"
    "into the same block ids of a local paged cache.\n"
    "\n"
    "Options:\n"
    "  -c, --connect IP:PORT     the prompt node; [IPv6]:PORT for IPv6\n"
    "      --metadata etcd://HOST:PORT[,HOST:PORT...]\n"
    "                            find the prompt node by its cluster id in\n"
    "                            etcd (llm.MetadataServer; no --connect)\n"
    "      --metadata-prefix P   the fleet's key prefix (llm.MetadataPrefix)\n"
    "      --cluster-id N        this decoder's cluster id\n"
    "      --remote-cluster-id M the prompt node's cluster id\n"
    "      --cache-id ID         the remote cache (default 1, the KV cache of\n"
    "                            `llmdd serve`; 2, its paged cache, with\n"
    "                            --blocks)\n"
    "      --batch-index B       the batch slot to pull (default 0)\n"
    "      --layers A:B          only layers A..B (inclusive; K and V each)\n"
    "      --blocks LIST         paged blocks, e.g. 0,3,8-15\n"
    "      --verify              check every byte against the pattern of\n"
    "                            `llmdd serve --fill`; exit 1 on a mismatch\n"
    "      --seed N              the seed serve --fill used (default 1)\n"
    "      --timeout MS          link timeout (default 5000)\n"
    "  -t, --transport NAME      auto (default), shm, tcp, ucx\n" CLI_SHAPE_HELP
    "  -o, --option K=V          extra llmdd option; see `llmdd info`\n"
    "  -h, --help                this text\n";

typedef struct {
    cli_lib_opts lo;
    cli_shape shape;
    char ip[LLMDD_IP_LEN];
    uint16_t port;
    uint64_t cluster, remote;
    bool have_connect, have_cluster, have_remote;
    int64_t cache_id; /* 0: the default for the operation */
    uint32_t batch;
    bool layers;
    int32_t first, last;
    uint64_t *blocks;
    size_t nblocks;
    bool verify;
    uint32_t seed;
    int timeout_ms;
} pull_cfg;

enum {
    OPT_CLUSTER = CLI_OPT_FIRST_FREE,
    OPT_REMOTE,
    OPT_CACHE,
    OPT_BATCH_INDEX,
    OPT_RANGE,
    OPT_BLOCKS,
    OPT_VERIFY,
};

static int
pull_opt(void *ctx, int opt, const char *arg)
{
    pull_cfg *c = ctx;
    uint64_t a, b;

    switch (opt) {
    case 'c':
        if (!cli_parse_hostport(arg, 1, c->ip, sizeof(c->ip), &c->port))
            return cli_usage_err(
                "--connect: \"%s\" is not IP:PORT or HOST:PORT with "
                "a port in 1..65535",
                arg);
        c->have_connect = true;
        break;
    case OPT_CLUSTER:
        if (!cli_parse_u64(arg, 0, UINT64_MAX, &c->cluster))
            return cli_usage_err("--cluster-id: bad number \"%s\"", arg);
        c->have_cluster = true;
        break;
    case OPT_REMOTE:
        if (!cli_parse_u64(arg, 0, UINT64_MAX, &c->remote))
            return cli_usage_err("--remote-cluster-id: bad number \"%s\"", arg);
        c->have_remote = true;
        break;
    case OPT_CACHE:
        if (!cli_parse_u64(arg, 1, INT64_MAX, &a))
            return cli_usage_err("--cache-id: bad id \"%s\"", arg);
        c->cache_id = (int64_t)a;
        break;
    case OPT_BATCH_INDEX:
        if (!cli_parse_u32(arg, 0, UINT32_MAX, &c->batch))
            return cli_usage_err("--batch-index: bad number \"%s\"", arg);
        break;
    case OPT_RANGE:
        if (!cli_parse_range(arg, false, &a, &b) || b > INT32_MAX)
            return cli_usage_err("--layers: \"%s\" is not A:B with "
                                 "A <= B",
                                 arg);
        c->layers = true;
        c->first = (int32_t)a;
        c->last = (int32_t)b;
        break;
    case OPT_BLOCKS:
        free(c->blocks);
        c->blocks = NULL;
        if (!cli_parse_list(arg, PULL_MAX_BLOCKS, &c->blocks, &c->nblocks))
            return cli_usage_err("--blocks: \"%s\" is not a list like "
                                 "0,3,8-15 (at most %u blocks)",
                                 arg, PULL_MAX_BLOCKS);
        break;
    case OPT_VERIFY:
        c->verify = true;
        break;
    default:
        return cli_usage_err("bad option");
    }
    return 0;
}

static int
pull_parse(pull_cfg *c, int argc, char **argv)
{
    static const struct option longopts[] = {
        {"connect", required_argument, NULL, 'c'},
        {"cluster-id", required_argument, NULL, OPT_CLUSTER},
        {"remote-cluster-id", required_argument, NULL, OPT_REMOTE},
        {"cache-id", required_argument, NULL, OPT_CACHE},
        {"batch-index", required_argument, NULL, OPT_BATCH_INDEX},
        {"layers", required_argument, NULL, OPT_RANGE},
        {"blocks", required_argument, NULL, OPT_BLOCKS},
        {"verify", no_argument, NULL, OPT_VERIFY},
        {NULL, 0, NULL, 0},
    };
    const cli_args a = {.usage = pull_usage,
                        .lo = &c->lo,
                        .shape = &c->shape,
                        .seed = &c->seed,
                        .timeout_ms = &c->timeout_ms};
    int rc = cli_args_parse(&a, longopts, "c:", pull_opt, c, argc, argv);

    if (rc != 0)
        return rc;
    if ((!c->have_connect && c->lo.metadata[0] == '\0') || !c->have_cluster ||
        !c->have_remote)
        return cli_usage_err("--connect (or --metadata), --cluster-id and "
                             "--remote-cluster-id are required");
    if (c->cluster == c->remote)
        return cli_usage_err("--cluster-id must differ from "
                             "--remote-cluster-id");
    return cli_peer_args_check(&c->lo, &c->shape);
}

int
cli_pull(int argc, char **argv)
{
    pull_cfg c;
    llmdd *dd = NULL;
    llmdd_cache local;
    bool have_local = false, linked = false;
    cli_seg *segs = NULL;
    size_t nsegs = 0;
    char err[1024], what[160], d[96], b1[32], b2[32];
    llmdd_status st;
    int rc;

    memset(&c, 0, sizeof(c));
    cli_lib_opts_init(&c.lo);
    cli_shape_default(&c.shape);
    c.seed = CLI_DEFAULT_SEED;
    c.timeout_ms = CLI_LINK_TIMEOUT_MS;
    rc = pull_parse(&c, argc, argv);
    if (rc != 0) {
        rc = rc < 0 ? CLI_EXIT_OK : rc;
        goto out;
    }
    rc = CLI_EXIT_FAIL;
    bool blocks = c.nblocks > 0;
    if (c.cache_id == 0)
        c.cache_id = blocks ? 2 : 1;
    llmdd_cache_desc desc =
        blocks ? cli_shape_paged(&c.shape) : cli_shape_kv(&c.shape);
    uint64_t stride = cli_desc_stride(&desc);

    st = cli_instance(c.cluster, LLMDD_ROLE_DECODER, &c.lo, NULL, NULL, &dd,
                      err, sizeof(err));
    if (st != LLM_SUCCESS) {
        cli_err("%s", err);
        goto out;
    }
    if ((st = llmdd_allocate_cache(dd, &desc, &local)) != LLM_SUCCESS) {
        cli_err_st(st, "llmdd_allocate_cache(%s)",
                   cli_fmt_desc(d, sizeof(d), &desc));
        goto out;
    }
    have_local = true;
    /* Fault the pages in now: a decoder reuses its caches, so the first
     * write's page faults are not part of a transfer. */
    for (uint32_t t = 0; t < local.desc.num_tensors; t++)
        memset((void *)(uintptr_t)local.tensor_addrs[t], 0,
               cli_desc_tensor_size(&desc));

    int64_t t0 = cli_now_ns();
    st = cli_link(dd, c.remote, c.have_connect ? c.ip : NULL, c.port,
                  c.timeout_ms, err, sizeof(err));
    int64_t link_ns = cli_now_ns() - t0;
    if (st != LLM_SUCCESS) {
        cli_err("%s", err);
        goto out;
    }
    linked = true;
    printf("llmdd pull: cluster %" PRIu64 " linked to cluster %" PRIu64
           " at %s in %s\n",
           c.cluster, c.remote,
           c.have_connect ? cli_fmt_addr(d, sizeof(d), c.ip, c.port)
                          : "the address etcd has",
           cli_fmt_ns(b1, sizeof(b1), link_ns));

    llmdd_cache_index idx = {.cluster_id = c.remote,
                             .cache_id = c.cache_id,
                             .batch_index = blocks ? 0 : c.batch};
    llmdd_kv_ext_param ext = {{c.first, c.last}, {c.first, c.last}, 2};
    const llmdd_kv_ext_param *extp = c.layers ? &ext : NULL;
    uint32_t tfirst = c.layers ? 2 * (uint32_t)c.first : 0;
    uint32_t tcount = c.layers ? 2 * (uint32_t)(c.last - c.first + 1)
                               : local.desc.num_tensors;
    uint64_t bytes;
    char layers[48] = "all layers";
    if (c.layers)
        snprintf(layers, sizeof(layers), "layers %" PRId32 "-%" PRId32, c.first,
                 c.last);

    uint64_t want = (blocks ? stride * c.nblocks : stride) * tcount;
    cli_progress *prog = cli_progress_start("pulling", want);
    t0 = cli_now_ns();
    if (blocks) {
        st = llmdd_pull_kv_blocks(dd, &idx, &local, c.blocks, c.blocks,
                                  c.nblocks, extp);
        snprintf(what, sizeof(what),
                 "llmdd_pull_kv_blocks(cache %" PRId64 ", %zu blocks, %s)",
                 c.cache_id, c.nblocks, layers);
        bytes = stride * c.nblocks * tcount;
    } else {
        st = llmdd_pull_kv_cache(dd, &idx, &local, c.batch, -1, extp);
        snprintf(what, sizeof(what),
                 "llmdd_pull_kv_cache(cache %" PRId64 ", slot %" PRIu32 ", %s)",
                 c.cache_id, c.batch, layers);
        bytes = stride * tcount;
    }
    int64_t ns = cli_now_ns() - t0;
    cli_progress_end(prog);
    if (st != LLM_SUCCESS) {
        cli_err_st(st, "%s", what);
        goto out;
    }
    printf("%s: %s in %s, %.2f GB/s\n", what,
           cli_fmt_bytes(b1, sizeof(b1), bytes), cli_fmt_ns(b2, sizeof(b2), ns),
           cli_gbps(bytes, ns));
    rc = CLI_EXIT_OK;

    if (c.verify) {
        bool made = blocks ? cli_segs_blocks(&local, c.blocks, c.blocks,
                                             c.nblocks, &segs, &nsegs)
                           : cli_segs_slot(&local, tfirst, tfirst, tcount,
                                           c.batch * stride, c.batch * stride,
                                           stride, &segs, &nsegs);
        if (!made) {
            cli_err("verification: out of memory");
            rc = CLI_EXIT_FAIL;
            goto out;
        }
        /* Blocks segments run tensor by tensor: keep the selected layers. */
        const cli_seg *sel = blocks ? segs + (size_t)tfirst * c.nblocks : segs;
        size_t nsel = blocks ? (size_t)tcount * c.nblocks : nsegs;
        cli_verdict v;
        cli_verify(sel, nsel, cli_cache_seed(c.seed, c.cache_id), &v);
        if (v.ok) {
            printf("verified: %s, checksum 0x%016" PRIx64 "\n",
                   cli_fmt_bytes(b1, sizeof(b1), v.bytes), v.got);
        } else {
            cli_err("verification FAILED: checksum 0x%016" PRIx64
                    " of what arrived != 0x%016" PRIx64
                    " expected; first wrong byte: tensor %" PRIu32
                    " offset %" PRIu64 "\n  hint: was `llmdd serve` started "
                    "with --fill (and the same --seed and shape)?",
                    v.got, v.want, sel[v.bad_seg].src_tensor,
                    sel[v.bad_seg].src_off + v.bad_off);
            rc = CLI_EXIT_FAIL;
        }
    }
out:
    if (linked) {
        st = cli_unlink(dd, c.remote, c.ip, c.port, c.timeout_ms, err,
                        sizeof(err));
        if (st != LLM_SUCCESS) {
            cli_err("%s", err);
            rc = CLI_EXIT_FAIL;
        }
    }
    if (have_local)
        llmdd_deallocate_cache(dd, local.cache_id);
    llmdd_destroy(dd);
    free(segs);
    free(c.blocks);
    cli_lib_opts_fini(&c.lo);
    return rc;
}
