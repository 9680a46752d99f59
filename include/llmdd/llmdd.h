/*
 * llmdd: move LLM KV caches between prefill and decode processes.
 *
 * This is the only public header: names, argument order and numeric
 * values are fixed here; docs/model.md states the semantics.
 *
 * Thread safety: one instance may be used from several threads at once,
 * except that llmdd_finalize() and llmdd_destroy() must not race with other
 * calls on the same instance. llmdd_status_str() and llmdd_version() are
 * always safe.
 */
#ifndef LLMDD_LLMDD_H
#define LLMDD_LLMDD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LLMDD_VERSION_MAJOR 0
#define LLMDD_VERSION_MINOR 3
#define LLMDD_VERSION_PATCH 0

#if defined(__GNUC__)
#define LLMDD_API __attribute__((visibility("default")))
#else
#define LLMDD_API
#endif

typedef uint32_t llmdd_status;

/*
 * The status codes: one list, the reference's names and values. C sees them
 * as macros (constant expressions for case labels and #if); C++ sees typed
 * constants, so that code written for LLM-DataDist can name them inside its
 * own namespaces (llm_datadist::LLM_SUCCESS) without a macro expanding there.
 */
#define LLMDD_STATUS_MAP(XX) \
    XX(LLM_SUCCESS, 0x0u) \
    XX(LLM_FAILED, 0xFFFFFFFFu) \
    XX(LLM_WAIT_PROC_TIMEOUT, 0x5010B001u) \
    XX(LLM_KV_CACHE_NOT_EXIST, 0x5010B002u) \
    XX(LLM_REPEAT_REQUEST, 0x5010B003u) \
    XX(LLM_REQUEST_ALREADY_COMPLETED, 0x5010B004u) \
    XX(LLM_PARAM_INVALID, 0x5010B005u) \
    XX(LLM_ENGINE_FINALIZED, 0x5010B006u) \
    XX(LLM_NOT_YET_LINK, 0x5010B007u) \
    XX(LLM_ALREADY_LINK, 0x5010B008u) \
    XX(LLM_LINK_FAILED, 0x5010B009u) \
    XX(LLM_UNLINK_FAILED, 0x5010B00Au) \
    XX(LLM_NOTIFY_PROMPT_UNLINK_FAILED, 0x5010B00Bu) \
    XX(LLM_CLUSTER_NUM_EXCEED_LIMIT, 0x5010B00Cu) \
    XX(LLM_PROCESSING_LINK, 0x5010B00Du) \
    XX(LLM_DEVICE_OUT_OF_MEMORY, 0x5010B00Eu) \
    XX(LLM_PREFIX_ALREADY_EXIST, 0x5010B00Fu) \
    XX(LLM_PREFIX_NOT_EXIST, 0x5010B010u) \
    XX(LLM_SEQ_LEN_OVER_LIMIT, 0x5010B011u) \
    XX(LLM_NO_FREE_BLOCK, 0x5010B012u) \
    XX(LLM_BLOCKS_OUT_OF_MEMORY, 0x5010B013u) \
    XX(LLM_CACHE_INCOMPATIBLE, 0x5010B014u) \
    XX(LLM_CACHE_KEY_ALREADY_EXIST, 0x5010B015u) \
    XX(LLM_COPY_CACHE_FAILED, 0x5010B016u) \
    XX(LLM_CACHE_ID_ALREADY_EXIST, 0x5010B017u) \
    XX(LLM_EXIST_LINK, 0x5010B018u) \
    XX(LLM_FEATURE_NOT_ENABLED, 0x5010B019u) \
    XX(LLM_TIMEOUT, 0x5010B01Au) \
    XX(LLM_LINK_BUSY, 0x5010B01Bu) \
    XX(LLM_OUT_OF_MEMORY, 0x5010B01Cu)

