/*
 * Layout math (src/core/layout.c): element sizes, desc validation with the
 * computed tensor size and stride, layer ranges resolved to tensor spans, and
 * block lists turned into byte runs. Pure functions, so every cache and
 * layer-range rule of docs/model.md is checked directly.
 */
#include <stdlib.h>
#include <string.h>

#include "core/layout.h"
#include "harness/harness.h"

#define SENTINEL 0x5a5a5a5a5a5a5a5aull

static llmdd_cache_desc
desc1(llmdd_data_type dt, uint32_t num_tensors, uint32_t num_dims,
      const int64_t *shape)
{
    llmdd_cache_desc d;

    memset(&d, 0, sizeof(d));
    d.placement = LLMDD_PLACEMENT_HOST;
    d.num_tensors = num_tensors;
    d.data_type = dt;
    d.num_dims = num_dims;
    for (uint32_t i = 0; i < num_dims && i < LLMDD_MAX_DIMS; i++)
        d.shape[i] = shape[i];
    return d;
}

/* Asserts the desc is rejected and that neither output was written. */
static void
assert_desc_invalid(const llmdd_cache_desc *d)
{
    uint64_t size = SENTINEL, stride = SENTINEL;

    assert_int_equal(llmdd__desc_check(d, &size, &stride), LLM_PARAM_INVALID);
    assert_true(size == SENTINEL);
    assert_true(stride == SENTINEL);
}

static void
assert_desc_valid(const llmdd_cache_desc *d, uint64_t want_size,
                  uint64_t want_stride)
{
    uint64_t size = 0, stride = 0;

    assert_int_equal(llmdd__desc_check(d, &size, &stride), LLM_SUCCESS);
    assert_int_equal(size, want_size);
    assert_int_equal(stride, want_stride);
}

static void
test_dtype_sizes(void **state)
{
    static const struct {
        llmdd_data_type dt;
        size_t size;
    } known[] = {
        {LLMDD_DT_FLOAT, 4},  {LLMDD_DT_FLOAT16, 2}, {LLMDD_DT_INT8, 1},
        {LLMDD_DT_INT32, 4},  {LLMDD_DT_UINT8, 1},   {LLMDD_DT_INT16, 2},
        {LLMDD_DT_UINT16, 2}, {LLMDD_DT_UINT32, 4},  {LLMDD_DT_INT64, 8},
        {LLMDD_DT_UINT64, 8}, {LLMDD_DT_DOUBLE, 8},  {LLMDD_DT_BOOL, 1},
        {LLMDD_DT_BF16, 2},
    };

    (void)state;
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        assert_int_equal(llmdd__dtype_size(known[i].dt), known[i].size);
    /* UNDEFINED and every number the enum skips have no size. */
    assert_int_equal(llmdd__dtype_size(LLMDD_DT_UNDEFINED), 0);
    static const int unknown[] = {5, 13, 14, 20, 26, 29, 100, -1, 1 << 30};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++)
        assert_int_equal(llmdd__dtype_size((llmdd_data_type)unknown[i]), 0);
}

static void
test_desc_valid_shapes(void **state)
{
    (void)state;
    int64_t kv[] = {4, 16, 32};
    llmdd_cache_desc d = desc1(LLMDD_DT_FLOAT16, 8, 3, kv);
    assert_desc_valid(&d, 4096, 1024);

    int64_t blocks[] = {64, 128};
    d = desc1(LLMDD_DT_BF16, 8, 2, blocks);
    assert_desc_valid(&d, 16384, 256);

    int64_t odd[] = {3, 5};
    d = desc1(LLMDD_DT_DOUBLE, 1, 2, odd);
    assert_desc_valid(&d, 120, 40);

    int64_t one[] = {7};
    d = desc1(LLMDD_DT_BOOL, 1, 1, one);
    assert_desc_valid(&d, 7, 1);

    /* The most dimensions allowed. */
    int64_t many[LLMDD_MAX_DIMS];
    for (int i = 0; i < LLMDD_MAX_DIMS; i++)
        many[i] = i < 3 ? 2 : 1;
    d = desc1(LLMDD_DT_INT32, 2, LLMDD_MAX_DIMS, many);
    assert_desc_valid(&d, 32, 16);

    /* Device placement is a valid desc; whether it can be served is the
     * caller's business. */
    d = desc1(LLMDD_DT_FLOAT16, 8, 3, kv);
    d.placement = LLMDD_PLACEMENT_DEVICE;
    assert_desc_valid(&d, 4096, 1024);

    /* The largest sizes that still fit in int64. */
    int64_t max[] = {INT64_MAX};
    d = desc1(LLMDD_DT_UINT8, 1, 1, max);
    assert_desc_valid(&d, (uint64_t)INT64_MAX, 1);
    int64_t half[] = {2, (int64_t)1 << 60};
    d = desc1(LLMDD_DT_UINT16, 1, 2, half);
    assert_desc_valid(&d, 1ull << 62, 1ull << 61);
}

