// A prompt and a decoder written the way LLM-DataDist's own C++ examples
// are (device buffers from aclrtMalloc, caches registered by address, Cache
// objects that hold only the cache_id RegisterKvCache returned), run on
// llmdd with the host-memory ACL stand-in of tests/compat/acl. Every byte
// that moves is checked, and so are the bytes that must not change.
//
//   1. The decoder links, pulls blocks and whole slots, pulls a slot of a
//      cache without blocks into blocks (PullKvBlocks with no source
//      blocks), pulls a one-tensor cache with the default KvCacheExtParam,
//      pushes blocks and a slot back (a decoder pushes), copies blocks
//      locally, and unlinks by cluster id.
//   2. Both switch roles: the decoder becomes a prompt and listens, the
//      prompt becomes a decoder, links to it, pushes layer by layer and
//      pulls, and unlinks by cluster id.
//
//   compat_cpp_pull_push        (forks the prompt itself)
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "acl/acl.h"
#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

namespace
{

constexpr uint64_t kPromptClusterId = 0;
constexpr uint64_t kDecoderClusterId = 1;
constexpr uint32_t kNumTensors = 4U;
const std::vector<int64_t> kBlocksShape = {8, 16}; // 8 blocks of 16 int32
constexpr size_t kBlockSize = 16 * sizeof(int32_t);
constexpr size_t kTensorSize = 8 * kBlockSize;
const std::vector<int64_t> kSlotShape = {2, 64};   // 2 slots of 64 int32
constexpr size_t kSlotSize = 64 * sizeof(int32_t); // four blocks' worth
const std::vector<int64_t> kOneShape = {4, 32};    // one tensor, 4 slots
constexpr size_t kOneSlotSize = 32 * sizeof(int32_t);

int failures;

#define EXPECT(cond)                                                           \
    do {                                                                       \
        if (!(cond)) {                                                         \
            failures++;                                                        \
            std::printf("[ERROR] %s:%d: %s\n", __FILE__, __LINE__, #cond);     \
        }                                                                      \
    } while (0)

// The value of element i of tensor t of a buffer set filled with `seed`.
int32_t
Value(int seed, uint32_t t, size_t i)
{
    return static_cast<int32_t>(seed * 1000003 + t * 10007 + i * 7 + 1);
}

// A line-based control channel between the two processes (the examples
// synchronise by hand; here both sides wait for each other explicitly).
class ControlChannel
{
  public:
    ControlChannel(int in, int out) : in_(in), out_(out)
    {
    }
    void
    Send(const std::string &s)
    {
        std::string l = s + "\n";
        if (write(out_, l.data(), l.size()) != static_cast<ssize_t>(l.size()))
            failures++;
    }
    std::string
    Recv()
    {
        std::string s;
        char ch;
        while (read(in_, &ch, 1) == 1 && ch != '\n')
            s += ch;
        return s;
    }

  private:
    int in_, out_;
};

uint16_t
FreePort()
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(s, reinterpret_cast<sockaddr *>(&a), sizeof(a)) != 0 ||
        getsockname(s, reinterpret_cast<sockaddr *>(&a), &len) != 0)
        a.sin_port = 0;
    close(s);
    return ntohs(a.sin_port);
}

// Device buffers for a cache, registered; cache_id is RegisterKvCache's.
struct DeviceCache {
    std::vector<void *> buffers;
    size_t tensor_size = 0;
    int64_t cache_id = -1;
};

