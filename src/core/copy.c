/*
 * The copy engine (copy.h). The streamed copies write the unaligned head of
 * the destination with memcpy, then whole 64-byte lines with aligned
 * non-temporal stores from unaligned loads, then the tail with memcpy: a
 * non-temporal store must be aligned, and full lines let the write-combining
 * buffers go out as one transaction each.
 *
 * The AVX2 copy is compiled with a target attribute and chosen at run time,
 * so the library builds without -mavx2 and runs on any x86-64 (SSE2 is part
 * of the architecture). Other CPUs use memcpy for everything.
 */
#include "core/copy.h"

#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <immintrin.h>
#endif

#define COPY_LINE 64u

#if defined(__x86_64__)
static void
copy_stream_sse2(uint8_t *d, const uint8_t *s, size_t n)
{
    for (; n >= 2 * COPY_LINE; n -= 2 * COPY_LINE) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        __m128i f = _mm_loadu_si128((const __m128i *)(s + 64));
        __m128i g = _mm_loadu_si128((const __m128i *)(s + 80));
        __m128i h = _mm_loadu_si128((const __m128i *)(s + 96));
        __m128i i = _mm_loadu_si128((const __m128i *)(s + 112));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        _mm_stream_si128((__m128i *)(d + 64), f);
        _mm_stream_si128((__m128i *)(d + 80), g);
        _mm_stream_si128((__m128i *)(d + 96), h);
        _mm_stream_si128((__m128i *)(d + 112), i);
        s += 2 * COPY_LINE;
        d += 2 * COPY_LINE;
    }
    if (n >= COPY_LINE) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
}

__attribute__((target("avx2"))) static void
copy_stream_avx2(uint8_t *d, const uint8_t *s, size_t n)
{
    for (; n >= 2 * COPY_LINE; n -= 2 * COPY_LINE) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
        s += 2 * COPY_LINE;
        d += 2 * COPY_LINE;
    }
    if (n >= COPY_LINE) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
    }
    /* No vzeroupper needed by hand: the compiler adds it on the way out of
     * a function that used the upper halves. */
}

/*
 * n bytes (whole lines, d line-aligned) as two streams of lines, one from
 * each end, that meet in the middle (copy_2d_stream says why).
 */
static void
copy_converge_sse2(uint8_t *d, const uint8_t *s, size_t n)
{
    size_t lo = 0, hi = n;

    for (; hi - lo >= 2 * COPY_LINE; lo += COPY_LINE) {
        hi -= COPY_LINE;
        __m128i a = _mm_loadu_si128((const __m128i *)(s + lo));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + lo + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + lo + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + lo + 48));
        __m128i f = _mm_loadu_si128((const __m128i *)(s + hi));
        __m128i g = _mm_loadu_si128((const __m128i *)(s + hi + 16));
        __m128i h = _mm_loadu_si128((const __m128i *)(s + hi + 32));
        __m128i i = _mm_loadu_si128((const __m128i *)(s + hi + 48));
        _mm_stream_si128((__m128i *)(d + lo), a);
        _mm_stream_si128((__m128i *)(d + lo + 16), b);
        _mm_stream_si128((__m128i *)(d + lo + 32), c);
        _mm_stream_si128((__m128i *)(d + lo + 48), e);
        _mm_stream_si128((__m128i *)(d + hi), f);
        _mm_stream_si128((__m128i *)(d + hi + 16), g);
        _mm_stream_si128((__m128i *)(d + hi + 32), h);
        _mm_stream_si128((__m128i *)(d + hi + 48), i);
    }
    if (hi > lo)
        copy_stream_sse2(d + lo, s + lo, hi - lo);
}

__attribute__((target("avx2"))) static void
copy_converge_avx2(uint8_t *d, const uint8_t *s, size_t n)
{
    size_t lo = 0, hi = n;

    for (; hi - lo >= 2 * COPY_LINE; lo += COPY_LINE) {
        hi -= COPY_LINE;
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + lo));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + lo + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + hi));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + hi + 32));
        _mm256_stream_si256((__m256i *)(d + lo), a);
        _mm256_stream_si256((__m256i *)(d + lo + 32), b);
        _mm256_stream_si256((__m256i *)(d + hi), c);
        _mm256_stream_si256((__m256i *)(d + hi + 32), e);
    }
    if (hi > lo)
        copy_stream_avx2(d + lo, s + lo, hi - lo);
}
#endif

