/*
 * Local copies (llmdd.h and docs/model.md, "Transfers"): every argument
 * rule, and byte-exact checks against a model of every cache after every
 * call, so a copy that moves the wrong bytes, or a rejected call that moves
 * any, is caught.
 */
#include <stdlib.h>
#include <string.h>

#include "harness/harness.h"

#define MAX_CACHES 12

typedef struct {
    llmdd_cache c;
    uint64_t size, stride;
    uint8_t *model[8];
    uint8_t *reg; /* caller memory of a registered cache */
} mcache;

static llmdd *dd;
static mcache caches[MAX_CACHES];
static int ncaches;

/* The caches every test starts from. */
static mcache *A, *B, *S, *F, *K, *K2, *L, *G, *R;

static llmdd_cache_desc
desc(llmdd_data_type dt, uint32_t nt, int64_t d0, int64_t d1, int64_t d2)
{
    llmdd_cache_desc d = {.placement = LLMDD_PLACEMENT_HOST,
                          .num_tensors = nt,
                          .data_type = dt,
                          .num_dims = d2 > 0 ? 3 : 2,
                          .shape = {d0, d1, d2}};
    return d;
}

static void
model_init(mcache *m, uint32_t seed)
{
    m->size = th_tensor_size(&m->c.desc);
    m->stride = m->size / (uint64_t)m->c.desc.shape[0];
    for (uint32_t t = 0; t < m->c.desc.num_tensors; t++) {
        m->model[t] = malloc(m->size);
        assert_non_null(m->model[t]);
        th_fill_buf(m->model[t], m->size, seed, t);
    }
    th_fill(&m->c, seed);
}

static mcache *
cache_new(llmdd_cache_desc d, uint32_t seed)
{
    mcache *m = &caches[ncaches++];

    memset(m, 0, sizeof(*m));
    assert_int_equal(llmdd_allocate_cache(dd, &d, &m->c), LLM_SUCCESS);
    model_init(m, seed);
    return m;
}

static mcache *
cache_register(llmdd_cache_desc d, uint32_t seed)
{
    mcache *m = &caches[ncaches++];
    uint64_t size = th_tensor_size(&d);

    memset(m, 0, sizeof(*m));
    m->reg = malloc(size * d.num_tensors);
    m->c.tensor_addrs = malloc(d.num_tensors * sizeof(uint64_t));
    assert_non_null(m->reg);
    assert_non_null(m->c.tensor_addrs);
    for (uint32_t t = 0; t < d.num_tensors; t++)
        m->c.tensor_addrs[t] = (uint64_t)(uintptr_t)(m->reg + size * t);
    m->c.desc = d;
    assert_int_equal(llmdd_register_kv_cache(dd, &d, m->c.tensor_addrs,
                                             d.num_tensors, &m->c.cache_id),
                     LLM_SUCCESS);
    model_init(m, seed);
    return m;
}

static int
setup(void **state)
{
    (void)state;
    ncaches = 0;
    if (llmdd_create(1, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, NULL, 0) != LLM_SUCCESS)
        return -1;
    A = cache_new(th_desc_kv(), 1);    /* 8 x [4,16,32] fp16, stride 1024 */
    B = cache_new(th_desc_kv(), 2);
    S = cache_new(th_desc_small(), 3); /* 8 x [4,8,32] fp16, stride 512 */
    F = cache_new(desc(LLMDD_DT_FLOAT16, 4, 4, 16, 32), 4); /* 4 tensors */
    K = cache_new(th_desc_blocks(), 5); /* 8 x [64,128] bf16, stride 256 */
    K2 = cache_new(th_desc_blocks(), 6);
    L = cache_new(desc(LLMDD_DT_BF16, 8, 16, 128, 0), 7); /* 16 blocks */
    G = cache_new(desc(LLMDD_DT_BF16, 4, 64, 128, 0), 8); /* 4 tensors */
    R = cache_register(th_desc_kv(), 9);
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    llmdd_destroy(dd);
    for (int i = 0; i < ncaches; i++) {
        for (int t = 0; t < 8; t++)
            free(caches[i].model[t]);
        if (caches[i].reg != NULL) {
            free(caches[i].reg);
            free(caches[i].c.tensor_addrs);
        }
    }
    return 0;
}

