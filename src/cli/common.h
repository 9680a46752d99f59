/*
 * Shared pieces of the llmdd tool: error reporting and formatting
 * (messages.c), argument parsing and the library options (args.c), model
 * shapes (shape.c), the deterministic fill and its checksum (fill.c), and
 * the nodes (a prompt or decoder instance in a child process or a thread)
 * that demo and bench drive over pipes (node.c). The tool uses only the
 * public API.
 *
 * Thread safety: the parsers, the fill and the checksum are pure and
 * thread-safe. cli_err* write one line at a time. Nodes are started and
 * stopped from the main thread only.
 */
#ifndef LLMDD_CLI_COMMON_H
#define LLMDD_CLI_COMMON_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include <llmdd/llmdd.h>

/* Exit codes of every subcommand. */
#define CLI_EXIT_OK 0
#define CLI_EXIT_FAIL 1  /* a library call or a verification failed */
#define CLI_EXIT_USAGE 2 /* bad flags */

#define CLI_MAX_OPTIONS 32
#define CLI_DEFAULT_SEED 1u
#define CLI_LINK_TIMEOUT_MS 5000
/* Transfers in the tool may be large; the library default (1 s) is not. */
#define CLI_WAIT_KEY "llm.SyncKvCacheWaitTime"
#define CLI_WAIT_MS "60000"

/* "llmdd demo", for messages. Set by main before a subcommand runs. */
extern const char *cli_prog;

/* ---- Messages. ---- */

