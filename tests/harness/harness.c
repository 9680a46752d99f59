#include "harness/harness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

uint64_t
th_tensor_size(const llmdd_cache_desc *d)
{
    uint64_t size = llmdd_data_type_size(d->data_type);

    for (uint32_t i = 0; i < d->num_dims; i++)
        size *= (uint64_t)d->shape[i];
    return size;
}

void
th_fill_buf(uint8_t *buf, uint64_t len, uint32_t seed, uint32_t t)
{
    for (uint64_t i = 0; i < len; i++)
        buf[i] = th_byte(seed, t, i);
}

void
th_fill(const llmdd_cache *c, uint32_t seed)
{
    uint64_t size = th_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++)
        th_fill_buf((uint8_t *)(uintptr_t)c->tensor_addrs[t], size, seed, t);
}

int64_t
th_check_buf(const uint8_t *buf, uint64_t len, uint32_t seed, uint32_t t)
{
    for (uint64_t i = 0; i < len; i++)
        if (buf[i] != th_byte(seed, t, i))
            return (int64_t)i;
    return -1;
}

__attribute__((no_sanitize("thread"))) int64_t
th_check_pushed(const uint8_t *buf, uint64_t len, uint32_t seed, uint32_t t)
{
    for (uint64_t i = 0; i < len; i++)
        if (buf[i] != th_byte(seed, t, i))
            return (int64_t)i;
    return -1;
}

static llmdd_cache_desc
desc3(llmdd_data_type dt, int64_t a, int64_t b, int64_t c, uint32_t ndims)
{
    llmdd_cache_desc d = {.placement = LLMDD_PLACEMENT_HOST,
                          .num_tensors = 8,
                          .data_type = dt,
                          .num_dims = ndims,
                          .shape = {a, b, c}};
    return d;
}

llmdd_cache_desc
th_desc_kv(void)
{
    return desc3(LLMDD_DT_FLOAT16, 4, 16, 32, 3);
}

llmdd_cache_desc
th_desc_blocks(void)
{
    return desc3(LLMDD_DT_BF16, 64, 128, 0, 2);
}

llmdd_cache_desc
th_desc_small(void)
{
    return desc3(LLMDD_DT_FLOAT16, 4, 8, 32, 3);
}

int
th_peer_setup(llmdd *dd, th_peer_caches *pc)
{
    llmdd_cache_desc kv = th_desc_kv(), bl = th_desc_blocks(),
                     sm = th_desc_small();
    llmdd_cache c;
    uint64_t addrs[8];
    uint64_t size = th_tensor_size(&kv);

    memset(pc, 0, sizeof(*pc));
    if (llmdd_allocate_cache(dd, &kv, &c) != LLM_SUCCESS)
        return -1;
    th_fill(&c, 1);
    pc->kv = c.cache_id;

    pc->reg_mem = aligned_alloc(64, size * 8);
    if (pc->reg_mem == NULL)
        return -1;
    for (int t = 0; t < 8; t++) {
        addrs[t] = (uint64_t)(uintptr_t)(pc->reg_mem + t * size);
        th_fill_buf(pc->reg_mem + t * size, size, 2, (uint32_t)t);
    }
    if (llmdd_register_kv_cache(dd, &kv, addrs, 8, &pc->reg) != LLM_SUCCESS)
        return -1;

    if (llmdd_allocate_cache(dd, &bl, &c) != LLM_SUCCESS)
        return -1;
    th_fill(&c, 3);
    pc->blocks = c.cache_id;
    if (llmdd_allocate_cache(dd, &sm, &c) != LLM_SUCCESS)
        return -1;
    th_fill(&c, 4);
    pc->small = c.cache_id;
    return 0;
}

void
th_peer_teardown(llmdd *dd, th_peer_caches *pc)
{
    llmdd_unregister_kv_cache(dd, pc->reg);
    free(pc->reg_mem);
    pc->reg_mem = NULL;
}

llmdd_status
th_init_listen(llmdd *dd, const char *ip, uint16_t *port_out,
               const llmdd_option *extra, size_t nextra)
{
    llmdd_option opts[16];
    char addr[96];
    llmdd_ip_info bound;
    llmdd_status st;

    if (nextra > 15)
        return LLM_PARAM_INVALID;
    if (nextra > 0) /* extra may be NULL then: memcpy must not see it */
        memcpy(opts + 1, extra, nextra * sizeof(*extra));
    /* Port 0: the kernel picks a free one, and the instance says which. */
    snprintf(addr, sizeof(addr), strchr(ip, ':') ? "[%s]:0" : "%s:0", ip);
    opts[0] = (llmdd_option){"llm.ListenIpInfo", addr};
    st = llmdd_initialize(dd, opts, nextra + 1);
    if (st != LLM_SUCCESS)
        return st;
    if ((st = llmdd_listen_address(dd, &bound)) != LLM_SUCCESS)
        return st;
    *port_out = bound.port;
    return LLM_SUCCESS;
}