/* Every byte of every cache equals its model. */
static void
verify_all(void)
{
    for (int i = 0; i < ncaches; i++) {
        const mcache *m = &caches[i];
        for (uint32_t t = 0; t < m->c.desc.num_tensors; t++) {
            const uint8_t *p =
                (const uint8_t *)(uintptr_t)m->c.tensor_addrs[t];
            if (memcmp(p, m->model[t], m->size) == 0)
                continue;
            for (uint64_t k = 0; k < m->size; k++)
                if (p[k] != m->model[t][k])
                    fail_msg("cache %lld tensor %u byte %llu: %u, want %u",
                             (long long)m->c.cache_id, t,
                             (unsigned long long)k, p[k], m->model[t][k]);
        }
    }
}

static void
model_slot(mcache *dst, const mcache *src, uint32_t sbi, uint32_t dbi,
           uint64_t off, uint64_t len)
{
    for (uint32_t t = 0; t < src->c.desc.num_tensors; t++)
        memmove(dst->model[t] + dbi * dst->stride + off,
                src->model[t] + sbi * src->stride + off, len);
}

/* Block by block, in list order. */
static void
model_blocks(mcache *dst, const mcache *src, const uint64_t *sb,
             const uint64_t *db, size_t n)
{
    for (size_t k = 0; k < n; k++)
        for (uint32_t t = 0; t < src->c.desc.num_tensors; t++)
            memmove(dst->model[t] + db[k] * dst->stride,
                    src->model[t] + sb[k] * src->stride, src->stride);
}

static void
copy_ok(mcache *src, mcache *dst, uint32_t sbi, uint32_t dbi, uint64_t off,
        int64_t size)
{
    llmdd_status st = llmdd_copy_kv_cache(dd, &src->c, &dst->c, sbi, dbi, off,
                                          size);
    if (st != LLM_SUCCESS)
        fail_msg("copy %u->%u off %llu size %lld: %s", sbi, dbi,
                 (unsigned long long)off, (long long)size,
                 llmdd_status_str(st));
    model_slot(dst, src, sbi, dbi, off,
               size == -1 ? src->stride - off : (uint64_t)size);
    verify_all();
}

static void
copy_bad(mcache *src, mcache *dst, uint32_t sbi, uint32_t dbi, uint64_t off,
         int64_t size, llmdd_status want)
{
    llmdd_status st = llmdd_copy_kv_cache(dd, &src->c, &dst->c, sbi, dbi, off,
                                          size);
    if (st != want)
        fail_msg("copy %u->%u off %llu size %lld: %s, want %s", sbi, dbi,
                 (unsigned long long)off, (long long)size,
                 llmdd_status_str(st), llmdd_status_str(want));
    verify_all();
}

static void
blocks_ok(mcache *src, mcache *dst, const uint64_t *sb, const uint64_t *db,
          size_t n)
{
    llmdd_status st = llmdd_copy_kv_blocks(dd, &src->c, &dst->c, sb, db, n);
    if (st != LLM_SUCCESS)
        fail_msg("copy_kv_blocks of %zu: %s", n, llmdd_status_str(st));
    model_blocks(dst, src, sb, db, n);
    verify_all();
}

static void
blocks_bad(mcache *src, mcache *dst, const uint64_t *sb, const uint64_t *db,
           size_t n, llmdd_status want)
{
    llmdd_status st = llmdd_copy_kv_blocks(dd, &src->c, &dst->c, sb, db, n);
    if (st != want)
        fail_msg("copy_kv_blocks of %zu: %s, want %s", n, llmdd_status_str(st),
                 llmdd_status_str(want));
    verify_all();
}

/* ---- copy_kv_cache ---- */

