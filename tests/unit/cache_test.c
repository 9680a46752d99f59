/*
 * The cache registry (docs/model.md): allocation (zeroed, ids), the
 * host pool and its exhaustion, deallocation, registration of caller memory
 * and its argument checks, and which call may remove which kind of cache.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
all_zero(const llmdd_cache *c)
{
    uint64_t size = th_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++) {
        const uint8_t *p = (const uint8_t *)(uintptr_t)c->tensor_addrs[t];
        for (uint64_t i = 0; i < size; i++)
            if (p[i] != 0)
                return false;
    }
    return true;
}

static llmdd_cache_desc
desc_u8(uint32_t num_tensors, int64_t batch, int64_t row)
{
    llmdd_cache_desc d = {.placement = LLMDD_PLACEMENT_HOST,
                          .num_tensors = num_tensors,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {batch, row}};
    return d;
}

/* Every desc the cache rules call invalid, built from a valid one. */
static size_t
invalid_descs(llmdd_cache_desc *out)
{
    llmdd_cache_desc base = th_desc_kv();
    size_t n = 0;

    out[n] = base, out[n++].num_tensors = 0;
    out[n] = base, out[n++].num_dims = 0;
    out[n] = base, out[n++].num_dims = LLMDD_MAX_DIMS + 1;
    out[n] = base, out[n++].shape[0] = 0;
    out[n] = base, out[n++].shape[1] = -4;
    out[n] = base, out[n++].shape[2] = INT64_MIN;
    out[n] = base, out[n++].data_type = LLMDD_DT_UNDEFINED;
    out[n] = base, out[n++].data_type = (llmdd_data_type)5;
    out[n] = base, out[n++].placement = (llmdd_placement)2;
    out[n] = base;
    out[n].data_type = LLMDD_DT_UINT8;
    out[n].num_dims = 2;
    out[n].shape[0] = INT64_MAX;
    out[n++].shape[1] = 2; /* the tensor size overflows */
    out[n] = base;
    out[n].num_dims = 1;
    out[n++].shape[0] = INT64_MAX / 4; /* the cache size overflows */
    return n;
}

static void
test_allocate_zeroed_and_ids(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c[3];

    for (int i = 0; i < 3; i++) {
        assert_int_equal(llmdd_allocate_cache(dd, &d, &c[i]), LLM_SUCCESS);
        assert_int_equal(c[i].cache_id, i + 1); /* ids start at 1 */
        assert_memory_equal(&c[i].desc, &d, sizeof(d));
        assert_non_null(c[i].tensor_addrs);
        assert_true(all_zero(&c[i]));
        /* Each tensor is its own writable buffer. */
        th_fill(&c[i], (uint32_t)i + 1);
    }
    for (int i = 0; i < 3; i++)
        for (uint32_t t = 0; t < 8; t++)
            assert_int_equal(
                th_check_buf((uint8_t *)(uintptr_t)c[i].tensor_addrs[t], 4096,
                             (uint32_t)i + 1, t),
                -1);

    /* Ids are never reused, not even the latest. */
    assert_int_equal(llmdd_deallocate_cache(dd, c[2].cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, c[0].cache_id), LLM_SUCCESS);
    llmdd_cache n;
    assert_int_equal(llmdd_allocate_cache(dd, &d, &n), LLM_SUCCESS);
    assert_int_equal(n.cache_id, 4);
    assert_true(all_zero(&n));

    /* Registration draws from the same sequence. */
    uint8_t *mem = calloc(8, 4096);
    uint64_t addrs[8];
    int64_t id = 0;
    for (int t = 0; t < 8; t++)
        addrs[t] = (uint64_t)(uintptr_t)(mem + 4096 * t);
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &id),
                     LLM_SUCCESS);
    assert_int_equal(id, 5);
    assert_int_equal(llmdd_unregister_kv_cache(dd, id), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &n), LLM_SUCCESS);
    assert_int_equal(n.cache_id, 6);
    free(mem);
}

