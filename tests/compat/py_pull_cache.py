"""The reference's pull_cache sample, run as its example runner runs it:
the prompt (cluster 1) allocates a cache from the memory pool with a
CacheKey for each of its two batch slots; the decoder (cluster 2)
allocates one and pulls both slots by key. Both link through a rank
table (LLMDataDist.link, polled with query_register_mem_status) and
unlink(comm_id) at the end.

The decoder links before the prompt listens, so its first connects are
refused and retried: the run must succeed, every byte checked, and, as
the runner demands, neither side may print a line holding "error" in any
case at the default log level.

    py_pull_cache.py                (starts both processes)
"""

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from compat_common import (check, init_process_group, launch, pattern, rank_base_port, same,
                           single_host_rank_table, wait_link_refused)
from llm_datadist import (CacheDesc, CacheKey, DataType, LLMConfig, LLMDataDist, LLMRole,
                          Placement, RegisterMemStatus)

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)

CACHE_NUM_TENSORS = 4
CACHE_SHAPE = [2, 16 * 1024]    # two batch slots of 32 KiB a tensor
MEM_POOL_SIZE = 64 * 1024 * 1024


def init_llm_datadist(role, cluster_id):
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    llm_config.mem_pool_cfg = f'{{"memory_size": {MEM_POOL_SIZE}}}'
    datadist.init(llm_config.generate_options())
    return datadist


def wait_linked(datadist, comm_id):
    end = time.monotonic() + 60
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            logging.info("query_register_mem_status ok")
            return
        check(ret != RegisterMemStatus.FAILED, "link failed")
        check(time.monotonic() < end, "link did not complete")
        time.sleep(0.01)


def cache_desc():
    return CacheDesc(num_tensors=CACHE_NUM_TENSORS, shape=CACHE_SHAPE,
                     data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)


def run_prompt(datadist):
    dist.barrier()  # the decoder's first connects were refused
    comm_id = datadist.link("link", {1: 0, 2: 1}, single_host_rank_table("127.0.0.1"))
    wait_linked(datadist, comm_id)
    cache_manager = datadist.cache_manager
    cache_key_0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache = cache_manager.allocate_cache(cache_desc(), [cache_key_0, cache_key_1])
    from torchair.llm_datadist import create_npu_tensors
    for t, tensor in enumerate(create_npu_tensors(CACHE_SHAPE, torch.float16,
                                                  cache.tensor_addrs)):
        tensor.copy_(pattern(10 + t, CACHE_SHAPE))
    logging.info("[prompt] allocate_cache success")
    dist.barrier()  # cache ready
    dist.barrier()  # decoder pull_cache end
    datadist.unlink(comm_id)
    dist.barrier()  # wait peer unlink end
    # A no-op after the pulls, which released both keys.
    cache_manager.remove_cache_key(cache_key_0)
    cache_manager.remove_cache_key(cache_key_1)
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
    logging.info("[prompt] finalize success")


def run_decoder(datadist):
    comm_id = datadist.link("link", {1: 0, 2: 1}, single_host_rank_table("127.0.0.1"))
    wait_link_refused(datadist)
    dist.barrier()  # the decoder's first connects were refused
    wait_linked(datadist, comm_id)
    cache_manager = datadist.cache_manager
    cache = cache_manager.allocate_cache(cache_desc())
    logging.info("[decoder] allocate_cache success")
    dist.barrier()  # cache ready
    # Crossed, so that a key that named the wrong slot shows.
    cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache,
                             batch_index=1)
    cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1, model_id=0), cache,
                             batch_index=0)
    from torchair.llm_datadist import create_npu_tensors
    for t, tensor in enumerate(create_npu_tensors(CACHE_SHAPE, torch.float16,
                                                  cache.tensor_addrs)):
        src = pattern(10 + t, CACHE_SHAPE)
        check(same(tensor[0], src[1]) and same(tensor[1], src[0]),
              f"pulled tensor {t} differs")
    logging.info("[decoder] pull_cache success, every byte checked")
    dist.barrier()  # decoder pull_cache end
    datadist.unlink(comm_id)
    dist.barrier()  # wait peer unlink end
    cache_manager.deallocate_cache(cache)
    datadist.finalize()
    logging.info("[decoder] finalize success")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--cluster_id", type=int)
    args = parser.parse_args()
    if args.rank is None:
        os.environ["LLMDD_RANK_BASE_PORT"] = str(rank_base_port())
        sys.exit(launch(os.path.abspath(__file__),
                        [["--cluster_id", "1"], ["--cluster_id", "2"]],
                        no_error_lines=True))
    torch.npu.set_device(0)
    init_process_group(args.rank)
    role = LLMRole.PROMPT if args.cluster_id == 1 else LLMRole.DECODER
    datadist = init_llm_datadist(role, args.cluster_id)
    if role == LLMRole.PROMPT:
        run_prompt(datadist)
    else:
        run_decoder(datadist)
    dist.destroy_process_group()
