/*
 * How much more memory this process may make resident before the kernel's
 * OOM killer takes it: the memory cgroup's limit less its usage.
 *
 * Caches and pools are prefaulted when they are allocated (core/cache.c).
 * Under a memory cgroup limit, a fault that cannot be charged does not fail
 * the call: the OOM killer kills the process inside it. So an allocation
 * first checks that its size fits below the limits of the process's memory
 * cgroup and of every ancestor (cgroup v2 memory.max and memory.high, or
 * v1's memory.limit_in_bytes), counting as used what is charged less the
 * file cache (reclaimable), and keeping MEMLIMIT_RESERVE spare for
 * everything else the process allocates; it checks again before each chunk
 * it prefaults, since others allocate meanwhile. Swap is not counted as
 * room: a cache that only fits by being swapped out is of no use.
 * memory.high is treated as a limit because going past it throttles the
 * process hard. Where no cgroup can be read there is no limit to check:
 * rlimits make mmap or ftruncate fail on their own (cache.c checks
 * RLIMIT_FSIZE first, as exceeding it raises SIGXFSZ).
 *
 * Thread-safe: no shared state; each check reads the files again.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"

#define MEMLIMIT_RESERVE (32ull << 20)

/* Reads the first number of a file; "max" reads as UINT64_MAX. */
static bool
read_u64(const char *dir, const char *name, uint64_t *out)
{
    char path[PATH_MAX + 64], buf[64];
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    if ((f = fopen(path, "re")) == NULL)
        return false;
    bool ok = fgets(buf, sizeof(buf), f) != NULL;
    fclose(f);
    if (!ok)
        return false;
    if (strncmp(buf, "max", 3) == 0) {
        *out = UINT64_MAX;
        return true;
    }
    char *end;
    *out = strtoull(buf, &end, 10);
    return end != buf;
}

/* The sum of the named keys of a memory.stat file; 0 when unreadable. */
static uint64_t
stat_sum(const char *dir, const char *k1, const char *k2)
{
    char path[PATH_MAX + 64], line[256];
    uint64_t sum = 0;
    FILE *f;

    snprintf(path, sizeof(path), "%s/memory.stat", dir);
    if ((f = fopen(path, "re")) == NULL)
        return 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        char key[128];
        unsigned long long v;
        if (sscanf(line, "%127s %llu", key, &v) == 2 &&
            (strcmp(key, k1) == 0 || strcmp(key, k2) == 0))
            sum += v;
    }
    fclose(f);
    return sum;
}

/* Room left below one cgroup's limits; UINT64_MAX when it has none. */
static uint64_t
dir_room(const llmdd__memcg *cg, const char *dir)
{
    uint64_t limit = UINT64_MAX, high = UINT64_MAX, used, file;

    if (cg->version == 2) {
        bool any = read_u64(dir, "memory.max", &limit);
        any |= read_u64(dir, "memory.high", &high);
        if (!any || !read_u64(dir, "memory.current", &used))
            return UINT64_MAX;
        file = stat_sum(dir, "active_file", "inactive_file");
    } else {
        if (!read_u64(dir, "memory.limit_in_bytes", &limit) ||
            !read_u64(dir, "memory.usage_in_bytes", &used))
            return UINT64_MAX;
        file = stat_sum(dir, "total_active_file", "total_inactive_file");
    }
    if (high < limit)
        limit = high;
    /* v1 spells "no limit" as a huge page-aligned number. */
    if (limit >= (UINT64_MAX >> 2))
        return UINT64_MAX;
    used = used > file ? used - file : 0;
    return limit > used ? limit - used : 0;
}

/*
 * Splits a mountinfo line into its mount root, mount point and file system
 * type and super options. False when malformed.
 */
