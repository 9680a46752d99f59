/*
 * The batch dimension over one transport (docs/model.md, "The batch
 * dimension"): caches whose slots are indexed by a dimension other than
 * shape[0], pulled, pushed and copied slot by slot between in-process
 * instances and compared byte for byte with a reference that finds every
 * byte by its coordinates (untouched bytes included); caches of different
 * geometries on the two sides (rows of different lengths, one side with
 * batch dimension 0); sizes of whole rows and not; block calls refused; the
 * batch dimension as the peer sees it; and a slot large enough to stripe.
 *
 *   batchdim_conf_test <transport>
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness/harness.h"

#define PEER 1
#define SELF 100
#define SENT 0xa5

static const char *transport;
static llmdd *dd, *peer;

static int
setup(void **state)
{
    (void)state;
    /* Three lanes: tcp stripes large transfers even over loopback. */
    llmdd_option o[] = {{"llm.Transport", transport},
                        {"llm.SyncKvCacheWaitTime", "10000"},
                        {"llm.TcpLanes", "3"}};
    uint16_t port;
    if (llmdd_create(SELF, LLMDD_ROLE_MIX, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, o, 3) != LLM_SUCCESS ||
        llmdd_create(PEER, LLMDD_ROLE_MIX, &peer) != LLM_SUCCESS ||
        th_init_listen(peer, "127.0.0.1", &port, o, 3) != LLM_SUCCESS ||
        th_link(dd, PEER, "127.0.0.1", port, 5000) != LLM_SUCCESS)
        return -1;
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    llmdd_destroy(dd);
    llmdd_destroy(peer);
    return 0;
}

static llmdd_cache_desc
desc_of(uint32_t nt, llmdd_data_type dt, uint32_t nd, const int64_t *shape)
{
    llmdd_cache_desc d;
    memset(&d, 0, sizeof(d));
    d.num_tensors = nt;
    d.data_type = dt;
    d.num_dims = nd;
    for (uint32_t i = 0; i < nd; i++)
        d.shape[i] = shape[i];
    return d;
}

static uint64_t
tensor_bytes(const llmdd_cache_desc *d)
{
    uint64_t n = llmdd_data_type_size(d->data_type);
    for (uint32_t i = 0; i < d->num_dims; i++)
        n *= (uint64_t)d->shape[i];
    return n;
}

/*
 * Where byte x of slot b lies in a tensor, found by coordinates: the
 * element's index in row-major order of every dim but bd, with b put in at
 * bd, and the byte within the element. Independent of the library's rows.
 */
static uint64_t
byte_at(const llmdd_cache_desc *d, uint32_t bd, uint64_t b, uint64_t x)
{
    uint64_t es = llmdd_data_type_size(d->data_type);
    uint64_t e = x / es, idx[LLMDD_MAX_DIMS];
    for (int i = (int)d->num_dims - 1; i >= 0; i--) {
        if ((uint32_t)i == bd) {
            idx[i] = b;
            continue;
        }
        idx[i] = e % (uint64_t)d->shape[i];
        e /= (uint64_t)d->shape[i];
    }
    uint64_t lin = 0;
    for (uint32_t i = 0; i < d->num_dims; i++)
        lin = lin * (uint64_t)d->shape[i] + idx[i];
    return lin * es + x % es;
}

/* One side of a case: an allocated cache with its desc and batch dim. */
typedef struct {
    llmdd *owner;
    llmdd_cache_desc d;
    uint32_t bd;
    llmdd_cache c;
    uint64_t size;
} side;

static void
side_make(side *s, llmdd *owner, const llmdd_cache_desc *d, uint32_t bd)
{
    s->owner = owner;
    s->d = *d;
    s->bd = bd;
    s->size = tensor_bytes(d);
    assert_int_equal(llmdd_allocate_cache_ex(owner, d, bd, &s->c), LLM_SUCCESS);
}

static void
side_free(side *s)
{
    assert_int_equal(llmdd_deallocate_cache(s->owner, s->c.cache_id),
                     LLM_SUCCESS);
}

static uint8_t *
tensor(const side *s, uint32_t t)
{
    return (uint8_t *)(uintptr_t)s->c.tensor_addrs[t];
}