void cli_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* "<prog>: <what> failed: LLM_X (0x...)" and a hint for common statuses. */
void cli_err_st(llmdd_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The same text into buf, for errors a node reports to its parent. */
void cli_fmt_st(char *buf, size_t cap, llmdd_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Prints "<prog>: <msg>" and "Try '<prog> --help'." and returns 2. */
int cli_usage_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- Parsing: each returns true on success and writes *out only then. ---- */

bool cli_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out);
bool cli_parse_u32(const char *s, uint32_t min, uint32_t max, uint32_t *out);
/* A byte count with an optional binary suffix: 4096, 16K, 64KiB, 1G. */
bool cli_parse_size(const char *s, uint64_t *out);
/* "A:B" with A <= B, both unsigned; a single "A" means A:A. */
bool cli_parse_range(const char *s, bool sizes, uint64_t *a, uint64_t *b);
/* "IP:PORT" or "[IPv6]:PORT", port min_port..65535; ip gets the bare
 * address. */
bool cli_parse_hostport(const char *s, uint32_t min_port, char *ip, size_t cap,
                        uint16_t *port);
/* "0,3,5-9": a list of at most max indices; *out is malloc'd. */
bool cli_parse_list(const char *s, size_t max, uint64_t **out, size_t *n);
/*
 * One of n names: 0 with its index in *out, else CLI_EXIT_USAGE after
 * "<flag>: \"<s>\" is not a, b or c".
 */
int cli_parse_choice(const char *flag, const char *s, const char *const *names,
                     size_t n, int *out);

/* ---- Formatting. ---- */

/* "16 MiB", "1.5 KiB", "512 B". */
const char *cli_fmt_bytes(char *buf, size_t cap, uint64_t n);
/* "10.0.0.1:26000" or "[::1]:26000". */
const char *cli_fmt_addr(char *buf, size_t cap, const char *ip, uint16_t port);
/* "1.23 ms", "850 us", "2.10 s". */
const char *cli_fmt_ns(char *buf, size_t cap, int64_t ns);
int64_t cli_now_ns(void); /* CLOCK_MONOTONIC, shared by the host's processes */
double cli_gbps(uint64_t bytes, int64_t ns); /* decimal GB/s */

/*
 * Progress of long work on a terminal: when stderr is one and total is at
 * least CLI_PROGRESS_MIN, a line on stderr redrawn every 0.5 s with the
 * elapsed time, and the share done once cli_progress_set reports some.
 * NULL (nothing shown) otherwise; every call takes NULL.
 */
#define CLI_PROGRESS_MIN (256ull << 20)
typedef struct cli_progress cli_progress;
cli_progress *cli_progress_start(const char *what, uint64_t total);
void cli_progress_set(cli_progress *p, uint64_t done);
void cli_progress_end(cli_progress *p);

/* ---- Library options common to the node-running subcommands. ---- */

typedef struct {
    char transport[16]; /* auto, loop, shm, tcp, ucx */
    char host_pool[96]; /* llm.HostMemPoolConfig the tool chose, or "" */
    llmdd_option user[CLI_MAX_OPTIONS]; /* -o KEY=VALUE, applied last */
    size_t nuser;
    /* --metadata etcd://...: llm.MetadataServer (also among user), or "" */
    char metadata[1100];
} cli_lib_opts;

void cli_lib_opts_init(cli_lib_opts *lo);
void cli_lib_opts_fini(cli_lib_opts *lo);
/* The transports the tool knows, in auto's order of preference, with what
 * each is for; built in or not (cli_transport_built). */
typedef struct {
    const char *name, *what;
} cli_transport;
extern const cli_transport cli_transports[];
extern const size_t cli_ntransports;

/* --transport: auto or a known name, compiled into this library; else
 * prints why. */
bool cli_set_transport(cli_lib_opts *lo, const char *name);
/* -o KEY=VALUE. */
bool cli_add_option(cli_lib_opts *lo, const char *kv);
/* Whether name is in llmdd_transport_list(). */
bool cli_transport_built(const char *name);

/*
 * Creates and initializes an instance. With listen_ip set it listens there:
 * on *port when it is non-zero, else on a random free high port, which it
 * writes to *port. Errors go to err (with the status name).
 */
llmdd_status cli_instance(uint64_t cluster_id, llmdd_role role,
                          const cli_lib_opts *lo, const char *listen_ip,
                          uint16_t *port, llmdd **out, char *err, size_t cap);
/* Links dd to the cluster listening at ip:port. */
llmdd_status cli_link(llmdd *dd, uint64_t cluster_id, const char *ip,
                      uint16_t port, int timeout_ms, char *err, size_t cap);
llmdd_status cli_unlink(llmdd *dd, uint64_t cluster_id, const char *ip,
                        uint16_t port, int timeout_ms, char *err, size_t cap);

/* Whether `bytes` fit in 80% of this machine's memory; else a message. */
bool cli_memory_fits(uint64_t bytes, const char *hint);

/* ---- Model shapes. ---- */

typedef struct {
    char model[32];
    uint32_t layers; /* each layer is a K and a V tensor */
    uint32_t heads;  /* KV heads */
    uint32_t head_dim;
    uint32_t tokens;       /* per batch slot */
    uint32_t batch;        /* batch slots in the KV cache */
    uint32_t block_tokens; /* tokens per block of the paged cache */
} cli_shape;

/* Long-option ids shared by the subcommands that take a shape. */
enum {
    CLI_OPT_MODEL = 0x100,
    CLI_OPT_LAYERS,
    CLI_OPT_NUM_LAYERS,
    CLI_OPT_HEADS,
    CLI_OPT_HEAD_DIM,
    CLI_OPT_TOKENS,
    CLI_OPT_BATCH,
    CLI_OPT_BLOCK_TOKENS,
    CLI_OPT_SEED,
    CLI_OPT_TIMEOUT,
    CLI_OPT_METADATA,
    CLI_OPT_METADATA_PREFIX,
    CLI_OPT_FIRST_FREE /* subcommands number their own options from here */
};

/* The shape options, for getopt_long tables; --layers is the count. */
#define CLI_SHAPE_LONGOPTS                                                     \
    {"model", required_argument, NULL, CLI_OPT_MODEL},                         \
        {"num-layers", required_argument, NULL, CLI_OPT_NUM_LAYERS},           \
        {"heads", required_argument, NULL, CLI_OPT_HEADS},                     \
        {"head-dim", required_argument, NULL, CLI_OPT_HEAD_DIM},               \
        {"tokens", required_argument, NULL, CLI_OPT_TOKENS},                   \
        {"batch", required_argument, NULL, CLI_OPT_BATCH},                     \
    {                                                                          \
        "block-tokens", required_argument, NULL, CLI_OPT_BLOCK_TOKENS          \
    }

#define CLI_SHAPE_HELP                                                         \
    "Cache shape (prompt and decoder must agree):\n"                           \
    "  -m, --model NAME      llama3-8b (default), llama3-70b, llama2-7b,\n"    \
    "                        qwen2-7b, mistral-7b, tiny\n"                     \
    "      --num-layers N    layers (each a K and a V tensor)\n"               \
    "      --heads N         KV heads\n"                                       \
    "      --head-dim N      dimensions per head\n"                            \
    "      --tokens N        tokens per batch slot (default 128)\n"            \
    "      --batch N         batch slots (default 4)\n"                        \
    "      --block-tokens N  tokens per block of the paged cache "             \
    "(default 16)\n"

void cli_shape_default(cli_shape *s);
/*
 * Applies one shape option (CLI_OPT_MODEL ... CLI_OPT_BLOCK_TOKENS; the
 * count for CLI_OPT_LAYERS and CLI_OPT_NUM_LAYERS). Returns 1 when applied,
 * 0 when opt is not a shape option, -1 (after a message) on a bad value.
 */
int cli_shape_opt(cli_shape *s, int opt, const char *arg);
/* Checks the sizes; false after a message. */
bool cli_shape_check(const cli_shape *s);
/* What serve and pull, one side of two processes, cannot run with: the loop
 * transport, a bad shape. 0 or CLI_EXIT_USAGE after a message. */
int cli_peer_args_check(const cli_lib_opts *lo, const cli_shape *shape);
/* The KV cache: 2*layers tensors of bf16 [batch, tokens, heads, head_dim]. */
llmdd_cache_desc cli_shape_kv(const cli_shape *s);
/* The paged cache: [blocks, block_tokens, heads, head_dim], holding as many
 * tokens as the KV cache (rounded up to whole blocks). */
llmdd_cache_desc cli_shape_paged(const cli_shape *s);
/* The flags that rebuild this shape, for commands the tool prints. */
void cli_shape_flags(const cli_shape *s, char *buf, size_t cap);
uint64_t cli_desc_tensor_size(const llmdd_cache_desc *d);
uint64_t cli_desc_stride(const llmdd_cache_desc *d);
/* "bf16 [4,128,8,128]". */
const char *cli_fmt_desc(char *buf, size_t cap, const llmdd_cache_desc *d);

/* ---- The command line of every subcommand. ---- */

/*
 * What a subcommand takes of the options several share; a NULL field is one
 * it does not take. Every subcommand takes -h/--help, which prints usage.
 */
typedef struct {
    const char *usage;
    cli_lib_opts *lo;    /* -t/--transport NAME, -o/--option K=V */
    bool *transport_set; /* set when -t was given; may be NULL */
    cli_shape *shape;    /* -m/--model and the other shape options */
    uint32_t *seed;      /* --seed N */
    int *timeout_ms;     /* --timeout MS, 1..3600000 */
} cli_args;

/*
 * A subcommand's own option `opt` (from its getopt_long table) with its
 * argument: 0 when applied, else an exit code after a message.
 */
typedef int (*cli_own_fn)(void *ctx, int opt, const char *arg);

/*
 * Parses argv: the shared options into `a`, the subcommand's own (long
 * options in `own`, ended by a zero entry, or NULL; short letters in
 * `shorts` in getopt's syntax, or NULL) through own_fn(ctx, ...). Refuses
 * positional arguments and unknown flags. Returns 0, -1 after printing the
 * usage for --help, or an exit code after a message.
 */
int cli_args_parse(const cli_args *a, const struct option *own,
                   const char *shorts, cli_own_fn own_fn, void *ctx, int argc,
                   char **argv);

/* ---- The deterministic fill and its checksum. ---- */

/*
 * Byte `off` of tensor `t` of a cache filled with `seed` is byte off % 8
 * (little-endian) of cli_fill_word(seed, t, off / 8). Every prompt-side cache
 * the tool fills uses cli_cache_seed(seed, cache id), so two caches differ.
 */
uint64_t cli_fill_word(uint32_t seed, uint32_t t, uint64_t w);
uint32_t cli_cache_seed(uint32_t seed, int64_t cache_id);
/* Writes bytes [off, off + len) of tensor t's pattern to dst. */
void cli_fill(void *dst, uint64_t len, uint32_t seed, uint32_t t, uint64_t off);
/* Fills every tensor of a cache. */
void cli_fill_cache(const llmdd_cache *c, uint32_t seed);

/* A streaming 64-bit checksum: 8 bytes a step, order-sensitive. */
typedef struct {
    uint64_t h;
    uint64_t n;
    uint8_t tail[8];
    unsigned ntail;
} cli_hash;

void cli_hash_init(cli_hash *x);
void cli_hash_update(cli_hash *x, const void *p, size_t len);
uint64_t cli_hash_final(const cli_hash *x);

/* A run of bytes that arrived, and where in the source pattern it came from. */
typedef struct {
    const uint8_t *local;
    uint32_t src_tensor;
    uint64_t src_off;
    uint64_t len;
} cli_seg;

typedef struct {
    bool ok;
    uint64_t got, want; /* checksums of what arrived and of the pattern */
    uint64_t bytes;
    size_t bad_seg;   /* when !ok: the first segment that differs */
    uint64_t bad_off; /* and the byte within it */
} cli_verdict;

/* Checks every segment against the pattern of src_seed. */
void cli_verify(const cli_seg *segs, size_t n, uint32_t src_seed,
                cli_verdict *v);

/*
 * Segments for a KV-cache transfer: `count` tensor pairs (local tensor
 * lfirst + i, source tensor sfirst + i), each `len` bytes at local offset
 * loff and source offset soff. *out is malloc'd.
 */
bool cli_segs_slot(const llmdd_cache *local, uint32_t lfirst, uint32_t sfirst,
                   uint32_t count, uint64_t loff, uint64_t soff, uint64_t len,
                   cli_seg **out, size_t *n);
/* Segments for blocks src[k] -> dst[k] of every tensor (same indices). */
bool cli_segs_blocks(const llmdd_cache *local, const uint64_t *src,
                     const uint64_t *dst, size_t nblocks, cli_seg **out,
                     size_t *n);

/*
 * A scattered, duplicate-free pick of n (<= nb) of nb blocks into src, and
 * dst[k] = k (a fresh block table). Consecutive picks are never adjacent
 * when nb > 2, so no two pairs merge into one run.
 */
void cli_pick_blocks(uint64_t nb, size_t n, uint64_t *src, uint64_t *dst);

/* ---- Nodes: an instance in a child process or a thread, over pipes. ---- */

/* A node's body: reads commands from in_fd, answers on out_fd, returns its
 * exit code when in_fd reaches end of file. */
typedef int (*cli_node_fn)(void *arg, int in_fd, int out_fd);

typedef struct {
    char name[32];
    bool threaded;
    bool abandoned; /* a thread that stopped answering: never joined */
    pid_t pid;
    int cmd_fd; /* ours: commands to the node */
    int rep_fd; /* ours: its replies */
    struct cli_node_thread *thr;
} cli_node;

/*
 * Starts fn(arg, ...) in a forked child, or in a thread when `threaded`
 * (the loop transport needs both instances in one process). Children close
 * every other node's pipes so each sees end of file when its parent closes.
 */
int cli_node_start(cli_node *n, const char *name, bool threaded, cli_node_fn fn,
                   void *arg);
/* Closes the command pipe, waits for the node; returns its exit code, or
 * -1 (after a message) when it died of a signal or was killed. */
int cli_node_stop(cli_node *n);
/* Waits up to timeout_ms (< 0: forever) for a reply: 1 when one is there,
 * 0 on timeout. */
int cli_node_wait(cli_node *n, int timeout_ms);
/* Gives up on a node that stopped answering: a process is killed and
 * reaped; a thread is left behind (the tool exits soon after). */
void cli_node_kill(cli_node *n);

typedef struct {
    uint32_t type;
    uint32_t pad;
    uint64_t len;
} cli_msg_hdr;

#define CLI_MSG_MAX (64u << 20)

/* Sends one message: a header and the concatenation of a and b. */
/* Whole reads and writes on a blocking fd (EINTR retried); 0 or -1. */
int cli_read_full(int fd, void *p, size_t len);
int cli_write_full(int fd, const void *p, size_t len);
int cli_msg_send(int fd, uint32_t type, const void *a, size_t alen,
                 const void *b, size_t blen);
/* Receives one message; *payload is malloc'd (NULL when empty). 0 on
 * success, -1 on end of file, error or an oversized message. */
int cli_msg_recv(int fd, uint32_t *type, void **payload, size_t *len);

/* ---- Subcommands. ---- */

int cli_demo(int argc, char **argv);
int cli_serve(int argc, char **argv);
int cli_pull(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_info(int argc, char **argv);
int cli_stats(int argc, char **argv);

/* ---- The /metrics endpoint (metrics_http.c), on its own thread. ---- */

typedef struct cli_metrics_server cli_metrics_server;
/* Serves GET /metrics of dd on ip:port; NULL with a message in err. */
cli_metrics_server *cli_metrics_start(llmdd *dd, const char *ip, uint16_t port,
                                      char *err, size_t cap);
/* The port it serves on: the kernel's choice when started on port 0. */
uint16_t cli_metrics_port(const cli_metrics_server *s);
void cli_metrics_stop(cli_metrics_server *s); /* NULL is a no-op */
/* The transport dd's own transfers went over, from its metrics ("" when
 * none moved yet). */
void cli_transport_used(llmdd *dd, char *out, size_t cap);

#endif