#ifdef __cplusplus
#define LLMDD__STATUS_CONST(name, value) constexpr llmdd_status name = value;
LLMDD_STATUS_MAP(LLMDD__STATUS_CONST)
#undef LLMDD__STATUS_CONST
#else
#define LLM_SUCCESS 0x0u
#define LLM_FAILED 0xFFFFFFFFu
#define LLM_WAIT_PROC_TIMEOUT 0x5010B001u
#define LLM_KV_CACHE_NOT_EXIST 0x5010B002u
#define LLM_REPEAT_REQUEST 0x5010B003u
#define LLM_REQUEST_ALREADY_COMPLETED 0x5010B004u
#define LLM_PARAM_INVALID 0x5010B005u
#define LLM_ENGINE_FINALIZED 0x5010B006u
#define LLM_NOT_YET_LINK 0x5010B007u
#define LLM_ALREADY_LINK 0x5010B008u
#define LLM_LINK_FAILED 0x5010B009u
#define LLM_UNLINK_FAILED 0x5010B00Au
#define LLM_NOTIFY_PROMPT_UNLINK_FAILED 0x5010B00Bu
#define LLM_CLUSTER_NUM_EXCEED_LIMIT 0x5010B00Cu
#define LLM_PROCESSING_LINK 0x5010B00Du
#define LLM_DEVICE_OUT_OF_MEMORY 0x5010B00Eu
#define LLM_PREFIX_ALREADY_EXIST 0x5010B00Fu
#define LLM_PREFIX_NOT_EXIST 0x5010B010u
#define LLM_SEQ_LEN_OVER_LIMIT 0x5010B011u
#define LLM_NO_FREE_BLOCK 0x5010B012u
#define LLM_BLOCKS_OUT_OF_MEMORY 0x5010B013u
#define LLM_CACHE_INCOMPATIBLE 0x5010B014u
#define LLM_CACHE_KEY_ALREADY_EXIST 0x5010B015u
#define LLM_COPY_CACHE_FAILED 0x5010B016u
#define LLM_CACHE_ID_ALREADY_EXIST 0x5010B017u
#define LLM_EXIST_LINK 0x5010B018u
#define LLM_FEATURE_NOT_ENABLED 0x5010B019u
#define LLM_TIMEOUT 0x5010B01Au
#define LLM_LINK_BUSY 0x5010B01Bu
#define LLM_OUT_OF_MEMORY 0x5010B01Cu
#endif

typedef enum {
    LLMDD_ROLE_PROMPT = 1,
    LLMDD_ROLE_DECODER = 2,
    LLMDD_ROLE_MIX = 3,
} llmdd_role;

typedef enum {
    LLMDD_PLACEMENT_HOST = 0,
    LLMDD_PLACEMENT_DEVICE = 1,
} llmdd_placement;

typedef enum {
    LLMDD_DT_FLOAT = 0,
    LLMDD_DT_FLOAT16 = 1,
    LLMDD_DT_INT8 = 2,
    LLMDD_DT_INT32 = 3,
    LLMDD_DT_UINT8 = 4,
    LLMDD_DT_INT16 = 6,
    LLMDD_DT_UINT16 = 7,
    LLMDD_DT_UINT32 = 8,
    LLMDD_DT_INT64 = 9,
    LLMDD_DT_UINT64 = 10,
    LLMDD_DT_DOUBLE = 11,
    LLMDD_DT_BOOL = 12,
    LLMDD_DT_BF16 = 27,
    LLMDD_DT_UNDEFINED = 28,
} llmdd_data_type;

#define LLMDD_MAX_DIMS 31
#define LLMDD_IP_LEN 64 /* textual IPv4/IPv6 address + NUL */

typedef struct llmdd llmdd; /* opaque instance */

typedef struct {
    llmdd_placement placement; /* zero = host */
    uint32_t num_tensors;
    llmdd_data_type data_type;
    uint32_t num_dims;             /* 1..LLMDD_MAX_DIMS */
    int64_t shape[LLMDD_MAX_DIMS]; /* shape[0] = batch size = number of blocks
                                      (see llmdd_allocate_cache_ex) */
} llmdd_cache_desc;

typedef struct {
    int64_t cache_id;
    llmdd_cache_desc desc;
    uint64_t *tensor_addrs; /* desc.num_tensors entries */
} llmdd_cache;

typedef struct { /* names a REMOTE cache */
    uint64_t cluster_id;
    int64_t cache_id;
    uint32_t batch_index;
} llmdd_cache_index;

typedef struct {
    int32_t first, second;
} llmdd_layer_range; /* inclusive */

typedef struct {
    llmdd_layer_range src_layer_range; /* {-1,-1} = all layers */
    llmdd_layer_range dst_layer_range; /* {-1,-1} = all layers */
    uint32_t tensor_num_per_layer;     /* default 2 */
} llmdd_kv_ext_param;
#define LLMDD_KV_EXT_PARAM_DEFAULT {{-1, -1}, {-1, -1}, 2}

typedef struct {
    const char *key;
    const char *value;
} llmdd_option;

typedef struct {
    char ip[LLMDD_IP_LEN];
    uint16_t port;
} llmdd_ip_info;

typedef struct {
    uint64_t remote_cluster_id;
    int32_t remote_role_type;
    const llmdd_ip_info *local_ip_infos;
    size_t num_local_ip_infos;
    const llmdd_ip_info *remote_ip_infos;
    size_t num_remote_ip_infos;
} llmdd_cluster_info;

/*
 * Wherever a function takes `const llmdd_kv_ext_param *ext`, NULL means the
 * default. Out-parameters (`*_out`) are written only on LLM_SUCCESS.
 */

LLMDD_API llmdd_status llmdd_create(uint64_t cluster_id, llmdd_role role,
                          llmdd **dd_out);
