/*
 * Backing memory of allocated caches (cache_mem.c), for the registry
 * (cache.c). The pool's functions are called with dd->lock held where the
 * registry holds it.
 */
#ifndef LLMDD_CORE_CACHE_MEM_H
#define LLMDD_CORE_CACHE_MEM_H

#include "core/internal.h"

/* Makes the host pool per cfg (*out NULL when none is configured). */
llmdd_status llmdd__pool_create(const llmdd__pool_config *cfg,
                                llmdd__pool **out);
void llmdd__pool_destroy(llmdd__pool *p);
/* Closes n pidfds (-1 entries skipped) and frees the array. */
void llmdd__pidfds_close(int *fds, size_t n);
/* Memory for num_tensors tensors of tensor_size bytes, from the pool when
 * there is one; dd->lock held. */
llmdd_status llmdd__mem_alloc(llmdd *dd, uint64_t tensor_size,
                              uint32_t num_tensors, llmdd__mem *m);
/* Gives an allocated cache's memory back (held back from the pool while a
 * stale peer may write it); dd->lock held. */
void llmdd__mem_free(llmdd *dd, llmdd__cache *c);

#endif
