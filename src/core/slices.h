/*
 * KV layouts and slice planning (docs/model.md, "KV layouts"): pure
 * functions over their arguments, thread-safe, no instance. The slice
 * transfer calls check and then plan with these; the unit tests drive them
 * directly against a per-byte reference.
 *
 * A slice becomes 2-D strided runs: `count` elements of `len` bytes, the
 * k-th from src_off + k * src_stride in the tensor the bytes leave to
 * dst_off + k * dst_stride in the one they reach. Runs that continue each
 * other are merged, so with one order on both sides the run count depends
 * on the block tables, not on heads or tokens. The plan is made once per
 * slice and applies to every tensor pair of it.
 */
#ifndef LLMDD_CORE_SLICES_H
#define LLMDD_CORE_SLICES_H

#include <llmdd/llmdd.h>

#include "core/layout.h"

/* Byte strides of one layout, by dim (index llmdd_kv_dim; 0 unused). */
typedef struct {
    uint64_t stride[LLMDD_KV_MAX_DIMS + 1];
    uint64_t block; /* one block: block_size * heads * head_bytes * parts */
} llmdd__layout_geom;

/*
 * The layout rules of docs/model.md against a cache whose block (its
 * shape[0] slot) is block_bytes: LLM_SUCCESS or LLM_PARAM_INVALID. On
 * success fills *g (may be NULL).
 */
llmdd_status llmdd__layout_check(const llmdd_kv_layout *l,
                                 uint64_t block_bytes, llmdd__layout_geom *g);

/* Whether two checked layouts may exchange slices: same total_heads,
 * head_bytes, num_parts, and equal tags when both are non-zero. */
bool llmdd__layout_compatible(const llmdd_kv_layout *a,
                              const llmdd_kv_layout *b);

/* The head range a slice moves: its own, or with {0,0} the heads both
 * layouts hold (possibly empty: *begin == *end). */
void llmdd__slice_heads(const llmdd_kv_slice *s, const llmdd_kv_layout *src,
                        const llmdd_kv_layout *dst, uint32_t *begin,
                        uint32_t *end);

/*
 * One side's table against its layout and cache of num_blocks blocks, for
 * tokens [tb, te) with tb < te: first_token aligned, every token covered,
 * every block of the covering entries in range. LLM_PARAM_INVALID else.
 * Only the entries the tokens use are bounds-checked (ignore the rest).
 */
llmdd_status llmdd__table_check(const llmdd_block_table *t,
                                const llmdd_kv_layout *l, uint64_t num_blocks,
                                uint64_t tb, uint64_t te);

/* Whether the table uses one block twice for tokens [tb, te): one pass for
 * an increasing table, a bitmap for ids below 64 per entry, else a sorted
 * copy; -1 when out of memory, else 0 or 1. */
int llmdd__table_repeats(const llmdd_block_table *t, uint32_t block_size,
                         uint64_t tb, uint64_t te);

/*
 * A growing list of 2-D runs; llmdd__plan_push merges a run into the last
 * one when it continues it.
 */
typedef struct {
    llmdd__run2 *runs;
    size_t n, cap;
} llmdd__plan2;

void llmdd__plan2_free(llmdd__plan2 *p);

/*
 * Appends the runs of one slice, tokens [tb, te) (tb < te) and heads
 * [h0, h1) (h0 < h1), every table and head range already checked against
 * its layout. Offsets are within one tensor. -1 when out of memory.
 */
int llmdd__plan_slice(llmdd__plan2 *p, const llmdd_kv_layout *sl,
                      const llmdd_block_table *st, const llmdd_kv_layout *dl,
                      const llmdd_block_table *dt, uint64_t tb, uint64_t te,
                      uint32_t h0, uint32_t h1);

/*
 * Appends the runs that move bytes [off, off + len) of slot ss of a cache
 * of geometry sg to the same bytes of slot ds of one of geometry dg (byte x
 * of a slot in row-major order of its remaining dims: core/layout.h), the
 * range already checked against both with llmdd__slot_range_check. Rows of
 * equal length on both sides become one 2-D run; rows of different lengths
 * become one 2-D run per piece of a period (their least common multiple).
 * Offsets are within one tensor. -1 when out of memory.
 */
int llmdd__plan_slot(llmdd__plan2 *p, const llmdd__slot_geom *sg, uint64_t ss,
                     const llmdd__slot_geom *dg, uint64_t ds, uint64_t off,
                     uint64_t len);

/* Elements a plan moves (sum of count) and its bytes (sum of len * count). */
uint64_t llmdd__plan2_elems(const llmdd__plan2 *p);
uint64_t llmdd__plan2_bytes(const llmdd__plan2 *p);

/*
 * The plan as 1-D runs (every element its own run, contiguous neighbours
 * merged), the form every transport moves. *out is malloc'd (NULL with 0
 * runs). -1 when out of memory.
 */
int llmdd__plan2_flatten(const llmdd__plan2 *p, llmdd__run **out,
                         size_t *n_out);

#endif
