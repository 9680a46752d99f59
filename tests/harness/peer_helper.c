/*
 * A peer process for multi-process tests. It initializes an instance that
 * listens on a free port, sets up the standard caches (harness.h), prints
 *   READY <port> <kv> <reg> <blocks> <small>
 * and then answers one command per stdin line until "quit" or EOF:
 *   alloc SEED                     a kv-shaped cache filled with SEED
 *   alloc-big MIB TENSORS SEED     TENSORS uint8 tensors of MIB MiB, 4 slots
 *   reg-big MIB TENSORS SEED       the same shape in malloc'd memory,
 *                                  registered (a peer on this host: CMA)
 *   alloc-blocks BLOCKS STRIDE SEED  2 uint8 tensors of BLOCKS x STRIDE
 *   dealloc ID | ping | check ID SEED (verify a cache still holds SEED)
 *   link CLUSTER IP PORT           link to another peer (a 2000 ms call)
 *   pull CLUSTER ID [SEED]         slot 0 of its cache ID into scratch:
 *                                  status; with SEED, the bytes checked
 *   push CLUSTER ID                our kv cache's slot 0 to its cache ID
 *   push-lanes CLUSTER ID RID      slot 0 of our cache ID to the peer's
 *                                  RID: "OK <n>", n the TCP connections of
 *                                  this process that carried 1 MiB of it
 *   post-pulls CLUSTER ID N        N posted pulls of slot 0 into scratch;
 *                                  waits for all: "OK <ms to the last end>
 *                                  <status>..." then watches the scratch
 *                                  for 500 ms more: "ERR late write" if a
 *                                  byte lands after the requests ended
 *   check-link CLUSTER MS          llmdd_check_link's status
 *   notify CLUSTER N               sends notifications "0".."N-1" until one
 *                                  fails: "OK <sent> <status> <ms>", status
 *                                  and ms of the failure (LLM_SUCCESS, 0)
 *   lookup CLUSTER KEY             llmdd_lookup_remote_key: "OK <ms>" or ERR
 *   push-loop CLUSTER ID RID N     pushes slot i % 4 of our cache ID into
 *                                  the peer's RID, N times or until one
 *                                  fails: "GO" once the first push ended,
 *                                  then "OK <done> <start of the last
 *                                  success, CLOCK_MONOTONIC ms> <status>"
 * Options: --cluster N --role prompt|decoder|mix --ip IP --transport T
 *          --auth TOKEN --wait MS --pool JSON --opt KEY=VALUE (any option)
 *          --nofile N (the fd limit, set before the instance is made)
 *          --no-dumpable (no value: refuse other processes' cross-memory
 *          attach, as prctl(PR_SET_DUMPABLE, 0) does without CAP_SYS_PTRACE)
 */
#include <dirent.h>
#include <linux/tcp.h> /* tcp_info with bytes_acked; glibc's lacks it */
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#include "core/internal.h"
#include "harness/harness.h"

#define MAX_CACHES 64

static llmdd_cache caches[MAX_CACHES];
static int ncaches;

static void
reply_status(llmdd_status st, int64_t id)
{
    if (st == LLM_SUCCESS)
        printf("OK %lld\n", (long long)id);
    else
        printf("ERR %s\n", llmdd_status_str(st));
    fflush(stdout);
}

/*
 * Hands this thread's writes to a cache (a fill) to the instance's threads,
 * and theirs (a push) to this one, through the registry lock. The real
 * happens-before edge goes through the test process, which TSan cannot see.
 */
static void
cache_sync(llmdd *dd, int64_t id)
{
    llmdd__cache_put(dd, llmdd__cache_get(dd, id));
}

static void
alloc(llmdd *dd, const llmdd_cache_desc *d, uint32_t seed)
{
    llmdd_cache c;
    llmdd_status st = llmdd_allocate_cache(dd, d, &c);

    if (st == LLM_SUCCESS) {
        th_fill(&c, seed);
        cache_sync(dd, c.cache_id);
        if (ncaches < MAX_CACHES)
            caches[ncaches++] = c;
    }
    reply_status(st, c.cache_id);
}

