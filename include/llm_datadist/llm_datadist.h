/*
 * LLM-DataDist's C++ interface over llmdd: code written for the reference
 * header <llm_datadist/llm_datadist.h> (namespace llm_datadist, class
 * LlmDataDist) compiles against this one unchanged and runs on llmdd.
 *
 * Header-only and exception-free: every call returns a Status, as the
 * reference does. The mapping and what differs are in docs/cpp.md; in short:
 *  - Statuses, data types and option names carry the reference's names and
 *    values (the LLM_* codes are llmdd's, see <llmdd/llmdd.h>).
 *  - Without device support, CachePlacement::kDevice is host memory (each
 *    instance logs it once).
 *  - A Cache passed to a transfer or a copy is known by its cache_id alone.
 *  - Options that only mean something on Ascend hardware (buffer pool,
 *    communication resources, transfer backend) are accepted and ignored
 *    with one log line.
 *
 * Thread safety: as the C library's: one LlmDataDist may be used from several
 * threads, except that Finalize and destruction must not race other calls.
 */
#ifndef LLMDD_LLM_DATADIST_LLM_DATADIST_H
#define LLMDD_LLM_DATADIST_LLM_DATADIST_H

#include <llmdd/llmdd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace ge {

using Status = uint32_t;
constexpr Status SUCCESS = 0x0U;
constexpr Status FAILED = 0xFFFFFFFFU;

/* The LLM_* codes, the same constants as llmdd's (not macros in C++). */
#define LLMDD__USING_STATUS(name, value) using ::name;
LLMDD_STATUS_MAP(LLMDD__USING_STATUS)

/* A string that, like the reference's, is built implicitly from a C string
 * and keys the option map. */
class AscendString {
  public:
    AscendString() = default;
    AscendString(const char *name) : s_(name != nullptr ? name : "") {}
    AscendString(const char *name, size_t length)
        : s_(name != nullptr ? std::string(name, length) : std::string())
    {
    }
    const char *GetString() const { return s_.c_str(); }
    size_t GetLength() const { return s_.size(); }
    size_t Hash() const { return std::hash<std::string>()(s_); }

    bool operator<(const AscendString &o) const { return s_ < o.s_; }
    bool operator>(const AscendString &o) const { return s_ > o.s_; }
    bool operator<=(const AscendString &o) const { return s_ <= o.s_; }
    bool operator>=(const AscendString &o) const { return s_ >= o.s_; }
    bool operator==(const AscendString &o) const { return s_ == o.s_; }
    bool operator!=(const AscendString &o) const { return s_ != o.s_; }

  private:
    std::string s_;
};

/* The reference's numbering; llmdd moves the types with a known size. */
enum DataType {
    DT_FLOAT = 0,
    DT_FLOAT16 = 1,
    DT_INT8 = 2,
    DT_INT32 = 3,
    DT_UINT8 = 4,
    DT_INT16 = 6,
    DT_UINT16 = 7,
    DT_UINT32 = 8,
    DT_INT64 = 9,
    DT_UINT64 = 10,
    DT_DOUBLE = 11,
    DT_BOOL = 12,
    DT_STRING = 13,
    DT_DUAL_SUB_INT8 = 14,
    DT_DUAL_SUB_UINT8 = 15,
    DT_COMPLEX64 = 16,
    DT_COMPLEX128 = 17,
    DT_QINT8 = 18,
    DT_QINT16 = 19,
    DT_QINT32 = 20,
    DT_QUINT8 = 21,
    DT_QUINT16 = 22,
    DT_RESOURCE = 23,
    DT_STRING_REF = 24,
    DT_DUAL = 25,
    DT_VARIANT = 26,
    DT_BF16 = 27,
    DT_UNDEFINED = 28,
    DT_INT4 = 29,
    DT_UINT1 = 30,
    DT_INT2 = 31,
    DT_UINT2 = 32,
    DT_COMPLEX32 = 33,
    DT_HIFLOAT8 = 34,
    DT_FLOAT8_E5M2 = 35,
    DT_FLOAT8_E4M3FN = 36,
    DT_FLOAT8_E8M0 = 37,
    DT_FLOAT6_E3M2 = 38,
    DT_FLOAT6_E2M3 = 39,
    DT_FLOAT4_E2M1 = 40,
    DT_FLOAT4_E1M2 = 41,
    DT_MAX
};

} // namespace ge