int32_t
RegisterCache(LlmDataDist &llm_datadist, const std::vector<int64_t> &shape,
              uint32_t num_tensors, size_t tensor_size, int seed,
              DeviceCache &out)
{
    CacheDesc cache_desc{};
    cache_desc.num_tensors = num_tensors;
    cache_desc.data_type = DT_INT32;
    cache_desc.shape = shape;
    std::vector<uint64_t> tensor_addrs;
    for (uint32_t t = 0U; t < num_tensors; ++t) {
        void *buffer = nullptr;
        if (aclrtMalloc(&buffer, tensor_size, ACL_MEM_MALLOC_HUGE_ONLY) !=
            ACL_ERROR_NONE)
            return -1;
        std::vector<int32_t> host(tensor_size / sizeof(int32_t));
        for (size_t i = 0; i < host.size(); ++i)
            host[i] = seed == 0 ? 0 : Value(seed, t, i);
        aclrtMemcpy(buffer, tensor_size, host.data(), tensor_size,
                    ACL_MEMCPY_HOST_TO_DEVICE);
        tensor_addrs.emplace_back(reinterpret_cast<uint64_t>(buffer));
        out.buffers.emplace_back(buffer);
    }
    out.tensor_size = tensor_size;
    auto ret = llm_datadist.RegisterKvCache(cache_desc, tensor_addrs, {},
                                            out.cache_id);
    if (ret != LLM_SUCCESS) {
        std::printf("[ERROR] RegisterKvCache failed, ret = %u\n", ret);
        return -1;
    }
    std::printf("[INFO] RegisterKvCache success, cache_id = %lld\n",
                static_cast<long long>(out.cache_id));
    return 0;
}

void
FreeCache(LlmDataDist &llm_datadist, DeviceCache &c)
{
    if (c.cache_id > 0)
        EXPECT(llm_datadist.UnregisterKvCache(c.cache_id) == LLM_SUCCESS);
    for (void *b : c.buffers)
        aclrtFree(b);
    c.buffers.clear();
}

// A copy of tensor t of a device cache, read back to the host.
std::vector<int32_t>
ReadBack(const DeviceCache &c, uint32_t t)
{
    std::vector<int32_t> host(c.tensor_size / sizeof(int32_t));
    aclrtMemcpy(host.data(), c.tensor_size, c.buffers[t], c.tensor_size,
                ACL_MEMCPY_DEVICE_TO_HOST);
    return host;
}

// Whether `bytes` bytes at dst_off of tensor dt hold the values of the
// seed's tensor st from src_off (the source tensor as it was filled).
bool
Holds(const DeviceCache &c, uint32_t dt, size_t dst_off, int seed, uint32_t st,
      size_t src_off, size_t bytes)
{
    std::vector<int32_t> host = ReadBack(c, dt);
    for (size_t i = 0; i < bytes / sizeof(int32_t); ++i)
        if (host[dst_off / sizeof(int32_t) + i] !=
            Value(seed, st, src_off / sizeof(int32_t) + i))
            return false;
    return true;
}

bool
IsZero(const DeviceCache &c, uint32_t t, size_t off, size_t bytes)
{
    std::vector<int32_t> host = ReadBack(c, t);
    for (size_t i = 0; i < bytes / sizeof(int32_t); ++i)
        if (host[off / sizeof(int32_t) + i] != 0)
            return false;
    return true;
}

int
Initialize(LlmDataDist &llm_datadist, const std::string &listen)
{
    std::map<AscendString, AscendString> options;
    options[OPTION_DEVICE_ID] = "0";
    options[OPTION_SYNC_CACHE_WAIT_TIME] = "10000";
    if (!listen.empty())
        options[OPTION_LISTEN_IP_INFO] = listen.c_str();
    auto ret = llm_datadist.Initialize(options);
    if (ret != LLM_SUCCESS) {
        std::printf("[ERROR] Initialize failed, ret = %u\n", ret);
        return -1;
    }
    std::printf("[INFO] Initialize success\n");
    return 0;
}

int
Link(LlmDataDist &llm_datadist, uint64_t remote_cluster_id,
     uint16_t remote_port)
{
    std::vector<Status> rets;
    std::vector<ClusterInfo> clusters;
    ClusterInfo cluster_info;
    cluster_info.remote_cluster_id = remote_cluster_id;
    IpInfo local_ip_info;
    local_ip_info.ip = "127.0.0.1";
    local_ip_info.port = 0;
    cluster_info.local_ip_infos.emplace_back(std::move(local_ip_info));
    IpInfo remote_ip_info;
    remote_ip_info.ip = "127.0.0.1";
    remote_ip_info.port = remote_port;
    cluster_info.remote_ip_infos.emplace_back(std::move(remote_ip_info));
    clusters.emplace_back(std::move(cluster_info));
    auto ret = llm_datadist.LinkLlmClusters(clusters, rets, 5000);
    if (ret != LLM_SUCCESS) {
        std::printf("[ERROR] LinkLlmClusters failed, ret = %u\n", ret);
        return -1;
    }
    std::printf("[INFO] LinkLlmClusters success\n");
    return 0;
}