/* Source tensors patterned, destination tensors SENT; refs = dst as is. */
static void
prime(const side *src, const side *dst, uint8_t **ref)
{
    for (uint32_t t = 0; t < src->d.num_tensors; t++)
        th_fill_buf(tensor(src, t), src->size, 7, t);
    for (uint32_t t = 0; t < dst->d.num_tensors; t++) {
        memset(tensor(dst, t), SENT, dst->size);
        ref[t] = malloc(dst->size);
        memset(ref[t], SENT, dst->size);
    }
}

/* Bytes [off, off + len) of slot sb of src tensor st into slot db of ref. */
static void
reference(const side *src, uint32_t st, uint64_t sb, const side *dst,
          uint8_t *ref, uint64_t db, uint64_t off, uint64_t len)
{
    const uint8_t *s = tensor(src, st);
    for (uint64_t x = off; x < off + len; x++)
        ref[byte_at(&dst->d, dst->bd, db, x)] =
            s[byte_at(&src->d, src->bd, sb, x)];
}

static void
check_and_free(const side *dst, uint8_t **ref)
{
    for (uint32_t t = 0; t < dst->d.num_tensors; t++) {
        assert_memory_equal(tensor(dst, t), ref[t], dst->size);
        free(ref[t]);
    }
}

/*
 * Pull (push false) or push slot sb of src into slot db of dst, size bytes
 * (-1: the local slot), every tensor; the peer's cache is the remote one.
 */
static void
move_case(const llmdd_cache_desc *ld, uint32_t lbd, const llmdd_cache_desc *rd,
          uint32_t rbd, bool push, uint32_t lb, uint32_t rb, int64_t size)
{
    side l, r;
    uint8_t *ref[8];
    side_make(&l, dd, ld, lbd);
    side_make(&r, peer, rd, rbd);
    const side *src = push ? &l : &r, *dst = push ? &r : &l;
    uint64_t sb = push ? lb : rb, db = push ? rb : lb;
    prime(src, dst, ref);
    uint64_t len =
        size > 0 ? (uint64_t)size : tensor_bytes(ld) / (uint64_t)ld->shape[lbd];
    for (uint32_t t = 0; t < dst->d.num_tensors; t++)
        reference(src, t, sb, dst, ref[t], db, 0, len);
    llmdd_cache_index ri = {PEER, r.c.cache_id, rb};
    llmdd_status st = push ? llmdd_push_kv_cache(dd, &l.c, &ri, lb, size, NULL)
                           : llmdd_pull_kv_cache(dd, &ri, &l.c, lb, size, NULL);
    assert_int_equal(st, LLM_SUCCESS);
    check_and_free(dst, ref);
    side_free(&l);
    side_free(&r);
}

/* Every batch dim of a 4-D bf16 shape, pulled and pushed, other slots. */
static void
test_same_geometry(void **state)
{
    (void)state;
    const int64_t sh[4] = {3, 5, 4, 6};
    llmdd_cache_desc d = desc_of(2, LLMDD_DT_BF16, 4, sh);
    for (uint32_t bd = 0; bd < 4; bd++) {
        uint32_t n = (uint32_t)sh[bd];
        move_case(&d, bd, &d, bd, false, n - 1, 1 % n, -1);
        move_case(&d, bd, &d, bd, true, 0, n - 1, -1);
    }
}

/* Whole rows of a slot (size), and a size that is not whole rows, which
 * moves nothing. */