/* Caller memory registered as a cache; it stays until the process exits. */
static void
reg(llmdd *dd, const llmdd_cache_desc *d, uint32_t seed)
{
    uint64_t size = th_tensor_size(d);
    uint64_t *addrs = calloc(d->num_tensors, sizeof(*addrs));
    llmdd_status st = addrs == NULL ? LLM_OUT_OF_MEMORY : LLM_SUCCESS;
    llmdd_cache c = {.cache_id = -1, .desc = *d, .tensor_addrs = addrs};

    for (uint32_t t = 0; st == LLM_SUCCESS && t < d->num_tensors; t++) {
        void *p = malloc(size);
        if (p == NULL)
            st = LLM_OUT_OF_MEMORY;
        addrs[t] = (uint64_t)(uintptr_t)p;
    }
    if (st == LLM_SUCCESS) {
        th_fill(&c, seed);
        st = llmdd_register_kv_cache(dd, d, addrs, d->num_tensors,
                                     &c.cache_id);
    }
    if (st == LLM_SUCCESS && ncaches < MAX_CACHES)
        caches[ncaches++] = c;
    reply_status(st, c.cache_id);
}

static void
check(llmdd *dd, long long id, uint32_t seed)
{
    cache_sync(dd, id);
    for (int i = 0; i < ncaches; i++) {
        if (caches[i].cache_id != id)
            continue;
        uint64_t size = th_tensor_size(&caches[i].desc);
        for (uint32_t t = 0; t < caches[i].desc.num_tensors; t++) {
            if (th_check_pushed((uint8_t *)(uintptr_t)caches[i].tensor_addrs[t],
                             size, seed, t) >= 0) {
                printf("ERR mismatch in tensor %u\n", t);
                fflush(stdout);
                return;
            }
        }
        printf("OK\n");
        fflush(stdout);
        return;
    }
    printf("ERR unknown\n");
    fflush(stdout);
}

/* The cache this helper allocated with that id, or NULL. */
static const llmdd_cache *
cache_find(long long id)
{
    for (int i = 0; i < ncaches; i++)
        if (caches[i].cache_id == id)
            return &caches[i];
    return NULL;
}

/*
 * The receiving side of "completion means landed": for each of `count`
 * notifications "<block>" (decimal), checks at once that block <block> of
 * every tensor of cache `id` holds th_byte(block, t, offset in block).
 * Prints "OK <torn>": how many blocks were not whole on arrival.
 */
static void
verify_notified(llmdd *dd, unsigned count, long long id, int timeout_ms)
{
    static llmdd_notify got[64];
    const llmdd_cache *c = cache_find(id);
    unsigned seen = 0, torn = 0;

    if (c == NULL) {
        printf("ERR unknown cache\n");
        fflush(stdout);
        return;
    }
    uint64_t block = th_tensor_size(&c->desc) / (uint64_t)c->desc.shape[0];
    while (seen < count) {
        struct pollfd p = {.fd = llmdd_notify_fd(dd), .events = POLLIN};
        size_t n = 0;
        if (poll(&p, 1, timeout_ms) != 1 ||
            llmdd_get_notifies(dd, got, 64, &n) != LLM_SUCCESS) {
            printf("ERR timeout after %u notifications\n", seen);
            fflush(stdout);
            return;
        }
        cache_sync(dd, id);
        for (size_t i = 0; i < n; i++, seen++) {
            unsigned b = (unsigned)strtoul((const char *)got[i].msg, NULL, 10);
            bool whole = b < (uint64_t)c->desc.shape[0];
            for (uint32_t t = 0; t < c->desc.num_tensors && whole; t++) {
                const uint8_t *p8 =
                    (const uint8_t *)(uintptr_t)c->tensor_addrs[t] + b * block;
                for (uint64_t k = 0; k < block && whole; k++)
                    whole = p8[k] == th_byte(b, t, k);
            }
            torn += !whole;
        }
    }
    printf("OK %u\n", torn);
    fflush(stdout);
}

