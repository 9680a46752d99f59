#include "harness/mp.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MP_MAX_PEERS 16

static th_proc peers[MP_MAX_PEERS];
static bool peer_used[MP_MAX_PEERS];

th_proc *
mp_peer_start(uint64_t cluster, const char *const *extra)
{
    const char *args[32];
    th_proc *p = NULL;
    char id[24];
    int n = 0;

    for (int i = 0; i < MP_MAX_PEERS && p == NULL; i++) {
        if (!peer_used[i]) {
            peer_used[i] = true;
            p = &peers[i];
        }
    }
    if (p == NULL)
        fail_msg("too many peers");
    snprintf(id, sizeof(id), "%llu", (unsigned long long)cluster);
    args[n++] = "--cluster";
    args[n++] = id;
    for (; extra != NULL && *extra != NULL && n < 30; extra++)
        args[n++] = *extra;
    args[n] = NULL;
    if (th_proc_start(p, NULL, args) != 0)
        fail_msg("peer_helper for cluster %llu did not start",
                 (unsigned long long)cluster);
    return p;
}

void
mp_peer_kill(th_proc *p)
{
    th_proc_kill(p, SIGCONT);
    th_proc_kill(p, SIGKILL);
    th_proc_stop(p);
}

/* Whether every thread of pid is in state T (stopped). */
static bool
all_stopped(pid_t pid)
{
    char path[320];
    int running = 0;

    snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (d == NULL)
        return false;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char stat[512], *rp;
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof(path), "/proc/%d/task/%s/stat", (int)pid,
                 e->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue; /* the thread just exited */
        size_t n = fread(stat, 1, sizeof(stat) - 1, f);
        fclose(f);
        stat[n] = '\0';
        /* "pid (comm) S ...": the state follows the last ')'. */
        rp = strrchr(stat, ')');
        if (rp == NULL || rp[1] != ' ' || rp[2] != 'T')
            running++;
    }
    closedir(d);
    return running == 0;
}

void
mp_peer_stop(th_proc *p)
{
    int64_t end = th_now_ms() + 2000;

    th_proc_kill(p, SIGSTOP);
    while (!all_stopped(p->pid)) {
        if (th_now_ms() > end)
            fail_msg("peer %d did not stop", (int)p->pid);
        th_sleep_ms(1);
    }
}

void
mp_reap_all(void)
{
    for (int i = 0; i < MP_MAX_PEERS; i++) {
        if (peer_used[i] && peers[i].pid > 0)
            mp_peer_kill(&peers[i]);
        peer_used[i] = false;
    }
}

llmdd *
mp_decoder(uint64_t cluster, const llmdd_option *opts, size_t n)
{
    llmdd *dd;

    assert_int_equal(llmdd_create(cluster, LLMDD_ROLE_DECODER, &dd),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, opts, n), LLM_SUCCESS);
    return dd;
}

llmdd_status
mp_pull_check(llmdd *dd, uint64_t cluster, int64_t id, uint32_t seed)
{
    llmdd_cache_desc d = th_desc_kv();
    llmdd_status st = LLM_SUCCESS;
    llmdd_cache c;

    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    for (uint32_t b = 0; b < 4 && st == LLM_SUCCESS; b++) {
        llmdd_cache_index idx = {cluster, id, b};
        st = llmdd_pull_kv_cache(dd, &idx, &c, b, -1, NULL);
    }
    if (st == LLM_SUCCESS) {
        for (uint32_t t = 0; t < d.num_tensors; t++) {
            int64_t bad = th_check_buf(
                (const uint8_t *)(uintptr_t)c.tensor_addrs[t],
                th_tensor_size(&d), seed, t);
            if (bad >= 0)
                fail_msg("cluster %llu cache %lld: tensor %u differs at %lld",
                         (unsigned long long)cluster, (long long)id, t,
                         (long long)bad);
        }
    }
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    return st;
}

llmdd_status
mp_pull_status(llmdd *dd, uint64_t cluster, int64_t id)
{
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache_index idx = {cluster, id, 0};
    llmdd_cache c;

    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    llmdd_status st = llmdd_pull_kv_cache(dd, &idx, &c, 0, -1, NULL);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    return st;
}

llmdd_status
mp_wait_pull_status(llmdd *dd, uint64_t cluster, int64_t id,
                    llmdd_status want, int timeout_ms)
{
    int64_t end = th_now_ms() + timeout_ms;
    llmdd_status st;

    for (;;) {
        st = mp_pull_status(dd, cluster, id);
        if (st == want || th_now_ms() >= end)
            return st;
        th_sleep_ms(10);
    }
}

bool
mp_conn_pending(int lfd)
{
    int flags = fcntl(lfd, F_GETFL);

    fcntl(lfd, F_SETFL, flags | O_NONBLOCK);
    int fd = accept(lfd, NULL, NULL);
    fcntl(lfd, F_SETFL, flags);
    if (fd < 0)
        return false;
    close(fd);
    return true;
}
