/*
 * The deterministic fill, its checksum and the verification of what
 * arrived; see common.h.
 */
#include "common.h"

#include <endian.h>
#include <stdlib.h>
#include <string.h>

/* ---- The deterministic fill and its checksum. ---- */

static inline uint64_t
cm_mix(uint64_t x)
{
    /* The splitmix64 finalizer: every input bit moves every output bit. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static inline uint64_t
cm_tensor_key(uint32_t seed, uint32_t t)
{
    return cm_mix(((uint64_t)seed << 32 | t) ^ 0x6c6c6d6464ull);
}

uint64_t
cli_fill_word(uint32_t seed, uint32_t t, uint64_t w)
{
    return cm_mix(cm_tensor_key(seed, t) + w * 0x9e3779b97f4a7c15ull);
}

uint32_t
cli_cache_seed(uint32_t seed, int64_t cache_id)
{
    return seed + (uint32_t)cache_id * 0x9e3779b9u;
}

void
cli_fill(void *dst, uint64_t len, uint32_t seed, uint32_t t, uint64_t off)
{
    uint8_t *p = dst;
    uint64_t key = cm_tensor_key(seed, t);

    /* Unaligned head and tail go byte by byte; the middle a word a step. */
    while (len > 0 && (off & 7) != 0) {
        uint64_t w = cm_mix(key + (off >> 3) * 0x9e3779b97f4a7c15ull);
        *p++ = (uint8_t)(w >> (8 * (off & 7)));
        off++;
        len--;
    }
    uint64_t w = off >> 3;
    for (; len >= 8; len -= 8, p += 8, w++) {
        uint64_t v = htole64(cm_mix(key + w * 0x9e3779b97f4a7c15ull));
        memcpy(p, &v, 8);
    }
    if (len > 0) {
        uint64_t v = cm_mix(key + w * 0x9e3779b97f4a7c15ull);
        for (uint64_t i = 0; i < len; i++)
            p[i] = (uint8_t)(v >> (8 * i));
    }
}

void
cli_fill_cache(const llmdd_cache *c, uint32_t seed)
{
    uint64_t size = cli_desc_tensor_size(&c->desc);

    for (uint32_t t = 0; t < c->desc.num_tensors; t++)
        cli_fill((void *)(uintptr_t)c->tensor_addrs[t], size, seed, t, 0);
}

#define CM_P1 0x9e3779b185ebca87ull
#define CM_P2 0xc2b2ae3d27d4eb4full
#define CM_P3 0x165667b19e3779f9ull

static inline uint64_t
cm_rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t
cm_step(uint64_t h, uint64_t v)
{
    return cm_rotl(h ^ (v * CM_P2), 31) * CM_P1 + CM_P3;
}

void
cli_hash_init(cli_hash *x)
{
    memset(x, 0, sizeof(*x));
    x->h = CM_P3;
}

void
cli_hash_update(cli_hash *x, const void *p, size_t len)
{
    const uint8_t *b = p;
    uint64_t v;

    x->n += len;
    if (x->ntail > 0) {
        while (len > 0 && x->ntail < 8) {
            x->tail[x->ntail++] = *b++;
            len--;
        }
        if (x->ntail < 8)
            return;
        memcpy(&v, x->tail, 8);
        x->h = cm_step(x->h, le64toh(v));
        x->ntail = 0;
    }
    uint64_t h = x->h;
    for (; len >= 8; len -= 8, b += 8) {
        memcpy(&v, b, 8);
        h = cm_step(h, le64toh(v));
    }
    x->h = h;
    memcpy(x->tail, b, len);
    x->ntail = (unsigned)len;
}

uint64_t
cli_hash_final(const cli_hash *x)
{
    uint64_t h = x->h;

    for (unsigned i = 0; i < x->ntail; i++)
        h = cm_rotl(h ^ (x->tail[i] * CM_P3), 11) * CM_P1;
    return cm_mix(h ^ x->n);
}

#define CM_CHUNK (64u << 10)