/*
 * Waits up to timeout_ms for notifications, then prints "OK <n>" and, for
 * each, " <sender cluster>:<message>" (tests send printable messages).
 */
static void
notifies(llmdd *dd, int timeout_ms)
{
    static llmdd_notify got[64];
    struct pollfd p = {.fd = llmdd_notify_fd(dd), .events = POLLIN};
    size_t n = 0;

    if (poll(&p, 1, timeout_ms) == 1 &&
        llmdd_get_notifies(dd, got, 64, &n) != LLM_SUCCESS)
        n = 0;
    printf("OK %zu", n);
    for (size_t i = 0; i < n; i++)
        printf(" %llu:%.*s", (unsigned long long)got[i].cluster_id,
               (int)got[i].len, (const char *)got[i].msg);
    printf("\n");
    fflush(stdout);
}

/* A kv-shaped scratch cache, zeroed, for pulls that are only counted. */
static llmdd_cache scratch;

static llmdd_status
scratch_get(llmdd *dd)
{
    llmdd_cache_desc d = th_desc_kv();

    if (scratch.tensor_addrs != NULL)
        return LLM_SUCCESS;
    return llmdd_allocate_cache(dd, &d, &scratch);
}

static uint64_t
scratch_sum(void)
{
    uint64_t sum = 0, size = th_tensor_size(&scratch.desc);

    for (uint32_t t = 0; t < scratch.desc.num_tensors; t++) {
        const uint8_t *b = (const uint8_t *)(uintptr_t)scratch.tensor_addrs[t];
        for (uint64_t i = 0; i < size; i++)
            sum = sum * 31 + b[i];
    }
    return sum;
}

static void
cmd_link(llmdd *dd, uint64_t cluster, const char *ip, unsigned port)
{
    reply_status(th_link(dd, cluster, ip, (uint16_t)port, 2000), 0);
}

/* seed > 0: the pulled slot must hold that seed's pattern. */
static void
cmd_pull(llmdd *dd, uint64_t cluster, long long id, unsigned seed)
{
    llmdd_cache_index src = {cluster, id, 0};
    llmdd_status st = scratch_get(dd);

    if (st == LLM_SUCCESS)
        st = llmdd_pull_kv_cache(dd, &src, &scratch, 0, -1, NULL);
    if (st == LLM_SUCCESS && seed > 0) {
        uint64_t stride = th_tensor_size(&scratch.desc) /
                          (uint64_t)scratch.desc.shape[0];
        cache_sync(dd, scratch.cache_id);
        for (uint32_t t = 0; t < scratch.desc.num_tensors; t++) {
            if (th_check_buf((const uint8_t *)(uintptr_t)
                                 scratch.tensor_addrs[t],
                             stride, seed, t) >= 0) {
                printf("ERR mismatch in tensor %u\n", t);
                fflush(stdout);
                return;
            }
        }
    }
    reply_status(st, 0);
}

static void
cmd_push(llmdd *dd, int64_t kv, uint64_t cluster, long long id)
{
    llmdd_cache local = {.cache_id = kv};
    llmdd_cache_index dst = {cluster, id, 0};

    reply_status(llmdd_push_kv_cache(dd, &local, &dst, 0, -1, NULL), 0);
}

