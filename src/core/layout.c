#include "core/layout.h"

size_t
llmdd__dtype_size(llmdd_data_type dt)
{
    switch (dt) {
    case LLMDD_DT_INT8:
    case LLMDD_DT_UINT8:
    case LLMDD_DT_BOOL:
        return 1;
    case LLMDD_DT_FLOAT16:
    case LLMDD_DT_INT16:
    case LLMDD_DT_UINT16:
    case LLMDD_DT_BF16:
        return 2;
    case LLMDD_DT_FLOAT:
    case LLMDD_DT_INT32:
    case LLMDD_DT_UINT32:
        return 4;
    case LLMDD_DT_INT64:
    case LLMDD_DT_UINT64:
    case LLMDD_DT_DOUBLE:
        return 8;
    default:
        return 0;
    }
}

size_t
llmdd_data_type_size(llmdd_data_type dt)
{
    return llmdd__dtype_size(dt);
}

llmdd_status
llmdd__desc_check(const llmdd_cache_desc *desc, uint64_t *tensor_size_out,
                  uint64_t *stride_out)
{
    if (desc == NULL)
        return LLM_PARAM_INVALID;
    if ((int)desc->placement != LLMDD_PLACEMENT_HOST &&
        (int)desc->placement != LLMDD_PLACEMENT_DEVICE)
        return LLM_PARAM_INVALID;
    if (desc->num_tensors == 0)
        return LLM_PARAM_INVALID;
    if (desc->num_dims < 1 || desc->num_dims > LLMDD_MAX_DIMS)
        return LLM_PARAM_INVALID;
    uint64_t size = llmdd__dtype_size(desc->data_type);
    if (size == 0)
        return LLM_PARAM_INVALID;
    for (uint32_t i = 0; i < desc->num_dims; i++) {
        if (desc->shape[i] <= 0)
            return LLM_PARAM_INVALID;
        if (__builtin_mul_overflow(size, (uint64_t)desc->shape[i], &size) ||
            size > INT64_MAX)
            return LLM_PARAM_INVALID;
    }
    /* The cache as a whole must also be addressable. */
    uint64_t total;
    if (__builtin_mul_overflow(size, (uint64_t)desc->num_tensors, &total) ||
        total > INT64_MAX)
        return LLM_PARAM_INVALID;
    *tensor_size_out = size;
    *stride_out = size / (uint64_t)desc->shape[0];
    return LLM_SUCCESS;
}

llmdd_status
llmdd__slot_geom_make(const llmdd_cache_desc *desc, uint32_t batch_dim,
                      llmdd__slot_geom *g)
{
    uint64_t rows = 1, row = llmdd__dtype_size(desc->data_type);

    if (batch_dim >= desc->num_dims)
        return LLM_PARAM_INVALID;
    /* The desc is checked: no product of its dims overflows. */
    for (uint32_t i = 0; i < batch_dim; i++)
        rows *= (uint64_t)desc->shape[i];
    for (uint32_t i = batch_dim + 1; i < desc->num_dims; i++)
        row *= (uint64_t)desc->shape[i];
    g->batch_dim = batch_dim;
    g->slots = (uint64_t)desc->shape[batch_dim];
    g->row = row;
    g->rows = rows;
    g->pitch = g->slots * row;
    return LLM_SUCCESS;
}

llmdd_status
llmdd__slot_range_check(const llmdd__slot_geom *g, uint64_t off, uint64_t len)
{
    uint64_t end;

    if (len == 0 || __builtin_add_overflow(off, len, &end) ||
        end > llmdd__slot_bytes(g))
        return LLM_PARAM_INVALID;
    if (g->batch_dim != 0 && (off % g->row != 0 || len % g->row != 0))
        return LLM_PARAM_INVALID;
    return LLM_SUCCESS;
}

static bool
range_is_default(llmdd_layer_range r)
{
    return r.first == -1 && r.second == -1;
}

static bool
range_shape_ok(llmdd_layer_range r)
{
    return range_is_default(r) || (r.first >= 0 && r.first <= r.second);
}

llmdd_status
llmdd__ext_check_shape(const llmdd_kv_ext_param *ext)
{
    if (!range_shape_ok(ext->src_layer_range) ||
        !range_shape_ok(ext->dst_layer_range))
        return LLM_PARAM_INVALID;
    /* tnpl means something only to a range that is given. */
    if ((!range_is_default(ext->src_layer_range) ||
         !range_is_default(ext->dst_layer_range)) &&
        ext->tensor_num_per_layer < 1)
        return LLM_PARAM_INVALID;
    return LLM_SUCCESS;
}

llmdd_status
llmdd__range_resolve(const llmdd_kv_ext_param *ext, bool is_src,
                     uint32_t num_tensors, llmdd__tensor_span *span_out)
{
    span_out->first = 0;
    span_out->count = num_tensors;
    if (ext == NULL)
        return LLM_SUCCESS;

    llmdd_layer_range range = is_src ? ext->src_layer_range
                                     : ext->dst_layer_range;
    uint32_t tnpl = ext->tensor_num_per_layer;
    if (!range_shape_ok(range))
        return LLM_PARAM_INVALID;
    if (range_is_default(range))
        return LLM_SUCCESS;
    if (tnpl < 1 || tnpl > num_tensors || num_tensors % tnpl != 0)
        return LLM_PARAM_INVALID;
    uint32_t max_layer = num_tensors / tnpl - 1;
    if ((uint32_t)range.second > max_layer)
        return LLM_PARAM_INVALID;
    span_out->first = (uint32_t)range.first * tnpl;
    span_out->count = ((uint32_t)range.second - (uint32_t)range.first + 1) *
                      tnpl;
    return LLM_SUCCESS;
}

llmdd_status
llmdd__spans_match(llmdd__tensor_span src, llmdd__tensor_span dst)
{
    return src.count == dst.count ? LLM_SUCCESS : LLM_PARAM_INVALID;
}

llmdd_status
llmdd__blocks_check(const uint64_t *blocks, size_t n, uint64_t num_blocks)
{
    if (blocks == NULL || n == 0)
        return LLM_PARAM_INVALID;
    for (size_t k = 0; k < n; k++)
        if (blocks[k] >= num_blocks)
            return LLM_PARAM_INVALID;
    return LLM_SUCCESS;
}

size_t
llmdd__block_runs(const uint64_t *src_blocks, const uint64_t *dst_blocks,
                  size_t n, uint64_t stride, llmdd__run *runs)
{
    size_t nruns = 0;
    size_t k = 0;

    while (k < n) {
        size_t len = 1;
        while (k + len < n && src_blocks[k + len] == src_blocks[k] + len &&
               dst_blocks[k + len] == dst_blocks[k] + len)
            len++;
        runs[nruns].src_off = src_blocks[k] * stride;
        runs[nruns].dst_off = dst_blocks[k] * stride;
        runs[nruns].len = len * stride;
        nruns++;
        k += len;
    }
    return nruns;
}
