/*
 * The copy engine (src/core/copy.c): byte-exact copies for every alignment
 * of source and destination within a line, lengths around the line, the
 * vector, the shortest streamed run and the batch threshold, with each
 * instruction set this CPU has; memmove semantics for overlapping ranges;
 * and no byte written outside the destination (guard bytes on both sides).
 */
#include <stdlib.h>
#include <string.h>

#include "core/copy.h"
#include "harness/harness.h"

#define GUARD 128
#define GUARD_BYTE 0xe7

static const size_t small_lens[] = {0,   1,   15,  16,   17,   31,  32,
                                    33,  63,  64,  65,   127,  128, 129,
                                    255, 256, 257, 4095, 4096, 4097};

/* A pattern that differs at every offset inside a page and across pages. */
static void
fill(uint8_t *p, size_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        p[i] = (uint8_t)(x >> 16);
    }
}

/* Line-aligned memory; C11 wants the size a multiple of the alignment. */
static uint8_t *
alloc64(size_t n)
{
    uint8_t *p = aligned_alloc(64, (n + 63) & ~(size_t)63);
    assert_non_null(p);
    return p;
}

/* A buffer of GUARD + cap + GUARD bytes, all guard bytes. */
static uint8_t *
guarded(size_t cap)
{
    uint8_t *p = alloc64(GUARD + cap + GUARD + 64);
    memset(p, GUARD_BYTE, GUARD + cap + GUARD + 64);
    return p;
}

/* Whether p[0, n) are all guard bytes. */
static bool
is_guard(const uint8_t *p, size_t n)
{
    static uint8_t g[4096];
    if (g[0] != GUARD_BYTE)
        memset(g, GUARD_BYTE, sizeof(g));
    for (size_t k; n > 0; p += k, n -= k) {
        k = n < sizeof(g) ? n : sizeof(g);
        if (memcmp(p, g, k) != 0)
            return false;
    }
    return true;
}

/* dst[off, off + len) equals src and every other byte is a guard byte. */
static void
check(const uint8_t *buf, size_t cap, size_t off, const uint8_t *src,
      size_t len)
{
    assert_memory_equal(buf + GUARD + off, src, len);
    assert_true(is_guard(buf, GUARD + off));
    assert_true(
        is_guard(buf + GUARD + off + len, cap - off - len + GUARD + 64));
}

static void
test_stream_alignments(void **state)
{
    (void)state;
    const size_t cap = 4097 + 64;
    uint8_t *src = alloc64(cap + 64);
    uint8_t *dst = guarded(cap);

    assert_non_null(src);
    fill(src, cap + 64, 1);
    for (int isa = LLMDD__COPY_PORTABLE; isa <= llmdd__copy_isa(); isa++) {
        for (size_t sa = 0; sa < 64; sa++) {
            for (size_t da = 0; da < 64; da++) {
                for (size_t k = 0; k < sizeof(small_lens) / sizeof(size_t);
                     k++) {
                    size_t len = small_lens[k];
                    llmdd__copy_stream(dst + GUARD + da, src + sa, len, isa);
                    check(dst, cap, da, src + sa, len);
                    memset(dst + GUARD + da, GUARD_BYTE, len);
                }
            }
        }
    }
    free(src);
    free(dst);
}

/*
 * Whole lines from both ends inwards, with every instruction set this CPU
 * has: odd and even line counts (the middle line alone), sources on and
 * off a line; every byte lands and nothing around it is written.
 */
static void
test_converge(void **state)
{
    (void)state;
    static const size_t lens[] = {64, 128, 192, 2048, 2112, 4096, 4160};
    const size_t cap = 4160;
    uint8_t *src = alloc64(cap + 64);
    uint8_t *dst = guarded(cap);

    assert_non_null(src);
    fill(src, cap + 64, 3);
    for (int isa = LLMDD__COPY_PORTABLE; isa <= llmdd__copy_isa(); isa++) {
        for (size_t sa = 0; sa < 64; sa += 7) {
            for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
                llmdd__copy_converge(dst + GUARD, src + sa, lens[k], isa);
                check(dst, cap, 0, src + sa, lens[k]);
                memset(dst + GUARD, GUARD_BYTE, lens[k]);
            }
        }
    }
    free(src);
    free(dst);
}