static void
test_copy_cache_valid(void **state)
{
    (void)state;
    verify_all();
    copy_ok(A, B, 1, 2, 0, -1);   /* a whole slot */
    copy_ok(A, B, 3, 0, 100, 200); /* part of one */
    copy_ok(A, B, 0, 3, 1000, -1); /* -1: stride - offset */
    copy_ok(B, A, 2, 2, 1000, 24); /* ends exactly at the stride */
    copy_ok(A, B, 0, 0, 1023, 1);
    copy_ok(A, B, 3, 3, 0, 1024);
    copy_ok(A, A, 0, 3, 10, 100); /* within one cache */
    copy_ok(A, A, 2, 2, 0, -1);   /* onto itself */
    copy_ok(R, A, 1, 0, 0, -1);   /* registered <-> allocated */
    copy_ok(A, R, 3, 1, 512, 256);
    /* Different strides: both offset + size bounds hold. */
    copy_ok(A, S, 0, 3, 0, 512);
    copy_ok(S, A, 1, 1, 100, 412);
}

static void
test_copy_cache_bounds(void **state)
{
    (void)state;
    copy_bad(A, B, 0, 0, 1000, 25, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 1024, 1, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 1024, -1, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, UINT64_MAX, 1, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, UINT64_MAX, -1, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 0, 1025, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 1, 1024, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 0, INT64_MAX, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 512, INT64_MAX, LLM_PARAM_INVALID);
    /* size 0 and below -1 */
    copy_bad(A, B, 0, 0, 0, 0, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 0, -2, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 0, 0, INT64_MIN, LLM_PARAM_INVALID);
    /* batch indices */
    copy_bad(A, B, 4, 0, 0, -1, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, 4, 0, -1, LLM_PARAM_INVALID);
    copy_bad(A, B, UINT32_MAX, 0, 0, -1, LLM_PARAM_INVALID);
    copy_bad(A, B, 0, UINT32_MAX, 0, -1, LLM_PARAM_INVALID);
    /* The bounds hold on both sides when strides differ. */
    copy_bad(A, S, 0, 0, 0, 513, LLM_PARAM_INVALID);
    copy_bad(A, S, 0, 0, 512, 1, LLM_PARAM_INVALID);
    copy_bad(S, A, 0, 0, 512, 1, LLM_PARAM_INVALID);
    copy_bad(S, A, 0, 0, 0, 513, LLM_PARAM_INVALID);
    copy_bad(A, S, 0, 0, 100, 413, LLM_PARAM_INVALID);
    /* Equal tensor counts. */
    copy_bad(A, F, 0, 0, 0, -1, LLM_PARAM_INVALID);
    copy_bad(F, A, 0, 0, 0, 16, LLM_PARAM_INVALID);
    /* Arguments come before the cache lookup. */
    assert_int_equal(llmdd_copy_kv_cache(dd, NULL, &B->c, 0, 0, 0, -1),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_cache(dd, &A->c, NULL, 0, 0, 0, -1),
                     LLM_PARAM_INVALID);
    verify_all();
}

static void
test_copy_cache_unknown(void **state)
{
    llmdd_cache unknown = A->c;

    (void)state;
    unknown.cache_id = 4242;
    assert_int_equal(llmdd_copy_kv_cache(dd, &unknown, &B->c, 0, 0, 0, -1),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_copy_kv_cache(dd, &A->c, &unknown, 0, 0, 0, -1),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_copy_kv_cache(dd, &unknown, &unknown, 0, 0, 0, -1),
                     LLM_KV_CACHE_NOT_EXIST);
    /* The call's own arguments are checked first, indices after. */
    assert_int_equal(llmdd_copy_kv_cache(dd, &unknown, &B->c, 0, 0, 0, 0),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_cache(dd, &unknown, &B->c, 9, 9, 0, -1),
                     LLM_KV_CACHE_NOT_EXIST);
    /* A deallocated cache is unknown. */
    llmdd_cache gone;
    llmdd_cache_desc d = th_desc_kv();
    assert_int_equal(llmdd_allocate_cache(dd, &d, &gone), LLM_SUCCESS);
    assert_int_equal(llmdd_deallocate_cache(dd, gone.cache_id), LLM_SUCCESS);
    assert_int_equal(llmdd_copy_kv_cache(dd, &A->c, &gone, 0, 0, 0, -1),
                     LLM_KV_CACHE_NOT_EXIST);
    verify_all();
}