static void
test_ids_per_instance(void **state)
{
    llmdd *dd = *state, *other;
    llmdd_cache_desc d = th_desc_small();
    llmdd_cache c;

    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(c.cache_id, 2);
    assert_int_equal(llmdd_create(2, LLMDD_ROLE_MIX, &other), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(other, NULL, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(other, &d, &c), LLM_SUCCESS);
    assert_int_equal(c.cache_id, 1);
    llmdd_destroy(other);
}

static void
test_failed_calls_consume_no_id(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc bad[16], d = th_desc_kv();
    size_t nbad = invalid_descs(bad);
    llmdd_cache c;
    int64_t id;
    static uint8_t mem[8][4096];
    uint64_t addrs[8];

    /* Real addresses: each description is refused for itself. */
    for (int t = 0; t < 8; t++)
        addrs[t] = (uint64_t)(uintptr_t)mem[t];
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(c.cache_id, 1);
    for (size_t i = 0; i < nbad; i++) {
        assert_int_equal(llmdd_allocate_cache(dd, &bad[i], &c),
                         LLM_PARAM_INVALID);
        assert_int_equal(llmdd_register_kv_cache(dd, &bad[i], addrs, 8, &id),
                         LLM_PARAM_INVALID);
    }
    d.placement = LLMDD_PLACEMENT_DEVICE; /* host memory in this build */
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(c.cache_id, 2);
    d.placement = LLMDD_PLACEMENT_HOST;
    addrs[3] = 0;
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &id),
                     LLM_PARAM_INVALID); /* address 0 */
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(c.cache_id, 3);
}

static void
test_allocate_invalid(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc bad[16], d = th_desc_kv();
    size_t nbad = invalid_descs(bad);
    llmdd_cache c, before;

    memset(&c, 0xa5, sizeof(c));
    before = c;
    for (size_t i = 0; i < nbad; i++) {
        if (llmdd_allocate_cache(dd, &bad[i], &c) != LLM_PARAM_INVALID)
            fail_msg("invalid desc %zu accepted", i);
        /* Out-parameters are written only on success. */
        assert_memory_equal(&c, &before, sizeof(c));
    }
    assert_int_equal(llmdd_allocate_cache(dd, NULL, &c), LLM_PARAM_INVALID);
    assert_int_equal(llmdd_allocate_cache(dd, &d, NULL), LLM_PARAM_INVALID);
    assert_memory_equal(&c, &before, sizeof(c));
}

static void
test_allocate_device(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;

    /* No device in this build: device placement is host memory, as code
     * written for LLM-DataDist (kDevice everywhere) expects to work. */
    d.placement = LLMDD_PLACEMENT_DEVICE;
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    th_fill(&c, 3);
    for (uint32_t t = 0; t < d.num_tensors; t++)
        assert_int_equal(
            th_check_buf((const uint8_t *)(uintptr_t)c.tensor_addrs[t],
                         th_tensor_size(&d), 3, t),
            -1);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
}

static void
test_pool(void **state)
{
    /* 16 pages of 4 KiB; a cache of one 4 KiB tensor takes one page. */
    llmdd_option o = {"llm.HostMemPoolConfig",
                      "{\"memory_size\": 65536, \"page_shift\": 12}"};
    llmdd_cache_desc page = desc_u8(1, 4, 1024);
    llmdd_cache_desc two = desc_u8(2, 4, 1024); /* two pages */
    llmdd_cache_desc huge = desc_u8(1, 17, 4096);
    llmdd_cache c[17], x;
    llmdd *dd;

    (void)state;
    assert_int_equal(llmdd_create(1, LLMDD_ROLE_MIX, &dd), LLM_SUCCESS);
    assert_int_equal(llmdd_initialize(dd, &o, 1), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &huge, &x), LLM_OUT_OF_MEMORY);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(llmdd_allocate_cache(dd, &page, &c[i]), LLM_SUCCESS);
        assert_int_equal(c[i].cache_id, i + 1);
        assert_true(all_zero(&c[i]));
        th_fill(&c[i], 7);
    }
    assert_int_equal(llmdd_allocate_cache(dd, &page, &x), LLM_OUT_OF_MEMORY);

    /* One page free again: it fits, reads zero, and the failures above
     * used no id. */
    assert_int_equal(llmdd_deallocate_cache(dd, c[5].cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &two, &x), LLM_OUT_OF_MEMORY);
    assert_int_equal(llmdd_allocate_cache(dd, &page, &c[5]), LLM_SUCCESS);
    assert_int_equal(c[5].cache_id, 17);
    assert_true(all_zero(&c[5]));
    assert_int_equal(llmdd_allocate_cache(dd, &page, &x), LLM_OUT_OF_MEMORY);

    /* Two neighbours free: a two-page cache fits there. */
    assert_int_equal(llmdd_deallocate_cache(dd, c[8].cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, c[9].cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &two, &x), LLM_SUCCESS);
    assert_int_equal(x.cache_id, 18);
    assert_true(all_zero(&x));
    /* The other caches kept their bytes. */
    for (int i = 0; i < 16; i++)
        if (i != 5 && i != 8 && i != 9)
            assert_int_equal(
                th_check_buf((uint8_t *)(uintptr_t)c[i].tensor_addrs[0], 4096,
                             7, 0),
                -1);
    llmdd_destroy(dd);
}