static void
cmd_post_pulls(llmdd *dd, uint64_t cluster, long long id, unsigned n)
{
    llmdd_request *reqs[64];
    llmdd_status sts[64];
    llmdd_cache_index src = {cluster, id, 0};
    llmdd_status st = scratch_get(dd);
    int64_t t0 = th_now_ms();

    if (n > 64)
        n = 64;
    for (unsigned i = 0; i < n && st == LLM_SUCCESS; i++)
        st = llmdd_pull_kv_cache_async(dd, &src, &scratch, i % 4, -1, NULL,
                                       NULL, &reqs[i]);
    if (st != LLM_SUCCESS) {
        reply_status(st, 0);
        return;
    }
    for (unsigned i = 0; i < n; i++)
        sts[i] = llmdd_request_wait(reqs[i], -1);
    int64_t ended = th_now_ms() - t0;
    for (unsigned i = 0; i < n; i++)
        llmdd_request_free(reqs[i]);
    /* Nothing may land once they ended: the scratch stays as it is. */
    cache_sync(dd, scratch.cache_id);
    uint64_t before = scratch_sum();
    th_sleep_ms(500);
    cache_sync(dd, scratch.cache_id);
    if (scratch_sum() != before) {
        printf("ERR late write\n");
        fflush(stdout);
        return;
    }
    printf("OK %lld", (long long)ended);
    for (unsigned i = 0; i < n; i++)
        printf(" %s", llmdd_status_str(sts[i]));
    printf("\n");
    fflush(stdout);
}

static void
cmd_notify(llmdd *dd, uint64_t cluster, unsigned n)
{
    llmdd_status st = LLM_SUCCESS;
    unsigned sent = 0;
    int64_t t0 = 0;

    for (; sent < n; sent++) {
        char msg[16];
        int len = snprintf(msg, sizeof(msg), "%u", sent);
        t0 = th_now_ms();
        if ((st = llmdd_send_notify(dd, cluster, msg, (size_t)len)) !=
            LLM_SUCCESS)
            break;
    }
    printf("OK %u %s %lld\n", sent, llmdd_status_str(st),
           st == LLM_SUCCESS ? 0LL : (long long)(th_now_ms() - t0));
    fflush(stdout);
}

static void
cmd_lookup(llmdd *dd, uint64_t cluster, const char *key)
{
    llmdd_cache_index idx;
    int64_t t0 = th_now_ms();
    llmdd_status st = llmdd_lookup_remote_key(dd, cluster, key, strlen(key),
                                              &idx);

    if (st == LLM_SUCCESS)
        printf("OK %lld\n", (long long)(th_now_ms() - t0));
    else
        printf("ERR %s\n", llmdd_status_str(st));
    fflush(stdout);
}

/* The fds looked at: a push-lanes test holds a link or two, far fewer. */
#define ACKED_MAX 256

/* bytes_acked of every TCP socket of this process, by fd (0: none). */
static void
tcp_acked(uint64_t *acked)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;

    memset(acked, 0, ACKED_MAX * sizeof(*acked));
    while (d != NULL && (e = readdir(d)) != NULL) {
        int fd = atoi(e->d_name);
        struct tcp_info ti;
        socklen_t len = sizeof(ti);
        if (fd > 2 && fd < ACKED_MAX && fd != dirfd(d) &&
            getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0)
            acked[fd] = ti.tcpi_bytes_acked;
    }
    if (d != NULL)
        closedir(d);
}

/*
 * Pushes slot 0 of our cache id to the peer's rid and counts the TCP
 * connections that carried at least 1 MiB of it: the lanes it was striped
 * over (llm.TcpLanes), as the kernel saw them.
 */
static void
cmd_push_lanes(llmdd *dd, uint64_t cluster, long long id, long long rid)
{
    static uint64_t before[ACKED_MAX], after[ACKED_MAX];
    llmdd_cache local = {.cache_id = id};
    llmdd_cache_index dst = {cluster, rid, 0};
    int lanes = 0;

    tcp_acked(before);
    llmdd_status st = llmdd_push_kv_cache(dd, &local, &dst, 0, -1, NULL);
    tcp_acked(after);
    for (int fd = 0; fd < ACKED_MAX; fd++)
        lanes += after[fd] >= before[fd] + (1u << 20);
    reply_status(st, lanes);
}