static void
test_desc_invalid(void **state)
{
    int64_t kv[] = {4, 16, 32};
    llmdd_cache_desc d;

    (void)state;
    assert_int_equal(llmdd__desc_check(NULL, &(uint64_t){0}, &(uint64_t){0}),
                     LLM_PARAM_INVALID);

    d = desc1(LLMDD_DT_FLOAT16, 0, 3, kv);
    assert_desc_invalid(&d);

    d = desc1(LLMDD_DT_FLOAT16, 8, 0, kv);
    assert_desc_invalid(&d);
    int64_t ones[LLMDD_MAX_DIMS];
    for (int i = 0; i < LLMDD_MAX_DIMS; i++)
        ones[i] = 1;
    d = desc1(LLMDD_DT_FLOAT16, 8, LLMDD_MAX_DIMS, ones);
    d.num_dims = LLMDD_MAX_DIMS + 1;
    assert_desc_invalid(&d);
    d.num_dims = UINT32_MAX;
    assert_desc_invalid(&d);

    /* A zero or negative dimension, first, middle or last. */
    for (int pos = 0; pos < 3; pos++) {
        for (int64_t bad = 0; bad >= -2; bad--) {
            int64_t s[] = {4, 16, 32};
            s[pos] = bad;
            d = desc1(LLMDD_DT_FLOAT16, 8, 3, s);
            assert_desc_invalid(&d);
        }
        int64_t s[] = {4, 16, 32};
        s[pos] = INT64_MIN;
        d = desc1(LLMDD_DT_FLOAT16, 8, 3, s);
        assert_desc_invalid(&d);
    }

    /* Unknown data types. */
    static const int bad_dt[] = {LLMDD_DT_UNDEFINED, 5, 13, 26, 29, -1};
    for (size_t i = 0; i < sizeof(bad_dt) / sizeof(bad_dt[0]); i++) {
        d = desc1((llmdd_data_type)bad_dt[i], 8, 3, kv);
        assert_desc_invalid(&d);
    }

    /* Placement outside 0..1. */
    d = desc1(LLMDD_DT_FLOAT16, 8, 3, kv);
    d.placement = (llmdd_placement)2;
    assert_desc_invalid(&d);
    d.placement = (llmdd_placement)-1;
    assert_desc_invalid(&d);
}

static void
test_desc_overflow(void **state)
{
    llmdd_cache_desc d;

    (void)state;
    /* The element size pushes INT64_MAX elements over int64. */
    int64_t max[] = {INT64_MAX};
    d = desc1(LLMDD_DT_UINT16, 1, 1, max);
    assert_desc_invalid(&d);

    /* Exactly 2^63 bytes: one past INT64_MAX. */
    int64_t p63[] = {2, (int64_t)1 << 62};
    d = desc1(LLMDD_DT_UINT8, 1, 2, p63);
    assert_desc_invalid(&d);

    /* Wraps uint64 in the product of the dimensions. */
    int64_t wrap[] = {(int64_t)1 << 32, (int64_t)1 << 32, 2};
    d = desc1(LLMDD_DT_UINT8, 1, 3, wrap);
    assert_desc_invalid(&d);
    int64_t big[] = {INT64_MAX, INT64_MAX};
    d = desc1(LLMDD_DT_UINT8, 1, 2, big);
    assert_desc_invalid(&d);

    /* Each tensor fits, the cache as a whole does not. */
    int64_t tensor[] = {(int64_t)1 << 62};
    d = desc1(LLMDD_DT_UINT8, 2, 1, tensor);
    assert_desc_invalid(&d);
    d = desc1(LLMDD_DT_UINT8, 1, 1, tensor);
    assert_desc_valid(&d, 1ull << 62, 1);
    int64_t t2[] = {((int64_t)1 << 62) / 3};
    d = desc1(LLMDD_DT_UINT8, 3, 1, t2);
    assert_desc_valid(&d, (uint64_t)t2[0], 1);
    d = desc1(LLMDD_DT_UINT8, UINT32_MAX, 1, t2);
    assert_desc_invalid(&d);
}