int64_t
th_metric(llmdd *dd, const char *series)
{
    size_t cap = llmdd_metrics_text(dd, NULL, 0) + 4096; /* it may grow */
    char *text = malloc(cap);
    size_t n = strlen(series);
    int64_t v = -1;

    if (text == NULL)
        return -1;
    llmdd_metrics_text(dd, text, cap);
    for (const char *p = text; p != NULL && *p != '\0';) {
        if (strncmp(p, series, n) == 0 && p[n] == ' ') {
            v = strtoll(p + n + 1, NULL, 10);
            break;
        }
        p = strchr(p, '\n');
        p = p != NULL ? p + 1 : NULL;
    }
    free(text);
    return v;
}

llmdd_cluster_info
th_cluster(uint64_t id, llmdd_ip_info *ipi, const char *ip, uint16_t port)
{
    memset(ipi, 0, sizeof(*ipi));
    snprintf(ipi->ip, sizeof(ipi->ip), "%s", ip);
    ipi->port = port;
    llmdd_cluster_info ci = {.remote_cluster_id = id,
                             .remote_role_type = LLMDD_ROLE_PROMPT,
                             .remote_ip_infos = ipi,
                             .num_remote_ip_infos = 1};
    return ci;
}

llmdd_status
th_link(llmdd *dd, uint64_t id, const char *ip, uint16_t port, int timeout_ms)
{
    llmdd_ip_info ipi;
    llmdd_cluster_info ci = th_cluster(id, &ipi, ip, port);
    llmdd_status ret = LLM_FAILED;
    llmdd_status st = llmdd_link_clusters(dd, &ci, 1, &ret, timeout_ms);

    return st == LLM_SUCCESS ? ret : st;
}

llmdd_status
th_link_retry(llmdd *dd, uint64_t id, const char *ip, uint16_t port,
              int timeout_ms)
{
    int64_t end = th_now_ms() + timeout_ms;
    llmdd_status st;

    while ((st = th_link(dd, id, ip, port, timeout_ms)) == LLM_ALREADY_LINK &&
           th_now_ms() < end)
        th_sleep_ms(5);
    return st;
}

llmdd_status
th_unlink(llmdd *dd, uint64_t id, const char *ip, uint16_t port, bool force,
          int timeout_ms)
{
    llmdd_ip_info ipi;
    llmdd_cluster_info ci = th_cluster(id, &ipi, ip, port);
    llmdd_status ret = LLM_FAILED;

    return llmdd_unlink_clusters(dd, &ci, 1, &ret, timeout_ms, force);
}

int
th_proc_start(th_proc *p, const char *const *wrapper, const char *const *args)
{
    const char *argv[64];
    int in[2], out[2], n = 0;
    char line[256];

    memset(p, 0, sizeof(*p));
    for (; wrapper != NULL && *wrapper != NULL && n < 40; wrapper++)
        argv[n++] = *wrapper;
    argv[n++] = LLMDD_PEER_HELPER;
    for (; args != NULL && *args != NULL && n < 62; args++)
        argv[n++] = *args;
    argv[n] = NULL;
    /* Close-on-exec, so that peers started later do not inherit this
     * peer's stdin and keep it from ever seeing EOF (dup2 clears it). */
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
        return -1;
    p->pid = th_spawn(argv, (const int[3]){in[0], out[1], -1});
    if (p->pid < 0)
        return -1;
    close(in[0]);
    close(out[1]);
    p->in = fdopen(in[1], "w");
    p->out = fdopen(out[0], "r");
    if (fgets(line, sizeof(line), p->out) == NULL) {
        th_proc_stop(p);
        return -1;
    }
    unsigned port;
    long long a, b, c, d;
    if (sscanf(line, "READY %u %lld %lld %lld %lld", &port, &a, &b, &c, &d) !=
        5) {
        th_proc_stop(p);
        return -1;
    }
    p->port = (uint16_t)port;
    p->ids.kv = a;
    p->ids.reg = b;
    p->ids.blocks = c;
    p->ids.small = d;
    return 0;
}

int
th_proc_cmd(th_proc *p, const char *cmd, char *reply, size_t cap)
{
    if (th_proc_send(p, cmd) != 0)
        return -1;
    return th_proc_reply(p, reply, cap);
}

int
th_proc_send(th_proc *p, const char *cmd)
{
    if (fprintf(p->in, "%s\n", cmd) < 0 || fflush(p->in) != 0)
        return -1;
    return 0;
}

int
th_proc_reply(th_proc *p, char *reply, size_t cap)
{
    char line[256];

    if (fgets(line, sizeof(line), p->out) == NULL)
        return -1;
    line[strcspn(line, "\n")] = '\0';
    if (reply != NULL)
        snprintf(reply, cap, "%s", line);
    return strncmp(line, "OK", 2) == 0 ? 0 : -1;
}

void
th_proc_kill(th_proc *p, int sig)
{
    if (p->pid > 0)
        kill(p->pid, sig);
}

int
th_proc_stop(th_proc *p)
{
    int status = 0;

    if (p->in != NULL)
        fclose(p->in);
    if (p->out != NULL)
        fclose(p->out);
    p->in = p->out = NULL;
    if (p->pid <= 0)
        return -1;
    /* stdin EOF makes it exit; do not wait forever on a stopped one. */
    int killed = th_wait(p->pid, 5000, &status);
    p->pid = 0;
    return killed == 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