// A link is known by its cluster id: no address is given.
int
Unlink(LlmDataDist &llm_datadist, uint64_t remote_cluster_id)
{
    std::vector<Status> rets;
    ClusterInfo cluster_info;
    cluster_info.remote_cluster_id = remote_cluster_id;
    auto ret = llm_datadist.UnlinkLlmClusters({cluster_info}, rets, 5000);
    if (ret != LLM_SUCCESS || rets.size() != 1 || rets[0] != LLM_SUCCESS) {
        std::printf("[ERROR] UnlinkLlmClusters failed, ret = %u\n", ret);
        return -1;
    }
    std::printf("[INFO] UnlinkLlmClusters success\n");
    return 0;
}

// The prompt: a blocks cache, a cache of two slots, a one-tensor cache and
// an empty push target. Serves the decoder, then switches to a decoder and
// pushes to (and pulls from) the other side.
int
RunPrompt(ControlChannel &ch)
{
    uint16_t port = FreePort();
    LlmDataDist llm_datadist(kPromptClusterId, LlmRole::kPrompt);
    if (Initialize(llm_datadist, "127.0.0.1:" + std::to_string(port)) != 0)
        return 1;
    DeviceCache blocks, slots, one, target;
    if (RegisterCache(llm_datadist, kBlocksShape, kNumTensors, kTensorSize, 1,
                      blocks) != 0 ||
        RegisterCache(llm_datadist, kSlotShape, kNumTensors, 2 * kSlotSize, 2,
                      slots) != 0 ||
        RegisterCache(llm_datadist, kOneShape, 1, 4 * kOneSlotSize, 3, one) !=
            0 ||
        RegisterCache(llm_datadist, kBlocksShape, kNumTensors, kTensorSize, 0,
                      target) != 0)
        return 1;
    ch.Send(std::to_string(port) + " " + std::to_string(blocks.cache_id) + " " +
            std::to_string(slots.cache_id) + " " +
            std::to_string(one.cache_id) + " " +
            std::to_string(target.cache_id));

    // The decoder pushed blocks {0, 1, 2} to {5, 6, 7} and its block 3 to
    // our block 0, layer 3 only (tensor_num_per_layer 1).
    EXPECT(ch.Recv() == "pushed");
    for (uint32_t t = 0; t < kNumTensors; ++t) {
        for (size_t b = 0; b < 3; ++b)
            EXPECT(Holds(target, t, (5 + b) * kBlockSize, 1, t, b * kBlockSize,
                         kBlockSize));
        if (t == 3)
            EXPECT(Holds(target, t, 0, 1, t, 3 * kBlockSize, kBlockSize));
        else
            EXPECT(IsZero(target, t, 0, kBlockSize));
        EXPECT(IsZero(target, t, kBlockSize, 4 * kBlockSize));
    }
    ch.Send("checked");

    // The decoder unlinked by id and now listens as a prompt: switch to a
    // decoder (no listening) and link to it.
    std::string listening = ch.Recv();
    unsigned peer_port = 0;
    long long peer_cache = 0;
    EXPECT(std::sscanf(listening.c_str(), "listening %u %lld", &peer_port,
                       &peer_cache) == 2);
    // Our side of the old link goes when its UNLINK arrives, just after
    // the peer's call returned: until then SetRole says LLM_EXIST_LINK.
    Status st = LLM_EXIST_LINK;
    for (int i = 0; i < 500 && st == LLM_EXIST_LINK; ++i) {
        st = llm_datadist.SetRole(LlmRole::kDecoder, {});
        if (st == LLM_EXIST_LINK)
            usleep(10000);
    }
    EXPECT(st == LLM_SUCCESS);
    if (Link(llm_datadist, kDecoderClusterId,
             static_cast<uint16_t>(peer_port)) != 0)
        return 1;
    // Layer by layer (one tensor a layer), blocks {5, 6, 7}, as the
    // reference's switched prompt does; then slot 4 whole.
    Cache cache{};
    cache.cache_id = blocks.cache_id;
    CacheIndex cache_index = {};
    cache_index.cluster_id = kDecoderClusterId;
    cache_index.cache_id = peer_cache;
    for (uint32_t i = 0U; i < kNumTensors; ++i) {
        KvCacheExtParam param{};
        param.src_layer_range = std::pair<int32_t, int32_t>(i, i);
        param.dst_layer_range = std::pair<int32_t, int32_t>(i, i);
        param.tensor_num_per_layer = 1;
        EXPECT(llm_datadist.PushKvBlocks(cache, cache_index, {5, 6, 7},
                                         {5, 6, 7}, param) == LLM_SUCCESS);
    }
    CacheIndex slot4 = cache_index;
    slot4.batch_index = 4;
    EXPECT(llm_datadist.PushKvCache(cache, slot4, 4) == LLM_SUCCESS);
    // And a pull in the new role: their block 0 into our target's block 1.
    Cache tcache{};
    tcache.cache_id = target.cache_id;
    EXPECT(llm_datadist.PullKvBlocks(cache_index, tcache, {0}, {1}) ==
           LLM_SUCCESS);
    ch.Send("pushed");
    EXPECT(ch.Recv() == "checked");
    for (uint32_t t = 0; t < kNumTensors; ++t)
        EXPECT(Holds(target, t, kBlockSize, 1, t, 0, kBlockSize));
    if (Unlink(llm_datadist, kDecoderClusterId) != 0)
        return 1;
    ch.Send("unlinked");
    FreeCache(llm_datadist, blocks);
    FreeCache(llm_datadist, slots);
    FreeCache(llm_datadist, one);
    FreeCache(llm_datadist, target);
    llm_datadist.Finalize();
    std::printf("[INFO] Prompt end, %d failures\n", failures);
    return failures == 0 ? 0 : 1;
}