LLMDD_API void llmdd_destroy(llmdd *dd); /* finalizes; NULL is a no-op */

LLMDD_API llmdd_status llmdd_initialize(llmdd *dd, const llmdd_option *options,
                              size_t num_options);
LLMDD_API void llmdd_finalize(llmdd *dd); /* idempotent */
LLMDD_API llmdd_status llmdd_set_role(llmdd *dd, llmdd_role role,
                            const llmdd_option *options, size_t num_options);

/*
 * rets: caller array of num_clusters entries, one status per cluster. A
 * cluster that another link or unlink call of this instance is running for
 * gets LLM_PROCESSING_LINK at once; with LLM_LINK_BUSY and LLM_TIMEOUT it
 * is a status to retry (docs/model.md).
 */
LLMDD_API llmdd_status llmdd_link_clusters(llmdd *dd, const llmdd_cluster_info *clusters,
                                 size_t num_clusters, llmdd_status *rets,
                                 int32_t timeout_ms);
LLMDD_API llmdd_status llmdd_unlink_clusters(llmdd *dd,
                                   const llmdd_cluster_info *clusters,
                                   size_t num_clusters, llmdd_status *rets,
                                   int32_t timeout_ms, bool force);

/* cache_out->tensor_addrs is owned by llmdd until the cache is deallocated. */
LLMDD_API llmdd_status llmdd_allocate_cache(llmdd *dd, const llmdd_cache_desc *desc,
                                  llmdd_cache *cache_out);
LLMDD_API llmdd_status llmdd_deallocate_cache(llmdd *dd, int64_t cache_id);
/*
 * Registers caller memory as a cache: peers read and write it directly, so
 * it must stay mapped and valid until llmdd_unregister_kv_cache returns.
 * Freeing it earlier is the caller's error, and a peer's pull then reads
 * freed memory in this process (over tcp, in a serving thread).
 */
LLMDD_API llmdd_status llmdd_register_kv_cache(llmdd *dd, const llmdd_cache_desc *desc,
                                     const uint64_t *addrs, size_t num_addrs,
                                     int64_t *cache_id_out);
LLMDD_API llmdd_status llmdd_unregister_kv_cache(llmdd *dd, int64_t cache_id);

LLMDD_API llmdd_status llmdd_pull_kv_cache(llmdd *dd,
                                 const llmdd_cache_index *src_cache_index,
                                 const llmdd_cache *dst_cache,
                                 uint32_t batch_index, int64_t size,
                                 const llmdd_kv_ext_param *ext);
LLMDD_API llmdd_status llmdd_pull_kv_blocks(llmdd *dd,
                                  const llmdd_cache_index *src_cache_index,
                                  const llmdd_cache *dst_cache,
                                  const uint64_t *src_blocks,
                                  const uint64_t *dst_blocks,
                                  size_t num_blocks,
                                  const llmdd_kv_ext_param *ext);
LLMDD_API llmdd_status llmdd_push_kv_cache(llmdd *dd, const llmdd_cache *src_cache,
                                 const llmdd_cache_index *dst_cache_index,
                                 uint32_t src_batch_index, int64_t size,
                                 const llmdd_kv_ext_param *ext);
LLMDD_API llmdd_status llmdd_push_kv_blocks(llmdd *dd, const llmdd_cache *src_cache,
                                  const llmdd_cache_index *dst_cache_index,
                                  const uint64_t *src_blocks,
                                  const uint64_t *dst_blocks,
                                  size_t num_blocks,
                                  const llmdd_kv_ext_param *ext);

LLMDD_API llmdd_status llmdd_copy_kv_cache(llmdd *dd, const llmdd_cache *src,
                                 const llmdd_cache *dst,
                                 uint32_t src_batch_index,
                                 uint32_t dst_batch_index, uint64_t offset,
                                 int64_t size);
/* Each src_blocks[k] is copied to dst_blocks[k]. */
LLMDD_API llmdd_status llmdd_copy_kv_blocks(llmdd *dd, const llmdd_cache *src,
                                  const llmdd_cache *dst,
                                  const uint64_t *src_blocks,
                                  const uint64_t *dst_blocks,
                                  size_t num_blocks);

LLMDD_API const char *llmdd_status_str(llmdd_status s); /* never NULL */
LLMDD_API const char *llmdd_version(void);

/*
 * Additions to the reference API.
 * llmdd_transport_list: the transports built into this library, in the order
 * llm.Transport=auto prefers them, comma-separated ("loop,shm,tcp").
 * Whether one can reach a given peer is decided when linking.
 */
LLMDD_API const char *llmdd_transport_list(void);
/*
 * llmdd_transport_info: one line about a built-in transport's environment
 * (for "ucx": the UCX version and the devices UCX found), or NULL when the
 * transport is not built in or has nothing to report. The string is static.
 */
