/*
 * Layout math shared by local copies and remote transfers: tensor sizes,
 * strides, layer-range -> tensor mapping and block-run coalescing.
 * Pure functions over their arguments; thread-safe.
 */
#ifndef LLMDD_CORE_LAYOUT_H
#define LLMDD_CORE_LAYOUT_H

#include <llmdd/llmdd.h>

/* Size in bytes of one element, or 0 when the type has no known size. */
size_t llmdd__dtype_size(llmdd_data_type dt);

/*
 * Validates a desc (docs/model.md's desc rules) and computes the tensor size
 * and the stride of one batch slot / block. Returns LLM_PARAM_INVALID on any
 * violation, including a size that overflows int64.
 */
llmdd_status llmdd__desc_check(const llmdd_cache_desc *desc,
                               uint64_t *tensor_size_out,
                               uint64_t *stride_out);

/*
 * Where the slots of a cache lie (docs/model.md, "The batch dimension"):
 * with batch dimension d, slot b of each tensor is `rows` rows of `row`
 * bytes (the dims after d), the k-th at b * row + k * pitch, where rows is
 * the product of the dims before d and pitch = slots * row. Byte x of the
 * slot, in row-major order of the remaining dims, is at
 * b * row + (x / row) * pitch + x % row. With d = 0 a slot is one row.
 */
typedef struct {
    uint32_t batch_dim;
    uint64_t slots; /* shape[batch_dim] */
    uint64_t row;
    uint64_t rows;
    uint64_t pitch;
} llmdd__slot_geom;

/*
 * The geometry of a desc already checked by llmdd__desc_check with batch
 * dimension batch_dim: LLM_PARAM_INVALID when batch_dim >= num_dims.
 */
llmdd_status llmdd__slot_geom_make(const llmdd_cache_desc *desc,
                                   uint32_t batch_dim, llmdd__slot_geom *g);

/* Bytes of one slot. */
static inline uint64_t
llmdd__slot_bytes(const llmdd__slot_geom *g)
{
    return g->row * g->rows;
}

/*
 * Whether bytes [off, off + len) of a slot (len >= 1) fit it and, with a
 * batch dimension other than 0, are whole rows (off and len multiples of
 * row): LLM_SUCCESS or LLM_PARAM_INVALID.
 */
llmdd_status llmdd__slot_range_check(const llmdd__slot_geom *g, uint64_t off,
                                     uint64_t len);

/* The selected tensors of one side: [first, first + count). */
typedef struct {
    uint32_t first;
    uint32_t count;
} llmdd__tensor_span;

/*
 * Checks the parts of an ext param that need no cache: each range either
 * {-1,-1} or 0 <= first <= second, and tensor_num_per_layer >= 1 when a
 * range is given (with both ranges default tnpl is not used, so a NULL ext
 * and the default ext behave alike on any cache).
 */
llmdd_status llmdd__ext_check_shape(const llmdd_kv_ext_param *ext);

/*
 * Resolves one side's range (the source side when is_src) against its cache
 * of num_tensors tensors. The default range (and a NULL ext) selects every
 * tensor and checks no tnpl: it has no meaning without a range, so a
 * one-tensor cache works with the default ext (tnpl 2). A given range needs
 * tnpl in [1, num_tensors], dividing num_tensors, and second <= max layer.
 */
llmdd_status llmdd__range_resolve(const llmdd_kv_ext_param *ext, bool is_src,
                                  uint32_t num_tensors,
                                  llmdd__tensor_span *span_out);

/* Both sides resolved must pair up: equal widths. */
llmdd_status llmdd__spans_match(llmdd__tensor_span src,
                                llmdd__tensor_span dst);

/* Every block index < num_blocks; n >= 1. */
llmdd_status llmdd__blocks_check(const uint64_t *blocks, size_t n,
                                 uint64_t num_blocks);

/*
 * A run of bytes within each selected tensor, from src_off in the tensor the
 * bytes leave to dst_off in the one they reach: the one run type of local
 * copies and of remote transfers (transport/transport.h, llmdd__xfer).
 */
typedef struct {
    uint64_t src_off;
    uint64_t dst_off;
    uint64_t len;
} llmdd__run;

/*
 * A 2-D run (a slice's plan, core/slices.h): `count` elements of `len`
 * bytes, the k-th from src_off + k * src_stride to dst_off + k * dst_stride.
 * Its first three fields are an llmdd__run's.
 */
typedef struct {
    uint64_t src_off, dst_off;
    uint64_t len;                    /* >= 1 */
    uint64_t count;                  /* >= 1 */
    uint64_t src_stride, dst_stride; /* meaningful when count > 1 */
} llmdd__run2;

/*
 * Whether count (>= 1) elements of len bytes, the k-th at off + k * stride,
 * all lie inside [0, size), with no sum or product overflowing: the check
 * between a peer's request or a transfer's plan and the memory it names.
 */
static inline bool
llmdd__elems_fit(uint64_t off, uint64_t len, uint64_t count, uint64_t stride,
                 uint64_t size)
{
    uint64_t last, end;

    return count > 0 &&
           !__builtin_mul_overflow(count - 1, count > 1 ? stride : 0, &last) &&
           !__builtin_add_overflow(off, last, &last) &&
           !__builtin_add_overflow(last, len, &end) && end <= size;
}

/*
 * Turns block pairs into byte runs, merging consecutive pairs that are
 * contiguous on both sides. Order is kept, so with duplicate destinations the
 * later pair wins, as it would block by block. runs must hold n entries.
 * Returns the number of runs. Indices must already be checked, so that
 * index * stride cannot overflow.
 */
size_t llmdd__block_runs(const uint64_t *src_blocks,
                         const uint64_t *dst_blocks, size_t n,
                         uint64_t stride, llmdd__run *runs);

#endif
