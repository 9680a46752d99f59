/*
 * llmdd._speedups: the binding's hottest calls without ctypes. ctypes
 * converts every argument through its argtypes on every call, about 2 us
 * of a 4 KiB pull that takes C 1-25 us (BENCHMARKS.md, "Python binding
 * overhead"); here the same calls take the already-checked integers the
 * package passes and call the library with the GIL released.
 *
 * Private to the package (llmdd/_ffi.py loads it, or falls back to ctypes
 * when it is absent or LLMDD_PY_SPEEDUPS=0): the pointers it takes are the
 * package's own (instance, cache, request), never checked here. It does not
 * link libllmdd: bind() hands it the addresses of the functions in the
 * library ctypes loaded, so both paths call the same library.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "llmdd/llmdd.h"

typedef llmdd_status (*pull_fn)(llmdd *, const llmdd_cache_index *,
                                const llmdd_cache *, uint32_t, int64_t,
                                const llmdd_kv_ext_param *);
typedef llmdd_status (*push_fn)(llmdd *, const llmdd_cache *,
                                const llmdd_cache_index *, uint32_t, int64_t,
                                const llmdd_kv_ext_param *);
typedef llmdd_status (*pull_async_fn)(llmdd *, const llmdd_cache_index *,
                                      const llmdd_cache *, uint32_t, int64_t,
                                      const llmdd_kv_ext_param *,
                                      const llmdd_xfer_opts *,
                                      llmdd_request **);
typedef llmdd_status (*push_async_fn)(llmdd *, const llmdd_cache *,
                                      const llmdd_cache_index *, uint32_t,
                                      int64_t, const llmdd_kv_ext_param *,
                                      const llmdd_xfer_opts *,
                                      llmdd_request **);
typedef llmdd_status (*wait_fn)(llmdd_request *, int32_t);
typedef llmdd_status (*completions_fn)(llmdd *, llmdd_request **, size_t,
                                       size_t *);
typedef void (*free_fn)(llmdd_request *);

static struct {
    pull_fn pull;
    push_fn push;
    pull_async_fn pull_async;
    push_async_fn push_async;
    wait_fn wait;
    completions_fn completions;
    free_fn free;
} fns;

#define COMPLETIONS_CAP 64

/* Argument k as an unsigned 64-bit integer (a pointer or an id). */
static int
arg_u64(PyObject *const *args, Py_ssize_t k, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(args[k]);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int
arg_i64(PyObject *const *args, Py_ssize_t k, int64_t *out)
{
    long long v = PyLong_AsLongLong(args[k]);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static int
arg_u32(PyObject *const *args, Py_ssize_t k, uint32_t *out)
{
    uint64_t v;
    if (arg_u64(args, k, &v) != 0)
        return -1;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value out of range for uint32");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static int
nargs_is(Py_ssize_t n, Py_ssize_t want, const char *name)
{
    if (n == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name,
                 want, n);
    return -1;
}

static int
bound(void)
{
    if (fns.pull != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "llmdd._speedups: bind() first");
    return -1;
}

/*
 * The common arguments of a slot transfer, in the order the package passes
 * them: dd, remote (cluster, cache_id, batch), local cache, local batch
 * index, size, ext.
 */
typedef struct {
    uint64_t dd, cache, ext;
    llmdd_cache_index idx;
    uint32_t batch;
    int64_t size;
} slot_args;

static int
parse_slot(PyObject *const *args, slot_args *a)
{
    if (arg_u64(args, 0, &a->dd) != 0 ||
        arg_u64(args, 1, &a->idx.cluster_id) != 0 ||
        arg_i64(args, 2, &a->idx.cache_id) != 0 ||
        arg_u32(args, 3, &a->idx.batch_index) != 0 ||
        arg_u64(args, 4, &a->cache) != 0 || arg_u32(args, 5, &a->batch) != 0 ||
        arg_i64(args, 6, &a->size) != 0 || arg_u64(args, 7, &a->ext) != 0)
        return -1;
    return 0;
}

/* bind(pull, push, pull_async, push_async, wait, get_completions,
 * request_free): the library's functions' addresses. */
static PyObject *
sp_bind(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t a[7];
    (void)self;
    if (nargs_is(n, 7, "bind") != 0)
        return NULL;
    for (Py_ssize_t k = 0; k < 7; k++) {
        if (arg_u64(args, k, &a[k]) != 0)
            return NULL;
        if (a[k] == 0) {
            PyErr_SetString(PyExc_ValueError, "bind: a NULL function");
            return NULL;
        }
    }
    fns.pull = (pull_fn)(uintptr_t)a[0];
    fns.push = (push_fn)(uintptr_t)a[1];
    fns.pull_async = (pull_async_fn)(uintptr_t)a[2];
    fns.push_async = (push_async_fn)(uintptr_t)a[3];
    fns.wait = (wait_fn)(uintptr_t)a[4];
    fns.completions = (completions_fn)(uintptr_t)a[5];
    fns.free = (free_fn)(uintptr_t)a[6];
    Py_RETURN_NONE;
}

/* A synchronous slot transfer: llmdd_push_kv_cache when push, else
 * llmdd_pull_kv_cache. */
static PyObject *
sync_xfer(PyObject *const *args, Py_ssize_t n, int push, const char *name)
{
    slot_args a;
    llmdd_status st;
    if (nargs_is(n, 8, name) != 0 || bound() != 0 || parse_slot(args, &a) != 0)
        return NULL;
    llmdd *dd = (llmdd *)(uintptr_t)a.dd;
    const llmdd_cache *c = (const llmdd_cache *)(uintptr_t)a.cache;
    const llmdd_kv_ext_param *e = (const llmdd_kv_ext_param *)(uintptr_t)a.ext;
    PyThreadState *ts = PyEval_SaveThread();
    st = push ? fns.push(dd, c, &a.idx, a.batch, a.size, e)
              : fns.pull(dd, &a.idx, c, a.batch, a.size, e);
    PyEval_RestoreThread(ts);
    return PyLong_FromUnsignedLong(st);
}

/* pull_cache(dd, cluster, cache_id, batch, cache, batch_index, size, ext)
 * -> status: llmdd_pull_kv_cache. */
static PyObject *
sp_pull_cache(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    (void)self;
    return sync_xfer(args, n, 0, "pull_cache");
}

/* push_cache(dd, cluster, cache_id, batch, cache, src_batch_index, size,
 * ext) -> status: llmdd_push_kv_cache (the remote index first, as in
 * pull_cache). */
static PyObject *
sp_push_cache(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    (void)self;
    return sync_xfer(args, n, 1, "push_cache");
}

/* post(dd, cluster, cache_id, batch, cache, batch_index, size, ext, opts,
 * push) -> (status, request): llmdd_pull_kv_cache_async, or
 * llmdd_push_kv_cache_async when push is true. */
static PyObject *
sp_post(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    slot_args a;
    uint64_t opts;
    llmdd_request *req = NULL;
    llmdd_status st;
    (void)self;
    if (nargs_is(n, 10, "post") != 0 || bound() != 0 ||
        parse_slot(args, &a) != 0 || arg_u64(args, 8, &opts) != 0)
        return NULL;
    int push = PyObject_IsTrue(args[9]);
    if (push < 0)
        return NULL;
    llmdd *dd = (llmdd *)(uintptr_t)a.dd;
    const llmdd_cache *c = (const llmdd_cache *)(uintptr_t)a.cache;
    const llmdd_kv_ext_param *e = (const llmdd_kv_ext_param *)(uintptr_t)a.ext;
    const llmdd_xfer_opts *o = (const llmdd_xfer_opts *)(uintptr_t)opts;
    PyThreadState *ts = PyEval_SaveThread();
    st = push ? fns.push_async(dd, c, &a.idx, a.batch, a.size, e, o, &req)
              : fns.pull_async(dd, &a.idx, c, a.batch, a.size, e, o, &req);
    PyEval_RestoreThread(ts);
    return Py_BuildValue("(kK)", (unsigned long)st,
                         (unsigned long long)(uintptr_t)req);
}

/* wait(request, timeout_ms) -> status: llmdd_request_wait. */
static PyObject *
sp_wait(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t req;
    int64_t t;
    llmdd_status st;
    (void)self;
    if (nargs_is(n, 2, "wait") != 0 || bound() != 0 ||
        arg_u64(args, 0, &req) != 0 || arg_i64(args, 1, &t) != 0)
        return NULL;
    if (t < INT32_MIN || t > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "timeout out of range for int32");
        return NULL;
    }
    if (t == 0) { /* a status read: no wait to leave the GIL for */
        st = fns.wait((llmdd_request *)(uintptr_t)req, 0);
    } else {
        PyThreadState *ts = PyEval_SaveThread();
        st = fns.wait((llmdd_request *)(uintptr_t)req, (int32_t)t);
        PyEval_RestoreThread(ts);
    }
    return PyLong_FromUnsignedLong(st);
}

/* free(request): llmdd_request_free (which cancels one in flight and waits
 * for it to stop moving: the GIL is released). */
static PyObject *
sp_free(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t req;
    (void)self;
    if (nargs_is(n, 1, "free") != 0 || bound() != 0 ||
        arg_u64(args, 0, &req) != 0)
        return NULL;
    PyThreadState *ts = PyEval_SaveThread();
    fns.free((llmdd_request *)(uintptr_t)req);
    PyEval_RestoreThread(ts);
    Py_RETURN_NONE;
}

/* completions(dd) -> (status, [request, ...]): llmdd_get_completions, up
 * to 64 at a time. */
static PyObject *
sp_completions(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
    uint64_t dd;
    llmdd_request *out[COMPLETIONS_CAP];
    size_t got = 0;
    llmdd_status st;
    (void)self;
    if (nargs_is(n, 1, "completions") != 0 || bound() != 0 ||
        arg_u64(args, 0, &dd) != 0)
        return NULL;
    st = fns.completions((llmdd *)(uintptr_t)dd, out, COMPLETIONS_CAP, &got);
    if (st != LLM_SUCCESS || got > COMPLETIONS_CAP)
        got = 0;
    PyObject *list = PyList_New((Py_ssize_t)got);
    if (list == NULL)
        return NULL;
    for (size_t i = 0; i < got; i++) {
        PyObject *v =
            PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)out[i]);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return Py_BuildValue("(kN)", (unsigned long)st, list);
}

static PyMethodDef sp_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))sp_bind, METH_FASTCALL, NULL},
    {"pull_cache", (PyCFunction)(void (*)(void))sp_pull_cache, METH_FASTCALL,
     NULL},
    {"push_cache", (PyCFunction)(void (*)(void))sp_push_cache, METH_FASTCALL,
     NULL},
    {"post", (PyCFunction)(void (*)(void))sp_post, METH_FASTCALL, NULL},
    {"wait", (PyCFunction)(void (*)(void))sp_wait, METH_FASTCALL, NULL},
    {"free", (PyCFunction)(void (*)(void))sp_free, METH_FASTCALL, NULL},
    {"completions", (PyCFunction)(void (*)(void))sp_completions, METH_FASTCALL,
     NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sp_module = {
    PyModuleDef_HEAD_INIT,
    "_speedups",
    "llmdd's hot calls without ctypes (private to the package)",
    -1,
    sp_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *m = PyModule_Create(&sp_module);
    if (m != NULL &&
        PyModule_AddIntConstant(m, "COMPLETIONS_CAP", COMPLETIONS_CAP) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