static void
cmd_push_loop(llmdd *dd, uint64_t cluster, long long id, long long rid,
              unsigned n)
{
    llmdd_cache local = {.cache_id = id};
    llmdd_status st = LLM_SUCCESS;
    int64_t last = 0;
    unsigned done = 0;

    for (; done < n; done++) {
        llmdd_cache_index dst = {cluster, rid, done % 4};
        int64_t began = th_now_ms();
        st = llmdd_push_kv_cache(dd, &local, &dst, done % 4, -1, NULL);
        if (st != LLM_SUCCESS)
            break;
        last = began;
        if (done == 0) { /* the loop is under way */
            printf("GO\n");
            fflush(stdout);
        }
    }
    if (done == 0) {
        printf("GO\n"); /* (and the result says why it stopped) */
        fflush(stdout);
    }
    printf("OK %u %lld %s\n", done, (long long)last, llmdd_status_str(st));
    fflush(stdout);
}

int
main(int argc, char **argv)
{
    uint64_t cluster = 1;
    llmdd_role role = LLMDD_ROLE_MIX;
    const char *ip = "127.0.0.1";
    llmdd_option opts[8];
    size_t nopts = 0;
    th_peer_caches pc;
    uint16_t port;
    llmdd *dd;

    for (int i = 1; i < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1]; /* argv[argc] is NULL */
        if (strcmp(k, "--no-dumpable") == 0) {
            if (prctl(PR_SET_DUMPABLE, 0) != 0)
                return 2;
            i--; /* a flag without a value */
            continue;
        }
        if (v == NULL)
            break;
        if (strcmp(k, "--cluster") == 0)
            cluster = strtoull(v, NULL, 10);
        else if (strcmp(k, "--role") == 0)
            role = strcmp(v, "prompt") == 0    ? LLMDD_ROLE_PROMPT
                   : strcmp(v, "decoder") == 0 ? LLMDD_ROLE_DECODER
                                               : LLMDD_ROLE_MIX;
        else if (strcmp(k, "--ip") == 0)
            ip = v;
        else if (strcmp(k, "--transport") == 0)
            opts[nopts++] = (llmdd_option){"llm.Transport", v};
        else if (strcmp(k, "--auth") == 0)
            opts[nopts++] = (llmdd_option){"llm.AuthToken", v};
        else if (strcmp(k, "--wait") == 0)
            opts[nopts++] = (llmdd_option){"llm.SyncKvCacheWaitTime", v};
        else if (strcmp(k, "--pool") == 0)
            opts[nopts++] = (llmdd_option){"llm.HostMemPoolConfig", v};
        else if (strcmp(k, "--nofile") == 0) {
            struct rlimit rl;
            if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
                return 2;
            rl.rlim_cur = strtoul(v, NULL, 10);
            if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
                return 2;
        } else if (strcmp(k, "--opt") == 0 && strchr(v, '=') != NULL) {
            char *eq = strchr(v, '=');
            *eq = '\0';
            opts[nopts++] = (llmdd_option){v, eq + 1};
        }
        if (nopts == 8)
            return 2;
    }
    if (llmdd_create(cluster, role, &dd) != LLM_SUCCESS)
        return 1;
    llmdd_status st = th_init_listen(dd, ip, &port, opts, nopts);
    if (st != LLM_SUCCESS) {
        fprintf(stderr, "peer_helper: initialize: %s\n", llmdd_status_str(st));
        return 1;
    }
    if (th_peer_setup(dd, &pc) != 0) {
        fprintf(stderr, "peer_helper: cache setup failed\n");
        return 1;
    }
    cache_sync(dd, pc.small); /* the last one th_peer_setup filled */
    printf("READY %u %lld %lld %lld %lld\n", port, (long long)pc.kv,
           (long long)pc.reg, (long long)pc.blocks, (long long)pc.small);
    fflush(stdout);

    char line[256];
    while (fgets(line, sizeof(line), stdin) != NULL) {
        unsigned a = 0, b = 0, c = 0;
        unsigned long long cl;
        long long id, id2;
        char key[64];
        if (strncmp(line, "quit", 4) == 0)
            break;
        if (sscanf(line, "alloc-big %u %u %u", &a, &b, &c) == 3) {
            llmdd_cache_desc d = {.num_tensors = b,
                                  .data_type = LLMDD_DT_UINT8,
                                  .num_dims = 2,
                                  .shape = {4, (int64_t)a << 18}};
            alloc(dd, &d, c);
        } else if (sscanf(line, "reg-big %u %u %u", &a, &b, &c) == 3) {
            llmdd_cache_desc d = {.num_tensors = b,
                                  .data_type = LLMDD_DT_UINT8,
                                  .num_dims = 2,
                                  .shape = {4, (int64_t)a << 18}};
            reg(dd, &d, c);
        } else if (sscanf(line, "alloc-blocks %u %u %u", &a, &b, &c) == 3) {
            llmdd_cache_desc d = {.num_tensors = 2,
                                  .data_type = LLMDD_DT_UINT8,
                                  .num_dims = 2,
                                  .shape = {a, b}};
            alloc(dd, &d, c);
        } else if (sscanf(line, "alloc %u", &a) == 1) {
            llmdd_cache_desc d = th_desc_kv();
            alloc(dd, &d, a);
        } else if (sscanf(line, "dealloc %lld", &id) == 1) {
            reply_status(llmdd_deallocate_cache(dd, id), id);
        } else if (sscanf(line, "check %lld %u", &id, &a) == 2) {
            check(dd, id, a);
        } else if (sscanf(line, "key %lld %u %63s", &id, &a, key) == 3) {
            reply_status(llmdd_set_cache_key(dd, id, a, key, strlen(key)), id);
        } else if (sscanf(line, "unkey %63s", key) == 1) {
            reply_status(llmdd_remove_cache_key(dd, key, strlen(key)), 0);
        } else if (sscanf(line, "verify-notified %u %lld %u", &a, &id, &b) ==
                   3) {
            verify_notified(dd, a, id, (int)b);
        } else if (sscanf(line, "notifies %u", &a) == 1) {
            notifies(dd, (int)a);
        } else if (sscanf(line, "link %llu %63s %u", &cl, key, &a) == 3) {
            cmd_link(dd, cl, key, a);
        } else if (sscanf(line, "pull %llu %lld %u", &cl, &id, &a) >= 2) {
            cmd_pull(dd, cl, id, a);
        } else if (sscanf(line, "push-lanes %llu %lld %lld", &cl, &id,
                          &id2) == 3) {
            cmd_push_lanes(dd, cl, id, id2);
        } else if (sscanf(line, "push %llu %lld", &cl, &id) == 2) {
            cmd_push(dd, pc.kv, cl, id);
        } else if (sscanf(line, "post-pulls %llu %lld %u", &cl, &id, &a) ==
                   3) {
            cmd_post_pulls(dd, cl, id, a);
        } else if (sscanf(line, "check-link %llu %u", &cl, &a) == 2) {
            reply_status(llmdd_check_link(dd, cl, (int32_t)a), 0);
        } else if (sscanf(line, "push-loop %llu %lld %lld %u", &cl, &id,
                          &id2, &a) == 4) {
            cmd_push_loop(dd, cl, id, id2, a);
        } else if (sscanf(line, "notify %llu %u", &cl, &a) == 2) {
            cmd_notify(dd, cl, a);
        } else if (sscanf(line, "lookup %llu %63s", &cl, key) == 2) {
            cmd_lookup(dd, cl, key);
        } else if (strncmp(line, "ping", 4) == 0) {
            reply_status(LLM_SUCCESS, 0);
        } else {
            printf("ERR unknown command\n");
            fflush(stdout);
        }
    }
    th_peer_teardown(dd, &pc);
    llmdd_destroy(dd);
    return 0;
}
