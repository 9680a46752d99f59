/*
 * A shm peer stalled in the middle of a push into the owner's pool must
 * not write into a cache the owner allocated after it gave up on the peer.
 *
 * This process owns a pool; a copy of itself (--pusher) links over shm and
 * pushes a 256 MiB slot from memory whose second half is registered with
 * userfaultfd, so its memcpy stops, provably mid-copy, at the first missing
 * page and says so. We SIGSTOP it there, deallocate (no INVAL ack: the link
 * is dropped), allocate a new cache of the same size, fill it, let the
 * pusher go on, and check: the new cache was not put on the old pages (or
 * the allocation failed), its bytes are intact, the push did not return
 * LLM_SUCCESS, and once the pusher exited the held pages serve again, as
 * zeros. Skips (77) where userfaultfd is not available.
 *
 *   shm_quarantine_test [test name]
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness/fault_util.h"

#define OWNER 2
#define PUSHER 3
#define SLOT (256ull << 20)
#define HALF (SLOT / 2)
#define POOL "{\"memory_size\": 536870912, \"page_shift\": 20}"
#define OWNER_WAIT "300"
#define PUSHED 0xa5
#define FILLED 0x3c

static llmdd_cache_desc
slot_desc(void)
{
    llmdd_cache_desc d = {.num_tensors = 1,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {1, (int64_t)SLOT}};
    return d;
}

static int
uffd_open(void)
{
    return (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
}

/* ---- The pusher (a child process). ---- */

static int uffd = -1;
static uint8_t *src;

/* Says when the copy reached the missing half, then waits for "go". */
static void *
fault_main(void *arg)
{
    struct pollfd p = {.fd = uffd, .events = POLLIN};
    struct uffd_msg msg;
    char line[16];

    (void)arg;
    while (poll(&p, 1, -1) != 1 ||
           read(uffd, &msg, sizeof(msg)) != (ssize_t)sizeof(msg) ||
           msg.event != UFFD_EVENT_PAGEFAULT)
        ;
    printf("FAULT\n");
    fflush(stdout);
    if (fgets(line, sizeof(line), stdin) == NULL)
        _exit(3);
    struct uffdio_zeropage z = {
        .range = {.start = (uint64_t)(uintptr_t)(src + HALF), .len = HALF}};
    if (ioctl(uffd, UFFDIO_ZEROPAGE, &z) != 0)
        _exit(4);
    return NULL;
}

static int
pusher_main(const char *port, int64_t id)
{
    llmdd_option o[] = {{"llm.Transport", "shm"}};
    llmdd_cache_desc d = slot_desc();
    uint64_t addr, blk = 0;
    llmdd_cache local = {.desc = d, .tensor_addrs = &addr};
    llmdd_cache_index idx = {OWNER, id, 0};
    llmdd *dd;
    pthread_t t;

    src = mmap(NULL, SLOT, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
               -1, 0);
    if (src == MAP_FAILED || llmdd_create(PUSHER, LLMDD_ROLE_MIX, &dd) != 0 ||
        llmdd_initialize(dd, o, 1) != LLM_SUCCESS ||
        th_link(dd, OWNER, "127.0.0.1", (uint16_t)atoi(port), 5000) !=
            LLM_SUCCESS)
        return 1;
    addr = (uint64_t)(uintptr_t)src;
    if (llmdd_register_kv_cache(dd, &d, &addr, 1, &local.cache_id) !=
            LLM_SUCCESS ||
        llmdd_pull_kv_blocks(dd, &idx, &local, &blk, &blk, 1, NULL) !=
            LLM_SUCCESS) /* the owner's pool is mapped here from now on */
        return 1;
    memset(src, PUSHED, HALF);
    struct uffdio_api api = {.api = UFFD_API};
    struct uffdio_register reg = {
        .range = {.start = (uint64_t)(uintptr_t)(src + HALF), .len = HALF},
        .mode = UFFDIO_REGISTER_MODE_MISSING};
    if ((uffd = uffd_open()) < 0 || ioctl(uffd, UFFDIO_API, &api) != 0 ||
        ioctl(uffd, UFFDIO_REGISTER, &reg) != 0 ||
        madvise(src + HALF, HALF, MADV_DONTNEED) != 0 ||
        pthread_create(&t, NULL, fault_main, NULL) != 0)
        return 2;
    printf("LINKED\n");
    fflush(stdout);
    llmdd_status st =
        llmdd_push_kv_blocks(dd, &local, &idx, &blk, &blk, 1, NULL);
    pthread_join(t, NULL);
    printf("PUSH %s\n", llmdd_status_str(st));
    fflush(stdout);
    llmdd_destroy(dd);
    return 0;
}