LLMDD_API const char *llmdd_transport_info(const char *name);
/*
 * llmdd_option_info: the index-th option key llmdd_initialize knows, with
 * the values it takes, its default and what it does; NULL past the last.
 * default_value is a value the key takes (what an instance uses when the
 * key is not given), or NULL when the default is "unset"; default_text says
 * it in words either way. Everything is static.
 */
typedef struct {
    const char *key;           /* "llm.SyncKvCacheWaitTime" */
    const char *values;        /* the values it takes, in words */
    const char *default_value; /* a value, or NULL: unset by default */
    const char *default_text;  /* "1000", "not listening" */
    const char *meaning;
} llmdd_option_doc;

LLMDD_API const llmdd_option_doc *llmdd_option_info(size_t index);
/*
 * llmdd_listen_address: where this instance listens, with the port the
 * kernel chose when llm.ListenIpInfo gave port 0. LLM_FAILED when it does
 * not listen (or is not initialized).
 */
LLMDD_API llmdd_status llmdd_listen_address(llmdd *dd, llmdd_ip_info *out);
/* Bytes of one element of `dt`; 0 for a type without a known size. */
LLMDD_API size_t llmdd_data_type_size(llmdd_data_type dt);

/*
 * Requests (0.2): posted transfers, notifications, layer streaming; the
 * semantics and decisions are in docs/model.md.
 *
 * A post runs every check of the synchronous call, in the same order, and
 * returns its status without posting anything when one fails. A posted
 * request is moved by the instance's worker threads, which serve the links
 * round robin so that a stalled peer holds up only its own requests;
 * llmdd_request_wait returns its final status once done
 * (LLM_WAIT_PROC_TIMEOUT while in flight). A request holds no descriptor.
 *
 * Lifetimes (0.3): requests must be freed with llmdd_request_free, also
 * after llmdd_finalize or llmdd_destroy (which end them with LLM_FAILED).
 * A request may be waited on, cancelled and marked from any thread, before,
 * during and after finalize and destroy of its instance. Free may race
 * waits already in progress on other threads: they return (LLM_FAILED if
 * the request was not done) and the memory goes when the last one leaves;
 * a call that starts after free returned is the caller's error.
 */
typedef struct llmdd_request llmdd_request;

#define LLMDD_XFER_LAYERWISE 0x1u /* push only: move a layer once marked */
/* 0.3: when the request ends (any status), queue it once for
 * llmdd_get_completions. */
#define LLMDD_XFER_COMPLETION 0x2u
#define LLMDD_NOTIFY_MAX 1024     /* bytes in one notification */

typedef struct {
    uint32_t flags;         /* LLMDD_XFER_* */
    const void *notify;     /* optional: delivered to the peer after every
                               byte landed */
    size_t notify_len;      /* 0..LLMDD_NOTIFY_MAX */
} llmdd_xfer_opts;          /* NULL = flags 0, no notification */

LLMDD_API llmdd_status llmdd_pull_kv_cache_async(
    llmdd *dd, const llmdd_cache_index *src_cache_index,
    const llmdd_cache *dst_cache, uint32_t batch_index, int64_t size,
    const llmdd_kv_ext_param *ext, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);
LLMDD_API llmdd_status llmdd_pull_kv_blocks_async(
    llmdd *dd, const llmdd_cache_index *src_cache_index,
    const llmdd_cache *dst_cache, const uint64_t *src_blocks,
    const uint64_t *dst_blocks, size_t num_blocks,
    const llmdd_kv_ext_param *ext, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);
LLMDD_API llmdd_status llmdd_push_kv_cache_async(
    llmdd *dd, const llmdd_cache *src_cache,
    const llmdd_cache_index *dst_cache_index, uint32_t src_batch_index,
    int64_t size, const llmdd_kv_ext_param *ext, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);
LLMDD_API llmdd_status llmdd_push_kv_blocks_async(
    llmdd *dd, const llmdd_cache *src_cache,
    const llmdd_cache_index *dst_cache_index, const uint64_t *src_blocks,
    const uint64_t *dst_blocks, size_t num_blocks,
    const llmdd_kv_ext_param *ext, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);

