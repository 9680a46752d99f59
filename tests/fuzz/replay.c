/*
 * Runs a fuzz target over files and directories of inputs, once each: the
 * corpus as a regression test for builds without libFuzzer (gcc, valgrind).
 *   <target>_replay FILE|DIR...
 */
#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz/fuzz.h"

__attribute__((weak)) int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    return 0;
}

static int
run_file(const char *path, size_t *count)
{
    FILE *f = fopen(path, "rb");
    uint8_t *buf = NULL;
    long n;

    if (f == NULL || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 ||
        fseek(f, 0, SEEK_SET) != 0) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        if (f != NULL)
            fclose(f);
        return -1;
    }
    /* An exact-size heap copy, so ASan sees reads past the end. */
    buf = malloc(n > 0 ? (size_t)n : 1);
    if (buf == NULL || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "replay: %s: short read\n", path);
        free(buf);
        fclose(f);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    (*count)++;
    return 0;
}

static int
run_path(const char *path, size_t *count)
{
    struct stat st;

    if (stat(path, &st) != 0) {
        fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode))
        return run_file(path, count);
    DIR *d = opendir(path);
    if (d == NULL)
        return -1;
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        char sub[4096];
        if (e->d_name[0] == '.')
            continue;
        snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name);
        rc = run_path(sub, count);
    }
    closedir(d);
    return rc;
}

int
main(int argc, char **argv)
{
    size_t count = 0;

    LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++)
        if (run_path(argv[i], &count) != 0)
            return 1;
    if (count == 0) {
        fprintf(stderr, "replay: no inputs\n");
        return 1;
    }
    printf("replay: %zu inputs, no failure\n", count);
    return 0;
}