static void
test_deallocate(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv();
    llmdd_cache c;

    assert_int_equal(llmdd_deallocate_cache(dd, 1), LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &c), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, 0), LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_deallocate_cache(dd, -1), LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_deallocate_cache(dd, INT64_MAX),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id + 1),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, c.cache_id),
                     LLM_KV_CACHE_NOT_EXIST);
}

static void
test_register(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv();
    uint8_t *mem = malloc(8 * 4096);
    uint64_t addrs[9];
    int64_t id = -7;

    assert_non_null(mem);
    for (int t = 0; t < 8; t++) {
        addrs[t] = (uint64_t)(uintptr_t)(mem + 4096 * t);
        th_fill_buf(mem + 4096 * t, 4096, 3, (uint32_t)t);
    }
    addrs[8] = addrs[0];

    assert_int_equal(llmdd_register_kv_cache(dd, &d, NULL, 8, &id),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 0, &id),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 7, &id),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 9, &id),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_register_kv_cache(dd, NULL, addrs, 8, &id),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, NULL),
                     LLM_PARAM_INVALID);
    for (int t = 0; t < 8; t++) {
        uint64_t save = addrs[t];
        addrs[t] = 0;
        assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &id),
                         LLM_PARAM_INVALID);
        /* A tensor that would wrap the address space. */
        addrs[t] = UINT64_MAX - 100;
        assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &id),
                         LLM_PARAM_INVALID);
        addrs[t] = save;
    }
    llmdd_cache_desc bad[16];
    size_t nbad = invalid_descs(bad);
    for (size_t i = 0; i < nbad; i++)
        assert_int_equal(llmdd_register_kv_cache(dd, &bad[i], addrs,
                                                 bad[i].num_tensors, &id),
                         LLM_PARAM_INVALID);
    assert_int_equal(id, -7); /* written only on success */

    /* Registered: the caller's bytes are adopted, not cleared. */
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &id),
                     LLM_SUCCESS);
    assert_int_equal(id, 1);
    for (int t = 0; t < 8; t++)
        assert_int_equal(th_check_buf(mem + 4096 * t, 4096, 3, (uint32_t)t),
                         -1);
    /* Copies see the caller's memory in both directions. */
    llmdd_cache a, r = {.cache_id = id, .desc = d};
    assert_int_equal(llmdd_allocate_cache(dd, &d, &a), LLM_SUCCESS);
    assert_int_equal(llmdd_copy_kv_cache(dd, &r, &a, 2, 2, 0, -1), LLM_SUCCESS);
    for (uint32_t t = 0; t < 8; t++)
        assert_memory_equal((uint8_t *)(uintptr_t)a.tensor_addrs[t] + 2048,
                            mem + 4096 * t + 2048, 1024);

    /* The same memory may be registered twice, as two caches. */
    int64_t id2;
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &id2),
                     LLM_SUCCESS);
    assert_int_equal(id2, 3);
    assert_int_equal(llmdd_unregister_kv_cache(dd, id2), LLM_SUCCESS);

    assert_int_equal(llmdd_unregister_kv_cache(dd, id), LLM_SUCCESS);
    /* The caller still owns the memory, untouched. */
    for (int t = 0; t < 8; t++)
        assert_int_equal(th_check_buf(mem + 4096 * t, 4096, 3, (uint32_t)t),
                         -1);
    assert_int_equal(llmdd_copy_kv_cache(dd, &r, &a, 2, 2, 0, -1),
                     LLM_KV_CACHE_NOT_EXIST);
    free(mem);
}

static void
test_register_device(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_kv();
    uint64_t addrs[8];
    uint8_t *mem = calloc(8, th_tensor_size(&d));
    int64_t id;

    assert_non_null(mem);
    for (int t = 0; t < 8; t++)
        addrs[t] = (uint64_t)(uintptr_t)(mem + t * th_tensor_size(&d));
    d.placement = LLMDD_PLACEMENT_DEVICE; /* host memory in this build */
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &id),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_unregister_kv_cache(dd, id), LLM_SUCCESS);
    free(mem);
}