/*
 * A batch slot into blocks (0.3; the reference's pull_blocks from a
 * CacheKey, and PullKvBlocks with no source blocks): pulls slot
 * src_cache_index->batch_index of a remote cache (one without blocks) into
 * dst_blocks of the local block cache dst_cache. Per mapped tensor pair,
 * chunk k of the slot, bytes [k*B, (k+1)*B) with B the destination's block
 * stride, lands in block dst_blocks[k]; the last chunk may be short, and the
 * rest of that block is left as it was. num_blocks must be
 * ceil(source slot stride / B). Tensors map as for every pull (ext; NULL is
 * the default). Checks, in the order of every transfer: own arguments
 * (num_blocks 0, NULL lists or caches, ext shape, opts, our own cluster id:
 * LLM_PARAM_INVALID); the local cache (LLM_KV_CACHE_NOT_EXIST), its block
 * indices and range (LLM_PARAM_INVALID); the link (LLM_NOT_YET_LINK); the
 * remote cache (LLM_KV_CACHE_NOT_EXIST), then its slot index, the block
 * count and the range widths (LLM_PARAM_INVALID). A destination block
 * named twice gets the later chunk. As every pull, on every transport.
 */
LLMDD_API llmdd_status llmdd_pull_kv_cache_to_blocks(
    llmdd *dd, const llmdd_cache_index *src_cache_index,
    const llmdd_cache *dst_cache, const uint64_t *dst_blocks, size_t num_blocks,
    const llmdd_kv_ext_param *ext);
LLMDD_API llmdd_status llmdd_pull_kv_cache_to_blocks_async(
    llmdd *dd, const llmdd_cache_index *src_cache_index,
    const llmdd_cache *dst_cache, const uint64_t *dst_blocks, size_t num_blocks,
    const llmdd_kv_ext_param *ext, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);
/*
 * The mirror image (an addition of llmdd's): slot src_batch_index of the
 * local cache src_cache (one without blocks) into dst_blocks of the remote
 * block cache dst_cache_index names (its batch_index must be 0, as for
 * llmdd_push_kv_blocks). B is the remote block stride, num_blocks must be
 * ceil(local slot stride / B), and the checks are those of a push in the
 * order above, with the local slot in place of the local blocks. Layer-wise
 * (LLMDD_XFER_LAYERWISE) as every push.
 */
LLMDD_API llmdd_status llmdd_push_kv_cache_to_blocks(
    llmdd *dd, const llmdd_cache *src_cache,
    const llmdd_cache_index *dst_cache_index, uint32_t src_batch_index,
    const uint64_t *dst_blocks, size_t num_blocks,
    const llmdd_kv_ext_param *ext);
LLMDD_API llmdd_status llmdd_push_kv_cache_to_blocks_async(
    llmdd *dd, const llmdd_cache *src_cache,
    const llmdd_cache_index *dst_cache_index, uint32_t src_batch_index,
    const uint64_t *dst_blocks, size_t num_blocks,
    const llmdd_kv_ext_param *ext, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);

/* timeout_ms: 0 tests, -1 waits until done, > 0 waits up to that long. */
LLMDD_API llmdd_status llmdd_request_wait(llmdd_request *req,
                                          int32_t timeout_ms);
/* Returns once no byte of the transfer will be read or written any more. */
LLMDD_API llmdd_status llmdd_request_cancel(llmdd_request *req);
LLMDD_API llmdd_status llmdd_request_layer_ready(llmdd_request *req,
                                                 uint32_t layer);
LLMDD_API void llmdd_request_free(llmdd_request *req); /* cancels; NULL ok */

/*
 * Liveness (0.3): a round trip on the control connection, answered by the
 * peer's control thread (never behind a transfer). LLM_SUCCESS when the
 * peer answered within timeout_ms (> 0, else LLM_PARAM_INVALID);
 * LLM_NOT_YET_LINK when there is no link or it died meanwhile; LLM_TIMEOUT.
 * Links also watch themselves: each side sends heartbeats at
 * llm.HeartbeatInterval and drops a link whose peer stayed silent for the
 * peer's interval times llm.HeartbeatMisses (docs/model.md, "Liveness").
 */
LLMDD_API llmdd_status llmdd_check_link(llmdd *dd, uint64_t cluster_id,
                                        int32_t timeout_ms);

/*
 * Completions (0.3): one descriptor per instance, none per request.
 * llmdd_completion_fd is readable (level-triggered, like llmdd_notify_fd)
 * while requests posted with LLMDD_XFER_COMPLETION have ended and wait to
 * be collected; owned by the instance, valid from llmdd_initialize until
 * llmdd_destroy; -1 when not initialized. llmdd_get_completions never
 * blocks: it moves up to cap ended requests to out, oldest first; each is
 * returned once, to whichever thread asks first. The caller still reads a
 * request's status with llmdd_request_wait(req, 0) and frees it; a request
 * freed before it was collected leaves the queue.
 */
LLMDD_API int llmdd_completion_fd(llmdd *dd);
LLMDD_API llmdd_status llmdd_get_completions(llmdd *dd, llmdd_request **out,
                                             size_t cap, size_t *count_out);

typedef struct {
    uint64_t cluster_id; /* the sender */
    size_t len;
    unsigned char msg[LLMDD_NOTIFY_MAX];
} llmdd_notify;