static void
test_size_rows(void **state)
{
    (void)state;
    const int64_t sh[3] = {4, 3, 10};
    llmdd_cache_desc d = desc_of(1, LLMDD_DT_UINT8, 3, sh);
    /* bd 1: rows of 10 bytes, 4 a slot. */
    move_case(&d, 1, &d, 1, false, 2, 0, 20);
    move_case(&d, 1, &d, 1, true, 1, 2, 30);
    side l, r;
    side_make(&l, dd, &d, 1);
    side_make(&r, peer, &d, 1);
    memset(tensor(&l, 0), SENT, l.size);
    memset(tensor(&r, 0), SENT, r.size);
    llmdd_cache_index ri = {PEER, r.c.cache_id, 0};
    assert_int_equal(llmdd_pull_kv_cache(dd, &ri, &l.c, 0, 15, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_push_kv_cache(dd, &l.c, &ri, 0, 15, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_cache(dd, &ri, &l.c, 0, 50, NULL),
                     LLM_PARAM_INVALID); /* past the slot's 40 */
    /* Slots count along the batch dim: 3, not shape[0]'s 4. */
    ri.batch_index = 3;
    assert_int_equal(llmdd_pull_kv_cache(dd, &ri, &l.c, 0, -1, NULL),
                     LLM_PARAM_INVALID);
    ri.batch_index = 0;
    assert_int_equal(llmdd_pull_kv_cache(dd, &ri, &l.c, 3, -1, NULL),
                     LLM_PARAM_INVALID);
    for (uint64_t i = 0; i < l.size; i++)
        assert_int_equal(tensor(&l, 0)[i], SENT);
    for (uint64_t i = 0; i < r.size; i++)
        assert_int_equal(tensor(&r, 0)[i], SENT);
    side_free(&l);
    side_free(&r);
}

/*
 * The two sides' geometries differ: rows of 6 bytes here and 4 there (a
 * period of 12 bytes in four pieces), rows of 24 and 8, and a batch-dim-0
 * cache against one with batch dim 2.
 */
static void
test_mixed_geometry(void **state)
{
    (void)state;
    const int64_t a[3] = {4, 5, 6}, b[3] = {6, 3, 4};
    llmdd_cache_desc da = desc_of(1, LLMDD_DT_UINT8, 3, a);
    llmdd_cache_desc db = desc_of(1, LLMDD_DT_UINT8, 3, b);
    move_case(&da, 1, &db, 1, false, 4, 2, -1);
    move_case(&da, 1, &db, 1, true, 3, 0, -1);
    move_case(&da, 1, &db, 1, false, 0, 1, 12);
    const int64_t c[4] = {2, 4, 3, 8}, e[4] = {2, 3, 4, 8};
    llmdd_cache_desc dc = desc_of(2, LLMDD_DT_UINT8, 4, c);
    llmdd_cache_desc de = desc_of(2, LLMDD_DT_UINT8, 4, e);
    move_case(&dc, 1, &de, 2, false, 3, 1, -1);
    move_case(&dc, 1, &de, 2, true, 2, 3, -1);
    /* uint8 [7, 96] batch dim 0 (one contiguous row) against fp16
     * [2, 7, 3, 8] batch dim 1 (two rows of 48 bytes). */
    const int64_t f[2] = {7, 96}, g[4] = {2, 7, 3, 8};
    llmdd_cache_desc df = desc_of(1, LLMDD_DT_UINT8, 2, f);
    llmdd_cache_desc dg = desc_of(1, LLMDD_DT_FLOAT16, 4, g);
    move_case(&df, 0, &dg, 1, false, 6, 5, -1);
    move_case(&df, 0, &dg, 1, true, 1, 6, -1);
    move_case(&dg, 1, &df, 0, false, 2, 3, -1);
}

/* Layer ranges: source tensors 2..3 into destination tensors 0..1. */
static void
test_layer_range(void **state)
{
    (void)state;
    const int64_t sh[3] = {4, 6, 8};
    llmdd_cache_desc d = desc_of(4, LLMDD_DT_FLOAT, 3, sh);
    side l, r;
    uint8_t *ref[4];
    side_make(&l, dd, &d, 2);
    side_make(&r, peer, &d, 2);
    prime(&r, &l, ref);
    uint64_t slot = l.size / 8;
    for (uint32_t t = 0; t < 2; t++)
        reference(&r, t + 2, 5, &l, ref[t], 7, 0, slot);
    llmdd_kv_ext_param ext = {{1, 1}, {0, 0}, 2};
    llmdd_cache_index ri = {PEER, r.c.cache_id, 5};
    assert_int_equal(llmdd_pull_kv_cache(dd, &ri, &l.c, 7, -1, &ext),
                     LLM_SUCCESS);
    check_and_free(&l, ref);
    side_free(&l);
    side_free(&r);
}

/* A posted pull and a layer-wise push. */
static void
test_posted(void **state)
{
    (void)state;
    const int64_t sh[3] = {8, 4, 64};
    llmdd_cache_desc d = desc_of(4, LLMDD_DT_UINT8, 3, sh);
    side l, r;
    uint8_t *ref[4];
    side_make(&l, dd, &d, 1);
    side_make(&r, peer, &d, 1);
    prime(&r, &l, ref);
    for (uint32_t t = 0; t < 4; t++)
        reference(&r, t, 1, &l, ref[t], 2, 0, 512);
    llmdd_cache_index ri = {PEER, r.c.cache_id, 1};
    llmdd_request *q;
    assert_int_equal(
        llmdd_pull_kv_cache_async(dd, &ri, &l.c, 2, -1, NULL, NULL, &q),
        LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(q, -1), LLM_SUCCESS);
    llmdd_request_free(q);
    check_and_free(&l, ref);

    prime(&l, &r, ref);
    for (uint32_t t = 0; t < 4; t++)
        reference(&l, t, 3, &r, ref[t], 0, 0, 512);
    llmdd_xfer_opts o = {.flags = LLMDD_XFER_LAYERWISE};
    ri.batch_index = 0;
    assert_int_equal(
        llmdd_push_kv_cache_async(dd, &l.c, &ri, 3, -1, NULL, &o, &q),
        LLM_SUCCESS);
    for (uint32_t layer = 0; layer < 2; layer++)
        assert_int_equal(llmdd_request_layer_ready(q, layer), LLM_SUCCESS);
    assert_int_equal(llmdd_request_wait(q, -1), LLM_SUCCESS);
    llmdd_request_free(q);
    check_and_free(&r, ref);
    side_free(&l);
    side_free(&r);
}

/*
 * Block calls need batch dim 0 on both sides; creation checks the batch
 * dim; registered memory takes one too; keys count slots along it.
 */
static void
test_refusals(void **state)
{
    (void)state;
    const int64_t sh[2] = {4, 64};
    llmdd_cache_desc d = desc_of(1, LLMDD_DT_UINT8, 2, sh);
    llmdd_cache bad;
    assert_int_equal(llmdd_allocate_cache_ex(dd, &d, 2, &bad),
                     LLM_PARAM_INVALID);
    side l0, l1, r0, r1;
    side_make(&l0, dd, &d, 0);
    side_make(&l1, dd, &d, 1);
    side_make(&r0, peer, &d, 0);
    side_make(&r1, peer, &d, 1);
    uint64_t blk[1] = {0};
    llmdd_cache_index i0 = {PEER, r0.c.cache_id, 0};
    llmdd_cache_index i1 = {PEER, r1.c.cache_id, 0};
    assert_int_equal(llmdd_pull_kv_blocks(dd, &i1, &l0.c, blk, blk, 1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_pull_kv_blocks(dd, &i0, &l1.c, blk, blk, 1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_push_kv_blocks(dd, &l0.c, &i1, blk, blk, 1, NULL),
                     LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_pull_kv_cache_to_blocks(dd, &i1, &l0.c, blk, 1, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(
        llmdd_push_kv_cache_to_blocks(dd, &l1.c, &i0, 0, blk, 1, NULL),
        LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_blocks(dd, &l1.c, &l0.c, blk, blk, 1),
                     LLM_PARAM_INVALID);
    /* 64 slots along dim 1: slot 10 exists, though shape[0] is 4. */
    assert_int_equal(llmdd_set_cache_key(dd, l1.c.cache_id, 10, "k", 1),
                     LLM_SUCCESS);
    assert_int_equal(llmdd_set_cache_key(dd, l1.c.cache_id, 64, "j", 1),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_set_cache_key(dd, l0.c.cache_id, 10, "j", 1),
                     LLM_PARAM_INVALID);
    side_free(&l0);
    side_free(&l1);
    side_free(&r0);
    side_free(&r1);

    static uint8_t mem[2][4 * 64];
    uint64_t addrs[2] = {(uint64_t)(uintptr_t)mem[0],
                         (uint64_t)(uintptr_t)mem[1]};
    d.num_tensors = 2;
    int64_t id;
    assert_int_equal(llmdd_register_kv_cache_ex(peer, &d, 5, addrs, 2, &id),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_register_kv_cache_ex(peer, &d, 1, addrs, 2, &id),
                     LLM_SUCCESS);
    for (int t = 0; t < 2; t++)
        th_fill_buf(mem[t], sizeof(mem[t]), 3, (uint32_t)t);
    side l;
    uint8_t *ref[2];
    side_make(&l, dd, &d, 1);
    for (uint32_t t = 0; t < 2; t++) {
        memset(tensor(&l, t), SENT, l.size);
        ref[t] = malloc(l.size);
        memset(ref[t], SENT, l.size);
        for (uint64_t k = 0; k < 4; k++)
            ref[t][k * 64 + 9] = mem[t][k * 64 + 33];
    }
    llmdd_cache_index ri = {PEER, id, 33};
    assert_int_equal(llmdd_pull_kv_cache(dd, &ri, &l.c, 9, -1, NULL),
                     LLM_SUCCESS);
    check_and_free(&l, ref);
    side_free(&l);
    assert_int_equal(llmdd_unregister_kv_cache(peer, id), LLM_SUCCESS);
}

/* llmdd_copy_kv_cache: offsets and sizes of whole rows, both geometries. */
static void
test_copy(void **state)
{
    (void)state;
    const int64_t a[3] = {4, 5, 6}, b[3] = {6, 3, 4};
    llmdd_cache_desc da = desc_of(2, LLMDD_DT_UINT8, 3, a);
    llmdd_cache_desc db = desc_of(2, LLMDD_DT_UINT8, 3, b);
    side s, t;
    uint8_t *ref[2];
    side_make(&s, dd, &da, 1);
    side_make(&t, dd, &db, 1);
    prime(&s, &t, ref);
    for (uint32_t k = 0; k < 2; k++)
        reference(&s, k, 3, &t, ref[k], 2, 12, 12);
    assert_int_equal(llmdd_copy_kv_cache(dd, &s.c, &t.c, 3, 2, 12, 12),
                     LLM_SUCCESS);
    check_and_free(&t, ref);
    /* Offset 6 is whole rows of s but not of t; size 8 neither. */
    assert_int_equal(llmdd_copy_kv_cache(dd, &s.c, &t.c, 3, 2, 6, 12),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_cache(dd, &s.c, &t.c, 3, 2, 0, 8),
                     LLM_PARAM_INVALID);
    assert_int_equal(llmdd_copy_kv_cache(dd, &s.c, &t.c, 5, 2, 0, -1),
                     LLM_PARAM_INVALID);
    /* Within one cache, slot 0 into slot 4 (rows interleaved). */
    for (uint32_t k = 0; k < 2; k++) {
        th_fill_buf(tensor(&s, k), s.size, 9, k);
        ref[k] = malloc(s.size);
        memcpy(ref[k], tensor(&s, k), s.size);
        reference(&s, k, 0, &s, ref[k], 4, 0, 24);
    }
    assert_int_equal(llmdd_copy_kv_cache(dd, &s.c, &s.c, 0, 4, 0, -1),
                     LLM_SUCCESS);
    check_and_free(&s, ref);
    side_free(&s);
    side_free(&t);
}

/* Slots of 2 MiB in 32 rows of 64 KiB, three tensors: large enough to
 * stripe over tcp lanes, pulled and pushed. */
static void
test_large(void **state)
{
    (void)state;
    const int64_t sh[3] = {32, 4, 32768};
    llmdd_cache_desc d = desc_of(3, LLMDD_DT_BF16, 3, sh);
    move_case(&d, 1, &d, 1, false, 3, 1, -1);
    move_case(&d, 1, &d, 1, true, 0, 2, -1);
}

int
main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s <transport>\n", argv[0]);
        return 2;
    }
    transport = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_geometry),
        cmocka_unit_test(test_size_rows),
        cmocka_unit_test(test_mixed_geometry),
        cmocka_unit_test(test_layer_range),
        cmocka_unit_test(test_posted),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_copy),
        cmocka_unit_test(test_large),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
