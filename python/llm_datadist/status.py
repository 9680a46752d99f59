"""LLMStatusCode and LLMException: the reference package's names and values."""

import enum

import llmdd
from llmdd._values import as_int, as_ints

# The reference spells two of llmdd's names its own way: its spelling is
# the member's name, llmdd's an alias of the same value.
_REF_SPELLING = {"LLM_WAIT_PROC_TIMEOUT": "LLM_WAIT_PROCESS_TIMEOUT",
                 "LLM_SEQ_LEN_OVER_LIMIT": "LLM_SEQ_LENOVERLIMIT"}
_members = []
for _s in llmdd.Status:
    if _s.name in _REF_SPELLING:
        _members.append((_REF_SPELLING[_s.name], int(_s)))
    _members.append((_s.name, int(_s)))
# The runtime's memory faults, which the reference passes on from its
# device runtime (ACL): llmdd, with no device, never returns them.
_members += [("LLM_DEVICE_MEM_ERROR", 507053), ("LLM_SUSPECT_REMOTE_ERROR", 507057),
             ("LLM_UNKNOWN_ERROR", -1)]


class _StatusCode(enum.IntEnum):
    def __str__(self):
        return f"{self.__class__.__name__}.{self.name}"


LLMStatusCode = _StatusCode("LLMStatusCode", _members, module=__name__)


def code_2_status(code):
    """The LLMStatusCode of a C status; unknown values are LLM_FAILED."""
    try:
        return LLMStatusCode(int(code))
    except ValueError:
        return LLMStatusCode.LLM_FAILED


class LLMException(RuntimeError):
    """Raised for failures; ``status_code`` is an LLMStatusCode."""

    def __init__(self, *args, status_code=LLMStatusCode.LLM_FAILED):
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self):
        return self._status_code


def check_int(name, v, lo, hi):
    """v as a Python int in [lo, hi], by llmdd's rule for integers
    (llmdd._values.as_int: ints, numpy and torch integers; not floats,
    strings or bools): TypeError, or ValueError out of range, as the
    reference's check_uint64 and its kin raise."""
    v = as_int(name, v)
    if not lo <= v <= hi:
        raise ValueError(f"{name}={v} out of range [{lo}, {hi}]")
    return v


def check_ints(name, v):
    """A list, tuple or 1-d integer array of integers as a list of ints."""
    if not isinstance(v, (list, tuple)) and not hasattr(v, "dtype"):
        raise TypeError(f"{name} must be a list or tuple of ints")
    return as_ints(name, v)


class Status:
    """A status as the reference's own calls return it: is_ok() and
    status_code (an LLMStatusCode)."""

    def __init__(self, status):
        self._status_code = status

    def is_ok(self):
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self):
        return self._status_code

    def __repr__(self):
        return f"Status({self._status_code})"


def raise_if_false(pred, msg, status_code=LLMStatusCode.LLM_PARAM_INVALID):
    if not pred:
        raise LLMException(msg, status_code=status_code)


def handle_status(code, what):
    if code != 0:
        st = code_2_status(code)
        raise LLMException(f"{what} failed, error code is {st}", status_code=st)


class _Translate:
    """Turns llmdd.LlmddError into LLMException with the same status."""

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if isinstance(e, llmdd.LlmddError):
            st = code_2_status(e.status)
            raise LLMException(f"{self.what} failed, error code is {st}: {e}",
                               status_code=st) from e
        return False


def translate(what):
    return _Translate(what)
