/* Model shapes of the llmdd tool: KV and paged caches; see common.h. */
#include "common.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* ---- Model shapes. ---- */

typedef struct {
    const char *name;
    uint32_t layers, heads, head_dim;
} cm_model;

/* KV layouts of public models (grouped-query attention where they use it). */
static const cm_model cm_models[] = {
    {"llama3-8b", 32, 8, 128},  {"llama3-70b", 80, 8, 128},
    {"llama2-7b", 32, 32, 128}, {"qwen2-7b", 28, 4, 128},
    {"mistral-7b", 32, 8, 128}, {"tiny", 4, 2, 64},
};
#define CM_NMODELS (sizeof(cm_models) / sizeof(cm_models[0]))

void
cli_shape_default(cli_shape *s)
{
    memset(s, 0, sizeof(*s));
    snprintf(s->model, sizeof(s->model), "%s", cm_models[0].name);
    s->layers = cm_models[0].layers;
    s->heads = cm_models[0].heads;
    s->head_dim = cm_models[0].head_dim;
    s->tokens = 128;
    s->batch = 4;
    s->block_tokens = 16;
}

static bool
cm_shape_num(const char *what, const char *arg, uint32_t max, uint32_t *out)
{
    if (cli_parse_u32(arg, 1, max, out))
        return true;
    cli_usage_err("%s: \"%s\" is not a whole number in 1..%" PRIu32, what, arg,
                  max);
    return false;
}

int
cli_shape_opt(cli_shape *s, int opt, const char *arg)
{
    uint32_t *field = NULL, max = 0;
    const char *what = NULL;
    char list[128];
    size_t len;

    switch (opt) {
    case CLI_OPT_MODEL:
        for (size_t i = 0; i < CM_NMODELS; i++) {
            if (strcmp(arg, cm_models[i].name) == 0) {
                snprintf(s->model, sizeof(s->model), "%s", arg);
                s->layers = cm_models[i].layers;
                s->heads = cm_models[i].heads;
                s->head_dim = cm_models[i].head_dim;
                return 1;
            }
        }
        len = 0;
        for (size_t i = 0; i < CM_NMODELS && len < sizeof(list); i++)
            len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s",
                                    i > 0 ? ", " : "", cm_models[i].name);
        cli_usage_err("unknown model \"%s\" (%s)", arg, list);
        return -1;
    case CLI_OPT_LAYERS:
        /* One name, one meaning: --layers is llmdd pull's range. */
        cli_usage_err("--layers is a layer range (A:B) of `llmdd pull`; the "
                      "number of layers is --num-layers");
        return -1;
    case CLI_OPT_NUM_LAYERS:
        field = &s->layers, max = 1024, what = "--layers";
        break;
    case CLI_OPT_HEADS:
        field = &s->heads, max = 1024, what = "--heads";
        break;
    case CLI_OPT_HEAD_DIM:
        field = &s->head_dim, max = 16384, what = "--head-dim";
        break;
    case CLI_OPT_TOKENS:
        field = &s->tokens, max = 1u << 24, what = "--tokens";
        break;
    case CLI_OPT_BATCH:
        field = &s->batch, max = 65536, what = "--batch";
        break;
    case CLI_OPT_BLOCK_TOKENS:
        field = &s->block_tokens, max = 1u << 20, what = "--block-tokens";
        break;
    default:
        return 0;
    }
    if (!cm_shape_num(what, arg, max, field))
        return -1;
    if (opt != CLI_OPT_BATCH && opt != CLI_OPT_TOKENS &&
        opt != CLI_OPT_BLOCK_TOKENS)
        snprintf(s->model, sizeof(s->model), "custom");
    return 1;
}

/* Bytes one token takes in one tensor. */
static uint64_t
cm_token_bytes(const cli_shape *s)
{
    return (uint64_t)s->heads * s->head_dim * 2;
}

static uint64_t
cm_paged_blocks(const cli_shape *s)
{
    uint64_t toks = (uint64_t)s->batch * s->tokens;
    return (toks + s->block_tokens - 1) / s->block_tokens;
}

