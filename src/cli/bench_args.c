/*
 * llmdd bench's command line: its usage text and its options into a
 * bench_cfg (bench.h).
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#include "bench.h"

static const char bench_usage[] =
    "Usage: llmdd bench [options]\n"
    "\n"
    "A sweep over block sizes (powers of two): one prompt and N decoder\n"
    "processes (threads for --transport loop) move blocks of each size.\n"
    "Each row: block size, blocks per call, GB/s (decimal, aggregate over\n"
    "decoders), p50/p99 latency per call, blocks/s, and the ratio to a\n"
    "baseline measured in the same run: one thread's memcpy of the same\n"
    "bytes (loop, shm, ucx), or one raw TCP loopback connection between two\n"
    "processes moving the same bytes per request, both cycling through as\n"
    "much memory as the row's caches, the connection kept for the whole\n"
    "run as a link's are (tcp; auto when shm and ucx are not built in).\n"
    "Next to memcpy, the best copy: the faster of memcpy and a copy with\n"
    "non-temporal stores of the same bytes, and the ratio to it (vs\n"
    "best).\n"
    "\n"
    "Options:\n"
    "      --op OP             pull (default): llmdd_pull_kv_cache of one\n"
    "                          batch slot of --blocks tensors;\n"
    "                          push: llmdd_push_kv_cache, the same from the\n"
    "                          prompt; pull-blocks: llmdd_pull_kv_blocks of\n"
    "                          --blocks scattered blocks of one tensor;\n"
    "                          link: link + unlink setup times;\n"
    "                          layerwise: compute-then-push against a\n"
    "                          layer-wise push (see below);\n"
    "                          fleet: 1 prompt, 8 decoders, 3 misbehaving\n"
    "                          (see below);\n"
    "                          discovery: N decoders link at once, by\n"
    "                          address and by cluster id (see below)\n"
    "  -t, --transport NAME    auto (default), loop, shm, tcp, ucx\n"
    "      --block-size MIN:MAX  block sizes, powers of two, e.g. 4K:16M or\n"
    "                          one size (default 4K:16M)\n"
    "      --blocks N          blocks per call (default 1; 64 for\n"
    "                          pull-blocks)\n"
    "      --inflight N        pull-blocks: keep N requests posted with\n"
    "                          llmdd_pull_kv_blocks_async in flight per\n"
    "                          decoder (1..1024); each row also prints the\n"
    "                          post call's own cost per block\n"
    "      --decoders N        concurrent decoder processes (default 1);\n"
    "                          push runs one prompt thread per decoder\n"
    "      --iters N           timed calls per decoder and row (default:\n"
    "                          as many as fit in --min-time, at least 5;\n"
    "                          100 for link)\n"
    "      --min-time MS       without --iters, time each row (and its\n"
    "                          baseline) for at least this long (default\n"
    "                          200)\n"
    "      --rounds N          run the whole sweep N times (1..100,\n"
    "                          default 1), row and baseline again each\n"
    "                          time; rows then show the medians of the\n"
    "                          rounds, the ratio as the median of each\n"
    "                          round's own ratio, with its lowest and\n"
    "                          highest (the plot: medians, bars from the\n"
    "                          lowest to the highest round; --json: each\n"
    "                          round too); pull, push and pull-blocks\n"
    "      --warmup N          untimed calls first (default: one pass over\n"
    "                          the cache and at least 16 MiB, 1..20000\n"
    "                          calls; iters/10 for link)\n"
    "      --total-size SIZE   memory of each cache per row (default 64M);\n"
    "                          calls cycle through the slots that fit, and a\n"
    "                          cache holds at least one call's worth\n"
    "      --register          the prompt registers malloc'd memory\n"
    "                          (llmdd_register_kv_cache) instead of\n"
    "                          llmdd_allocate_cache\n"
    "      --no-pool           allocate each row's caches on their own;\n"
    "                          by default they come from a host pool\n"
    "                          (llm.HostMemPoolConfig) sized for the largest\n"
    "                          row, so rows reuse memory already faulted in\n"
    "      --baseline KIND     auto (default), memcpy, tcp, none\n"
    "      --json FILE         write the results as JSON\n"
    "      --csv FILE          write the results as CSV\n"
    "      --plot FILE.png     draw GB/s and latency over block size with\n"
    "                          gnuplot (`sh scripts/deps.sh` installs it)\n"
    "      --no-progress       no progress bar (it shows only on a TTY)\n"
    "      --timeout MS        link timeout (default 5000)\n"
    "      --lanes N           tcp: llm.TcpLanes, auto or 1..16 data\n"
    "                          connections a transfer of 4 MiB or more is\n"
    "                          striped over (-o llm.TcpLanes=N)\n"
    "  -o, --option K=V        extra llmdd option for every instance\n"
    "  -h, --help              this text\n"
    "\n"
    "--op layerwise (tcp unless -t; one decoder; one row per block size,\n"
    "default 1M, a layer being the K and V tensors of one slot): each round\n"
    "times the prompt's llmdd_push_kv_cache of a slot alone, (a) every\n"
    "layer's compute and then that push, and (b) a push posted with\n"
    "LLMDD_XFER_LAYERWISE before the compute, each layer marked with\n"
    "llmdd_request_layer_ready after its compute, then waited for. Prints\n"
    "the medians, (b)/(a) and (b) / (max(compute, push) + push/layers).\n"
    "      --num-layers N      layers (default 32)\n"
    "      --compute-us N      compute per layer, simulated by sleeping\n"
    "                          until layer l's end, start + (l + 1) * N,\n"
    "                          as a GPU computing the layers back to back\n"
    "                          (default: one layer's push, measured)\n"
    "      --iters N           rounds (default: as many as fit in\n"
    "                          --min-time, at least 5)\n"
    "\n"
    "Examples:\n"
    "  llmdd bench --transport tcp --block-size 4K:64M --plot bench.png\n"
    "  llmdd bench --op pull --block-size 1G --blocks 1 --transport tcp\n"
    "  llmdd bench --op pull-blocks --block-size 16K --blocks 4096\n"
    "  llmdd bench --op pull-blocks -t tcp --block-size 64K --inflight 64\n"
    "  llmdd bench --op link --iters 200\n"
    "  llmdd bench --op layerwise --num-layers 32 --iters 10\n"
    "  llmdd bench --op fleet --min-time 5000\n"
    "  llmdd bench --op slices -t shm --rounds 7\n"
    "\n"
    "--op slices (tcp unless -t): slice pulls (KV layouts) against a\n"
    "contiguous pull of the same bytes, alternated --rounds times (default\n"
    "5); 32 MiB a tensor, or --block-size. Rows: heads-hnd, heads-nhd,\n"
    "remap16-64, 4-sources (with 1-source, its reference, in the same\n"
    "rounds), heads-perm; then the host's copy floor and the planner.\n"
    "      --row NAME          only that row (and no floor or planner)\n"
    "\n"
    "--op fleet (tcp unless -t): a prompt and 8 decoder processes; 5 pull\n"
    "and are pushed a slot (--block-size, default 256K) every 20 ms each,\n"
    "checked byte for byte, for --min-time ms (default 3000) alone, then as\n"
    "long while decoder 5 is stopped, 6 floods notifications and 7 is cut\n"
    "off (a network namespace of its own; needs root). Prints the healthy\n"
    "decoders' p99 in both phases and their ratio; exits 1 if a healthy\n"
    "decoder saw an error, a wrong byte or a request past the wait time.\n"
    "\n"
    "--op discovery [--metadata etcd://HOST:PORT]: --decoders N (default\n"
    "256, up to 1024) decoder instances of this process link at once to one\n"
    "prompt (tcp unless -t), by address (the baseline) and, with --metadata,\n"
    "by cluster id looked up in etcd, --rounds times (default 3); prints\n"
    "first call to last success for each, medians, spread and ratio, and\n"
    "the kernel's listen queue overflows and drops meanwhile (TcpExt\n"
    "ListenOverflows, ListenDrops); exits 1 if a link fails.\n";

enum {
    OPT_OP = CLI_OPT_FIRST_FREE,
    OPT_BLOCK_SIZE,
    OPT_BLOCKS,
    OPT_DECODERS,
    OPT_ITERS,
    OPT_WARMUP,
    OPT_TOTAL,
    OPT_REGISTER,
    OPT_BASELINE,
    OPT_JSON,
    OPT_CSV,
    OPT_PLOT,
    OPT_NO_PROGRESS,
    OPT_MIN_TIME,
    OPT_NO_POOL,
    OPT_INFLIGHT,
    OPT_NUM_LAYERS,
    OPT_COMPUTE_US,
    OPT_LANES,
    OPT_ROUNDS,
    OPT_ROW,
};

static int
bench_opt(void *ctx, int opt, const char *arg)
{
    bench_cfg *c = ctx;
    uint32_t v;

    switch (opt) {
    case OPT_OP:
        return cli_parse_choice("--op", arg, bench_ops, BOP_N, &c->op);
    case OPT_BLOCK_SIZE:
        c->block_set = true;
        if (!cli_parse_range(arg, true, &c->bmin, &c->bmax) || c->bmin == 0 ||
            c->bmax > (64ull << 30))
            return cli_usage_err("--block-size: \"%s\" is not MIN:MAX "
                                 "with 1 <= MIN <= MAX <= 64G",
                                 arg);
        if (c->bmin != c->bmax &&
            ((c->bmin & (c->bmin - 1)) != 0 || (c->bmax & (c->bmax - 1)) != 0))
            return cli_usage_err("--block-size: a sweep's MIN and MAX "
                                 "must be powers of two");
        break;
    case OPT_BLOCKS:
        if (!cli_parse_u32(arg, 1, BENCH_MAX_BLOCKS, &c->blocks))
            return cli_usage_err("--blocks: want 1..%u, got \"%s\"",
                                 BENCH_MAX_BLOCKS, arg);
        break;
    case OPT_DECODERS:
        if (!cli_parse_u32(arg, 1, BENCH_MAX_DISCOVERY, &c->decoders))
            return cli_usage_err("--decoders: want 1..%d, got \"%s\"",
                                 BENCH_MAX_DECODERS, arg);
        c->decoders_set = true;
        break;
    case OPT_ITERS:
        if (!cli_parse_u32(arg, 1, BENCH_MAX_ITERS, &c->iters))
            return cli_usage_err("--iters: want 1..%u, got \"%s\"",
                                 BENCH_MAX_ITERS, arg);
        break;
    case OPT_WARMUP:
        if (!cli_parse_u32(arg, 0, BENCH_MAX_ITERS, &c->warmup))
            return cli_usage_err("--warmup: want 0..%u, got \"%s\"",
                                 BENCH_MAX_ITERS, arg);
        c->warmup_set = true;
        break;
    case OPT_TOTAL:
        if (!cli_parse_size(arg, &c->total) || c->total == 0)
            return cli_usage_err("--total-size: bad size \"%s\"", arg);
        break;
    case OPT_REGISTER:
        c->reg = true;
        break;
    case OPT_BASELINE:
        return cli_parse_choice("--baseline", arg, bench_bases, BASE_N,
                                &c->baseline);
    case OPT_JSON:
        c->json = arg;
        break;
    case OPT_CSV:
        c->csv = arg;
        break;
    case OPT_PLOT:
        c->plot = arg;
        break;
    case OPT_NO_PROGRESS:
        c->progress = false;
        break;
    case OPT_NO_POOL:
        c->no_pool = true;
        break;
    case OPT_NUM_LAYERS:
        if (!cli_parse_u32(arg, 1, 1024, &c->num_layers))
            return cli_usage_err("--num-layers: want 1..1024, got \"%s\"", arg);
        c->num_layers_set = true;
        break;
    case OPT_ROW:
        return cli_parse_choice("--row", arg, bench_slice_rows, SROW_N,
                                &c->row);
    case OPT_COMPUTE_US:
        if (!cli_parse_u32(arg, 0, 10000000, &v))
            return cli_usage_err("--compute-us: want 0..10000000, got "
                                 "\"%s\"",
                                 arg);
        c->compute_ns = (int64_t)v * 1000;
        break;
    case OPT_INFLIGHT:
        if (!cli_parse_u32(arg, 1, BENCH_MAX_INFLIGHT, &c->inflight))
            return cli_usage_err("--inflight: want 1..%u, got \"%s\"",
                                 BENCH_MAX_INFLIGHT, arg);
        break;
    case OPT_LANES: {
        char kv[64];
        snprintf(kv, sizeof(kv), "llm.TcpLanes=%s", arg);
        if (!cli_add_option(&c->lo, kv))
            return cli_usage_err("--lanes: too many options");
        break;
    }
    case OPT_ROUNDS:
        if (!cli_parse_u32(arg, 1, 100, &c->rounds))
            return cli_usage_err("--rounds: want 1..100, got \"%s\"", arg);
        break;
    case OPT_MIN_TIME:
        if (!cli_parse_u32(arg, 1, 3600000, &c->min_time_ms))
            return cli_usage_err("--min-time: bad milliseconds \"%s\"", arg);
        break;
    default:
        return cli_usage_err("bad option");
    }
    return 0;
}

/* Returns 0, -1 after --help, or an exit code after a message. */
int
bench_parse(bench_cfg *cfg, int argc, char **argv)
{
    static const struct option longopts[] = {
        {"op", required_argument, NULL, OPT_OP},
        {"block-size", required_argument, NULL, OPT_BLOCK_SIZE},
        {"blocks", required_argument, NULL, OPT_BLOCKS},
        {"decoders", required_argument, NULL, OPT_DECODERS},
        {"iters", required_argument, NULL, OPT_ITERS},
        {"warmup", required_argument, NULL, OPT_WARMUP},
        {"total-size", required_argument, NULL, OPT_TOTAL},
        {"register", no_argument, NULL, OPT_REGISTER},
        {"baseline", required_argument, NULL, OPT_BASELINE},
        {"json", required_argument, NULL, OPT_JSON},
        {"csv", required_argument, NULL, OPT_CSV},
        {"plot", required_argument, NULL, OPT_PLOT},
        {"no-progress", no_argument, NULL, OPT_NO_PROGRESS},
        {"min-time", required_argument, NULL, OPT_MIN_TIME},
        {"no-pool", no_argument, NULL, OPT_NO_POOL},
        {"inflight", required_argument, NULL, OPT_INFLIGHT},
        {"num-layers", required_argument, NULL, OPT_NUM_LAYERS},
        {"compute-us", required_argument, NULL, OPT_COMPUTE_US},
        {"lanes", required_argument, NULL, OPT_LANES},
        {"rounds", required_argument, NULL, OPT_ROUNDS},
        {"row", required_argument, NULL, OPT_ROW},
        {NULL, 0, NULL, 0},
    };
    const cli_args a = {.usage = bench_usage,
                        .lo = &cfg->lo,
                        .transport_set = &cfg->transport_set,
                        .timeout_ms = &cfg->timeout_ms};
    int rc = cli_args_parse(&a, longopts, NULL, bench_opt, cfg, argc, argv);

    if (rc != 0)
        return rc;
    if (cfg->op == BOP_SLICES) {
        if (!cfg->transport_set && !cli_set_transport(&cfg->lo, "tcp"))
            return CLI_EXIT_USAGE;
        return 0;
    }
    if (cfg->row >= 0)
        return cli_usage_err("--row: only with --op slices");
    if (cfg->op == BOP_DISCOVERY) {
        if (!cfg->transport_set && !cli_set_transport(&cfg->lo, "tcp"))
            return CLI_EXIT_USAGE;
        return 0;
    }
    if (cfg->decoders > BENCH_MAX_DECODERS)
        return cli_usage_err("--decoders: want 1..%d (up to %d with --op "
                             "discovery)",
                             BENCH_MAX_DECODERS, BENCH_MAX_DISCOVERY);
    if (cfg->blocks == 0)
        cfg->blocks = cfg->op == BOP_PULL_BLOCKS ? 64 : 1;
    if (cfg->inflight > 0 && cfg->op != BOP_PULL_BLOCKS)
        return cli_usage_err("--inflight: only with --op pull-blocks");
    if (cfg->rounds > 1 && (cfg->op == BOP_LINK || cfg->op == BOP_LAYERWISE))
        return cli_usage_err("--rounds: only with --op pull, push or "
                             "pull-blocks");
    if (cfg->rounds == 0)
        cfg->rounds = 1;
    if (cfg->op == BOP_FLEET) {
        if (!cfg->block_set)
            cfg->bmin = cfg->bmax = 256u << 10;
        if (cfg->bmin != cfg->bmax || cfg->csv != NULL || cfg->plot != NULL ||
            cfg->rounds > 1)
            return cli_usage_err("--op fleet: one --block-size, no --csv, "
                                 "--plot or --rounds (run it again)");
        if (!cfg->transport_set && !cli_set_transport(&cfg->lo, "tcp"))
            return CLI_EXIT_USAGE;
    }
    if (cfg->op == BOP_LAYERWISE) {
        if (cfg->decoders > 1 || cfg->blocks > 1 || cfg->csv != NULL ||
            cfg->plot != NULL || cfg->baseline != BASE_AUTO)
            return cli_usage_err("--op layerwise: one decoder, one block "
                                 "per tensor, no --csv, --plot or "
                                 "--baseline (its baseline is (a))");
        /* A layer of 2 MiB: long enough to time, short enough to run
         * several rounds a second. */
        if (!cfg->block_set)
            cfg->bmin = cfg->bmax = 1u << 20;
        if (!cfg->transport_set && !cli_set_transport(&cfg->lo, "tcp"))
            return CLI_EXIT_USAGE;
        cfg->baseline = BASE_NONE;
    } else if (cfg->num_layers_set || cfg->compute_ns >= 0) {
        return cli_usage_err("--num-layers and --compute-us: only with "
                             "--op layerwise");
    }
    if (cfg->op == BOP_LINK && cfg->plot != NULL)
        return cli_usage_err("--plot draws a block-size sweep; --op link "
                             "has none");
    if (cfg->bmax * cfg->blocks / cfg->blocks != cfg->bmax ||
        cfg->bmax * cfg->blocks > (64ull << 30))
        return cli_usage_err("--block-size x --blocks must stay within 64G "
                             "per call");
    return 0;
}