namespace std {
template <> struct hash<ge::AscendString> {
    size_t operator()(const ge::AscendString &s) const { return s.Hash(); }
};
} // namespace std

namespace llm_datadist {

using Status = ge::Status;
using AscendString = ge::AscendString;
using DataType = ge::DataType;

LLMDD_STATUS_MAP(LLMDD__USING_STATUS)
#undef LLMDD__USING_STATUS

using ge::DT_BF16;
using ge::DT_BOOL;
using ge::DT_COMPLEX128;
using ge::DT_COMPLEX32;
using ge::DT_COMPLEX64;
using ge::DT_DOUBLE;
using ge::DT_DUAL;
using ge::DT_DUAL_SUB_INT8;
using ge::DT_DUAL_SUB_UINT8;
using ge::DT_FLOAT;
using ge::DT_FLOAT16;
using ge::DT_FLOAT4_E1M2;
using ge::DT_FLOAT4_E2M1;
using ge::DT_FLOAT6_E2M3;
using ge::DT_FLOAT6_E3M2;
using ge::DT_FLOAT8_E4M3FN;
using ge::DT_FLOAT8_E5M2;
using ge::DT_FLOAT8_E8M0;
using ge::DT_HIFLOAT8;
using ge::DT_INT16;
using ge::DT_INT2;
using ge::DT_INT32;
using ge::DT_INT4;
using ge::DT_INT64;
using ge::DT_INT8;
using ge::DT_QINT16;
using ge::DT_QINT32;
using ge::DT_QINT8;
using ge::DT_QUINT16;
using ge::DT_QUINT8;
using ge::DT_RESOURCE;
using ge::DT_STRING;
using ge::DT_STRING_REF;
using ge::DT_UINT1;
using ge::DT_UINT16;
using ge::DT_UINT2;
using ge::DT_UINT32;
using ge::DT_UINT64;
using ge::DT_UINT8;
using ge::DT_UNDEFINED;
using ge::DT_VARIANT;

/* Option keys. The last four are accepted and, here, have no effect. */
constexpr const char OPTION_LISTEN_IP_INFO[] = "llm.ListenIpInfo";
constexpr const char OPTION_DEVICE_ID[] = "llm.DeviceId";
constexpr const char OPTION_SYNC_CACHE_WAIT_TIME[] = "llm.SyncKvCacheWaitTime";
constexpr const char OPTION_BUF_POOL_CFG[] = "llm.BufPoolCfg";
constexpr const char OPTION_ENABLE_SET_ROLE[] = "llm.EnableSwitchRole";
constexpr const char OPTION_LOCAL_COMM_RES[] = "llm.LocalCommRes";
constexpr const char OPTION_TRANSFER_BACKEND[] = "llm.TransferBackend";
/* llmdd's discovery through etcd (docs/model.md, "Discovery"): with the
 * server set, a ClusterInfo without remote_ip_infos is looked up by its
 * remote_cluster_id. */
constexpr const char OPTION_METADATA_SERVER[] = "llm.MetadataServer";
constexpr const char OPTION_METADATA_PREFIX[] = "llm.MetadataPrefix";
constexpr const char OPTION_METADATA_LEASE_MS[] = "llm.MetadataLeaseMs";

struct IpInfo {
    AscendString ip;
    uint16_t port = 0U;
    uint8_t reserved[128];
};

struct ClusterInfo {
    uint64_t remote_cluster_id = 0U;
    int32_t remote_role_type = 0;
    std::vector<IpInfo> local_ip_infos;
    std::vector<IpInfo> remote_ip_infos;
    uint8_t reserved[128];
};

enum class LlmRole : int32_t { kPrompt = 1, kDecoder = 2, kMix = 3, kEnd };

/* An aggregate without default member initialisers, as the reference's. */
struct CacheIndex {
    uint64_t cluster_id;
    int64_t cache_id;
    uint32_t batch_index;
    uint8_t reserved[128];
};

enum class CachePlacement : uint32_t { kHost = 0U, kDevice = 1U };

struct CacheDesc {
    CachePlacement placement = CachePlacement::kDevice;
    uint32_t num_tensors = 0U;
    DataType data_type = DT_UNDEFINED;
    std::vector<int64_t> shape;
    uint8_t reserved[128];
};

struct Cache {
    int64_t cache_id = -1;
    std::vector<uintptr_t> tensor_addrs;
    CacheDesc cache_desc;
    uint8_t reserved[128];
};

struct KvCacheExtParam {
    std::pair<int32_t, int32_t> src_layer_range = {-1, -1};
    std::pair<int32_t, int32_t> dst_layer_range = {-1, -1};
    uint8_t tensor_num_per_layer = 2U;
    uint8_t reserved[127];
};

struct RegisterCfg {
    uint8_t reserved[128] = {0};
};

namespace detail {

static_assert(sizeof(uintptr_t) == sizeof(uint64_t),
              "tensor addresses are 64-bit");

inline Status
to_c_desc(const CacheDesc &d, llmdd_cache_desc &out)
{
    if (d.shape.empty() || d.shape.size() > LLMDD_MAX_DIMS)
        return LLM_PARAM_INVALID;
    std::memset(&out, 0, sizeof(out));
    out.placement = d.placement == CachePlacement::kHost
                        ? LLMDD_PLACEMENT_HOST
                        : LLMDD_PLACEMENT_DEVICE;
    out.num_tensors = d.num_tensors;
    out.data_type = static_cast<llmdd_data_type>(d.data_type);
    out.num_dims = static_cast<uint32_t>(d.shape.size());
    for (size_t i = 0; i < d.shape.size(); i++)
        out.shape[i] = d.shape[i];
    return LLM_SUCCESS;
}

/*
 * A view of a Cache for the C calls, which find a local cache by its id
 * alone: as the reference documents, a Cache that holds only the cache_id
 * RegisterKvCache returned is enough, so nothing else is converted or
 * checked here.
 */
inline llmdd_cache
to_c_cache(const Cache &c)
{
    llmdd_cache out;
    std::memset(&out, 0, sizeof(out));
    out.cache_id = c.cache_id;
    return out;
}

inline llmdd_kv_ext_param
to_c_ext(const KvCacheExtParam &e)
{
    llmdd_kv_ext_param p;
    p.src_layer_range = {e.src_layer_range.first, e.src_layer_range.second};
    p.dst_layer_range = {e.dst_layer_range.first, e.dst_layer_range.second};
    p.tensor_num_per_layer = e.tensor_num_per_layer;
    return p;
}

inline std::vector<llmdd_option>
to_c_options(const std::map<AscendString, AscendString> &options)
{
    std::vector<llmdd_option> v;
    v.reserve(options.size());
    for (const auto &kv : options)
        v.push_back({kv.first.GetString(), kv.second.GetString()});
    return v;
}

/* Owns the C cluster descriptions of one call. */
struct CClusters {
    std::vector<llmdd_ip_info> ips;
    std::vector<llmdd_cluster_info> infos;