static bool
mount_fields(char *line, char **root, char **point, char **type, char **opts)
{
    char *save, *f[16];
    int n = 0, dash = -1;

    for (char *t = strtok_r(line, " \n", &save); t != NULL && n < 16;
         t = strtok_r(NULL, " \n", &save)) {
        if (dash < 0 && strcmp(t, "-") == 0)
            dash = n;
        f[n++] = t;
    }
    if (dash < 5 || n < dash + 4)
        return false;
    *root = f[3];
    *point = f[4];
    *type = f[dash + 1];
    *opts = f[dash + 3];
    return true;
}

static bool
has_word(const char *list, const char *word)
{
    size_t n = strlen(word);

    for (const char *p = list; p != NULL; p = strchr(p, ',')) {
        p += *p == ',';
        if (strncmp(p, word, n) == 0 && (p[n] == ',' || p[n] == '\0'))
            return true;
    }
    return false;
}

void
llmdd__memcg_find(llmdd__memcg *cg)
{
    char line[1024], v1path[PATH_MAX] = "", v2path[PATH_MAX] = "";
    bool v1 = false, v2 = false;
    FILE *f;

    memset(cg, 0, sizeof(*cg));
    if ((f = fopen("/proc/self/cgroup", "re")) == NULL)
        return;
    while (fgets(line, sizeof(line), f) != NULL) {
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (c2 == NULL)
            continue;
        *c2 = '\0';
        c2[1 + strcspn(c2 + 1, "\n")] = '\0';
        if (strcmp(line, "0") == 0 && c1[1] == '\0') {
            v2 = true;
            snprintf(v2path, sizeof(v2path), "%s", c2 + 1);
        } else if (has_word(c1 + 1, "memory")) {
            v1 = true;
            snprintf(v1path, sizeof(v1path), "%s", c2 + 1);
        }
    }
    fclose(f);
    if ((f = fopen("/proc/self/mountinfo", "re")) == NULL)
        return;
    while (fgets(line, sizeof(line), f) != NULL) {
        char *root, *point, *type, *opts;
        if (!mount_fields(line, &root, &point, &type, &opts))
            continue;
        /* The memory controller lives in one hierarchy: v1's if bound. */
        bool is_v1 = strcmp(type, "cgroup") == 0 && has_word(opts, "memory");
        bool is_v2 = strcmp(type, "cgroup2") == 0 && !v1;
        if (!(is_v1 && v1) && !(is_v2 && v2))
            continue;
        const char *rel = is_v1 ? v1path : v2path;
        size_t rl = strlen(root);
        if (strcmp(root, "/") != 0 && strncmp(rel, root, rl) == 0)
            rel += rl; /* our path is shown from the mount's root */
        int n = snprintf(cg->path, sizeof(cg->path), "%s", point);
        if (n < 0 || (size_t)n >= sizeof(cg->path))
            break;
        cg->top_len = (size_t)n;
        n = snprintf(cg->path + n, sizeof(cg->path) - (size_t)n, "%s",
                     strcmp(rel, "/") == 0 ? "" : rel);
        if (n < 0 || cg->top_len + (size_t)n >= sizeof(cg->path))
            break;
        cg->version = is_v1 ? 1 : 2;
        break;
    }
    fclose(f);
}

bool
llmdd__memcg_fits(const llmdd__memcg *cg, uint64_t len)
{
    char dir[PATH_MAX];
    uint64_t need;

    if (cg->version == 0)
        return true;
    if (__builtin_add_overflow(len, MEMLIMIT_RESERVE, &need))
        return false;
    snprintf(dir, sizeof(dir), "%s", cg->path);
    /* The cgroup itself, then each ancestor up to the mount's root. */
    for (;;) {
        if (dir_room(cg, dir) < need)
            return false;
        size_t n = strlen(dir);
        if (n <= cg->top_len)
            return true;
        while (n > cg->top_len && dir[n - 1] != '/')
            n--;
        if (n > cg->top_len)
            n--; /* the slash */
        dir[n] = '\0';
    }
}