/* ---- The owner (this process). ---- */

static th_child child;

static int
teardown(void **state)
{
    (void)state;
    if (child.pid > 0) {
        kill(child.pid, SIGCONT);
        th_child_reap(&child, 5000);
        child.pid = 0;
    }
    return 0;
}

static bool
all_bytes(const uint8_t *p, uint64_t len, uint8_t v)
{
    for (uint64_t i = 0; i < len; i++)
        if (p[i] != v)
            return false;
    return true;
}

static void
test_stalled_pusher(void **state)
{
    llmdd_option o[] = {{"llm.Transport", "shm"},
                        {"llm.SyncKvCacheWaitTime", OWNER_WAIT},
                        {"llm.HostMemPoolConfig", POOL}};
    llmdd_cache_desc d = slot_desc();
    char port[16], id[32], line[128];
    llmdd_cache a, b, c;
    uint16_t p;
    llmdd *dd;
    int status;

    (void)state;
    assert_int_equal(llmdd_create(OWNER, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(th_init_listen(dd, "127.0.0.1", &p, o, 3), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &a), LLM_SUCCESS);
    uint8_t *old = (uint8_t *)(uintptr_t)a.tensor_addrs[0];
    snprintf(port, sizeof(port), "%u", p);
    snprintf(id, sizeof(id), "%lld", (long long)a.cache_id);
    const char *argv[] = {"/proc/self/exe", "--pusher", port, id, NULL};
    assert_int_equal(th_child_spawn(&child, argv), 0);
    assert_int_equal(th_child_readline(&child, line, sizeof(line), 20000), 0);
    assert_string_equal(line, "LINKED");
    assert_int_equal(th_child_readline(&child, line, sizeof(line), 20000), 0);
    assert_string_equal(line, "FAULT");
    /* Mid-copy: the first half landed, the rest waits on the fault. */
    assert_int_equal(kill(child.pid, SIGSTOP), 0);
    assert_int_equal(waitpid(child.pid, &status, WUNTRACED), child.pid);
    assert_true(WIFSTOPPED(status));
    assert_int_equal(old[0], PUSHED);
    assert_int_equal(old[SLOT - 1], 0);

    /* No INVAL ack from a stopped peer: the owner drops the link. */
    assert_int_equal(llmdd_deallocate_cache(dd, a.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &b), LLM_SUCCESS);
    uint8_t *new = (uint8_t *)(uintptr_t)b.tensor_addrs[0];
    bool overlaps = new < old + SLOT &&old < new + SLOT;
    memset(new, FILLED, SLOT);
    /* The rest of the pool is held back for the pusher: no room. */
    llmdd_status third = llmdd_allocate_cache(dd, &d, &c);
    if (third == LLM_SUCCESS)
        assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);

    assert_int_equal(kill(child.pid, SIGCONT), 0);
    assert_int_equal(th_child_write(&child, "go\n"), 0);
    assert_int_equal(th_child_readline(&child, line, sizeof(line), 20000), 0);
    printf("shm_quarantine_test: pusher: %s\n", line);
    int rc = th_child_reap(&child, 20000);
    child.pid = 0;
    assert_int_equal(rc, 0);
    if (!all_bytes(new, SLOT, FILLED))
        fail_msg("the stalled push wrote into the new cache");
    assert_false(overlaps);
    assert_string_not_equal(line, "PUSH LLM_SUCCESS");
    assert_true(strncmp(line, "PUSH ", 5) == 0);
    assert_int_equal(third, LLM_OUT_OF_MEMORY);

    /* The pusher is gone: its held pages serve again, zeroed. */
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_ptr_equal((uint8_t *)(uintptr_t)c.tensor_addrs[0], old);
    assert_true(all_bytes(old, SLOT, 0));
    llmdd_destroy(dd);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_stalled_pusher, teardown),
    };

    if (argc == 4 && strcmp(argv[1], "--pusher") == 0)
        return pusher_main(argv[2], atoll(argv[3]));
    int fd = uffd_open();
    if (fd < 0) {
        printf("shm_quarantine_test: no userfaultfd here (%s); skipped\n",
               strerror(errno));
        return TH_SKIP;
    }
    close(fd);
    th_test_filter(argc, argv);
    return cmocka_run_group_tests_name("shm_quarantine", tests, NULL, NULL);
}