    Status build(const std::vector<ClusterInfo> &clusters)
    {
        size_t n = 0;
        for (const auto &c : clusters)
            n += c.local_ip_infos.size() + c.remote_ip_infos.size();
        ips.resize(n);
        size_t k = 0;
        for (const auto &c : clusters) {
            llmdd_cluster_info ci;
            std::memset(&ci, 0, sizeof(ci));
            ci.remote_cluster_id = c.remote_cluster_id;
            ci.remote_role_type = c.remote_role_type;
            ci.local_ip_infos = ips.data() + k;
            ci.num_local_ip_infos = c.local_ip_infos.size();
            for (const auto &ip : c.local_ip_infos)
                if (copy_ip(ip, ips[k++]) != LLM_SUCCESS)
                    return LLM_PARAM_INVALID;
            ci.remote_ip_infos = ips.data() + k;
            ci.num_remote_ip_infos = c.remote_ip_infos.size();
            for (const auto &ip : c.remote_ip_infos)
                if (copy_ip(ip, ips[k++]) != LLM_SUCCESS)
                    return LLM_PARAM_INVALID;
            infos.push_back(ci);
        }
        return LLM_SUCCESS;
    }

    static Status copy_ip(const IpInfo &in, llmdd_ip_info &out)
    {
        std::memset(&out, 0, sizeof(out));
        if (in.ip.GetLength() >= sizeof(out.ip))
            return LLM_PARAM_INVALID;
        std::memcpy(out.ip, in.ip.GetString(), in.ip.GetLength());
        out.port = in.port;
        return LLM_SUCCESS;
    }
};

} // namespace detail

class LlmDataDist {
  public:
    LlmDataDist(uint64_t cluster_id, LlmRole role)
    {
        create_status_ =
            llmdd_create(cluster_id, static_cast<llmdd_role>(role), &dd_);
        if (create_status_ != LLM_SUCCESS)
            dd_ = nullptr;
    }
    ~LlmDataDist() { llmdd_destroy(dd_); }
    LlmDataDist(const LlmDataDist &) = delete;
    LlmDataDist &operator=(const LlmDataDist &) = delete;