/*
 * Flow control (0.3): an instance takes at most LLMDD_NOTIFY_WINDOW
 * notifications from one peer before the application has taken them with
 * llmdd_get_notifies. A send beyond that waits, up to
 * llm.SyncKvCacheWaitTime, until the peer takes some, and then returns
 * LLM_TIMEOUT; the link stays. So LLM_SUCCESS means the peer will deliver
 * the notification unless the link dies.
 */
#define LLMDD_NOTIFY_WINDOW 128

/* Ordered after every transfer this instance completed earlier on that
 * link. */
LLMDD_API llmdd_status llmdd_send_notify(llmdd *dd, uint64_t cluster_id,
                                         const void *msg, size_t len);
/* Never blocks: moves up to cap received notifications to out, oldest
 * first. */
LLMDD_API llmdd_status llmdd_get_notifies(llmdd *dd, llmdd_notify *out,
                                          size_t cap, size_t *count_out);
/* Readable while notifications wait; owned by the instance until finalize;
 * -1 when not initialized. */
LLMDD_API int llmdd_notify_fd(llmdd *dd);

/*
 * Cache keys (0.2): a name of 1..LLMDD_KEY_MAX raw bytes for one batch slot
 * of a local cache, so that a linked peer finds it without knowing ids (the
 * reference's CacheKey and BlocksCacheKey). Keys belong to the instance;
 * deallocating or unregistering the cache removes its keys.
 *
 * llmdd_set_cache_key: LLM_PARAM_INVALID for a bad key or a slot out of
 * range, LLM_KV_CACHE_NOT_EXIST for an unknown cache,
 * LLM_CACHE_KEY_ALREADY_EXIST when the key is bound (the first binding
 * stays). llmdd_remove_cache_key: an unknown key is LLM_SUCCESS.
 * llmdd_lookup_remote_key asks the linked peer `cluster_id` which (cache id,
 * batch index) its key names: LLM_NOT_YET_LINK without a link,
 * LLM_KV_CACHE_NOT_EXIST when the peer has no such key, LLM_TIMEOUT past
 * llm.SyncKvCacheWaitTime. *index_out is written only on success.
 */
#define LLMDD_KEY_MAX 128
LLMDD_API llmdd_status llmdd_set_cache_key(llmdd *dd, int64_t cache_id,
                                           uint32_t batch_index,
                                           const void *key, size_t key_len);
LLMDD_API llmdd_status llmdd_remove_cache_key(llmdd *dd, const void *key,
                                              size_t key_len);
LLMDD_API llmdd_status llmdd_lookup_remote_key(llmdd *dd, uint64_t cluster_id,
                                               const void *key,
                                               size_t key_len,
                                               llmdd_cache_index *index_out);

/*
 * Metrics (0.2): the Prometheus text exposition (format 0.0.4) of this
 * instance's counters, histograms and gauges; docs/operations.md lists them.
 * snprintf's convention: returns the length the whole text needs (without
 * the NUL); writes at most cap bytes into buf, NUL-terminated when cap > 0.
 * The text may grow between two calls, so size the buffer with some slack.
 * dd NULL: returns 0. Thread-safe; cheap enough to call on every scrape.
 */
LLMDD_API size_t llmdd_metrics_text(llmdd *dd, char *buf, size_t cap);

/*
 * KV layouts (0.3): heterogeneous tensor parallelism, block sizes and
 * dimension orders, planned and moved by the library (docs/model.md, "KV
 * layouts"). A layout is fixed metadata of a cache: each tensor is
 * [shape[0] blocks] x one block of the layout, whose dims are, outermost
 * first, BLOCK, then HEAD, TOKEN and (with num_dims 5) PART in any order,
 * and BYTES last ("NHD": BLOCK, TOKEN, HEAD, BYTES; "HND": BLOCK, HEAD,
 * TOKEN, BYTES). Rules, else LLM_PARAM_INVALID at creation: each dim once,
 * BLOCK first, BYTES last, PART iff num_dims == 5, extents >= 1,
 * head_first + num_heads <= total_heads, and block_size * num_heads *
 * head_bytes * num_parts equals the tensor size divided by shape[0]
 * (overflow-checked). A layout cache is an ordinary cache for every other
 * call (a slot is a block); its layout travels to linked peers with its
 * description.
 */
