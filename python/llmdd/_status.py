"""Status codes: the reference's names and values, read from the library."""

import enum

from ._ffi import lib


def _statuses():
    """Every status the library names (llmdd_status_str): the reference's
    values are 0, 0xFFFFFFFF and 0x5010B001 on, so the list is read from the
    library, not copied here."""
    out = []
    for v in [0x0, 0xFFFFFFFF] + list(range(0x5010B001, 0x5010B100)):
        name = lib.llmdd_status_str(v).decode()
        if name != "LLM_UNKNOWN_STATUS":
            out.append((name, v))
    return tuple(out)


_STATUS = _statuses()

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
