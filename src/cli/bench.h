/*
 * llmdd bench: what its files share (bench.c parses and sweeps, bench_node.c
 * runs the nodes, bench_base.c measures baselines, bench_report.c writes the
 * results). The tool uses only the public API.
 */
#ifndef LLMDD_CLI_BENCH_H
#define LLMDD_CLI_BENCH_H

#include "common.h"

#define BENCH_MAX_DECODERS 64
#define BENCH_MAX_DISCOVERY 1024 /* --op discovery: decoder instances */
#define BENCH_MAX_ITERS 100000u
#define BENCH_MAX_BLOCKS (1u << 20)
#define BENCH_MAX_SLOTS (1u << 20)
#define BENCH_PROMPT_ID 1
#define BENCH_AUTO_CALLS 100000u /* at most, per decoder and row */
#define BENCH_AUTO_MIN_CALLS 5
#define BENCH_MIN_TIME_MS 200
#define BENCH_WARMUP_MAX 20000u
#define BENCH_POOL_SHIFT 16
#define BENCH_MAX_INFLIGHT 1024

enum {
    BOP_PULL,
    BOP_PUSH,
    BOP_PULL_BLOCKS,
    BOP_LINK,
    BOP_LAYERWISE,
    BOP_FLEET,
    BOP_DISCOVERY,
    BOP_SLICES,
    BOP_N
};
extern const char *const bench_ops[BOP_N];

/* --op slices --row: the rows it has (src/cli/bench_slices.c). */
enum { SROW_HND, SROW_NHD, SROW_REMAP, SROW_4SRC, SROW_PERM, SROW_N };
extern const char *const bench_slice_rows[SROW_N];

enum { BASE_AUTO, BASE_MEMCPY, BASE_TCP, BASE_NONE, BASE_N };
extern const char *const bench_bases[BASE_N];

typedef struct {
    int op;
    cli_lib_opts lo;
    uint64_t bmin, bmax;
    uint32_t blocks;
    uint32_t inflight; /* pull-blocks: posted requests; 0: synchronous */
    uint32_t num_layers;
    int64_t compute_ns; /* layerwise: per layer; -1: one layer's push */
    bool block_set, transport_set, num_layers_set;
    int row; /* slices: the one row to run (SROW_*), -1: every row */
    uint32_t decoders;
    bool decoders_set;
    uint32_t iters, warmup; /* iters 0: auto, by time */
    bool warmup_set;
    uint32_t min_time_ms;
    uint32_t rounds; /* the sweep, repeated; rows report medians */
    bool no_pool;
    uint64_t pool_bytes; /* per node: the largest row's cache */
    uint64_t total;
    bool reg;
    int baseline;
    const char *json, *csv, *plot;
    bool progress;
    int timeout_ms;
    char command[1024];
} bench_cfg;

enum {
    BC_LINK = 1,
    BC_SETUP,
    BC_RUN,
    BC_PUSH_RUN,
    BC_LINKBENCH,
    BC_LAYERWISE,
    BC_REPLY
};

/* --op layerwise: the samples of one round, in this order. */
enum {
    LW_PUSH,    /* the push alone */
    LW_SEQ,     /* (a) */
    LW_LAYERED, /* (b) */
    LW_COMPUTE, /* (b): the sleeps, as they took */
    LW_TAIL,    /* (b): from the last mark to the end of the wait */
    LW_MARKS,   /* (b): inside llmdd_request_layer_ready, all layers */
    LW_PREEMPT, /* (b): involuntary context switches in those calls */
    LW_LAYER,   /* one layer pushed alone */
    LW_N
};

/* One row's layout: `tensors` tensors of u8 [nslots, block]. */
typedef struct {
    uint32_t op;
    uint32_t tensors;
    uint64_t block;
    uint64_t nslots;        /* slots, or blocks for pull-blocks; 0: free only */
    uint32_t per_call;      /* pull-blocks: blocks per call */
    uint32_t inflight;      /* pull-blocks: posted requests kept in flight */
    uint32_t num_layers;    /* layerwise: 2 tensors (K, V) each */
    int64_t compute_ns;     /* layerwise: per layer; < 0: one layer's push */
    uint32_t iters, warmup; /* iters: at most, with min_ns */
    int64_t min_ns;         /* > 0: stop once this long and 5 calls done */
    uint16_t port;
    uint32_t ndec;
    int64_t remote_cache;                  /* pull: the prompt's cache */
    int64_t dec_cache[BENCH_MAX_DECODERS]; /* push: each decoder's cache */
} bench_cmd;

