"""llm_datadist: the Python API of Huawei's LLM-DataDist (its V2 cache
manager surface), implemented over llmdd. docs/python.md has the mapping
and what differs."""

from .status import LLMStatusCode, LLMException
from .data_type import DataType
from .configs import LLMRole, LLMConfig, LlmConfig, LLMClusterInfo
from .llm_types import (CacheDesc, Cache, CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey,
                        Placement, RegisterMemStatus, LayerSynchronizer, TransferConfig,
                        TransferWithCacheKeyConfig, CacheTask)
from .cache_manager import CacheManager
from .llm_datadist import LLMDataDist

__all__ = ["LLMStatusCode", "LLMException", "DataType", "LLMRole", "LLMConfig",
           "LLMClusterInfo", "CacheDesc", "Cache", "CacheKey", "CacheKeyByIdAndIndex",
           "BlocksCacheKey", "Placement", "RegisterMemStatus", "LayerSynchronizer",
           "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask", "CacheManager",
           "LLMDataDist"]