static llmdd_kv_ext_param
ext(int32_t sf, int32_t ss, int32_t df, int32_t ds, uint32_t tnpl)
{
    llmdd_kv_ext_param e = {{sf, ss}, {df, ds}, tnpl};
    return e;
}

static void
test_ext_check_shape(void **state)
{
    llmdd_kv_ext_param e = LLMDD_KV_EXT_PARAM_DEFAULT;

    (void)state;
    assert_int_equal(llmdd__ext_check_shape(&e), LLM_SUCCESS);
    e = ext(0, 0, 5, 9, 1);
    assert_int_equal(llmdd__ext_check_shape(&e), LLM_SUCCESS);

    /* tnpl is checked only where a range uses it. */
    e = ext(-1, -1, -1, -1, 0);
    assert_int_equal(llmdd__ext_check_shape(&e), LLM_SUCCESS);
    e = ext(0, 0, -1, -1, 0);
    assert_int_equal(llmdd__ext_check_shape(&e), LLM_PARAM_INVALID);
    e = ext(-1, -1, 1, 1, 0);
    assert_int_equal(llmdd__ext_check_shape(&e), LLM_PARAM_INVALID);

    /* Each bad range, on either side. */
    static const int32_t bad[][2] = {
        {-1, 5}, {5, -1}, {-2, -2}, {3, 1}, {0, -1}, {-1, 0}, {INT32_MIN, 0},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        e = ext(bad[i][0], bad[i][1], -1, -1, 2);
        assert_int_equal(llmdd__ext_check_shape(&e), LLM_PARAM_INVALID);
        e = ext(-1, -1, bad[i][0], bad[i][1], 2);
        assert_int_equal(llmdd__ext_check_shape(&e), LLM_PARAM_INVALID);
    }
}

static void
assert_span(const llmdd_kv_ext_param *e, bool is_src, uint32_t n,
            uint32_t first, uint32_t count)
{
    llmdd__tensor_span s = {99, 99};

    assert_int_equal(llmdd__range_resolve(e, is_src, n, &s), LLM_SUCCESS);
    assert_int_equal(s.first, first);
    assert_int_equal(s.count, count);
}

static void
assert_range_invalid(const llmdd_kv_ext_param *e, bool is_src, uint32_t n)
{
    llmdd__tensor_span s;

    assert_int_equal(llmdd__range_resolve(e, is_src, n, &s),
                     LLM_PARAM_INVALID);
}

static void
test_range_resolve(void **state)
{
    llmdd_kv_ext_param e = LLMDD_KV_EXT_PARAM_DEFAULT;

    (void)state;
    /* NULL ext: every tensor, nothing checked, even one tensor. */
    assert_span(NULL, true, 8, 0, 8);
    assert_span(NULL, false, 1, 0, 1);

    /* The default range selects every tensor. */
    assert_span(&e, true, 8, 0, 8);
    assert_span(&e, false, 8, 0, 8);
    /* tnpl need not divide num_tensors for the default range. */
    e = ext(-1, -1, -1, -1, 3);
    assert_span(&e, true, 8, 0, 8);

    /* With the default range tnpl is not used: 0 and values above
     * num_tensors select every tensor, as a NULL ext does. */
    e = ext(-1, -1, -1, -1, 0);
    assert_span(&e, true, 8, 0, 8);
    e = ext(-1, -1, -1, -1, 9);
    assert_span(&e, false, 8, 0, 8);
    /* The default ext (tnpl 2) on a one-tensor cache: every tensor. */
    e = (llmdd_kv_ext_param)LLMDD_KV_EXT_PARAM_DEFAULT;
    assert_span(&e, false, 1, 0, 1);
    assert_span(&e, true, 1, 0, 1);
    /* Where a range uses it, tnpl must be in [1, num_tensors]. */
    e = ext(0, 0, -1, -1, 0);
    assert_range_invalid(&e, true, 8);
    e = ext(0, 0, -1, -1, 9);
    assert_range_invalid(&e, true, 8);
    assert_span(&e, false, 8, 0, 8); /* the dst side is default */
    e = ext(0, 0, 0, 0, 2);
    assert_range_invalid(&e, true, 1);
    e = ext(0, 0, 0, 0, 8);
    assert_span(&e, true, 8, 0, 8);

    /* A range with tnpl not dividing num_tensors. */
    e = ext(0, 0, -1, -1, 3);
    assert_range_invalid(&e, true, 8);
    assert_span(&e, false, 8, 0, 8); /* the dst side is default */

    /* Layers: 8 tensors, tnpl 2, max layer 3. */
    e = ext(1, 2, 3, 3, 2);
    assert_span(&e, true, 8, 2, 4);
    assert_span(&e, false, 8, 6, 2);
    e = ext(0, 3, 0, 0, 2);
    assert_span(&e, true, 8, 0, 8);
    assert_span(&e, false, 8, 0, 2);
    e = ext(0, 7, 0, 3, 1);
    assert_span(&e, true, 8, 0, 8);
    assert_span(&e, false, 8, 0, 4);
    e = ext(2, 2, 1, 1, 4);
    assert_range_invalid(&e, true, 8); /* max layer is 1 */
    assert_span(&e, false, 8, 4, 4);

    /* second above the max layer, first above second, bad shapes. */
    e = ext(0, 4, 0, 4, 2);
    assert_range_invalid(&e, true, 8);
    assert_range_invalid(&e, false, 8);
    e = ext(4, 4, -1, -1, 2);
    assert_range_invalid(&e, true, 8);
    e = ext(2, 1, -1, -1, 2);
    assert_range_invalid(&e, true, 8);
    e = ext(-1, 5, -1, -1, 2);
    assert_range_invalid(&e, true, 8);
    e = ext(-2, -2, -1, -1, 2);
    assert_range_invalid(&e, true, 8);
    e = ext(-1, -1, 0, INT32_MAX, 2);
    assert_range_invalid(&e, false, 8);
    /* Only the requested side is looked at. */
    assert_span(&e, true, 8, 0, 8);
}