typedef struct {
    uint32_t status;
    int64_t cache_id;
    uint16_t port;
    int64_t t0, t1; /* the timed calls, CLOCK_MONOTONIC */
    uint64_t bytes;
    uint64_t calls;
    int64_t post_ns;    /* --inflight: p50 of the post calls alone */
    int64_t compute_ns; /* layerwise: the compute per layer it simulated */
    uint64_t nsamples;  /* int64 nanoseconds follow */
    char err[768];
} bench_reply;

typedef struct {
    const bench_cfg *cfg;
    bool prompt;
    uint32_t index;
} bench_role;

typedef struct {
    const bench_cfg *cfg;
    bool prompt;
    uint64_t cluster;
    llmdd *dd;
    llmdd_cache cache;
    bool have_cache;
    uint64_t *reg_addrs; /* --register: our buffers */
} bench_node;

typedef struct {
    bool on;
    size_t done, total;
    int64_t t0;
    char label[64];
} bench_progress;

typedef struct {
    uint64_t block;
    uint32_t per_call;
    uint64_t bytes_per_call;
    uint32_t iters, warmup;
    uint64_t calls;
    double gbps, p50, p99, blocks_per_s;
    int base;
    double base_gbps, base_p50, base_p99;
    double ratio;
    /* memcpy baseline: the faster of memcpy and a streamed copy. */
    bool best_nt;
    double best_gbps, ratio_best;
    double unlink_p50, unlink_p99; /* op link */
    uint32_t inflight;             /* pull-blocks --inflight */
    double post_ns;                /* its post cost, per call (p50) */
    /* op layerwise: medians over rounds, in ms, and per-round ratios. */
    uint32_t layers;
    double compute_ms, push_ms, seq_ms, lw_ms, comp_ms, tail_ms, marks_ms;
    double preempt, layer_ms, ideal_ms;
    double ratio_seq, ratio_ideal;
    double layer_eff; /* median of (push / layers) / one layer alone */
    /* The rounds the medians above come from, and their spread (one
     * round: its own values) */
    uint32_t rounds;
    double gbps_lo, gbps_hi, base_lo, base_hi, ratio_lo, ratio_hi;
} bench_result;

typedef struct {
    double gbps, p50, p99;
} bench_base_result;

/* The memcpy baseline's buffers, kept across rows: faulting fresh pages in
 * for every row would cost more than the copies. */
typedef struct {
    uint8_t *src, *dst;
    size_t cap;
} bench_bufs;

/* ---- bench_node.c ---- */

bool bench_done(const bench_cmd *c, uint64_t timed, int64_t t0);
int bench_node_main(void *arg, int in_fd, int out_fd);

/* ---- bench_base.c ---- */

void bench_progress_draw(const bench_progress *p);
void bench_progress_clear(const bench_progress *p);
bool bench_recv(cli_node *node, const bench_progress *prog, bench_reply *r,
                int64_t **samples);
bool bench_call(cli_node *node, uint32_t type, const bench_cmd *c,
                const bench_progress *prog, bench_reply *r, int64_t **samples);
int bench_cmp_i64(const void *a, const void *b);
double bench_pct(const int64_t *s, size_t n, double q);
void bench_bufs_free(bench_bufs *b);
bool bench_base_memcpy(const bench_cmd *c, bench_bufs *bufs, bool nt,
                       bench_base_result *out);
bool bench_base_tcp(const bench_cmd *c, uint64_t per_call,
                    bench_base_result *out);
/* Ends the raw-TCP baseline's connection and sender; false if it failed. */
bool bench_base_tcp_stop(void);

/* ---- bench_fleet.c: --op fleet, start to end; the exit code. ---- */

int bench_fleet(const bench_cfg *cfg);
/* ---- bench_discovery.c: --op discovery; the exit code. ---- */
int bench_discovery(const bench_cfg *cfg);
/* ---- bench_slices.c: --op slices (KV layouts); the exit code. ---- */
int bench_slices(const bench_cfg *cfg);

/* ---- bench_args.c ---- */

/* Parses the command line into cfg: 0, -1 after --help, or an exit code
 * after a message. */
int bench_parse(bench_cfg *cfg, int argc, char **argv);

/* ---- bench_report.c ---- */

int bench_base_kind(const bench_cfg *cfg);
const char *bench_base_label(int kind);
void bench_print_header(const bench_cfg *cfg);
void bench_print_row(const bench_cfg *cfg, const bench_result *r);
/* runs: every round's rows, round after round (cfg->rounds x n). */
bool bench_write_json(const bench_cfg *cfg, const bench_result *rows, size_t n,
                      const bench_result *runs);
bool bench_write_csv(const bench_cfg *cfg, const bench_result *rows, size_t n);
bool bench_plot(const bench_cfg *cfg, const bench_result *rows, size_t n);

#endif