typedef enum {
    LLMDD_KV_DIM_BLOCK = 1,
    LLMDD_KV_DIM_PART = 2,
    LLMDD_KV_DIM_HEAD = 3,
    LLMDD_KV_DIM_TOKEN = 4,
    LLMDD_KV_DIM_BYTES = 5
} llmdd_kv_dim;
#define LLMDD_KV_MAX_DIMS 5
typedef struct {
    uint32_t num_dims;                     /* 4, or 5 with PART */
    llmdd_kv_dim order[LLMDD_KV_MAX_DIMS]; /* outermost first */
    uint32_t block_size;                   /* tokens per block */
    uint32_t num_heads, head_first; /* heads held; global index of the first */
    uint32_t total_heads;           /* the model's KV heads (MLA: 1) */
    uint32_t head_bytes; /* one head of one token, packed scales included */
    uint32_t num_parts;  /* PART extent (K and V in one tensor: 2), else 1 */
    uint64_t compat_tag; /* the caller's model/dtype hash; 0 = unchecked */
} llmdd_kv_layout;

/* llmdd_allocate_cache with a layout. */
LLMDD_API llmdd_status llmdd_allocate_cache_layout(
    llmdd *dd, const llmdd_cache_desc *desc, const llmdd_kv_layout *layout,
    llmdd_cache *cache_out);
/* llmdd_register_kv_cache with a layout. */
LLMDD_API llmdd_status llmdd_register_kv_cache_layout(
    llmdd *dd, const llmdd_cache_desc *desc, const llmdd_kv_layout *layout,
    const uint64_t *addrs, size_t num_addrs, int64_t *id_out);
/*
 * The layout of a linked peer's cache, for a check at startup (it asks the
 * peer): LLM_NOT_YET_LINK without a link, LLM_KV_CACHE_NOT_EXIST for an
 * unknown cache, LLM_CACHE_INCOMPATIBLE when it has no layout.
 */
LLMDD_API llmdd_status llmdd_query_remote_layout(llmdd *dd,
                                                 uint64_t cluster_id,
                                                 int64_t cache_id,
                                                 llmdd_kv_layout *layout_out);

typedef struct {
    const uint64_t *blocks; /* this side's block table for the request */
    size_t num_blocks;
    uint64_t first_token; /* position of blocks[0] slot 0; a multiple of
                             block_size */
} llmdd_block_table;
typedef struct {
    llmdd_block_table src, dst;
    uint64_t token_begin, token_end; /* request positions [begin, end) */
    uint32_t head_begin, head_end; /* global heads; {0,0}: all both hold */
    llmdd_kv_ext_param ext;        /* layer ranges, tensors per layer */
} llmdd_kv_slice;
#define LLMDD_SLICES_MAX 256
/*
 * Slice transfers: for each slice, each mapped tensor pair, part, token t in
 * [token_begin, token_end) and head h in [head_begin, head_end), the
 * head_bytes at (blocks[(t - first_token) / block_size], slot
 * (t - first_token) % block_size, head h - head_first) of the source land at
 * the same coordinates of the destination; nothing else is written. Slice i
 * comes from srcs[i] (a pull) or goes to dsts[i] (a push); every index names
 * its cache with batch_index 0. Every check of docs/model.md runs, in its
 * order, before anything is posted. A slice with token_begin == token_end
 * moves nothing and carries only the notification. opts->notify reaches
 * each peer once, after that peer's bytes landed.
 */
LLMDD_API llmdd_status llmdd_pull_kv_slices_async(
    llmdd *dd, const llmdd_cache_index *srcs, const llmdd_kv_slice *slices,
    size_t n, const llmdd_cache *dst_cache, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);
LLMDD_API llmdd_status llmdd_push_kv_slices_async(
    llmdd *dd, const llmdd_cache *src_cache, const llmdd_cache_index *dsts,
    const llmdd_kv_slice *slices, size_t n, const llmdd_xfer_opts *opts,
    llmdd_request **req_out);
LLMDD_API llmdd_status llmdd_pull_kv_slices(llmdd *dd,
                                            const llmdd_cache_index *srcs,
                                            const llmdd_kv_slice *slices,
                                            size_t n,
                                            const llmdd_cache *dst_cache);
LLMDD_API llmdd_status llmdd_push_kv_slices(llmdd *dd,
                                            const llmdd_cache *src_cache,
                                            const llmdd_cache_index *dsts,
                                            const llmdd_kv_slice *slices,
                                            size_t n);

/*
 * Pure: the size of the plan the library makes for one slice between two
 * layouts, without caches (sizing, benchmarks): the 2-D strided runs
 * (offset, length, count and stride on each side) it moves per tensor pair
 * and their bytes. Tables are checked for alignment and coverage only (no
 * cache bounds them). LLM_PARAM_INVALID for a bad or incompatible layout,
 * a bad table or heads not held by both; an empty token range is 0 runs.
 */
LLMDD_API llmdd_status llmdd_kv_slice_plan_size(const llmdd_kv_layout *src,
                                                const llmdd_kv_layout *dst,
                                                const llmdd_kv_slice *slice,
                                                uint64_t *runs_out,
                                                uint64_t *bytes_out);