int32_t
PullCache(LlmDataDist &llm_datadist, long long blocks_id,
          const DeviceCache &dblocks)
{
    std::vector<uint64_t> prompt_blocks{1, 2, 3};
    std::vector<uint64_t> decoder_blocks{1, 2, 3};
    CacheIndex cache_index = {};
    cache_index.cluster_id = kPromptClusterId;
    cache_index.cache_id = blocks_id;
    cache_index.batch_index = 0;
    Cache cache{};
    cache.cache_id = dblocks.cache_id;
    auto ret = llm_datadist.PullKvBlocks(cache_index, cache, prompt_blocks,
                                         decoder_blocks);
    if (ret != LLM_SUCCESS) {
        std::printf("[ERROR] PullKvBlocks failed, ret = %u\n", ret);
        return -1;
    }
    ret = llm_datadist.PullKvCache(cache_index, cache, 0);
    if (ret != LLM_SUCCESS) {
        std::printf("[ERROR] PullKvCache failed, ret = %u\n", ret);
        return -1;
    }
    std::printf("[INFO] PullKvBlocks and PullKvCache success\n");
    return 0;
}

int
RunDecoder(ControlChannel &ch)
{
    LlmDataDist llm_datadist(kDecoderClusterId, LlmRole::kDecoder);
    if (Initialize(llm_datadist, "") != 0)
        return 1;
    DeviceCache dblocks, dslot_blocks, done, dcopy;
    if (RegisterCache(llm_datadist, kBlocksShape, kNumTensors, kTensorSize, 0,
                      dblocks) != 0 ||
        RegisterCache(llm_datadist, kBlocksShape, kNumTensors, kTensorSize, 0,
                      dslot_blocks) != 0 ||
        RegisterCache(llm_datadist, kOneShape, 1, 4 * kOneSlotSize, 0, done) !=
            0 ||
        RegisterCache(llm_datadist, kBlocksShape, kNumTensors, kTensorSize, 0,
                      dcopy) != 0)
        return 1;
    unsigned port = 0;
    long long blocks_id = 0, slots_id = 0, one_id = 0, target_id = 0;
    EXPECT(std::sscanf(ch.Recv().c_str(), "%u %lld %lld %lld %lld", &port,
                       &blocks_id, &slots_id, &one_id, &target_id) == 5);
    if (Link(llm_datadist, kPromptClusterId, static_cast<uint16_t>(port)) != 0)
        return 1;

    // Blocks {1, 2, 3} and slot (block) 0: blocks 0..3 hold theirs.
    EXPECT(PullCache(llm_datadist, blocks_id, dblocks) == 0);
    for (uint32_t t = 0; t < kNumTensors; ++t) {
        EXPECT(Holds(dblocks, t, 0, 1, t, 0, 4 * kBlockSize));
        EXPECT(IsZero(dblocks, t, 4 * kBlockSize, 4 * kBlockSize));
    }

    // Slot 1 of the two-slot cache into blocks {7, 2, 3, 5}: four chunks.
    CacheIndex slot_index = {};
    slot_index.cluster_id = kPromptClusterId;
    slot_index.cache_id = slots_id;
    slot_index.batch_index = 1;
    Cache slot_blocks{};
    slot_blocks.cache_id = dslot_blocks.cache_id;
    // Three blocks are not a 256-byte slot's four: refused, nothing moves.
    EXPECT(llm_datadist.PullKvBlocks(slot_index, slot_blocks, {}, {0, 1, 4}) ==
           LLM_PARAM_INVALID);
    EXPECT(llm_datadist.PullKvBlocks(slot_index, slot_blocks, {},
                                     {7, 2, 3, 5}) == LLM_SUCCESS);
    const size_t chunk_to[] = {7, 2, 3, 5};
    for (uint32_t t = 0; t < kNumTensors; ++t) {
        for (size_t k = 0; k < 4; ++k)
            EXPECT(Holds(dslot_blocks, t, chunk_to[k] * kBlockSize, 2, t,
                         kSlotSize + k * kBlockSize, kBlockSize));
        for (size_t b : {0, 1, 4, 6})
            EXPECT(IsZero(dslot_blocks, t, b * kBlockSize, kBlockSize));
    }

    // A one-tensor cache with the default KvCacheExtParam (tnpl 2).
    CacheIndex one_index = {};
    one_index.cluster_id = kPromptClusterId;
    one_index.cache_id = one_id;
    one_index.batch_index = 1;
    Cache one{};
    one.cache_id = done.cache_id;
    EXPECT(llm_datadist.PullKvCache(one_index, one, 2, -1, KvCacheExtParam{}) ==
           LLM_SUCCESS);
    EXPECT(Holds(done, 0, 2 * kOneSlotSize, 3, 0, kOneSlotSize, kOneSlotSize));
    EXPECT(IsZero(done, 0, 0, 2 * kOneSlotSize));
    EXPECT(IsZero(done, 0, 3 * kOneSlotSize, kOneSlotSize));

    // A decoder pushes: blocks {0, 1, 2} to their {5, 6, 7}, and layer 3
    // of block 3 to their block 0 (one tensor a layer).
    CacheIndex target_index = {};
    target_index.cluster_id = kPromptClusterId;
    target_index.cache_id = target_id;
    Cache cache{};
    cache.cache_id = dblocks.cache_id;
    EXPECT(llm_datadist.PushKvBlocks(cache, target_index, {0, 1, 2},
                                     {5, 6, 7}) == LLM_SUCCESS);
    KvCacheExtParam layer3{};
    layer3.src_layer_range = {3, 3};
    layer3.dst_layer_range = {3, 3};
    layer3.tensor_num_per_layer = 1;
    EXPECT(llm_datadist.PushKvCache(cache, target_index, 3, -1, layer3) ==
           LLM_SUCCESS);
    ch.Send("pushed");
    EXPECT(ch.Recv() == "checked");

    // Local copies with id-only caches: blocks {0, 1} to {2, 3} and {4, 5}.
    Cache copy{};
    copy.cache_id = dcopy.cache_id;
    EXPECT(llm_datadist.CopyKvBlocks(cache, copy, {0, 1}, {{2, 3}, {4, 5}}) ==
           LLM_SUCCESS);
    EXPECT(llm_datadist.CopyKvBlocks(cache, copy, {0}, {{1}, {8}}) ==
           LLM_PARAM_INVALID); // block 8 of 8: nothing moves
    EXPECT(llm_datadist.CopyKvCache(cache, copy, 3, 7) == LLM_SUCCESS);
    for (uint32_t t = 0; t < kNumTensors; ++t) {
        EXPECT(IsZero(dcopy, t, 0, 2 * kBlockSize));
        EXPECT(Holds(dcopy, t, 2 * kBlockSize, 1, t, 0, 2 * kBlockSize));
        EXPECT(Holds(dcopy, t, 4 * kBlockSize, 1, t, 0, 2 * kBlockSize));
        EXPECT(IsZero(dcopy, t, 6 * kBlockSize, kBlockSize));
        EXPECT(
            Holds(dcopy, t, 7 * kBlockSize, 1, t, 3 * kBlockSize, kBlockSize));
    }

    // Unlink by id, switch to a prompt that listens, and wait for the
    // switched prompt to push back.
    if (Unlink(llm_datadist, kPromptClusterId) != 0)
        return 1;
    uint16_t my_port = 0;
    Status st = LLM_FAILED;
    for (int i = 0; i < 20 && st != LLM_SUCCESS; ++i) {
        my_port = FreePort();
        std::string listen = "127.0.0.1:" + std::to_string(my_port);
        std::map<AscendString, AscendString> options;
        options[OPTION_LISTEN_IP_INFO] = listen.c_str();
        st = llm_datadist.SetRole(LlmRole::kPrompt, options);
    }
    EXPECT(st == LLM_SUCCESS);
    ch.Send("listening " + std::to_string(my_port) + " " +
            std::to_string(dblocks.cache_id));
    EXPECT(ch.Recv() == "pushed");
    for (uint32_t t = 0; t < kNumTensors; ++t) {
        EXPECT(Holds(dblocks, t, 0, 1, t, 0, 4 * kBlockSize)); // as before
        EXPECT(Holds(dblocks, t, 4 * kBlockSize, 1, t, 4 * kBlockSize,
                     4 * kBlockSize)); // 4 by slot, 5..7 by blocks
    }
    ch.Send("checked");
    EXPECT(ch.Recv() == "unlinked");
    FreeCache(llm_datadist, dblocks);
    FreeCache(llm_datadist, dslot_blocks);
    FreeCache(llm_datadist, done);
    FreeCache(llm_datadist, dcopy);
    llm_datadist.Finalize();
    std::printf("[INFO] Decoder end, %d failures\n", failures);
    return failures == 0 ? 0 : 1;
}

} // namespace

int
main()
{
    int to_prompt[2], to_decoder[2];
    if (aclInit(nullptr) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS ||
        pipe(to_prompt) != 0 || pipe(to_decoder) != 0)
        return 2;
    pid_t pid = fork();
    if (pid == 0) {
        close(to_prompt[1]);
        close(to_decoder[0]);
        ControlChannel ch(to_prompt[0], to_decoder[1]);
        int rc = RunPrompt(ch);
        std::fflush(stdout);
        _exit(rc);
    }
    close(to_prompt[0]);
    close(to_decoder[1]);
    ControlChannel ch(to_decoder[0], to_prompt[1]);
    int rc = RunDecoder(ch);
    close(to_prompt[1]); // a prompt still waiting for a line sees EOF
    int status = 0;
    waitpid(pid, &status, 0);
    bool prompt_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    std::printf("decoder %s, prompt %s\n", rc == 0 ? "ok" : "FAILED",
                prompt_ok ? "ok" : "FAILED");
    aclFinalize();
    return rc == 0 && prompt_ok ? 0 : 1;
}