/* How many times `needle` occurs in `hay`. */
static int
count_of(const char *hay, const char *needle)
{
    int n = 0;

    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

/*
 * Device placement without device support is logged once per instance:
 * each instance's first device cache says so, whatever the call, and no
 * later one repeats it.
 */
static void
test_device_warning_once_per_instance(void **state)
{
    llmdd_cache_desc d = th_desc_small();
    char path[] = "/tmp/llmdd-devlog-XXXXXX";
    int fd = mkstemp(path), saved = dup(STDERR_FILENO);
    uint8_t *mem = calloc(8, th_tensor_size(&d));
    uint64_t addrs[8];
    llmdd *dd[2];
    static char buf[65536];

    (void)state;
    assert_true(fd >= 0 && saved >= 0 && mem != NULL);
    for (int t = 0; t < 8; t++)
        addrs[t] = (uint64_t)(uintptr_t)(mem + t * th_tensor_size(&d));
    d.placement = LLMDD_PLACEMENT_DEVICE;
    dup2(fd, STDERR_FILENO);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(llmdd_create(10 + (uint64_t)i, LLMDD_ROLE_MIX, &dd[i]),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_initialize(dd[i], NULL, 0), LLM_SUCCESS);
        for (int k = 0; k < 3; k++) {
            llmdd_cache c;
            int64_t id;
            assert_int_equal(llmdd_register_kv_cache(dd[i], &d, addrs, 8, &id),
                             LLM_SUCCESS);
            assert_int_equal(llmdd_unregister_kv_cache(dd[i], id), LLM_SUCCESS);
            assert_int_equal(llmdd_allocate_cache(dd[i], &d, &c), LLM_SUCCESS);
            assert_int_equal(llmdd_deallocate_cache(dd[i], c.cache_id),
                             LLM_SUCCESS);
        }
    }
    dup2(saved, STDERR_FILENO);
    close(saved);
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    buf[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(path);
    llmdd_destroy(dd[0]);
    llmdd_destroy(dd[1]);
    free(mem);
    assert_int_equal(count_of(buf, "no device support"), 2);
}

static void
test_remove_by_kind(void **state)
{
    llmdd *dd = *state;
    llmdd_cache_desc d = th_desc_small();
    uint8_t *mem = calloc(8, 2048);
    uint64_t addrs[8];
    llmdd_cache a;
    int64_t r;

    assert_non_null(mem);
    for (int t = 0; t < 8; t++)
        addrs[t] = (uint64_t)(uintptr_t)(mem + 2048 * t);
    assert_int_equal(llmdd_register_kv_cache(dd, &d, addrs, 8, &r),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_allocate_cache(dd, &d, &a), LLM_SUCCESS);

    /* deallocate does not know registered caches... */
    assert_int_equal(llmdd_deallocate_cache(dd, r), LLM_KV_CACHE_NOT_EXIST);
    /* ...and unregister of an id that is not a registered cache is a
     * success that removes nothing. */
    assert_int_equal(llmdd_unregister_kv_cache(dd, a.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_unregister_kv_cache(dd, 999), LLM_SUCCESS);
    assert_int_equal(llmdd_unregister_kv_cache(dd, 0), LLM_SUCCESS);
    assert_int_equal(llmdd_unregister_kv_cache(dd, -1), LLM_SUCCESS);

    /* Both are still there. */
    llmdd_cache rc = {.cache_id = r, .desc = d};
    assert_int_equal(llmdd_copy_kv_cache(dd, &a, &rc, 0, 1, 0, -1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_unregister_kv_cache(dd, r), LLM_SUCCESS);
    assert_int_equal(llmdd_unregister_kv_cache(dd, r), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, a.cache_id), LLM_SUCCESS);
    free(mem);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_allocate_zeroed_and_ids, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_ids_per_instance, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_calls_consume_no_id, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_allocate_invalid, setup, teardown),
        cmocka_unit_test_setup_teardown(test_allocate_device, setup, teardown),
        cmocka_unit_test(test_pool),
        cmocka_unit_test_setup_teardown(test_deallocate, setup, teardown),
        cmocka_unit_test_setup_teardown(test_register, setup, teardown),
        cmocka_unit_test_setup_teardown(test_register_device, setup, teardown),
        cmocka_unit_test_setup_teardown(test_remove_by_kind, setup, teardown),
        cmocka_unit_test(test_device_warning_once_per_instance),
    };
    return cmocka_run_group_tests_name("cache", tests, NULL, NULL);
}
