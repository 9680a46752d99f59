/*
 * The transport registry (src/transport/transport.c): every registered
 * table has the mandatory ops the core calls unchecked, the registry and
 * llmdd_transport_list agree, and the check refuses a table missing any
 * mandatory op while accepting one without the optional ones.
 */
#include <stddef.h>
#include <string.h>

#include "harness/harness.h"
#include "transport/transport.h"

/* The mandatory ops, as offsets into the table (transport.h). */
static const size_t mandatory[] = {
    offsetof(llmdd_transport_ops, name),
    offsetof(llmdd_transport_ops, reaches),
    offsetof(llmdd_transport_ops, link_init),
    offsetof(llmdd_transport_ops, link_shutdown),
    offsetof(llmdd_transport_ops, link_fini),
    offsetof(llmdd_transport_ops, query),
    offsetof(llmdd_transport_ops, xfer),
};

static void
test_registered_tables(void **state)
{
    char names[256] = "";
    size_t n = llmdd__transport_count();

    (void)state;
    assert_true(n >= 2); /* loop and tcp are always built */
    for (size_t i = 0; i < n; i++) {
        const llmdd_transport_ops *ops = llmdd__transport_at(i);
        assert_non_null(ops);
        assert_true(llmdd__transport_valid(ops));
        assert_ptr_equal(llmdd__transport_find(ops->name), ops);
        assert_true(llmdd__transport_known(ops->name));
        if (i > 0)
            strcat(names, ",");
        strcat(names, ops->name);
    }
    assert_null(llmdd__transport_at(n));
    assert_string_equal(llmdd_transport_list(), names);
    assert_string_equal(llmdd__transport_at(0)->name, "loop");
    assert_string_equal(llmdd__transport_at(n - 1)->name, "tcp");
}

static void
test_check_refuses_missing_ops(void **state)
{
    const llmdd_transport_ops *tcp = llmdd__transport_find("tcp");

    (void)state;
    assert_non_null(tcp);
    for (size_t i = 0; i < sizeof(mandatory) / sizeof(mandatory[0]); i++) {
        llmdd_transport_ops broken = *tcp;
        memset((char *)&broken + mandatory[i], 0, sizeof(void *));
        if (llmdd__transport_valid(&broken))
            fail_msg("a table without op %zu was accepted", i);
    }
    llmdd_transport_ops unnamed = *tcp;
    unnamed.name = "";
    assert_false(llmdd__transport_valid(&unnamed));
    /* The optional ones may be missing. */
    llmdd_transport_ops lean = *tcp;
    lean.accept_conn = NULL;
    lean.remote_free = NULL;
    lean.cache_removed = NULL;
    lean.reopen = NULL;
    lean.info = NULL;
    assert_true(llmdd__transport_valid(&lean));
}

/* A transfer's size, and the size of the cache it writes into: the local
 * one on a pull, the remote one on a push (the copy engine's hint). */
static void
test_xfer_sizes(void **state)
{
    (void)state;
    llmdd__remote_cache rc = {.desc = {.num_tensors = 6}, .tensor_size = 1000};
    const llmdd__run runs[] = {{.len = 10}, {.len = 32}};
    llmdd__xfer x = {.remote = &rc,
                     .count = 3,
                     .runs = runs,
                     .nruns = 2,
                     .local_bytes = 77};

    assert_int_equal(llmdd__xfer_bytes(&x), 3 * 42);
    assert_int_equal(llmdd__xfer_dst_bytes(&x), 77);
    x.write = true;
    assert_int_equal(llmdd__xfer_dst_bytes(&x), 6000);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registered_tables),
        cmocka_unit_test(test_check_refuses_missing_ops),
        cmocka_unit_test(test_xfer_sizes),
    };

    th_test_filter(argc, argv);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