/* A piece of llmdd_tp_plan: source rank `rank` gives heads [head_begin,
 * head_end); an empty range: that rank only gets the notification. */
typedef struct {
    uint32_t rank, head_begin, head_end;
} llmdd_tp_piece;
/*
 * Pure: which source ranks hold what dst_rank needs, each destination head
 * read once, replicas spread over destination ranks; every source rank
 * appears once (with an empty piece when it gives nothing), so the request
 * notifies all. Head ownership: with tp <= H, rank r holds heads
 * [r*H/tp, (r+1)*H/tp) and H % tp must be 0; with tp > H, rank r holds head
 * floor(r*H/tp) and tp % H must be 0. LLM_PARAM_INVALID otherwise, for
 * dst_rank >= dst_tp, NULLs, or cap below the piece count (src_tp pieces).
 */
LLMDD_API llmdd_status llmdd_tp_plan(uint32_t total_heads, uint32_t src_tp,
                                     uint32_t dst_tp, uint32_t dst_rank,
                                     llmdd_tp_piece *out, size_t cap,
                                     size_t *count_out);

/*
 * The batch dimension (0.4; the reference's CacheDesc.batch_dim_index): a
 * cache whose slots are indexed by shape[batch_dim] instead of shape[0].
 * Slot b of each tensor is then the strided sub-tensor at index b of that
 * dimension, rows of the dims after it (row = their product times the
 * element size), one row for each index of the dims before it; a slot
 * call's size and copy offset count bytes of the slot in row-major order of
 * the remaining dims and must be whole rows (else LLM_PARAM_INVALID, as
 * for batch_dim >= num_dims). Batch dimension 0 is llmdd_allocate_cache and
 * llmdd_register_kv_cache, the 0.3 calls. The batch dimension is fixed for
 * the cache's life and travels to peers with its description; block calls
 * and slice transfers need batch dimension 0 on both sides
 * (LLM_PARAM_INVALID). docs/model.md, "The batch dimension".
 */
LLMDD_API llmdd_status llmdd_allocate_cache_ex(llmdd *dd,
                                               const llmdd_cache_desc *desc,
                                               uint32_t batch_dim,
                                               llmdd_cache *cache_out);
LLMDD_API llmdd_status llmdd_register_kv_cache_ex(
    llmdd *dd, const llmdd_cache_desc *desc, uint32_t batch_dim,
    const uint64_t *addrs, size_t num_addrs, int64_t *cache_id_out);
/*
 * Discovery (0.3, docs/model.md "Discovery"). With llm.MetadataServer
 * (etcd://HOST:PORT[,HOST:PORT...], etcd's v3 JSON gateway over HTTP) set
 * at llmdd_initialize:
 *  - initialize reaches the server within 5 s or returns LLM_TIMEOUT (and
 *    a listener's publishing has 5 s of its own);
 *  - a listening instance publishes PREFIX/clusters/CLUSTER_ID
 *    (llm.MetadataPrefix, default "llmdd": its listen address, role,
 *    protocol version, transports, host boot id and pid) under a lease of
 *    llm.MetadataLeaseMs that a metadata thread keeps alive; llmdd_set_role
 *    publishes when it starts listening and removes the entry when it
 *    stops; finalize revokes the lease. A wildcard listen address is
 *    LLM_PARAM_INVALID. A cluster id published by a live instance is
 *    LLM_PARAM_INVALID (one etcd transaction); the entry of a dead process
 *    on this host (same boot id) is taken over;
 *  - llmdd_link_clusters with num_remote_ip_infos == 0 looks the cluster
 *    up: LLM_LINK_FAILED when it is not published, LLM_TIMEOUT when the
 *    server does not answer within the call's timeout;
 *  - a peer whose entry is deleted or expires can no longer be looked up;
 *    its link ends only when its heartbeats stop (0.4: heartbeats are the
 *    authority on liveness), or with the entry when it announced none (its
 *    requests end with LLM_NOT_YET_LINK); nothing relinks by itself. An
 *    entry merely absent because the server lost its data drops nothing,
 *    and every instance publishes again within one lease period once the
 *    server is back; an instance's own entry deleted or overwritten by
 *    someone else is taken back within one lease period (never from
 *    another live instance of its cluster id, which is logged at error).
 * llmdd_metadata_list: every entry published under prefix (NULL: "llmdd")
 * as a JSON array of the entries' objects, snprintf's convention for buf
 * and cap (*len_out: the whole length); no instance needed. LLM_TIMEOUT
 * when the server does not answer within timeout_ms.
 */
LLMDD_API llmdd_status llmdd_metadata_list(const char *server,
                                           const char *prefix,
                                           int32_t timeout_ms, char *buf,
                                           size_t cap, size_t *len_out);

#ifdef __cplusplus
}
#endif

#endif /* LLMDD_LLMDD_H */
