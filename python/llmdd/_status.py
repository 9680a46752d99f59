"""Status codes: the reference's names and values, read from one list."""

import enum

from ._ffi import lib

# The same list as LLMDD_STATUS_MAP in include/llmdd/llmdd.h.
_STATUS = (
    ("LLM_SUCCESS", 0x0),
    ("LLM_FAILED", 0xFFFFFFFF),
    ("LLM_WAIT_PROC_TIMEOUT", 0x5010B001),
    ("LLM_KV_CACHE_NOT_EXIST", 0x5010B002),
    ("LLM_REPEAT_REQUEST", 0x5010B003),
    ("LLM_REQUEST_ALREADY_COMPLETED", 0x5010B004),
    ("LLM_PARAM_INVALID", 0x5010B005),
    ("LLM_ENGINE_FINALIZED", 0x5010B006),
    ("LLM_NOT_YET_LINK", 0x5010B007),
    ("LLM_ALREADY_LINK", 0x5010B008),
    ("LLM_LINK_FAILED", 0x5010B009),
    ("LLM_UNLINK_FAILED", 0x5010B00A),
    ("LLM_NOTIFY_PROMPT_UNLINK_FAILED", 0x5010B00B),
    ("LLM_CLUSTER_NUM_EXCEED_LIMIT", 0x5010B00C),
    ("LLM_PROCESSING_LINK", 0x5010B00D),
    ("LLM_DEVICE_OUT_OF_MEMORY", 0x5010B00E),
    ("LLM_PREFIX_ALREADY_EXIST", 0x5010B00F),
    ("LLM_PREFIX_NOT_EXIST", 0x5010B010),
    ("LLM_SEQ_LEN_OVER_LIMIT", 0x5010B011),
    ("LLM_NO_FREE_BLOCK", 0x5010B012),
    ("LLM_BLOCKS_OUT_OF_MEMORY", 0x5010B013),
    ("LLM_CACHE_INCOMPATIBLE", 0x5010B014),
    ("LLM_CACHE_KEY_ALREADY_EXIST", 0x5010B015),
    ("LLM_COPY_CACHE_FAILED", 0x5010B016),
    ("LLM_CACHE_ID_ALREADY_EXIST", 0x5010B017),
    ("LLM_EXIST_LINK", 0x5010B018),
    ("LLM_FEATURE_NOT_ENABLED", 0x5010B019),
    ("LLM_TIMEOUT", 0x5010B01A),
    ("LLM_LINK_BUSY", 0x5010B01B),
    ("LLM_OUT_OF_MEMORY", 0x5010B01C),
)

Status = enum.IntEnum("Status", _STATUS, module=__name__)
Status.__doc__ = "llmdd_status values (an IntEnum: compares equal to the C numbers)."


def status_str(status):
    """The constant's name, from the library ("LLM_UNKNOWN_STATUS" otherwise)."""
    return lib.llmdd_status_str(int(status) & 0xFFFFFFFF).decode()


class LlmddError(RuntimeError):
    """A library call returned a status other than LLM_SUCCESS.

    ``status`` is the int status; the message names it (``LLM_TIMEOUT``).
    """

    def __init__(self, status, message=None):
        self.status = int(status)
        self.status_name = status_str(self.status)
        text = f"{self.status_name} (0x{self.status:08X})"
        if message:
            text = f"{message}: {text}"
        super().__init__(text)


class RequestTimeout(LlmddError, TimeoutError):
    """Request.wait() returned while the transfer was still in flight
    (LLM_WAIT_PROC_TIMEOUT); the request goes on."""

    def __init__(self, message="request still in flight"):
        super().__init__(Status.LLM_WAIT_PROC_TIMEOUT, message)


def check(status, what):
    """Raises LlmddError unless status is LLM_SUCCESS."""
    if status != 0:
        raise LlmddError(status, what)