bool
cli_shape_check(const cli_shape *s)
{
    /* A tensor stays below 64 GiB and a cache below 1 TiB, so the sizes
     * the tool prints and allocates never overflow. */
    uint64_t kv = (uint64_t)s->batch * s->tokens * cm_token_bytes(s);
    uint64_t paged = cm_paged_blocks(s) * s->block_tokens * cm_token_bytes(s);
    uint64_t tensors = 2ull * s->layers;

    if (kv > (64ull << 30) || paged > (64ull << 30) ||
        kv * tensors > (1ull << 40) || paged * tensors > (1ull << 40)) {
        cli_usage_err("the cache shape is too large (a tensor may hold at "
                      "most 64 GiB, a cache 1 TiB)");
        return false;
    }
    return true;
}

llmdd_cache_desc
cli_shape_kv(const cli_shape *s)
{
    llmdd_cache_desc d = {
        .placement = LLMDD_PLACEMENT_HOST,
        .num_tensors = 2 * s->layers,
        .data_type = LLMDD_DT_BF16,
        .num_dims = 4,
        .shape = {s->batch, s->tokens, s->heads, s->head_dim}};
    return d;
}

llmdd_cache_desc
cli_shape_paged(const cli_shape *s)
{
    llmdd_cache_desc d = {.placement = LLMDD_PLACEMENT_HOST,
                          .num_tensors = 2 * s->layers,
                          .data_type = LLMDD_DT_BF16,
                          .num_dims = 4,
                          .shape = {(int64_t)cm_paged_blocks(s),
                                    s->block_tokens, s->heads, s->head_dim}};
    return d;
}

void
cli_shape_flags(const cli_shape *s, char *buf, size_t cap)
{
    cli_shape def;
    size_t n = 0;

    cli_shape_default(&def);
    buf[0] = '\0';
#define CM_ADD(...)                                                            \
    do {                                                                       \
        int k = snprintf(buf + n, cap - n, __VA_ARGS__);                       \
        if (k > 0 && (size_t)k < cap - n)                                      \
            n += (size_t)k;                                                    \
    } while (0)
    if (strcmp(s->model, "custom") == 0)
        CM_ADD(" --num-layers %" PRIu32 " --heads %" PRIu32
               " --head-dim %" PRIu32,
               s->layers, s->heads, s->head_dim);
    else if (strcmp(s->model, def.model) != 0)
        CM_ADD(" --model %s", s->model);
    if (s->tokens != def.tokens)
        CM_ADD(" --tokens %" PRIu32, s->tokens);
    if (s->batch != def.batch)
        CM_ADD(" --batch %" PRIu32, s->batch);
    if (s->block_tokens != def.block_tokens)
        CM_ADD(" --block-tokens %" PRIu32, s->block_tokens);
#undef CM_ADD
}

uint64_t
cli_desc_tensor_size(const llmdd_cache_desc *d)
{
    uint64_t n = llmdd_data_type_size(d->data_type);

    for (uint32_t i = 0; i < d->num_dims; i++)
        n *= (uint64_t)d->shape[i];
    return n;
}

uint64_t
cli_desc_stride(const llmdd_cache_desc *d)
{
    return cli_desc_tensor_size(d) / (uint64_t)d->shape[0];
}

const char *
cli_fmt_desc(char *buf, size_t cap, const llmdd_cache_desc *d)
{
    size_t n = 0;
    int k;

    k = snprintf(buf, cap, "%s [",
                 d->data_type == LLMDD_DT_BF16      ? "bf16"
                 : d->data_type == LLMDD_DT_FLOAT16 ? "fp16"
                                                    : "u8");
    if (k < 0 || (size_t)k >= cap)
        return buf;
    n = (size_t)k;
    for (uint32_t i = 0; i < d->num_dims && n < cap; i++) {
        k = snprintf(buf + n, cap - n, "%s%" PRId64, i > 0 ? "," : "",
                     d->shape[i]);
        if (k < 0)
            break;
        n += (size_t)k;
    }
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
    return buf;
}
