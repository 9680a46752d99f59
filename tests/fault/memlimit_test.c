/*
 * Allocating more than the memory cgroup lets the process hold returns
 * LLM_OUT_OF_MEMORY instead of getting the process OOM-killed while the
 * pages are faulted in. The test makes a memory cgroup of its own (cgroup
 * v2, or v1's memory hierarchy) with a 1 GiB limit and no swap, runs a
 * forked child in it that allocates 3 GiB (and a 3 GiB pool) and then
 * 256 MiB, and removes the cgroup. It skips (77) where no memory cgroup can
 * be made (not root, no writable hierarchy).
 *
 *   memlimit_test [test name]
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness/fault_util.h"

#define LIMIT (1ull << 30)

static char cgdir[PATH_MAX];
static int cgversion;

/* Writes a string to dir/name; 0 or -1 with errno. */
static int
put(const char *dir, const char *name, const char *val)
{
    char path[PATH_MAX + 64];
    int fd;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    if ((fd = open(path, O_WRONLY | O_CLOEXEC)) < 0)
        return -1;
    ssize_t n = write(fd, val, strlen(val));
    int err = errno;
    close(fd);
    errno = err;
    return n == (ssize_t)strlen(val) ? 0 : -1;
}

/*
 * Finds where our memory cgroup is (the hierarchy that holds the memory
 * controller) and makes a child of it; false when that cannot be done.
 */
static bool
cgroup_make(void)
{
    char line[1024], rel[PATH_MAX] = "", mnt[PATH_MAX] = "";
    bool v1 = false;
    FILE *f = fopen("/proc/self/cgroup", "r");

    if (f == NULL)
        return false;
    while (fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (c2 == NULL)
            continue;
        *c2 = '\0';
        if (strstr(c1 + 1, "memory") != NULL) {
            v1 = true;
            snprintf(rel, sizeof(rel), "%s", c2 + 1);
        } else if (!v1 && c1[1] == '\0') {
            snprintf(rel, sizeof(rel), "%s", c2 + 1);
        }
    }
    fclose(f);
    if ((f = fopen("/proc/self/mountinfo", "r")) == NULL)
        return false;
    while (fgets(line, sizeof(line), f) != NULL) {
        char root[PATH_MAX], point[PATH_MAX], type[64], opts[512];
        char *dash = strstr(line, " - ");
        if (dash == NULL ||
            sscanf(line, "%*s %*s %*s %4095s %4095s", root, point) != 2 ||
            sscanf(dash, " - %63s %*s %511s", type, opts) != 2)
            continue;
        if ((v1 && strcmp(type, "cgroup") == 0 &&
             strstr(opts, "memory") != NULL) ||
            (!v1 && strcmp(type, "cgroup2") == 0)) {
            snprintf(mnt, sizeof(mnt), "%s", point);
            break;
        }
    }
    fclose(f);
    if (mnt[0] == '\0')
        return false;
    char parent[PATH_MAX];
    if (snprintf(parent, sizeof(parent), "%s%s", mnt,
                 strcmp(rel, "/") == 0 ? "" : rel) >= (int)sizeof(parent))
        return false;
    if (!v1) {
        /* v2: the parent must hand the memory controller down. */
        char ctl[512] = "", path[PATH_MAX];
        if (snprintf(path, sizeof(path), "%s/cgroup.subtree_control", parent) >=
            (int)sizeof(path))
            return false;
        if ((f = fopen(path, "r")) != NULL) {
            if (fgets(ctl, sizeof(ctl), f) == NULL)
                ctl[0] = '\0';
            fclose(f);
        }
        if (strstr(ctl, "memory") == NULL &&
            put(parent, "cgroup.subtree_control", "+memory") != 0) {
            printf("memlimit_test: cannot enable memory in %s: %s\n", parent,
                   strerror(errno));
            return false;
        }
    }
    if (snprintf(cgdir, sizeof(cgdir), "%s/llmdd-memlimit-%d", parent,
                 (int)getpid()) >= (int)sizeof(cgdir)) {
        cgdir[0] = '\0';
        return false;
    }
    if (mkdir(cgdir, 0755) != 0) {
        printf("memlimit_test: mkdir %s: %s\n", cgdir, strerror(errno));
        cgdir[0] = '\0';
        return false;
    }
    cgversion = v1 ? 1 : 2;
    char lim[32];
    snprintf(lim, sizeof(lim), "%llu", LIMIT);
    int rc = v1 ? put(cgdir, "memory.limit_in_bytes", lim)
                : put(cgdir, "memory.max", lim);
    if (rc != 0) {
        printf("memlimit_test: setting the limit: %s\n", strerror(errno));
        return false;
    }
    /* No swap: the limit is what stays resident. Absent without swap
     * accounting, which is as good. */
    if (v1)
        (void)put(cgdir, "memory.memsw.limit_in_bytes", lim);
    else
        (void)put(cgdir, "memory.swap.max", "0");
    return true;
}