static void
test_spans_match(void **state)
{
    (void)state;
    assert_int_equal(llmdd__spans_match((llmdd__tensor_span){0, 4},
                                        (llmdd__tensor_span){4, 4}),
                     LLM_SUCCESS);
    assert_int_equal(llmdd__spans_match((llmdd__tensor_span){0, 4},
                                        (llmdd__tensor_span){0, 2}),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd__spans_match((llmdd__tensor_span){0, 8},
                                        (llmdd__tensor_span){0, 9}),
                     LLM_PARAM_INVALID);
}

/*
 * The two sides resolved and paired, as transfer.c does it step by step
 * (the shape, the source range, the destination range, equal widths).
 */
static llmdd_status
map(const llmdd_kv_ext_param *e, uint32_t src_n, uint32_t dst_n,
    llmdd__tensor_span *s, llmdd__tensor_span *d)
{
    llmdd_status st;

    if (e != NULL && (st = llmdd__ext_check_shape(e)) != LLM_SUCCESS)
        return st;
    if ((st = llmdd__range_resolve(e, true, src_n, s)) != LLM_SUCCESS ||
        (st = llmdd__range_resolve(e, false, dst_n, d)) != LLM_SUCCESS)
        return st;
    return llmdd__spans_match(*s, *d);
}

static void
test_map_tensors(void **state)
{
    llmdd__tensor_span s, d;
    llmdd_kv_ext_param e;

    (void)state;
    /* Without ranges tensor i maps to tensor i: equal counts needed. */
    assert_int_equal(map(NULL, 8, 8, &s, &d), LLM_SUCCESS);
    assert_int_equal(s.first, 0);
    assert_int_equal(s.count, 8);
    assert_int_equal(d.first, 0);
    assert_int_equal(d.count, 8);
    assert_int_equal(map(NULL, 8, 4, &s, &d),
                     LLM_PARAM_INVALID);
    e = (llmdd_kv_ext_param)LLMDD_KV_EXT_PARAM_DEFAULT;
    assert_int_equal(map(&e, 8, 4, &s, &d), LLM_PARAM_INVALID);
    /* A NULL ext and the default ext agree on one-tensor caches. */
    assert_int_equal(map(NULL, 1, 1, &s, &d), LLM_SUCCESS);
    assert_int_equal(map(&e, 1, 1, &s, &d), LLM_SUCCESS);
    assert_int_equal(s.count, 1);
    assert_int_equal(d.count, 1);

    /* Layers 0..1 of the source onto layers 2..3 of the destination. */
    e = ext(0, 1, 2, 3, 2);
    assert_int_equal(map(&e, 8, 8, &s, &d), LLM_SUCCESS);
    assert_int_equal(s.first, 0);
    assert_int_equal(s.count, 4);
    assert_int_equal(d.first, 4);
    assert_int_equal(d.count, 4);

    /* A range as wide as a whole smaller cache (default range). */
    e = ext(2, 3, -1, -1, 2);
    assert_int_equal(map(&e, 8, 4, &s, &d), LLM_SUCCESS);
    assert_int_equal(s.first, 4);
    assert_int_equal(s.count, 4);
    assert_int_equal(d.first, 0);
    assert_int_equal(d.count, 4);

    /* Unequal widths, a bad shape, a bad side. */
    e = ext(0, 0, 0, 1, 2);
    assert_int_equal(map(&e, 8, 8, &s, &d), LLM_PARAM_INVALID);
    e = ext(-1, 3, -1, -1, 2);
    assert_int_equal(map(&e, 8, 8, &s, &d), LLM_PARAM_INVALID);
    e = ext(0, 0, 4, 4, 2);
    assert_int_equal(map(&e, 8, 10, &s, &d), LLM_SUCCESS);
    assert_int_equal(d.first, 8);
    assert_int_equal(d.count, 2);
    assert_int_equal(map(&e, 10, 8, &s, &d),
                     LLM_PARAM_INVALID);
}