/*
 * Batches below, at and above the thresholds (LLMDD__COPY_NT_BATCH; from
 * LLMDD__COPY_NT_SPAN_BATCH up, a destination of LLMDD__COPY_NT_SPAN), with
 * their runs around them and around the shortest streamed run, at a few
 * alignments.
 */
static void
test_batch_thresholds(void **state)
{
    (void)state;
    const size_t t = LLMDD__COPY_NT_BATCH, m = LLMDD__COPY_NT_MIN_RUN;
    const size_t sb = LLMDD__COPY_NT_SPAN_BATCH;
    const size_t lens[] = {0,
                           1,
                           m - 1,
                           m,
                           m + 1,
                           t - 1,
                           t,
                           t + 1,
                           (3u << 20) + 17,
                           (5u << 20) + 4095};
    const uint64_t totals[] = {sb - 1, sb, t - 1, t, t + 1};
    const uint64_t spans[] = {0, LLMDD__COPY_NT_SPAN - 1, LLMDD__COPY_NT_SPAN};
    const size_t aligns[] = {0, 1, 17, 32, 63};
    const size_t cap = t + 64 + 1;
    uint8_t *src = alloc64(cap + 64);
    uint8_t *dst = guarded(cap);

    assert_non_null(src);
    fill(src, cap + 64, 2);
    for (size_t k = 0; k < 5 * 3; k++) {
        uint64_t total = totals[k % 5], span = spans[k / 5];
        bool stream =
            total >= t || (total >= sb && span >= LLMDD__COPY_NT_SPAN);
        for (size_t li = 0; li < sizeof(lens) / sizeof(size_t); li++) {
            for (size_t ai = 0; ai < 5; ai++) {
                size_t sa = aligns[ai], da = aligns[(ai + 2) % 5];
                llmdd__copy_batch b;
                llmdd__copy_begin(&b, total, span);
                assert_int_equal(b.stream,
                                 stream &&
                                     llmdd__copy_isa() != LLMDD__COPY_PORTABLE);
                llmdd__copy(&b, dst + GUARD + da, src + sa, lens[li]);
                llmdd__copy_end(&b);
                assert_int_equal(b.streamed, b.stream && lens[li] >= m);
                check(dst, cap, da, src + sa, lens[li]);
                memset(dst + GUARD + da, GUARD_BYTE, lens[li]);
            }
        }
    }
    free(src);
    free(dst);
}

/* Several runs of one batch, as a transfer's tensors and blocks are. */
static void
test_batch_runs(void **state)
{
    (void)state;
    const size_t run = 16384 + 3, nruns = 700, cap = run * nruns * 2;
    uint8_t *src = malloc(cap);
    uint8_t *dst = guarded(cap);
    llmdd__copy_batch b;

    assert_non_null(src);
    fill(src, cap, 3);
    llmdd__copy_begin(&b, (uint64_t)run * nruns, 0);
    assert_true(b.stream || llmdd__copy_isa() == LLMDD__COPY_PORTABLE);
    /* Scattered: every other run-sized slot, in reverse. */
    for (size_t i = 0; i < nruns; i++)
        llmdd__copy(&b, dst + GUARD + 2 * i * run, src + (nruns - 1 - i) * run,
                    run);
    llmdd__copy_end(&b);
    for (size_t i = 0; i < nruns; i++) {
        assert_memory_equal(dst + GUARD + 2 * i * run,
                            src + (nruns - 1 - i) * run, run);
        assert_true(is_guard(dst + GUARD + (2 * i + 1) * run, run));
    }
    assert_true(is_guard(dst, GUARD));
    assert_true(is_guard(dst + GUARD + cap, GUARD + 64));
    free(src);
    free(dst);
}

