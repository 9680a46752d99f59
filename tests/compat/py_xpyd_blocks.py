"""Several prefill instances into one decoder, by blocks, as the
reference's xPyD sample writes it: cluster ids made of each instance's
ip:port, every prefill a blocks cache under its BlocksCacheKey, the decoder
linking to all of them in one link_clusters call and pulling blocks from
each into its own blocks (here distinct ones, so that every byte can be
checked), then unlinking them all.

    py_xpyd_blocks.py [N]           (starts N prefill processes, 3 by
                                     default, and the decoder)
"""

import argparse
import logging
import os
import socket
import struct
import sys

import torch
import torch.distributed as dist

from compat_common import check, free_port, init_process_group, launch, pattern, same
from llm_datadist import (LLMDataDist, LLMRole, LLMConfig, CacheDesc, DataType, Placement,
                          BlocksCacheKey, LLMClusterInfo, LLMStatusCode)

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

NUM_TENSORS = 2
BLOCKS_NUM = 4
KV_SHAPE = 10


def ip_port_to_int(ip_port):
    ip, port = ip_port.split(":")
    return (struct.unpack("!I", socket.inet_aton(ip))[0] << 16) | int(port)


def init_llm_datadist(role, local_ip_port, listen):
    datadist = LLMDataDist(role, ip_port_to_int(local_ip_port))
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.local_comm_res = ""
    llm_config.sync_kv_timeout = 10000
    if listen:
        llm_config.listen_ip_info = local_ip_port
    datadist.init(llm_config.generate_options())
    return datadist


def desc(blocks):
    return CacheDesc(num_tensors=NUM_TENSORS, shape=[blocks, KV_SHAPE],
                     data_type=DataType.DT_FLOAT, placement=Placement.DEVICE)


def run_prompt(args, index):
    cluster_id = ip_port_to_int(args.local_ip_port)
    datadist = init_llm_datadist(LLMRole.PROMPT, args.local_ip_port, True)
    tensors = [pattern(index * 10 + t, [BLOCKS_NUM, KV_SHAPE], torch.float32).npu()
               for t in range(NUM_TENSORS)]
    cache = datadist.cache_manager.register_blocks_cache(
        desc(BLOCKS_NUM), [t.data_ptr() for t in tensors], BlocksCacheKey(cluster_id, 0))
    logging.info(f"[prompt {index}] registered, cluster_id={cluster_id}")
    dist.barrier()  # registered
    dist.barrier()  # the decoder pulled and unlinked
    for t in range(NUM_TENSORS):
        check(same(tensors[t].cpu(), pattern(index * 10 + t, [BLOCKS_NUM, KV_SHAPE],
                                             torch.float32)), "a source changed")
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    logging.info(f"[prompt {index}] end")


def run_decoder(args):
    remote_list = args.remote_ip_port.split(";")
    n = len(remote_list)
    datadist = init_llm_datadist(LLMRole.DECODER, args.local_ip_port, False)
    cache_manager = datadist.cache_manager
    tensors = [torch.full((2 * n + 1, KV_SHAPE), 0, dtype=torch.float).npu()
               for _ in range(NUM_TENSORS)]
    cache = cache_manager.register_blocks_cache(
        desc(2 * n + 1), [t.data_ptr() for t in tensors],
        BlocksCacheKey(ip_port_to_int(args.local_ip_port), 0))
    dist.barrier()  # registered

    cluster_list = []
    for remote in remote_list:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = ip_port_to_int(remote)
        cluster.append_local_ip_info(args.local_ip_port.split(":")[0], 0)
        cluster.append_remote_ip_info(remote.split(":")[0], int(remote.split(":")[1]))
        cluster_list.append(cluster)
    ret, rets = datadist.link_clusters(cluster_list, 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, f"link failed: {rets}")

    # From prefill i: its blocks 3 and 1 into our blocks 2i + 1 and 2i.
    for i, remote in enumerate(remote_list):
        cache_manager.pull_blocks(BlocksCacheKey(ip_port_to_int(remote), 0), cache,
                                  src_blocks=[3, 1], dst_blocks=[2 * i + 1, 2 * i])
    for t in range(NUM_TENSORS):
        want = torch.zeros(2 * n + 1, KV_SHAPE, dtype=torch.float32)
        for i in range(n):
            src = pattern(i * 10 + t, [BLOCKS_NUM, KV_SHAPE], torch.float32)
            want[2 * i], want[2 * i + 1] = src[1], src[3]
        check(same(tensors[t].cpu(), want), f"tensor {t} differs")
    logging.info(f"[decoder] blocks from {n} prefill instances landed")
    ret, _ = datadist.unlink_clusters(cluster_list, 5000)
    check(ret == LLMStatusCode.LLM_SUCCESS, "unlink failed")
    dist.barrier()  # pulled and unlinked
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()
    logging.info("[decoder] end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("count", nargs="?", type=int, default=3)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--local_ip_port")
    parser.add_argument("--remote_ip_port")
    args = parser.parse_args()
    if args.rank is None:
        prompts = [f"127.0.0.1:{free_port()}" for _ in range(args.count)]
        decoder = f"127.0.0.1:{free_port()}"
        sys.exit(launch(os.path.abspath(__file__),
                        [["--local_ip_port", p] for p in prompts] +
                        [["--local_ip_port", decoder, "--remote_ip_port", ";".join(prompts)]]))
    torch.npu.set_device(0)
    init_process_group(args.rank)
    if args.remote_ip_port:
        run_decoder(args)
    else:
        run_prompt(args, args.rank)
    dist.destroy_process_group()