/* Finds the first byte of a segment that differs from its pattern. */
static bool
cm_find_bad(const cli_seg *s, uint32_t seed, uint8_t *scratch,
            uint64_t *off_out)
{
    for (uint64_t o = 0; o < s->len; o += CM_CHUNK) {
        uint64_t n = s->len - o < CM_CHUNK ? s->len - o : CM_CHUNK;
        cli_fill(scratch, n, seed, s->src_tensor, s->src_off + o);
        if (memcmp(scratch, s->local + o, n) != 0) {
            for (uint64_t i = 0; i < n; i++) {
                if (scratch[i] != s->local[o + i]) {
                    *off_out = o + i;
                    return true;
                }
            }
        }
    }
    return false;
}

void
cli_verify(const cli_seg *segs, size_t n, uint32_t src_seed, cli_verdict *v)
{
    uint8_t *scratch = malloc(CM_CHUNK);
    cli_hash got, want;

    memset(v, 0, sizeof(*v));
    if (scratch == NULL)
        return;
    cli_hash_init(&got);
    cli_hash_init(&want);
    for (size_t i = 0; i < n; i++) {
        const cli_seg *s = &segs[i];
        cli_hash_update(&got, s->local, s->len);
        for (uint64_t o = 0; o < s->len; o += CM_CHUNK) {
            uint64_t k = s->len - o < CM_CHUNK ? s->len - o : CM_CHUNK;
            cli_fill(scratch, k, src_seed, s->src_tensor, s->src_off + o);
            cli_hash_update(&want, scratch, k);
        }
        v->bytes += s->len;
    }
    v->got = cli_hash_final(&got);
    v->want = cli_hash_final(&want);
    v->ok = v->got == v->want;
    if (!v->ok) {
        /* Only a failure pays for locating the damage. */
        for (size_t i = 0; i < n; i++) {
            if (cm_find_bad(&segs[i], src_seed, scratch, &v->bad_off)) {
                v->bad_seg = i;
                break;
            }
        }
    }
    free(scratch);
}

bool
cli_segs_slot(const llmdd_cache *local, uint32_t lfirst, uint32_t sfirst,
              uint32_t count, uint64_t loff, uint64_t soff, uint64_t len,
              cli_seg **out, size_t *n)
{
    cli_seg *s = calloc(count > 0 ? count : 1, sizeof(*s));

    if (s == NULL)
        return false;
    for (uint32_t i = 0; i < count; i++) {
        s[i].local =
            (const uint8_t *)(uintptr_t)local->tensor_addrs[lfirst + i] + loff;
        s[i].src_tensor = sfirst + i;
        s[i].src_off = soff;
        s[i].len = len;
    }
    *out = s;
    *n = count;
    return true;
}

bool
cli_segs_blocks(const llmdd_cache *local, const uint64_t *src,
                const uint64_t *dst, size_t nblocks, cli_seg **out, size_t *n)
{
    uint64_t stride = cli_desc_stride(&local->desc);
    size_t total = (size_t)local->desc.num_tensors * nblocks;
    cli_seg *s = calloc(total > 0 ? total : 1, sizeof(*s));

    if (s == NULL)
        return false;
    for (uint32_t t = 0; t < local->desc.num_tensors; t++) {
        for (size_t k = 0; k < nblocks; k++) {
            cli_seg *g = &s[(size_t)t * nblocks + k];
            g->local = (const uint8_t *)(uintptr_t)local->tensor_addrs[t] +
                       dst[k] * stride;
            g->src_tensor = t;
            g->src_off = src[k] * stride;
            g->len = stride;
        }
    }
    *out = s;
    *n = total;
    return true;
}

static uint64_t
cm_gcd(uint64_t a, uint64_t b)
{
    while (b != 0) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

void
cli_pick_blocks(uint64_t nb, size_t n, uint64_t *src, uint64_t *dst)
{
    uint64_t step = nb * 5 / 8 + 1;

    /* A step coprime with nb visits every block once. */
    while (cm_gcd(step, nb) != 1 || (nb > 2 && step % nb == 1))
        step++;
    for (size_t k = 0; k < n; k++) {
        src[k] = (3 + (uint64_t)k * step) % nb;
        dst[k] = k;
    }
}