int
llmdd__copy_isa(void)
{
#if defined(__x86_64__)
    static int isa = -1; /* racing first callers store the same value */
    int v = __atomic_load_n(&isa, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") ? LLMDD__COPY_AVX2
                                           : LLMDD__COPY_SSE2;
        __atomic_store_n(&isa, v, __ATOMIC_RELAXED);
    }
    return v;
#else
    return LLMDD__COPY_PORTABLE;
#endif
}

void
llmdd__copy_stream(void *dst, const void *src, size_t len, int isa)
{
    uint8_t *d = dst;
    const uint8_t *s = src;

    if (isa == LLMDD__COPY_PORTABLE || len < COPY_LINE) {
        memcpy(d, s, len);
        return;
    }
    size_t head =
        (COPY_LINE - ((uintptr_t)d & (COPY_LINE - 1))) & (COPY_LINE - 1);
    memcpy(d, s, head);
    d += head;
    s += head;
    len -= head;
    size_t body = len & ~(size_t)(COPY_LINE - 1);
#if defined(__x86_64__)
    if (isa == LLMDD__COPY_AVX2)
        copy_stream_avx2(d, s, body);
    else
        copy_stream_sse2(d, s, body);
#else
    memcpy(d, s, body);
#endif
    memcpy(d + body, s + body, len - body);
}

void
llmdd__copy_converge(void *dst, const void *src, size_t len, int isa)
{
#if defined(__x86_64__)
    if (isa == LLMDD__COPY_AVX2) {
        copy_converge_avx2(dst, src, len);
        return;
    }
    if (isa == LLMDD__COPY_SSE2) {
        copy_converge_sse2(dst, src, len);
        return;
    }
#endif
    memcpy(dst, src, len);
}

/*
 * The hardware prefetchers stop at page boundaries, and scattered runs (a
 * gather of 16 KiB blocks) start cold on every page: touching one line of
 * each of the first pages of the next run while this one copies measured
 * 1.2x on such a gather (BENCHMARKS.md, "Copy engine"). A long run needs it
 * only for its start.
 */
#define COPY_PREFETCH_PAGES 16u
#define COPY_PAGE 4096u

static void
copy_prefetch(const void *src, size_t len)
{
    const uint8_t *s = src;
    size_t n = len < COPY_PREFETCH_PAGES * COPY_PAGE
                   ? len
                   : COPY_PREFETCH_PAGES * COPY_PAGE;

    for (size_t off = 0; off < n; off += COPY_PAGE)
        __builtin_prefetch(s + off);
}

static void
copy_flush(llmdd__copy_batch *b)
{
    if (b->len > 0) {
        llmdd__copy_stream(b->dst, b->src, b->len, llmdd__copy_isa());
        b->streamed = true;
        b->len = 0;
    }
}

void
llmdd__copy_begin(llmdd__copy_batch *b, uint64_t total, uint64_t dst_span)
{
    b->stream = (total >= LLMDD__COPY_NT_BATCH ||
                 (total >= LLMDD__COPY_NT_SPAN_BATCH &&
                  dst_span >= LLMDD__COPY_NT_SPAN)) &&
                llmdd__copy_isa() != LLMDD__COPY_PORTABLE;
    b->streamed = false;
    b->len = 0;
}

void
llmdd__copy(llmdd__copy_batch *b, void *dst, const void *src, size_t len)
{
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;

    /* Copies within one cache may overlap: only memmove is right then. The
     * pending run goes first, since runs apply in order. */
    if (d < s + len && s < d + len) {
        copy_flush(b);
        memmove(dst, src, len);
        return;
    }
    if (!b->stream || len < LLMDD__COPY_NT_MIN_RUN) {
        copy_flush(b);
        memcpy(dst, src, len);
        return;
    }
    copy_prefetch(src, len);
    copy_flush(b);
    b->dst = dst;
    b->src = src;
    b->len = len;
}

