"""A host-memory stand-in for torchair, for the compat tests only."""

from . import llm_datadist  # noqa: F401