static void
cgroup_remove(void)
{
    if (cgdir[0] != '\0' && rmdir(cgdir) != 0)
        printf("memlimit_test: rmdir %s: %s\n", cgdir, strerror(errno));
    cgdir[0] = '\0';
}

static int
teardown(void **state)
{
    (void)state;
    cgroup_remove();
    return 0;
}

/* A cache of `mib` MiB: one uint8 tensor of 4 slots. */
static llmdd_cache_desc
desc_mib(uint64_t mib)
{
    llmdd_cache_desc d = {.num_tensors = 1,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, (int64_t)(mib << 18)}};
    return d;
}

/* The child, inside the cgroup: an exit code per broken promise. */
static int
child_main(void)
{
    llmdd_option pool[] = {{"llm.HostMemPoolConfig",
                            "{\"memory_size\": 3221225472, \"page_shift\": "
                            "20}"}};
    llmdd_cache_desc big = desc_mib(3072), small = desc_mib(256);
    llmdd_cache c;
    llmdd *dd;

    if (llmdd_create(1, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, NULL, 0) != LLM_SUCCESS)
        return 10;
    if (llmdd_allocate_cache(dd, &big, &c) != LLM_OUT_OF_MEMORY)
        return 11;
    if (llmdd_allocate_cache(dd, &small, &c) != LLM_SUCCESS)
        return 12;
    memset((void *)(uintptr_t)c.tensor_addrs[0], 0x5a, 256u << 20);
    if (llmdd_deallocate_cache(dd, c.cache_id) != LLM_SUCCESS)
        return 13;
    llmdd_destroy(dd);
    /* A pool is prefaulted whole when the instance starts. */
    if (llmdd_create(1, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, pool, 1) != LLM_OUT_OF_MEMORY)
        return 14;
    llmdd_destroy(dd);
    return 0;
}

static void
test_over_the_cgroup_limit(void **state)
{
    int go[2], status;
    char pid[32];

    (void)state;
    printf("memlimit_test: cgroup v%d at %s, limit %llu MiB\n", cgversion,
           cgdir, LIMIT >> 20);
    fflush(stdout);
    assert_int_equal(pipe(go), 0);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        char b;
        close(go[1]);
        /* Start once the parent moved us into the cgroup. */
        _exit(read(go[0], &b, 1) == 1 ? child_main() : 20);
    }
    close(go[0]);
    snprintf(pid, sizeof(pid), "%d", (int)child);
    int moved = put(cgdir, "cgroup.procs", pid);
    int err = errno;
    if (moved == 0)
        assert_int_equal(write(go[1], "g", 1), 1);
    close(go[1]);
    assert_int_equal(waitpid(child, &status, 0), child);
    if (moved != 0)
        fail_msg("moving the child into %s: %s", cgdir, strerror(err));
    if (WIFSIGNALED(status))
        fail_msg("the child was killed by signal %d (the OOM killer?)",
                 WTERMSIG(status));
    assert_true(WIFEXITED(status));
    if (WEXITSTATUS(status) != 0)
        fail_msg("the child failed with code %d (see child_main)",
                 WEXITSTATUS(status));
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_over_the_cgroup_limit, teardown),
    };

    th_test_filter(argc, argv);
#if defined(__SANITIZE_THREAD__)
    /* TSan's shadow of the child's memory counts against the very limit
     * under test; the plain and ASan builds run this. */
    printf("memlimit_test: not under ThreadSanitizer; skipped\n");
    return TH_SKIP;
#endif
    if (geteuid() != 0 || !cgroup_make()) {
        cgroup_remove();
        printf("memlimit_test: no memory cgroup can be made here; "
               "skipped\n");
        return TH_SKIP;
    }
    return cmocka_run_group_tests_name("memlimit", tests, NULL, NULL);
}
