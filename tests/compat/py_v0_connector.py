"""A prompt and a decoder that call llm_datadist the way a serving
connector written for its older (V0-era) API does, run on llmdd:

- init with the reference's raw option keys: llm.listenIpInfo on the
  prompt at the fixed port 26000, ge.exec.deviceId, llm.SyncKvCacheWaitTime
  as a str;
- the V1 cache manager (LLMDataDist.kv_cache_manager): the prompt
  allocates four caches (keys, values, input tokens, hidden states), each
  named by a CacheKey(cluster, 0, model_id), and fills them through the
  tensors create_npu_tensors makes over per_device_tensor_addrs[0];
- the decoder builds its cluster with append_local_ip_info(ip, 0) and
  append_remote_ip_info(ip, 26000), links, allocates the same four
  caches and pulls each with pull_cache(key, cache, 0): two by CacheKey,
  two by CacheKeyByIdAndIndex(prompt, cache_id 3 or 4, 0), the prompt's
  third and fourth cache ids as that connector assumes them;
- unlink_clusters([cluster], 5000), deallocate_cache, finalize.

Every byte pulled is checked. The port is 26000, as the connector has it
(CTest runs this under RESOURCE_LOCK port_26000). The cluster ids differ
(0 and 1): llmdd refuses a peer with its own cluster id (docs/python.md,
"Not done yet"), which this connector gives both sides.

    py_v0_connector.py              (starts both processes)
"""

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
from torchair.llm_datadist import create_npu_tensors

import llm_datadist
from compat_common import check, init_process_group, launch, pattern, same

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

PORT = 26000
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
NUM_LAYER = 3
SEQ = 16
HEADS, HEAD_SIZE, HIDDEN = 2, 8, 32


def descs():
    """key, value, input and hidden CacheDescs, as that connector makes them
    (float16 KV and hidden states, int32 tokens)."""
    dt = llm_datadist.DataType
    kv_shape = (1, SEQ, HEADS, HEAD_SIZE)
    return [(llm_datadist.CacheDesc(NUM_LAYER, kv_shape, dt.DT_FLOAT16, seq_len_dim_index=1),
             torch.float16, 100),
            (llm_datadist.CacheDesc(NUM_LAYER, kv_shape, dt.DT_FLOAT16, seq_len_dim_index=1),
             torch.float16, 200),
            (llm_datadist.CacheDesc(1, (1, SEQ, 1, 1), dt.DT_INT32, seq_len_dim_index=-1),
             torch.int32, 300),
            (llm_datadist.CacheDesc(1, (1, SEQ, 1, HIDDEN), dt.DT_FLOAT16,
                                    seq_len_dim_index=-1), torch.float16, 400)]


def init(role, cluster_id):
    data_dist = llm_datadist.LLMDataDist(role, cluster_id)
    options = {"llm.SyncKvCacheWaitTime": "5000", "ge.exec.deviceId": "0"}
    if role == llm_datadist.LLMRole.PROMPT:
        options["llm.listenIpInfo"] = f"127.0.0.1:{PORT}"
    data_dist.init(options)
    return data_dist, data_dist.kv_cache_manager


def run_prompt():
    data_dist, kv_transfer = init(llm_datadist.LLMRole.PROMPT, PROMPT_CLUSTER_ID)
    buffers = []
    for model_id, (desc, dtype, seed) in enumerate(descs(), 1):
        keys = [llm_datadist.CacheKey(PROMPT_CLUSTER_ID, 0, model_id)]
        buf = kv_transfer.allocate_cache(desc, keys)
        check(buf.cache_id == model_id, f"cache {model_id} has id {buf.cache_id}")
        for i, t in enumerate(create_npu_tensors(desc.shape, dtype,
                                                 buf.per_device_tensor_addrs[0])):
            t.copy_(pattern(seed + i, list(desc.shape), dtype))
        buffers.append(buf)
    logging.info("[prompt] caches filled")
    dist.barrier()  # listening, caches filled
    dist.barrier()  # the decoder pulled and unlinked
    for buf in buffers:
        kv_transfer.deallocate_cache(buf)
    data_dist.finalize()
    logging.info("[prompt] end")


def run_decoder():
    data_dist, kv_transfer = init(llm_datadist.LLMRole.DECODER, DECODER_CLUSTER_ID)
    dist.barrier()  # the prompt listens
    cluster = llm_datadist.LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info("127.0.0.1", 0)
    cluster.append_remote_ip_info("127.0.0.1", PORT)
    ret, rets = data_dist.link_clusters([cluster], 20000)
    check(ret == llm_datadist.LLMStatusCode.LLM_SUCCESS and
          rets == [llm_datadist.LLMStatusCode.LLM_SUCCESS], f"link: {ret} {rets}")
    for model_id, (desc, dtype, seed) in enumerate(descs(), 1):
        buf = kv_transfer.allocate_cache(desc)
        tensors = create_npu_tensors(desc.shape, dtype, buf.per_device_tensor_addrs[0])
        if model_id <= 2:
            key = llm_datadist.CacheKey(PROMPT_CLUSTER_ID, 0, model_id)
        else:
            key = llm_datadist.CacheKeyByIdAndIndex(cluster.remote_cluster_id, model_id, 0)
        kv_transfer.pull_cache(key, buf, 0)
        for i, t in enumerate(tensors):
            check(same(t, pattern(seed + i, list(desc.shape), dtype)),
                  f"cache {model_id} tensor {i} differs")
        kv_transfer.deallocate_cache(buf)
        check(buf.per_device_tensor_addrs == [], "deallocated cache keeps its addresses")
    logging.info("[decoder] every byte pulled is the prompt's")
    ret, rets = data_dist.unlink_clusters([cluster], 5000)
    check(ret == llm_datadist.LLMStatusCode.LLM_SUCCESS, f"unlink: {ret} {rets}")
    dist.barrier()  # pulled and unlinked
    data_dist.finalize()
    logging.info("[decoder] end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    args = parser.parse_args()
    if args.rank is None:
        sys.exit(launch(os.path.abspath(__file__), [[], []]))
    torch.npu.set_device(0)
    init_process_group(args.rank)
    if args.rank == 0:
        run_prompt()
    else:
        run_decoder()
    dist.destroy_process_group()
