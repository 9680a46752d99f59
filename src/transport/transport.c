/* The transport registry, in "auto" preference order. */
#include <string.h>

#include <llmdd/llmdd.h>

#include "transport/transport.h"

extern const llmdd_transport_ops llmdd__loop_ops;
extern const llmdd_transport_ops llmdd__shm_ops;
extern const llmdd_transport_ops llmdd__ucx_ops;
extern const llmdd_transport_ops llmdd__tcp_ops;

static const llmdd_transport_ops *const transports[] = {
    &llmdd__loop_ops,
#ifdef LLMDD_HAVE_SHM
    &llmdd__shm_ops,
#endif
#ifdef LLMDD_HAVE_UCX
    &llmdd__ucx_ops,
#endif
    &llmdd__tcp_ops,
};

/* Every name llm.Transport accepts, built in or not. */
static const char *const known[] = {"loop", "shm", "tcp", "ucx"};

const llmdd_transport_ops *
llmdd__transport_find(const char *name)
{
    for (size_t i = 0; i < sizeof(transports) / sizeof(transports[0]); i++)
        if (strcmp(transports[i]->name, name) == 0)
            return transports[i];
    return NULL;
}

bool
llmdd__transport_known(const char *name)
{
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (strcmp(known[i], name) == 0)
            return true;
    return false;
}

size_t
llmdd__transport_count(void)
{
    return sizeof(transports) / sizeof(transports[0]);
}

const llmdd_transport_ops *
llmdd__transport_at(size_t i)
{
    return transports[i];
}

const char *
llmdd_transport_info(const char *name)
{
    const llmdd_transport_ops *ops = name ? llmdd__transport_find(name) : NULL;

    if (ops == NULL || ops->info == NULL)
        return NULL;
    return ops->info();
}

const char *
llmdd_transport_list(void)
{
    static const char list[] = "loop"
#ifdef LLMDD_HAVE_SHM
                               ",shm"
#endif
#ifdef LLMDD_HAVE_UCX
                               ",ucx"
#endif
                               ",tcp";
    return list;
}

uint64_t
llmdd__xfer_bytes(const llmdd__xfer *x)
{
    uint64_t sum = 0;

    for (size_t i = 0; i < x->nruns; i++)
        sum += x->runs[i].len;
    return sum * x->count;
}
