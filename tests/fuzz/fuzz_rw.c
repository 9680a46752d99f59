/*
 * Fuzz target: the serving side of a remote READ or WRITE. The input is a
 * request payload; it is decoded as a data connection would decode it and
 * checked against a live instance's registry with llmdd__cache_get_span, the
 * one check between a peer and our memory. Every run it accepts is touched
 * at the first and last byte of its first and last element (a strided run's
 * count x stride may overflow), so ASan reports any span outside the cache.
 *
 * The instance holds an allocated cache (id 1: 3 tensors of 4 x 1000 bytes)
 * and a registered one (id 2: 2 tensors of 3 x 4 x 2-byte elements in exact
 * size heap blocks) so both kinds of memory are covered.
 */
#include <string.h>

#include "core/internal.h"
#include "base/wire.h"
#include "fuzz/fuzz.h"

static llmdd *dd;
static uint64_t *offs, *lens, *cnts, *strides;
static uint8_t *reg[2];

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    llmdd_cache_desc a = {.num_tensors = 3,
                          .data_type = LLMDD_DT_UINT8,
                          .num_dims = 2,
                          .shape = {4, 1000}};
    llmdd_cache_desc r = {.num_tensors = 2,
                          .data_type = LLMDD_DT_INT16,
                          .num_dims = 2,
                          .shape = {3, 4}};
    llmdd_cache c;
    uint64_t addrs[2];
    int64_t id;

    (void)argc;
    (void)argv;
    offs = malloc(LLMDD_WIRE_MAX_RUNS * sizeof(*offs));
    lens = malloc(LLMDD_WIRE_MAX_RUNS * sizeof(*lens));
    cnts = malloc(LLMDD_WIRE_MAX_RUNS * sizeof(*cnts));
    strides = malloc(LLMDD_WIRE_MAX_RUNS * sizeof(*strides));
    for (int i = 0; i < 2; i++) {
        reg[i] = malloc(24);
        if (reg[i] == NULL)
            abort();
        memset(reg[i], i, 24);
        addrs[i] = (uint64_t)(uintptr_t)reg[i];
    }
    if (offs == NULL || lens == NULL || cnts == NULL || strides == NULL ||
        llmdd_create(1, LLMDD_ROLE_PROMPT, &dd) != LLM_SUCCESS ||
        llmdd_initialize(dd, NULL, 0) != LLM_SUCCESS ||
        llmdd_allocate_cache(dd, &a, &c) != LLM_SUCCESS || c.cache_id != 1 ||
        llmdd_register_kv_cache(dd, &r, addrs, 2, &id) != LLM_SUCCESS ||
        id != 2)
        abort();
    return 0;
}

static volatile uint8_t sink;

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    llmdd__rw_req req = {
        .offs = offs, .lens = lens, .cnts = cnts, .strides = strides};
    llmdd__cache *c = NULL;

    if (llmdd__wire_rw_decode(data, size, &req) != 0)
        return 0;
    if (llmdd__cache_get_span(dd, req.cache_id, req.first, req.count, offs,
                              lens, cnts, strides, req.nruns,
                              &c) != LLM_SUCCESS) {
        FUZZ_CHECK(c == NULL);
        return 0;
    }
    FUZZ_CHECK(c != NULL && c->id == req.cache_id);
    FUZZ_CHECK(req.first < c->desc.num_tensors &&
               req.count <= c->desc.num_tensors - req.first);
    for (uint32_t t = req.first; t < req.first + req.count; t++) {
        const uint8_t *base = (const uint8_t *)(uintptr_t)c->addrs[t];
        for (uint32_t i = 0; i < req.nruns; i++) {
            FUZZ_CHECK(cnts[i] >= 1 && offs[i] < c->tensor_size &&
                       lens[i] <= c->tensor_size - offs[i]);
            sink = base[offs[i]];
            sink = base[offs[i] + lens[i] - 1];
            if (cnts[i] == 1)
                continue;
            FUZZ_CHECK(strides[i] <= c->tensor_size / (cnts[i] - 1));
            uint64_t last = offs[i] + (cnts[i] - 1) * strides[i];
            FUZZ_CHECK(last < c->tensor_size &&
                       lens[i] <= c->tensor_size - last);
            sink = base[last];
            sink = base[last + lens[i] - 1];
        }
    }
    llmdd__cache_put(dd, c);
    return 0;
}
