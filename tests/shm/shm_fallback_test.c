/*
 * A registered cache whose owner refuses cross-memory attach still moves,
 * over the tcp data plane, and says so once in the log. The owner is a
 * peer_helper with --no-dumpable; this process also drops CAP_SYS_PTRACE
 * from its effective set, which root would otherwise use to attach anyway.
 * Exits 77 when the kernel lets the attach through regardless.
 */
#include <errno.h>
#include <linux/capability.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "harness/harness.h"
#include "transport/shm/shm.h"

#define PEER 1
#define SELF 2

static th_proc proc;

/* Per thread: transfers run in the calling (this) thread. */
static int
drop_ptrace_cap(void)
{
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];

    if (syscall(SYS_capget, &h, d) != 0)
        return -1;
    d[CAP_SYS_PTRACE / 32].effective &= ~(1u << (CAP_SYS_PTRACE % 32));
    return (int)syscall(SYS_capset, &h, d);
}

static llmdd_status
pull_all(llmdd *dd, int64_t id, const llmdd_cache *c)
{
    uint64_t all[] = {0, 1, 2, 3};
    llmdd_cache_index idx = {PEER, id, 0};

    return llmdd_pull_kv_blocks(dd, &idx, c, all, all, 4, NULL);
}

static void
check_cache(const llmdd_cache *c, uint32_t seed)
{
    uint64_t size = th_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++)
        assert_int_equal(
            th_check_buf((const uint8_t *)(uintptr_t)c->tensor_addrs[t], size,
                         seed, t),
            -1);
}

static void
test_cma_refused_falls_back(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "shm"},
                        {"llm.SyncKvCacheWaitTime", "5000"}};
    llmdd_cache_desc d = th_desc_kv();
    llmdd__shm_stats a, b;
    llmdd_cache c, back;
    llmdd *dd;

    (void)state;
    assert_int_equal(llmdd_create(SELF, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, o, 2), LLM_SUCCESS);
    assert_int_equal(th_link(dd, PEER, "127.0.0.1", proc.port, 5000),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &back), LLM_SUCCESS);

    /* The library's log (stderr) goes to a file while the fallback runs. */
    FILE *log = tmpfile();
    assert_non_null(log);
    fflush(stderr);
    int saved = dup(2);
    assert_true(saved >= 0 && dup2(fileno(log), 2) == 2);

    llmdd__shm_stats_get(&a);
    assert_int_equal(pull_all(dd, proc.ids.reg, &c), LLM_SUCCESS);
    check_cache(&c, 2);
    llmdd__shm_stats_get(&b);
    assert_int_equal(b.cma_refused - a.cma_refused, 1);
    assert_int_equal(b.stream_xfers - a.stream_xfers, 1);
    assert_int_equal(b.cma_xfers, a.cma_xfers);

    /* Later transfers of that cache go straight to tcp, pushes too. */
    th_fill(&c, 70);
    llmdd_cache_index idx = {PEER, proc.ids.reg, 0};
    uint64_t all[] = {0, 1, 2, 3};
    assert_int_equal(llmdd_push_kv_blocks(dd, &c, &idx, all, all, 4, NULL),
                     LLM_SUCCESS);
    assert_int_equal(pull_all(dd, proc.ids.reg, &back), LLM_SUCCESS);
    check_cache(&back, 70);
    llmdd__shm_stats_get(&a);
    assert_int_equal(a.cma_refused, b.cma_refused);
    assert_int_equal(a.stream_xfers - b.stream_xfers, 2);
    assert_int_equal(a.cma_xfers, b.cma_xfers);

    /* Three transfers of the refused cache, one line saying so. */
    fflush(stderr);
    assert_int_equal(dup2(saved, 2), 2);
    close(saved);
    char text[8192];
    rewind(log);
    size_t n = fread(text, 1, sizeof(text) - 1, log);
    text[n] = '\0';
    fclose(log);
    int lines = 0;
    for (const char *p = text; (p = strstr(p, "cross-memory attach")) != NULL;
         p++)
        lines++;
    if (lines != 1)
        fail_msg("expected one log line about the refused attach, got %d:\n%s",
                 lines, text);

    /* Allocated caches need no ptrace access: still a memcpy. */
    assert_int_equal(pull_all(dd, proc.ids.kv, &c), LLM_SUCCESS);
    check_cache(&c, 1);
    llmdd__shm_stats_get(&b);
    assert_int_equal(b.memfd_xfers - a.memfd_xfers, 1);
    llmdd_destroy(dd);
}

int
main(void)
{
    const char *args[] = {"--cluster",     "1", "--wait", "5000",
                          "--no-dumpable", NULL};
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cma_refused_falls_back),
    };
    char byte;

    if (th_proc_start(&proc, NULL, args) != 0) {
        fprintf(stderr, "cannot start peer_helper\n");
        return 1;
    }
    /* An address the peer surely has not mapped: EPERM means refused,
     * EFAULT means the kernel would have let us in. */
    drop_ptrace_cap();
    struct iovec l = {&byte, 1}, r = {(void *)(uintptr_t)4096, 1};
    errno = 0;
    if (process_vm_readv(proc.pid, &l, 1, &r, 1, 0) >= 0 || errno != EPERM) {
        fprintf(stderr,
                "cross-memory attach is not refused here (%s); "
                "skipping\n",
                strerror(errno));
        th_proc_stop(&proc);
        return TH_SKIP;
    }
    int rc = cmocka_run_group_tests_name("shm_fallback", tests, NULL, NULL);
    th_proc_stop(&proc);
    return rc;
}