    Status Initialize(const std::map<AscendString, AscendString> &options)
    {
        if (dd_ == nullptr) /* why the constructor failed: a role outside
                               1..3 (LLM_PARAM_INVALID), no memory, ... */
            return create_status_;
        std::vector<llmdd_option> o = detail::to_c_options(options);
        return llmdd_initialize(dd_, o.data(), o.size());
    }

    void Finalize() { llmdd_finalize(dd_); }

    Status SetRole(LlmRole role,
                   const std::map<AscendString, AscendString> &options = {})
    {
        if (dd_ == nullptr)
            return create_status_;
        std::vector<llmdd_option> o = detail::to_c_options(options);
        return llmdd_set_role(dd_, static_cast<llmdd_role>(role), o.data(),
                              o.size());
    }

    Status LinkLlmClusters(const std::vector<ClusterInfo> &clusters,
                           std::vector<Status> &rets,
                           int32_t timeout_in_millis = 1000)
    {
        return link(clusters, rets, timeout_in_millis, false, false);
    }

    Status UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters,
                             std::vector<Status> &rets,
                             int32_t timeout_in_millis = 1000,
                             bool force_flag = false)
    {
        return link(clusters, rets, timeout_in_millis, true, force_flag);
    }

    Status AllocateCache(const CacheDesc &cache_desc, Cache &cache)
    {
        llmdd_cache_desc d;
        llmdd_cache c;
        Status st = detail::to_c_desc(cache_desc, d);
        if (st != LLM_SUCCESS || dd_ == nullptr)
            return LLM_PARAM_INVALID;
        if ((st = llmdd_allocate_cache(dd_, &d, &c)) != LLM_SUCCESS)
            return st;
        cache.cache_id = c.cache_id;
        cache.cache_desc = cache_desc;
        cache.tensor_addrs.assign(c.tensor_addrs,
                                  c.tensor_addrs + d.num_tensors);
        return LLM_SUCCESS;
    }

    /* As the reference: a cache that does not exist is LLM_SUCCESS. */
    Status DeallocateCache(int64_t cache_id)
    {
        Status st = llmdd_deallocate_cache(dd_, cache_id);
        return st == LLM_KV_CACHE_NOT_EXIST ? LLM_SUCCESS : st;
    }

    Status RegisterKvCache(const CacheDesc &cache_desc,
                           const std::vector<uint64_t> &addrs,
                           const RegisterCfg &cfg, int64_t &cache_id)
    {
        llmdd_cache_desc d;
        (void)cfg;
        if (detail::to_c_desc(cache_desc, d) != LLM_SUCCESS || dd_ == nullptr)
            return LLM_PARAM_INVALID;
        return llmdd_register_kv_cache(dd_, &d, addrs.data(), addrs.size(),
                                       &cache_id);
    }

    Status UnregisterKvCache(int64_t cache_id)
    {
        return llmdd_unregister_kv_cache(dd_, cache_id);
    }

    Status PullKvCache(const CacheIndex &src_cache_index,
                       const Cache &dst_cache, uint32_t batch_index = 0U,
                       int64_t size = -1,
                       const KvCacheExtParam &ext_param = {})
    {
        llmdd_cache dst = detail::to_c_cache(dst_cache);
        llmdd_cache_index src = index(src_cache_index);
        llmdd_kv_ext_param ext = detail::to_c_ext(ext_param);
        return llmdd_pull_kv_cache(dd_, &src, &dst, batch_index, size, &ext);
    }