static void
test_blocks_check(void **state)
{
    uint64_t ok[] = {0, 63, 5, 5, 0};
    uint64_t over[] = {0, 64};
    uint64_t huge[] = {UINT64_MAX};

    (void)state;
    assert_int_equal(llmdd__blocks_check(ok, 5, 64), LLM_SUCCESS);
    assert_int_equal(llmdd__blocks_check(ok, 1, 1), LLM_SUCCESS);
    assert_int_equal(llmdd__blocks_check(NULL, 1, 64), LLM_PARAM_INVALID);
    assert_int_equal(llmdd__blocks_check(ok, 0, 64), LLM_PARAM_INVALID);
    assert_int_equal(llmdd__blocks_check(over, 2, 64), LLM_PARAM_INVALID);
    assert_int_equal(llmdd__blocks_check(over, 1, 64), LLM_SUCCESS);
    assert_int_equal(llmdd__blocks_check(huge, 1, 64), LLM_PARAM_INVALID);
    assert_int_equal(llmdd__blocks_check(ok, 1, 0), LLM_PARAM_INVALID);
}

/* Runs as {src block, dst block, number of blocks}. */
typedef struct {
    uint64_t src, dst, n;
} want_run;

static void
assert_runs(const uint64_t *src, const uint64_t *dst, size_t n,
            const want_run *want, size_t nwant)
{
    const uint64_t stride = 40;
    llmdd__run *runs = calloc(n, sizeof(*runs));

    assert_non_null(runs);
    size_t got = llmdd__block_runs(src, dst, n, stride, runs);
    assert_int_equal(got, nwant);
    for (size_t i = 0; i < nwant; i++) {
        assert_true(runs[i].src_off == want[i].src * stride);
        assert_true(runs[i].dst_off == want[i].dst * stride);
        assert_true(runs[i].len == want[i].n * stride);
    }
    free(runs);
}

static void
test_block_runs_sorted(void **state)
{
    (void)state;
    uint64_t s1[] = {0, 1, 2, 3}, d1[] = {4, 5, 6, 7};
    assert_runs(s1, d1, 4, (want_run[]){{0, 4, 4}}, 1);

    /* A gap on the source side splits the run; so does one on dst. */
    uint64_t s2[] = {0, 1, 3, 4}, d2[] = {0, 1, 2, 3};
    assert_runs(s2, d2, 4, (want_run[]){{0, 0, 2}, {3, 2, 2}}, 2);
    uint64_t s3[] = {0, 1, 2, 3}, d3[] = {0, 1, 5, 6};
    assert_runs(s3, d3, 4, (want_run[]){{0, 0, 2}, {2, 5, 2}}, 2);

    /* Contiguous on one side only: no merging. */
    uint64_t s4[] = {0, 1, 2}, d4[] = {0, 2, 4};
    assert_runs(s4, d4, 3, (want_run[]){{0, 0, 1}, {1, 2, 1}, {2, 4, 1}}, 3);
    uint64_t s5[] = {5, 3, 1}, d5[] = {0, 1, 2};
    assert_runs(s5, d5, 3, (want_run[]){{5, 0, 1}, {3, 1, 1}, {1, 2, 1}}, 3);

    /* A single block. */
    uint64_t s6[] = {7}, d6[] = {9};
    assert_runs(s6, d6, 1, (want_run[]){{7, 9, 1}}, 1);
}

