/*
 * The copy engine: every same-host byte move of cache data (the loop
 * transport, shm's copy through a peer's mapped memfd, llmdd_copy_kv_cache
 * and llmdd_copy_kv_blocks) goes through it.
 *
 * A transfer's runs form one batch. The batch's total size, not each run's,
 * and the size of the cache it writes into pick the kind of store: a batch
 * that fits in cache is copied with memcpy (cached stores, so the
 * destination is warm for whoever reads it next); a larger one, or one of
 * 1 MiB or more into a cache far larger than L3, streams its runs with
 * non-temporal stores, which skip the read for ownership of every
 * destination line and leave the caches to the source. llmdd__copy_end
 * fences those stores, so once it returns the bytes are visible to every
 * other core and process: a transfer is reported complete, or a
 * notification sent, only after it.
 *
 * Thread-safe: a batch lives on its caller's stack; the CPU is probed once.
 */
#ifndef LLMDD_CORE_COPY_H
#define LLMDD_CORE_COPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/*
 * Batches of at least this many bytes use non-temporal stores. Such a batch
 * pulls twice its size through the caches (source and destination), half
 * of a Zen 5 CCD's 32 MiB L3 and more than a core's share on most servers,
 * so cached stores would only evict the lines they write. Below it the
 * bytes may well still be cached, and there memcpy measured up to twice as
 * fast as streaming (BENCHMARKS.md, "Copy engine"). The L3 size the CPU
 * reports is not used: virtual machines report nonsense (508 MiB on the
 * bench host).
 */
#define LLMDD__COPY_NT_BATCH (8u << 20)
/*
 * A smaller batch, from LLMDD__COPY_NT_SPAN_BATCH up, streams too when the
 * memory it writes into (the destination cache, dst_span) is at least
 * LLMDD__COPY_NT_SPAN, twice that L3: a serving engine's KV cache is
 * gigabytes, and a slot it writes is seldom still cached. Pulls of 1-4 MiB
 * into a 64 MiB cache went from 0.69-0.82x to 0.85-1.06x the best copy;
 * into a 4 MiB cache, where the slots stay cached, streaming measured
 * 0.73-0.83x memcpy, so small caches keep memcpy (BENCHMARKS.md, "Smaller
 * batches into large caches").
 */
#define LLMDD__COPY_NT_SPAN (64ull << 20)
#define LLMDD__COPY_NT_SPAN_BATCH (1u << 20)
/*
 * Runs shorter than this are copied with memcpy even in a streamed batch:
 * partial lines written non-temporally cost a full memory transaction each,
 * and short runs spread over the source (a head slice of 256-byte elements)
 * load too slowly to keep the streamed stores busy: such a slice moved at
 * 0.20x a contiguous pull with 256-byte runs streamed one call each,
 * 0.28-0.34x with memcpy (BENCHMARKS.md, KV layouts). llmdd__copy_2d's
 * elements of whole lines into aligned lines are the exception: it streams
 * them in one loop that prefetches the source ahead, which beats memcpy.
 */
#define LLMDD__COPY_NT_MIN_RUN 512u

/* Instruction sets for the streamed copy; the best one present is used. */
enum {
    LLMDD__COPY_PORTABLE, /* memcpy only: not x86-64 */
    LLMDD__COPY_SSE2,
    LLMDD__COPY_AVX2,
};

typedef struct {
    bool stream;   /* this batch streams its long runs */
    bool streamed; /* non-temporal stores were issued: fence at the end */
    /* A streamed run waits here until the next one is known, so that the
     * next run's source is prefetched while this one copies. */
    void *dst;
    const void *src;
    size_t len;
} llmdd__copy_batch;

/* Starts a batch of `total` bytes in all, written into memory (a cache)
 * of dst_span bytes. */
void llmdd__copy_begin(llmdd__copy_batch *b, uint64_t total,
                       uint64_t dst_span);
/*
 * Copies len bytes. The ranges may overlap (memmove semantics); overlapping
 * runs are always copied with memmove. Runs apply in order, but a run may
 * land only at the next call or at llmdd__copy_end: callers read nothing a
 * batch writes before its end.
 */
void llmdd__copy(llmdd__copy_batch *b, void *dst, const void *src, size_t len);
/*
 * `count` elements of len bytes, the k-th from src + k * src_stride to
 * dst + k * dst_stride, as that many llmdd__copy calls, in order. Elements
 * that overlap nothing go in one loop: in a streamed batch, those of
 * LLMDD__COPY_NT_MIN_RUN bytes or more and those of whole lines into
 * line-aligned destinations stream (no partial line is written), other
 * short ones are memcpy'd.
 */
void llmdd__copy_2d(llmdd__copy_batch *b, uint8_t *dst, size_t dst_stride,
                    const uint8_t *src, size_t src_stride, size_t len,
                    size_t count);
/* Ends the batch: its bytes are visible everywhere once this returns. */
void llmdd__copy_end(llmdd__copy_batch *b);

/* The best instruction set this CPU has (probed once). */
int llmdd__copy_isa(void);
/*
 * A non-temporal copy of non-overlapping ranges with the given instruction
 * set (at most llmdd__copy_isa()), without the fence. For the tests.
 */
void llmdd__copy_stream(void *dst, const void *src, size_t len, int isa);

/*
 * len bytes, whole lines (len a multiple of 64, dst 64-byte aligned), with
 * non-temporal stores as two streams of lines, one from each end, that
 * meet in the middle (llmdd__copy_2d's elements with skipped bytes after
 * them); isa as for llmdd__copy_stream; not fenced.
 */
void llmdd__copy_converge(void *dst, const void *src, size_t len, int isa);

#endif
