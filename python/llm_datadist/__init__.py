"""llm_datadist: the Python API of Huawei's LLM-DataDist (its V2 cache
manager surface, and the V1 KvCacheManager), implemented over llmdd.
docs/python.md has the mapping and what differs."""

from .status import LLMStatusCode, LLMException, Status
from .data_type import DataType
from .configs import LLMRole, LLMConfig, LlmConfig, LLMClusterInfo
from .llm_types import (CacheDesc, Cache, KvCache, CacheKey, CacheKeyByIdAndIndex,
                        BlocksCacheKey, Placement, RegisterMemStatus, LayerSynchronizer,
                        TransferConfig, TransferWithCacheKeyConfig, CacheTask, Memtype,
                        MemInfo)
from .cache_manager import CacheManager
from .kv_cache_manager import KvCacheManager
from .llm_datadist import LLMDataDist

# The reference's public names, exactly (CacheManager is reached through
# LLMDataDist.cache_manager, as there).
__all__ = ["LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig",
           "LLMConfig", "DataType", "Status", "CacheDesc", "CacheKey",
           "CacheKeyByIdAndIndex", "KvCache", "Cache", "BlocksCacheKey", "LLMDataDist",
           "Placement", "RegisterMemStatus", "LayerSynchronizer", "TransferConfig",
           "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo", "TensorDesc",
           "Tensor", "KvCacheManager"]


def __getattr__(name):
    # TensorDesc and Tensor hold numpy arrays: numpy is imported only for
    # them (the reference loads its V1 names lazily too).
    if name in ("TensorDesc", "Tensor"):
        from . import tensor
        return getattr(tensor, name)
    raise AttributeError(f"module 'llm_datadist' has no attribute '{name}'")