static void
test_copy_cache_by_id_only(void **state)
{
    /* Only cache_id is looked at: the rest of the struct is informational. */
    llmdd_cache src = {.cache_id = A->c.cache_id};
    llmdd_cache dst = {.cache_id = B->c.cache_id};

    (void)state;
    dst.desc = th_desc_small();
    assert_int_equal(llmdd_copy_kv_cache(dd, &src, &dst, 3, 1, 0, -1),
                     LLM_SUCCESS);
    model_slot(B, A, 3, 1, 0, 1024);
    verify_all();
}

static void
test_copy_every_role(void **state)
{
    static const llmdd_role roles[] = {LLMDD_ROLE_PROMPT, LLMDD_ROLE_DECODER,
                                       LLMDD_ROLE_MIX};
    llmdd_cache_desc d = th_desc_blocks();

    (void)state;
    for (size_t i = 0; i < 3; i++) {
        llmdd *x;
        llmdd_cache a, b;
        uint64_t sb[] = {1}, db[] = {2};
        assert_int_equal(llmdd_create(50, roles[i], &x), LLM_SUCCESS);
        assert_int_equal(llmdd_initialize(x, NULL, 0), LLM_SUCCESS);
        assert_int_equal(llmdd_allocate_cache(x, &d, &a), LLM_SUCCESS);
        assert_int_equal(llmdd_allocate_cache(x, &d, &b), LLM_SUCCESS);
        th_fill(&a, 11);
        assert_int_equal(llmdd_copy_kv_cache(x, &a, &b, 0, 0, 0, -1),
                         LLM_SUCCESS);
        assert_int_equal(llmdd_copy_kv_blocks(x, &a, &b, sb, db, 1),
                         LLM_SUCCESS);
        uint8_t *p = (uint8_t *)(uintptr_t)b.tensor_addrs[3];
        assert_int_equal(th_check_buf(p, 256, 11, 3), -1);
        for (int k = 0; k < 256; k++)
            assert_int_equal(p[512 + k], th_byte(11, 3, 256 + k));
        llmdd_destroy(x);
    }
}

/* ---- copy_kv_blocks ---- */

static void
test_copy_blocks_valid(void **state)
{
    (void)state;
    uint64_t s1[] = {0, 1, 2, 3}, d1[] = {4, 5, 6, 7};
    blocks_ok(K, K2, s1, d1, 4);
    uint64_t s2[] = {10, 3, 7}, d2[] = {0, 15, 8};
    blocks_ok(K, K2, s2, d2, 3); /* unsorted */
    uint64_t s3[] = {5, 5, 5}, d3[] = {1, 2, 3};
    blocks_ok(K, K2, s3, d3, 3); /* duplicate sources */
    uint64_t s4[] = {1, 2, 3}, d4[] = {9, 9, 9};
    blocks_ok(K, K2, s4, d4, 3); /* duplicate destinations: the last wins */
    uint64_t s5[] = {20, 21, 40, 22}, d5[] = {30, 31, 9, 32};
    blocks_ok(K, K2, s5, d5, 4);
    uint64_t s6[] = {63}, d6[] = {0};
    blocks_ok(K, K2, s6, d6, 1);
    /* Within one cache, source and destination blocks disjoint. */
    uint64_t s7[] = {0, 1, 2, 10}, d7[] = {40, 41, 42, 5};
    blocks_ok(K, K, s7, d7, 4);
    uint64_t s8[] = {63, 0, 0}, d8[] = {32, 31, 33};
    blocks_ok(K, K, s8, d8, 3);
    /* Different block counts, same stride. */
    uint64_t s9[] = {60, 2, 3}, d9[] = {15, 0, 1};
    blocks_ok(K, L, s9, d9, 3);
    uint64_t s10[] = {15, 0}, d10[] = {63, 62};
    blocks_ok(L, K2, s10, d10, 2);
}

