"""LLMStatusCode and LLMException: the reference package's names and values."""

import enum

import llmdd

_members = [(s.name, int(s)) for s in llmdd.Status]
# The reference's Python names for two constants (aliases, same values).
_members += [("LLM_WAIT_PROCESS_TIMEOUT", int(llmdd.Status.LLM_WAIT_PROC_TIMEOUT)),
             ("LLM_SEQ_LENOVERLIMIT", int(llmdd.Status.LLM_SEQ_LEN_OVER_LIMIT)),
             ("LLM_UNKNOWN_ERROR", -1)]
LLMStatusCode = enum.Enum("LLMStatusCode", _members, module=__name__)


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