/* Overlapping ranges, both directions, small and streamed: as memmove. */
static void
test_overlap(void **state)
{
    (void)state;
    const size_t shifts[] = {1, 15, 16, 63, 64, 65, 4096};
    const size_t lens[] = {1, 17, 64, 300, 4097, LLMDD__COPY_NT_BATCH + 33};
    const size_t cap = LLMDD__COPY_NT_BATCH + 33 + 4096 + 64;
    uint8_t *buf = guarded(cap), *ref = guarded(cap);

    for (size_t si = 0; si < sizeof(shifts) / sizeof(size_t); si++) {
        for (size_t li = 0; li < sizeof(lens) / sizeof(size_t); li++) {
            for (int dir = 0; dir < 2; dir++) {
                size_t s = shifts[si], n = lens[li];
                size_t so = dir ? s : 0, doff = dir ? 0 : s;
                fill(buf + GUARD, n + s, (uint32_t)(si * 16 + li));
                memcpy(ref + GUARD, buf + GUARD, n + s);
                llmdd__copy_batch b;
                llmdd__copy_begin(&b, UINT64_MAX, 0);
                llmdd__copy(&b, buf + GUARD + doff, buf + GUARD + so, n);
                llmdd__copy_end(&b);
                memmove(ref + GUARD + doff, ref + GUARD + so, n);
                assert_memory_equal(buf, ref, GUARD + n + s + GUARD);
                memset(buf, GUARD_BYTE, GUARD + cap + GUARD + 64);
                memset(ref, GUARD_BYTE, GUARD + cap + GUARD + 64);
            }
        }
    }
    /* A streamed run, then an overlapping one that reads what it wrote:
     * runs apply in order even when a streamed one is held back. */
    const size_t n = 65536;
    fill(buf + GUARD, n, 11);
    memcpy(ref, buf, GUARD + cap + GUARD + 64);
    llmdd__copy_batch ob;
    llmdd__copy_begin(&ob, UINT64_MAX, 0);
    llmdd__copy(&ob, buf + GUARD + n, buf + GUARD, n);
    llmdd__copy(&ob, buf + GUARD + n + 7, buf + GUARD + n, n);
    llmdd__copy(&ob, buf + GUARD + 3 * n, buf + GUARD + n + 7, n);
    llmdd__copy_end(&ob);
    memcpy(ref + GUARD + n, ref + GUARD, n);
    memmove(ref + GUARD + n + 7, ref + GUARD + n, n);
    memcpy(ref + GUARD + 3 * n, ref + GUARD + n + 7, n);
    assert_memory_equal(buf, ref, GUARD + cap + GUARD + 64);
    memset(buf, GUARD_BYTE, GUARD + cap + GUARD + 64);

    /* The very same range: nothing changes. */
    fill(buf + GUARD, 4096, 9);
    memcpy(ref, buf, GUARD + 4096 + GUARD);
    llmdd__copy_batch b;
    llmdd__copy_begin(&b, UINT64_MAX, 0);
    llmdd__copy(&b, buf + GUARD, buf + GUARD, 4096);
    llmdd__copy_end(&b);
    assert_memory_equal(buf, ref, GUARD + 4096 + GUARD);
    free(buf);
    free(ref);
}

/*
 * 2-D copies: elements short and long, strided on either side, in batches
 * that stream and that do not, against per-element memmove in order; one
 * whose extents overlap (elements moved within one buffer), and one that
 * reads what a held-back streamed run of the batch wrote.
 */