    /*
     * With src_blocks empty, the source is a cache without blocks: its slot
     * src_cache_index.batch_index is cut into dst_cache's blocks, chunk k
     * into dst_blocks[k] (llmdd_pull_kv_cache_to_blocks).
     */
    Status PullKvBlocks(const CacheIndex &src_cache_index,
                        const Cache &dst_cache,
                        const std::vector<uint64_t> &src_blocks,
                        const std::vector<uint64_t> &dst_blocks,
                        const KvCacheExtParam &ext_param = {})
    {
        llmdd_cache dst = detail::to_c_cache(dst_cache);
        llmdd_cache_index src = index(src_cache_index);
        llmdd_kv_ext_param ext = detail::to_c_ext(ext_param);
        if (src_blocks.empty())
            return llmdd_pull_kv_cache_to_blocks(
                dd_, &src, &dst, dst_blocks.data(), dst_blocks.size(), &ext);
        if (src_blocks.size() != dst_blocks.size())
            return LLM_PARAM_INVALID;
        return llmdd_pull_kv_blocks(dd_, &src, &dst, src_blocks.data(),
                                    dst_blocks.data(), src_blocks.size(),
                                    &ext);
    }

    Status PushKvCache(const Cache &src_cache,
                       const CacheIndex &dst_cache_index,
                       uint32_t src_batch_index = 0U, int64_t size = -1,
                       const KvCacheExtParam &ext_param = {})
    {
        llmdd_cache src = detail::to_c_cache(src_cache);
        llmdd_cache_index dst = index(dst_cache_index);
        llmdd_kv_ext_param ext = detail::to_c_ext(ext_param);
        return llmdd_push_kv_cache(dd_, &src, &dst, src_batch_index, size,
                                   &ext);
    }

    Status PushKvBlocks(const Cache &src_cache,
                        const CacheIndex &dst_cache_index,
                        const std::vector<uint64_t> &src_blocks,
                        const std::vector<uint64_t> &dst_blocks,
                        const KvCacheExtParam &ext_param = {})
    {
        llmdd_cache src = detail::to_c_cache(src_cache);
        if (src_blocks.size() != dst_blocks.size())
            return LLM_PARAM_INVALID;
        llmdd_cache_index dst = index(dst_cache_index);
        llmdd_kv_ext_param ext = detail::to_c_ext(ext_param);
        return llmdd_push_kv_blocks(dd_, &src, &dst, src_blocks.data(),
                                    dst_blocks.data(), src_blocks.size(),
                                    &ext);
    }

    Status CopyKvCache(const Cache &src_cache, const Cache &dst_cache,
                       uint32_t src_batch_index = 0U,
                       uint32_t dst_batch_index = 0U, uint64_t offset = 0U,
                       int64_t size = -1)
    {
        llmdd_cache src = detail::to_c_cache(src_cache);
        llmdd_cache dst = detail::to_c_cache(dst_cache);
        return llmdd_copy_kv_cache(dd_, &src, &dst, src_batch_index,
                                   dst_batch_index, offset, size);
    }

    /*
     * Copies src_blocks into each list of dst_blocks_list in turn, as one
     * llmdd_copy_kv_blocks call over the lists laid end to end (the source
     * list repeated), so that every list is checked (length, block range)
     * before the first byte moves, and pairs still apply in order.
     */
    Status CopyKvBlocks(
        const Cache &src_cache, const Cache &dst_cache,
        const std::vector<uint64_t> &src_blocks,
        const std::vector<std::vector<uint64_t>> &dst_blocks_list)
    {
        llmdd_cache src = detail::to_c_cache(src_cache);
        llmdd_cache dst = detail::to_c_cache(dst_cache);
        if (dst_blocks_list.empty())
            return LLM_PARAM_INVALID;
        std::vector<uint64_t> all_src, all_dst;
        for (const auto &dst_blocks : dst_blocks_list) {
            if (dst_blocks.size() != src_blocks.size())
                return LLM_PARAM_INVALID;
            all_src.insert(all_src.end(), src_blocks.begin(), src_blocks.end());
            all_dst.insert(all_dst.end(), dst_blocks.begin(), dst_blocks.end());
        }
        return llmdd_copy_kv_blocks(dd_, &src, &dst, all_src.data(),
                                    all_dst.data(), all_src.size());
    }