static void
test_copy_blocks_long_lists(void **state)
{
    uint64_t sb[64], db[64];

    (void)state;
    for (int i = 0; i < 64; i++) {
        sb[i] = (uint64_t)(63 - i);
        db[i] = (uint64_t)i;
    }
    blocks_ok(K, K2, sb, db, 64); /* all reversed */
    for (int i = 0; i < 64; i++) {
        sb[i] = (uint64_t)i;
        db[i] = (uint64_t)((i * 5) % 64);
    }
    blocks_ok(K2, K, sb, db, 64);
    for (int i = 0; i < 64; i++)
        sb[i] = db[i] = (uint64_t)i;
    blocks_ok(K, K2, sb, db, 64); /* one run */
}

static void
test_copy_blocks_invalid(void **state)
{
    uint64_t ok[] = {0, 1}, over64[] = {0, 64}, over16[] = {15, 16},
             huge[] = {UINT64_MAX, 0};

    (void)state;
    blocks_bad(K, K2, ok, ok, 0, LLM_PARAM_INVALID);
    blocks_bad(K, K2, NULL, ok, 2, LLM_PARAM_INVALID);
    blocks_bad(K, K2, ok, NULL, 2, LLM_PARAM_INVALID);
    blocks_bad(K, K2, over64, ok, 2, LLM_PARAM_INVALID);
    blocks_bad(K, K2, ok, over64, 2, LLM_PARAM_INVALID);
    blocks_bad(K, L, ok, over16, 2, LLM_PARAM_INVALID);
    blocks_bad(L, K, over16, ok, 2, LLM_PARAM_INVALID);
    blocks_bad(K, K2, huge, ok, 2, LLM_PARAM_INVALID);
    blocks_bad(K, K2, ok, huge, 2, LLM_PARAM_INVALID);
    /* Strides differ (256 vs 1024), tensor counts differ (8 vs 4). */
    blocks_bad(K, A, ok, ok, 2, LLM_PARAM_INVALID);
    blocks_bad(A, K, ok, ok, 2, LLM_PARAM_INVALID);
    blocks_bad(A, S, ok, ok, 1, LLM_PARAM_INVALID);
    blocks_bad(K, G, ok, ok, 2, LLM_PARAM_INVALID);
    blocks_bad(G, K, ok, ok, 2, LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_blocks(dd, NULL, &K->c, ok, ok, 1),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_blocks(dd, &K->c, NULL, ok, ok, 1),
                     LLM_PARAM_INVALID);
    verify_all();
}

static void
test_copy_blocks_unknown(void **state)
{
    llmdd_cache unknown = K->c;
    uint64_t ok[] = {0}, over[] = {100};

    (void)state;
    unknown.cache_id = 4242;
    assert_int_equal(llmdd_copy_kv_blocks(dd, &unknown, &K->c, ok, ok, 1),
                     LLM_KV_CACHE_NOT_EXIST);
    assert_int_equal(llmdd_copy_kv_blocks(dd, &K->c, &unknown, ok, ok, 1),
                     LLM_KV_CACHE_NOT_EXIST);
    /* An empty list is the call's own argument: it decides first. */
    assert_int_equal(llmdd_copy_kv_blocks(dd, &unknown, &K->c, ok, ok, 0),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_blocks(dd, &unknown, &K->c, over, over, 1),
                     LLM_KV_CACHE_NOT_EXIST);
    verify_all();
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_copy_cache_valid),       T(test_copy_cache_bounds),
        T(test_copy_cache_unknown),     T(test_copy_cache_by_id_only),
        T(test_copy_every_role),        T(test_copy_blocks_valid),
        T(test_copy_blocks_long_lists), T(test_copy_blocks_invalid),
        T(test_copy_blocks_unknown),
    };
#undef T
    return cmocka_run_group_tests_name("copy", tests, NULL, NULL);
}