/*
 * Elements of whole lines with line-aligned destinations stream like long
 * runs: no partial line is written. Their sources are spread (a head slice
 * reads one element in two or more), where the hardware prefetchers start
 * late, so the lines of the element COPY_2D_AHEAD bytes on are prefetched
 * while this one copies; from COPY_2D_PF_ALL up, the next element's pages
 * are, as for a run (the prefetchers follow within a page). In a standalone
 * program (two threads, memfd memory) 256-byte elements went from
 * 0.40-0.47x a contiguous streamed copy with memcpy element by element to
 * 0.59-0.73x with this; 4 KiB elements move at 0.84-0.86x (BENCHMARKS.md,
 * KV layouts).
 */
#define COPY_2D_AHEAD 2048u
#define COPY_2D_PF_ALL 1024u
/*
 * An element of whole lines from COPY_2D_CONVERGE up with bytes after it
 * that the copy skips (a head slice's element, the other heads' next to
 * it) is copied from both ends inwards. The hardware prefetchers run a
 * stream on past its end, into the neighbour's lines, which nobody reads:
 * with the neighbours' pages unmapped, every other 4 KiB element moved at
 * 0.86-1.02x a contiguous copy instead of 0.72-0.82x. Two streams that meet
 * mid-element run on into bytes that are read anyway: a head slice of
 * 4 KiB elements went from 0.70-0.80x (median 0.71) to 0.71-0.85x (0.79)
 * of a contiguous pull over shm, 10 alternated runs (BENCHMARKS.md, KV
 * layouts).
 */
#define COPY_2D_CONVERGE 2048u

static void
copy_2d_stream(uint8_t *dst, size_t dst_stride, const uint8_t *src,
               size_t src_stride, size_t len, size_t count, bool lines, int isa)
{
    size_t ahead = len < COPY_2D_AHEAD ? COPY_2D_AHEAD / len : 1;
    bool converge = lines && len >= COPY_2D_CONVERGE && src_stride > len;

    for (size_t k = 0; k < count; k++) {
        if (k + ahead < count) {
            const uint8_t *p = src + (k + ahead) * src_stride;
            if (len < COPY_2D_PF_ALL) {
                for (size_t o = 0; o < len; o += COPY_LINE)
                    __builtin_prefetch(p + o);
            } else {
                copy_prefetch(p, len);
                if (converge)
                    __builtin_prefetch(p + len - COPY_LINE);
            }
        }
        if (converge)
            llmdd__copy_converge(dst + k * dst_stride, src + k * src_stride,
                                 len, isa);
        else
            llmdd__copy_stream(dst + k * dst_stride, src + k * src_stride, len,
                               isa);
    }
}

void
llmdd__copy_2d(llmdd__copy_batch *b, uint8_t *dst, size_t dst_stride,
               const uint8_t *src, size_t src_stride, size_t len, size_t count)
{
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    uintptr_t dend = d + (count - 1) * dst_stride + len;
    uintptr_t send = s + (count - 1) * src_stride + len;
    bool apart = dend <= s || send <= d;
    bool lines = len % COPY_LINE == 0 && d % COPY_LINE == 0 &&
                 dst_stride % COPY_LINE == 0;

    if (count > 1 && apart && b->stream &&
        (len >= LLMDD__COPY_NT_MIN_RUN || (len > 0 && lines))) {
        copy_flush(b);
        copy_2d_stream(dst, dst_stride, src, src_stride, len, count, lines,
                       llmdd__copy_isa());
        b->streamed = true;
        return;
    }
    if (count > 1 && apart) {
        copy_flush(b);
        for (size_t k = 0; k < count; k++)
            memcpy(dst + k * dst_stride, src + k * src_stride, len);
        return;
    }
    for (size_t k = 0; k < count; k++)
        llmdd__copy(b, dst + k * dst_stride, src + k * src_stride, len);
}

void
llmdd__copy_end(llmdd__copy_batch *b)
{
    copy_flush(b);
#if defined(__x86_64__)
    /* Non-temporal stores are weakly ordered: without the fence a flag or
     * message written after the copy could be seen before its bytes. */
    if (b->streamed)
        _mm_sfence();
#endif
}