    /* The C instance, for llmdd's own calls (llmdd_ext below); nullptr
     * when the constructor failed. */
    ::llmdd *NativeHandle() const { return dd_; }

  private:
    static llmdd_cache_index index(const CacheIndex &i)
    {
        llmdd_cache_index c = {i.cluster_id, i.cache_id, i.batch_index};
        return c;
    }

    Status link(const std::vector<ClusterInfo> &clusters,
                std::vector<Status> &rets, int32_t timeout, bool unlink,
                bool force)
    {
        detail::CClusters c;
        if (dd_ == nullptr || c.build(clusters) != LLM_SUCCESS)
            return LLM_PARAM_INVALID;
        std::vector<Status> r(clusters.size(), LLM_FAILED);
        Status st =
            unlink ? llmdd_unlink_clusters(dd_, c.infos.data(),
                                           c.infos.size(), r.data(), timeout,
                                           force)
                   : llmdd_link_clusters(dd_, c.infos.data(), c.infos.size(),
                                         r.data(), timeout);
        rets = std::move(r);
        return st;
    }

    llmdd *dd_ = nullptr;
    Status create_status_ = LLM_SUCCESS; /* llmdd_create's, for later calls */
};

/*
 * llmdd's extensions beyond the reference: KV layouts and slice transfers
 * (heterogeneous TP, block sizes and orders; docs/model.md, "KV layouts").
 * Free functions over an LlmDataDist; every one returns a Status.
 */
