"""kvbm's logger, inside vLLM's logger tree.

vLLM configures one logger, ``vllm``, with its own handler and format (and
``VLLM_LOGGING_LEVEL``), and its modules log through children of it. kvbm's lines are
``vllm.kvbm_vllm``'s, so they show where vLLM's do, formatted as vLLM's, at vLLM's level,
with no logging set-up of kvbm's own. Every module of the package logs through
:data:`logger` or a child of it (``vllm.kvbm_vllm.tiers``).
"""

import logging

#: The package's logger (see the module docs).
LOGGER_NAME = "vllm.kvbm_vllm"
logger = logging.getLogger(LOGGER_NAME)


def child(name: str) -> logging.Logger:
    """A module's logger under :data:`logger`."""
    return logger.getChild(name)
