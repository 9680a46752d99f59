/*
 * Cache keys on one instance: the argument rules of docs/model.md ("Requests
 * (0.2)", keys), the first binding staying, keys going with their cache, and
 * a table that grows past its first size. Lookups by a linked peer are in
 * the conformance suite.
 */
#include <stdio.h>
#include <string.h>

#include "core/internal.h"
#include "harness/harness.h"

static int
setup(void **state)
{
    llmdd *dd;

    if (llmdd_create(1, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, NULL, 0) != LLM_SUCCESS)
        return -1;
    *state = dd;
    return 0;
}

static int
teardown(void **state)
{
    llmdd_destroy(*state);
    return 0;
}

static bool
bound(llmdd *dd, const char *key, int64_t *id, uint32_t *slot)
{
    return llmdd__keys_find(dd, key, strlen(key), id, slot);
}

static void
test_key_rules(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv(); /* 4 slots */
    llmdd_cache c;
    uint8_t big[LLMDD_KEY_MAX + 1];
    int64_t id;
    uint32_t slot;

    memset(big, 'k', sizeof(big));
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 0, "a", 0),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 0, NULL, 1),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 0, big, sizeof(big)),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id + 100, 0, "a", 1),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 4, "a", 1),
                     LLM_PARAM_INVALID);
    assert_false(bound(dd, "a", &id, &slot));

    /* The longest key, then the first binding stays. */
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 3, big, LLMDD_KEY_MAX),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 2, "a", 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 2, "a", 1),
                     LLM_CACHE_KEY_ALREADY_EXIST);
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 1, "a", 1),
                     LLM_CACHE_KEY_ALREADY_EXIST);
    assert_true(bound(dd, "a", &id, &slot));
    assert_int_equal(id, c.cache_id);
    assert_int_equal(slot, 2);
    /* Raw bytes: an embedded NUL is part of the key. */
    assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, 1, "a\0b", 3),
                     LLM_SUCCESS);
    assert_true(llmdd__keys_find(dd, "a\0b", 3, &id, &slot));
    assert_int_equal(slot, 1);

    assert_int_equal(llmdd_remove_cache_key(dd, "a", 1), LLM_SUCCESS);
    assert_false(bound(dd, "a", &id, &slot));
    assert_int_equal(llmdd_remove_cache_key(dd, "a", 1), LLM_SUCCESS);
    assert_int_equal(llmdd_remove_cache_key(dd, "a", 0), LLM_PARAM_INVALID);
    assert_true(llmdd__keys_find(dd, "a\0b", 3, &id, &slot));
}

static void
test_keys_go_with_their_cache(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache a, b;
    int64_t id;
    uint32_t slot;

    assert_int_equal(llmdd_allocate_cache(dd, &d, &a), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &b), LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, a.cache_id, 0, "x", 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, a.cache_id, 1, "y", 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, b.cache_id, 0, "z", 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, a.cache_id), LLM_SUCCESS);
    assert_false(bound(dd, "x", &id, &slot));
    assert_false(bound(dd, "y", &id, &slot));
    assert_true(bound(dd, "z", &id, &slot));
    /* The name is free again. */
    assert_int_equal(llmdd_set_cache_key(dd, b.cache_id, 2, "x", 1),
                     LLM_SUCCESS);

    /* Registered caches too. */
    uint8_t mem[8][1024];
    uint64_t addrs[8];
    int64_t rid;
    for (int t = 0; t < 8; t++)
        addrs[t] = (uint64_t)(uintptr_t)mem[t];
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &rid),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, rid, 0, "r", 1), LLM_SUCCESS);
    assert_int_equal(llmdd_unregister_kv_cache(dd, rid), LLM_SUCCESS);
    assert_false(bound(dd, "r", &id, &slot));

    /* Not initialized: every key call fails as any other call does. */
    llmdd_finalize(dd);
    assert_int_equal(llmdd_set_cache_key(dd, b.cache_id, 0, "q", 1),
                     LLM_FAILED);
    assert_int_equal(llmdd_remove_cache_key(dd, "z", 1), LLM_FAILED);
    llmdd_cache_index idx;
    assert_int_equal(llmdd_lookup_remote_key(dd, 2, "z", 1, &idx), LLM_FAILED);
    assert_int_equal(llmdd_set_cache_key(NULL, 1, 0, "q", 1),
                     LLM_PARAM_INVALID);
}

static void
test_many_keys(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;
    char key[32];
    int64_t id;
    uint32_t slot;

    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    for (int i = 0; i < 5000; i++) {
        snprintf(key, sizeof(key), "request-%d", i);
        assert_int_equal(llmdd_set_cache_key(dd, c.cache_id, (uint32_t)i % 4,
                                             key, strlen(key)),
                         LLM_SUCCESS);
    }
    for (int i = 0; i < 5000; i += 7) {
        snprintf(key, sizeof(key), "request-%d", i);
        assert_true(bound(dd, key, &id, &slot));
        assert_int_equal(slot, (uint32_t)i % 4);
    }
    assert_false(bound(dd, "request-5000", &id, &slot));
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    assert_false(bound(dd, "request-0", &id, &slot));
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_key_rules, setup, teardown),
        cmocka_unit_test_setup_teardown(test_keys_go_with_their_cache, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_many_keys, setup, teardown),
    };
    return cmocka_run_group_tests_name("keys", tests, NULL, NULL);
}