static void
test_block_runs_unsorted(void **state)
{
    (void)state;
    /* Order is kept; only ascending neighbours merge. */
    uint64_t s1[] = {3, 1, 2}, d1[] = {3, 1, 2};
    assert_runs(s1, d1, 3, (want_run[]){{3, 3, 1}, {1, 1, 2}}, 2);
    uint64_t s2[] = {3, 2, 1}, d2[] = {3, 2, 1};
    assert_runs(s2, d2, 3, (want_run[]){{3, 3, 1}, {2, 2, 1}, {1, 1, 1}}, 3);
    uint64_t s3[] = {10, 11, 0, 1, 2}, d3[] = {5, 6, 20, 21, 22};
    assert_runs(s3, d3, 5, (want_run[]){{10, 5, 2}, {0, 20, 3}}, 2);
}

static void
test_block_runs_duplicates(void **state)
{
    (void)state;
    /* The same source twice: two runs, in order. */
    uint64_t s1[] = {2, 2, 2}, d1[] = {0, 1, 2};
    assert_runs(s1, d1, 3, (want_run[]){{2, 0, 1}, {2, 1, 1}, {2, 2, 1}}, 3);
    /* The same destination twice: the later pair comes later. */
    uint64_t s2[] = {0, 1}, d2[] = {5, 5};
    assert_runs(s2, d2, 2, (want_run[]){{0, 5, 1}, {1, 5, 1}}, 2);
    /* A duplicate pair is not contiguous with itself. */
    uint64_t s3[] = {4, 4, 5}, d3[] = {8, 8, 9};
    assert_runs(s3, d3, 3, (want_run[]){{4, 8, 1}, {4, 8, 2}}, 2);
}

/* A small deterministic generator, so failures reproduce. */
static uint64_t
xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void
test_block_runs_equal_block_by_block(void **state)
{
    /* Applying the runs in order must give what copying block by block
     * gives, for any lists (src and dst are different buffers). */
    enum { NB = 16, STRIDE = 8, N = 24 };
    uint8_t src[NB * STRIDE], a[NB * STRIDE], b[NB * STRIDE];
    uint64_t sb[N], db[N], seed = 0x9e3779b97f4a7c15ull;
    llmdd__run runs[N];

    (void)state;
    for (int i = 0; i < NB * STRIDE; i++)
        src[i] = (uint8_t)(i * 7 + 3);
    for (int iter = 0; iter < 2000; iter++) {
        size_t n = 1 + xorshift(&seed) % N;
        /* Mostly ascending lists with jumps, so runs form and break. */
        uint64_t s = xorshift(&seed) % NB, d = xorshift(&seed) % NB;
        for (size_t k = 0; k < n; k++) {
            if (xorshift(&seed) % 4 == 0)
                s = xorshift(&seed) % NB;
            if (xorshift(&seed) % 4 == 0)
                d = xorshift(&seed) % NB;
            sb[k] = s % NB;
            db[k] = d % NB;
            s++;
            d++;
        }
        memset(a, 0, sizeof(a));
        memset(b, 0, sizeof(b));
        for (size_t k = 0; k < n; k++)
            memcpy(a + db[k] * STRIDE, src + sb[k] * STRIDE, STRIDE);
        size_t nr = llmdd__block_runs(sb, db, n, STRIDE, runs);
        assert_true(nr >= 1 && nr <= n);
        uint64_t total = 0;
        for (size_t i = 0; i < nr; i++) {
            memcpy(b + runs[i].dst_off, src + runs[i].src_off, runs[i].len);
            total += runs[i].len;
        }
        assert_true(total == n * STRIDE);
        assert_memory_equal(a, b, sizeof(a));
    }
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_sizes),
        cmocka_unit_test(test_desc_valid_shapes),
        cmocka_unit_test(test_desc_invalid),
        cmocka_unit_test(test_desc_overflow),
        cmocka_unit_test(test_ext_check_shape),
        cmocka_unit_test(test_range_resolve),
        cmocka_unit_test(test_spans_match),
        cmocka_unit_test(test_map_tensors),
        cmocka_unit_test(test_blocks_check),
        cmocka_unit_test(test_block_runs_sorted),
        cmocka_unit_test(test_block_runs_unsorted),
        cmocka_unit_test(test_block_runs_duplicates),
        cmocka_unit_test(test_block_runs_equal_block_by_block),
    };
    return cmocka_run_group_tests_name("layout", tests, NULL, NULL);
}
