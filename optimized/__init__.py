"""The real engine: the optimized scheduler, the model runner and the ``LLM`` API.

Importing this package is cheap: the scheduler (pure Python and numpy) and the
engine (torch) are loaded on first use of their names. It sets the OpenMP wait
policy first, before anything can load torch (optimized/engine/cpu_defaults.py).
"""

from __future__ import annotations

from optimized.engine import cpu_defaults

cpu_defaults.set_wait_policy()

import importlib  # noqa: E402  (after the wait policy, on purpose)
from typing import TYPE_CHECKING, Any  # noqa: E402

from optimized.core.errors import EmptyDecodeError  # noqa: E402
from optimized.engine.sampling_params import RequestRefused, SamplingParams  # noqa: E402

if TYPE_CHECKING:  # the lazy names, as mypy should see them
    from optimized.core.config import SchedulerConfig as SchedulerConfig
    from optimized.core.scheduler import Scheduler as Scheduler
    from optimized.core.sequence import Sequence as Sequence
    from optimized.core.sequence import SequenceStatus as SequenceStatus
    from optimized.engine.args import EngineArgs as EngineArgs
    from optimized.entry.llm import LLM as LLM
    from optimized.entry.llm import RequestOutput as RequestOutput

_LAZY = {  # each name's own module, in its room
    "Scheduler": "optimized.core.scheduler",
    "SchedulerConfig": "optimized.core.config",
    "Sequence": "optimized.core.sequence",
    "SequenceStatus": "optimized.core.sequence",
    "EngineArgs": "optimized.engine.args",
    "LLM": "optimized.entry.llm",
    "RequestOutput": "optimized.entry.llm",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'optimized' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


__all__ = ["EmptyDecodeError", "RequestRefused", "SamplingParams", *_LAZY]