namespace llmdd_ext {

using KvLayout = llmdd_kv_layout;
using TpPiece = llmdd_tp_piece;

/* A layout by name, read outermost first after the block dim: "NHD"
 * (tokens, heads, bytes), "HND", or with P (parts) such as "PHND". An
 * unknown name gives num_dims 0, which the library refuses. */
inline KvLayout
MakeLayout(const char *order, uint32_t block_size, uint32_t head_first,
           uint32_t num_heads, uint32_t total_heads, uint32_t head_bytes,
           uint32_t num_parts = 1, uint64_t compat_tag = 0)
{
    KvLayout l;
    std::memset(&l, 0, sizeof(l));
    size_t n = order != nullptr ? std::strlen(order) : 0;
    if (n >= 3 && n <= 4) {
        l.num_dims = static_cast<uint32_t>(n + 1);
        l.order[0] = LLMDD_KV_DIM_BLOCK;
        for (size_t i = 0; i < n && l.num_dims != 0; i++) {
            switch (order[i]) {
            case 'N': l.order[i + 1] = LLMDD_KV_DIM_TOKEN; break;
            case 'H': l.order[i + 1] = LLMDD_KV_DIM_HEAD; break;
            case 'P': l.order[i + 1] = LLMDD_KV_DIM_PART; break;
            case 'D': l.order[i + 1] = LLMDD_KV_DIM_BYTES; break;
            default: l.num_dims = 0;
            }
        }
    }
    l.block_size = block_size;
    l.head_first = head_first;
    l.num_heads = num_heads;
    l.total_heads = total_heads;
    l.head_bytes = head_bytes;
    l.num_parts = num_parts;
    l.compat_tag = compat_tag;
    return l;
}

inline Status
AllocateCacheLayout(LlmDataDist &dd, const CacheDesc &cache_desc,
                    const KvLayout &layout, Cache &cache)
{
    llmdd_cache_desc d;
    llmdd_cache c;
    if (detail::to_c_desc(cache_desc, d) != LLM_SUCCESS ||
        dd.NativeHandle() == nullptr)
        return LLM_PARAM_INVALID;
    Status st = llmdd_allocate_cache_layout(dd.NativeHandle(), &d, &layout, &c);
    if (st != LLM_SUCCESS)
        return st;
    cache.cache_id = c.cache_id;
    cache.cache_desc = cache_desc;
    cache.tensor_addrs.assign(c.tensor_addrs, c.tensor_addrs + d.num_tensors);
    return LLM_SUCCESS;
}

inline Status
RegisterKvCacheLayout(LlmDataDist &dd, const CacheDesc &cache_desc,
                      const KvLayout &layout,
                      const std::vector<uint64_t> &addrs, int64_t &cache_id)
{
    llmdd_cache_desc d;
    if (detail::to_c_desc(cache_desc, d) != LLM_SUCCESS ||
        dd.NativeHandle() == nullptr)
        return LLM_PARAM_INVALID;
    return llmdd_register_kv_cache_layout(dd.NativeHandle(), &d, &layout,
                                          addrs.data(), addrs.size(),
                                          &cache_id);
}

inline Status
QueryRemoteLayout(LlmDataDist &dd, uint64_t cluster_id, int64_t cache_id,
                  KvLayout &layout)
{
    return llmdd_query_remote_layout(dd.NativeHandle(), cluster_id, cache_id,
                                     &layout);
}

/* One slice: token positions [token_begin, token_end) and global heads
 * [head_begin, head_end) ({0,0}: all both hold) from the source's table to
 * the destination's. */
struct Slice {
    std::vector<uint64_t> src_blocks, dst_blocks;
    uint64_t src_first_token = 0, dst_first_token = 0;
    uint64_t token_begin = 0, token_end = 0;
    uint32_t head_begin = 0, head_end = 0;
    KvCacheExtParam ext_param = {};
};

namespace detail2 {
inline std::vector<llmdd_kv_slice>
to_c_slices(const std::vector<Slice> &slices)
{
    std::vector<llmdd_kv_slice> v(slices.size());
    for (size_t i = 0; i < slices.size(); i++) {
        const Slice &s = slices[i];
        v[i].src = {s.src_blocks.data(), s.src_blocks.size(),
                    s.src_first_token};
        v[i].dst = {s.dst_blocks.data(), s.dst_blocks.size(),
                    s.dst_first_token};
        v[i].token_begin = s.token_begin;
        v[i].token_end = s.token_end;
        v[i].head_begin = s.head_begin;
        v[i].head_end = s.head_end;
        v[i].ext = detail::to_c_ext(s.ext_param);
    }
    return v;
}
inline std::vector<llmdd_cache_index>
to_c_indexes(const std::vector<CacheIndex> &idx)
{
    std::vector<llmdd_cache_index> v(idx.size());
    for (size_t i = 0; i < idx.size(); i++)
        v[i] = {idx[i].cluster_id, idx[i].cache_id, idx[i].batch_index};
    return v;
}
} // namespace detail2

/* Slice i from srcs[i] into the local layout cache dst_cache; one request,
 * every check first (srcs.size() must equal slices.size()). */
inline Status
PullKvSlices(LlmDataDist &dd, const std::vector<CacheIndex> &srcs,
             const std::vector<Slice> &slices, const Cache &dst_cache)
{
    if (srcs.size() != slices.size())
        return LLM_PARAM_INVALID;
    std::vector<llmdd_kv_slice> s = detail2::to_c_slices(slices);
    std::vector<llmdd_cache_index> i = detail2::to_c_indexes(srcs);
    llmdd_cache dst = detail::to_c_cache(dst_cache);
    return llmdd_pull_kv_slices(dd.NativeHandle(), i.data(), s.data(),
                                s.size(), &dst);
}

inline Status
PushKvSlices(LlmDataDist &dd, const Cache &src_cache,
             const std::vector<CacheIndex> &dsts,
             const std::vector<Slice> &slices)
{
    if (dsts.size() != slices.size())
        return LLM_PARAM_INVALID;
    std::vector<llmdd_kv_slice> s = detail2::to_c_slices(slices);
    std::vector<llmdd_cache_index> i = detail2::to_c_indexes(dsts);
    llmdd_cache src = detail::to_c_cache(src_cache);
    return llmdd_push_kv_slices(dd.NativeHandle(), &src, i.data(), s.data(),
                                s.size());
}

/* llmdd_tp_plan: one piece per source rank. */
inline Status
TpPlan(uint32_t total_heads, uint32_t src_tp, uint32_t dst_tp,
       uint32_t dst_rank, std::vector<TpPiece> &pieces)
{
    std::vector<TpPiece> v(src_tp);
    size_t n = 0;
    Status st = llmdd_tp_plan(total_heads, src_tp, dst_tp, dst_rank,
                              v.data(), v.size(), &n);
    if (st == LLM_SUCCESS) {
        v.resize(n);
        pieces = std::move(v);
    }
    return st;
}

} // namespace llmdd_ext

} // namespace llm_datadist

#endif