static void
test_copy_2d(void **state)
{
    (void)state;
    const struct {
        size_t len, count, ss, ds;
    } cases[] = {{1, 1, 0, 0},        {100, 50, 300, 100},
                 {256, 64, 512, 256}, {511, 9, 511, 1024},
                 {512, 9, 1024, 512}, {4096, 5, 8192, 4096},
                 {64, 40, 64, 64},    {256, 100, 512, 320},
                 {128, 33, 200, 128}, {2112, 7, 4224, 2112}};
    const size_t cap = 1u << 16;
    uint8_t *src = malloc(cap), *dst = guarded(cap), *ref = guarded(cap);

    assert_non_null(src);
    fill(src, cap, 21);
    /* Destinations off a line and on one (whole-line elements stream). */
    for (size_t i = 0; i < 2 * sizeof(cases) / sizeof(cases[0]); i++) {
        size_t c = i / 2, o = i % 2 ? 0 : 3;
        for (int stream = 0; stream < 2; stream++) {
            llmdd__copy_batch b;
            llmdd__copy_begin(&b, stream ? UINT64_MAX : 0, 0);
            llmdd__copy_2d(&b, dst + GUARD + o, cases[c].ds, src + 5,
                           cases[c].ss, cases[c].len, cases[c].count);
            llmdd__copy_end(&b);
            for (size_t k = 0; k < cases[c].count; k++)
                memmove(ref + GUARD + o + k * cases[c].ds,
                        src + 5 + k * cases[c].ss, cases[c].len);
            assert_memory_equal(dst, ref, GUARD + cap + GUARD + 64);
            memset(dst, GUARD_BYTE, GUARD + cap + GUARD + 64);
            memset(ref, GUARD_BYTE, GUARD + cap + GUARD + 64);
        }
    }
    /* Within one buffer: element k from 100 + 48k to 64 + 32k, in order,
     * each reading bytes an earlier element may have written. */
    fill(dst + GUARD, cap, 4);
    memcpy(ref, dst, GUARD + cap + GUARD + 64);
    llmdd__copy_batch ob;
    llmdd__copy_begin(&ob, 0, 0);
    llmdd__copy_2d(&ob, dst + GUARD + 64, 32, dst + GUARD + 100, 48, 40, 100);
    llmdd__copy_end(&ob);
    for (size_t k = 0; k < 100; k++)
        memmove(ref + GUARD + 64 + 32 * k, ref + GUARD + 100 + 48 * k, 40);
    assert_memory_equal(dst, ref, GUARD + cap + GUARD + 64);
    /* A streamed run held back, then short elements reading it. */
    fill(dst + GUARD, cap, 8);
    memcpy(ref, dst, GUARD + cap + GUARD + 64);
    llmdd__copy_begin(&ob, UINT64_MAX, 0);
    llmdd__copy(&ob, dst + GUARD + 8192, dst + GUARD, 8192);
    llmdd__copy_2d(&ob, dst + GUARD + 32768, 64, dst + GUARD + 8192, 128, 64,
                   64);
    llmdd__copy_end(&ob);
    memcpy(ref + GUARD + 8192, ref + GUARD, 8192);
    for (size_t k = 0; k < 64; k++)
        memcpy(ref + GUARD + 32768 + 64 * k, ref + GUARD + 8192 + 128 * k, 64);
    assert_memory_equal(dst, ref, GUARD + cap + GUARD + 64);
    free(src);
    free(dst);
    free(ref);
}

/* Adjacent, not overlapping: streamed like any other pair of ranges. */
static void
test_adjacent_streams(void **state)
{
    (void)state;
    const size_t n = 1u << 20;
    uint8_t *buf = guarded(2 * n), *want = malloc(n);
    llmdd__copy_batch b;

    assert_non_null(want);
    fill(buf + GUARD + n, n, 5);
    memcpy(want, buf + GUARD + n, n);
    llmdd__copy_begin(&b, UINT64_MAX, 0);
    llmdd__copy(&b, buf + GUARD, buf + GUARD + n, n);
    llmdd__copy_end(&b);
    assert_int_equal(b.streamed, llmdd__copy_isa() != LLMDD__COPY_PORTABLE);
    assert_memory_equal(buf + GUARD, want, n);
    assert_memory_equal(buf + GUARD + n, want, n); /* the source, unchanged */
    assert_true(is_guard(buf, GUARD));
    assert_true(is_guard(buf + GUARD + 2 * n, GUARD + 64));
    free(buf);
    free(want);
}

int
main(int argc, char **argv)
{
    th_test_filter(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_alignments),
        cmocka_unit_test(test_batch_thresholds),
        cmocka_unit_test(test_batch_runs),
        cmocka_unit_test(test_overlap),
        cmocka_unit_test(test_converge),
        cmocka_unit_test(test_copy_2d),
        cmocka_unit_test(test_adjacent_streams),
    };
    return cmocka_run_group_tests_name("copy_engine", tests, NULL, NULL);
}
