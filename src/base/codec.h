/*
 * The one byte codec of every protocol (the control plane, the stream data
 * plane, shm's socket, ucx's exchange and active messages): a bounded
 * little-endian writer and reader. A write past the buffer's capacity or a
 * read past the bytes present sets `err` and does nothing else (reads give
 * zeros), so an encoder or decoder checks once, at its end: llmdd__wdone
 * gives the length written or 0, llmdd__rdone whether every byte was read
 * and no read fell short. Every length read from the wire is still checked
 * against a limit by its caller before it sizes anything.
 *
 * Pure functions over their arguments; thread-safe.
 */
#ifndef LLMDD_BASE_CODEC_H
#define LLMDD_BASE_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <llmdd/llmdd.h>

typedef struct {
    uint8_t *p;
    size_t len, cap;
    bool err;
} llmdd__wbuf;

typedef struct {
    const uint8_t *p;
    size_t len, pos;
    bool err;
} llmdd__rbuf;

#define LLMDD__WBUF(buf, n) ((llmdd__wbuf){.p = (buf), .cap = (n)})
#define LLMDD__RBUF(buf, n) ((llmdd__rbuf){.p = (buf), .len = (n)})

/* The encoded size of a desc (llmdd__put_desc) with LLMDD_MAX_DIMS dims. */
#define LLMDD__DESC_MAX (20 + 8 * LLMDD_MAX_DIMS)

static inline void
llmdd__put_bytes(llmdd__wbuf *w, const void *src, size_t n)
{
    if (w->err || w->cap - w->len < n) {
        w->err = true;
        return;
    }
    if (n > 0)
        memcpy(w->p + w->len, src, n);
    w->len += n;
}

/* The low n bytes of v, least significant first. */
static inline void
llmdd__put_le(llmdd__wbuf *w, uint64_t v, size_t n)
{
    uint8_t b[8];

    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    llmdd__put_bytes(w, b, n);
}

static inline void
llmdd__put_u8(llmdd__wbuf *w, uint8_t v)
{
    llmdd__put_le(w, v, 1);
}

static inline void
llmdd__put_u16(llmdd__wbuf *w, uint16_t v)
{
    llmdd__put_le(w, v, 2);
}

static inline void
llmdd__put_u32(llmdd__wbuf *w, uint32_t v)
{
    llmdd__put_le(w, v, 4);
}

static inline void
llmdd__put_u64(llmdd__wbuf *w, uint64_t v)
{
    llmdd__put_le(w, v, 8);
}

static inline void
llmdd__put_i64(llmdd__wbuf *w, int64_t v)
{
    llmdd__put_le(w, (uint64_t)v, 8);
}

/* The length written, or 0 when anything did not fit. */
static inline size_t
llmdd__wdone(const llmdd__wbuf *w)
{
    return w->err ? 0 : w->len;
}

/* The next n bytes in place, or NULL (and err) when fewer are left. */
static inline const uint8_t *
llmdd__get_span(llmdd__rbuf *r, size_t n)
{
    if (r->err || r->len - r->pos < n) {
        r->err = true;
        return NULL;
    }
    r->pos += n;
    return r->p + r->pos - n;
}

/* Copies the next n bytes to dst; zeros when fewer are left. */
static inline void
llmdd__get_bytes(llmdd__rbuf *r, void *dst, size_t n)
{
    const uint8_t *b = llmdd__get_span(r, n);

    if (b == NULL)
        memset(dst, 0, n);
    else if (n > 0)
        memcpy(dst, b, n);
}

static inline uint64_t
llmdd__get_le(llmdd__rbuf *r, size_t n)
{
    const uint8_t *b = llmdd__get_span(r, n);
    uint64_t v = 0;

    for (size_t i = 0; b != NULL && i < n; i++)
        v |= (uint64_t)b[i] << (8 * i);
    return v;
}

static inline uint8_t
llmdd__get_u8(llmdd__rbuf *r)
{
    return (uint8_t)llmdd__get_le(r, 1);
}

static inline uint16_t
llmdd__get_u16(llmdd__rbuf *r)
{
    return (uint16_t)llmdd__get_le(r, 2);
}

static inline uint32_t
llmdd__get_u32(llmdd__rbuf *r)
{
    return (uint32_t)llmdd__get_le(r, 4);
}

static inline uint64_t
llmdd__get_u64(llmdd__rbuf *r)
{
    return llmdd__get_le(r, 8);
}

static inline int64_t
llmdd__get_i64(llmdd__rbuf *r)
{
    return (int64_t)llmdd__get_le(r, 8);
}

/* Bytes not read yet; 0 after a short read. */
static inline size_t
llmdd__get_left(const llmdd__rbuf *r)
{
    return r->err ? 0 : r->len - r->pos;
}

/* 0 when every byte was read and none was missing: trailing bytes are an
 * error, so each message has exactly one encoding. */
static inline int
llmdd__rdone(const llmdd__rbuf *r)
{
    return r->err || r->pos != r->len ? -1 : 0;
}

/* A name: a u8 length, at most max (< 256), and that many bytes. */
void llmdd__put_name(llmdd__wbuf *w, const char *s, size_t max);
/* Reads a name into out (max + 1 bytes, NUL-terminated; "" on error); its
 * bytes must be printable ASCII without spaces. */
void llmdd__get_name(llmdd__rbuf *r, char *out, size_t max);

/*
 * A cache description: placement, tensor count, data type and dim count
 * (u32 each), then each dim (u64), then (protocol version 3) the batch
 * dimension (u32). The reader checks what it must to stay in bounds
 * (1..LLMDD_MAX_DIMS dims) and that the batch dimension names one of the
 * dims; whether the desc makes sense is llmdd__desc_check's, in the core.
 */
void llmdd__put_desc(llmdd__wbuf *w, const llmdd_cache_desc *d,
                     uint32_t batch_dim);
void llmdd__get_desc(llmdd__rbuf *r, llmdd_cache_desc *out,
                     uint32_t *batch_dim);

#endif
