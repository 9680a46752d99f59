/* The transport registry, in "auto" preference order. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <llmdd/llmdd.h>

#include "base/log.h"
#include "transport/transport.h"

extern const llmdd_transport_ops llmdd__loop_ops;
extern const llmdd_transport_ops llmdd__shm_ops;
extern const llmdd_transport_ops llmdd__ucx_ops;
extern const llmdd_transport_ops llmdd__tcp_ops;

#ifdef LLMDD_HAVE_SHM
#define SHM_OPS (&llmdd__shm_ops)
#else
#define SHM_OPS NULL
#endif
#ifdef LLMDD_HAVE_UCX
#define UCX_OPS (&llmdd__ucx_ops)
#else
#define UCX_OPS NULL
#endif

/* The one list of transports: every name llm.Transport accepts, in auto's
 * order of preference, with its table when this build has it. */
static const struct {
    const char *name;
    const llmdd_transport_ops *ops; /* NULL: not built in */
} all[] = {
    {"loop", &llmdd__loop_ops},
    {"shm", SHM_OPS},
    {"ucx", UCX_OPS},
    {"tcp", &llmdd__tcp_ops},
};

#define NALL (sizeof(all) / sizeof(all[0]))

/* The built-in transports whose tables are whole, set up once. */
static const llmdd_transport_ops *transports[NALL];
static size_t ntransports;
static char list[64]; /* their names, comma-separated */
static pthread_once_t registry_once = PTHREAD_ONCE_INIT;

bool
llmdd__transport_valid(const llmdd_transport_ops *ops)
{
    /* The core calls these without checking; the others are optional. */
    return ops->name != NULL && ops->name[0] != '\0' &&
           ops->reaches != NULL && ops->link_init != NULL &&
           ops->link_shutdown != NULL && ops->link_fini != NULL &&
           ops->query != NULL && ops->xfer != NULL;
}

/* Registration checks each table once: a broken one is logged and left
 * out, so the library runs with the transports that are whole. */
static void
registry_init(void)
{
    for (size_t i = 0; i < NALL; i++) {
        const llmdd_transport_ops *ops = all[i].ops;
        if (ops == NULL)
            continue;
        if (!llmdd__transport_valid(ops) ||
            strcmp(ops->name, all[i].name) != 0) {
            log_error(
                "transport %s lacks a mandatory op or its name; not registered",
                ops->name != NULL ? ops->name : "(unnamed)");
            continue;
        }
        size_t used = strlen(list);
        if (strlen(ops->name) + 2 > sizeof(list) - used) {
            log_error("transport %s: the name list is full", ops->name);
            continue;
        }
        if (used > 0)
            list[used++] = ',';
        strcpy(list + used, ops->name);
        transports[ntransports++] = ops;
    }
}

const llmdd_transport_ops *
llmdd__transport_find(const char *name)
{
    pthread_once(&registry_once, registry_init);
    for (size_t i = 0; i < ntransports; i++)
        if (strcmp(transports[i]->name, name) == 0)
            return transports[i];
    return NULL;
}

bool
llmdd__transport_known(const char *name)
{
    for (size_t i = 0; i < NALL; i++)
        if (strcmp(all[i].name, name) == 0)
            return true;
    return false;
}

size_t
llmdd__transport_count(void)
{
    pthread_once(&registry_once, registry_init);
    return ntransports;
}

const llmdd_transport_ops *
llmdd__transport_at(size_t i)
{
    pthread_once(&registry_once, registry_init);
    return i < ntransports ? transports[i] : NULL;
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
    pthread_once(&registry_once, registry_init);
    return list;
}

uint64_t
llmdd__xfer_bytes(const llmdd__xfer *x)
{
    uint64_t sum = 0;

    for (size_t i = 0; i < x->nruns; i++)
        sum += x->runs[i].len;
    for (size_t i = 0; x->runs2 != NULL && i < x->nruns2; i++)
        sum += x->runs2[i].len * x->runs2[i].count;
    return sum * x->count;
}

bool
llmdd__xfer_fits(const llmdd__xfer *x, uint64_t tensor_size)
{
    for (size_t i = 0; i < llmdd__xfer_nruns(x); i++) {
        llmdd__run2 r = llmdd__xfer_run(x, i);
        if (!llmdd__elems_fit(x->write ? r.dst_off : r.src_off, r.len, r.count,
                              x->write ? r.dst_stride : r.src_stride,
                              tensor_size))
            return false;
    }
    return true;
}

int
llmdd__xfer_plain(const llmdd__xfer *x, llmdd__xfer *out, llmdd__run **tmp)
{
    uint64_t n = 0;

    *out = *x;
    *tmp = NULL;
    if (x->runs2 == NULL)
        return 0;
    for (size_t i = 0; i < x->nruns2; i++)
        n += x->runs2[i].count;
    llmdd__run *r = n <= SIZE_MAX / sizeof(*r) ? malloc(n * sizeof(*r)) : NULL;
    if (r == NULL && n > 0)
        return -1;
    size_t k = 0;
    for (size_t i = 0; i < x->nruns2; i++) {
        const llmdd__run2 *q = &x->runs2[i];
        for (uint64_t e = 0; e < q->count; e++)
            r[k++] = (llmdd__run){q->src_off + e * q->src_stride,
                                  q->dst_off + e * q->dst_stride, q->len};
    }
    out->runs = r;
    out->nruns = k;
    out->runs2 = NULL;
    out->nruns2 = 0;
    *tmp = r;
    return 0;
}

uint64_t
llmdd__xfer_dst_bytes(const llmdd__xfer *x)
{
    if (!x->write)
        return x->local_bytes;
    return x->remote->tensor_size * x->remote->desc.num_tensors;
}
