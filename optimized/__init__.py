"""The real engine: the optimized scheduler, the model runner and the ``LLM`` API.

Importing this package is cheap: the scheduler (pure Python and numpy) and the
engine (torch) are loaded on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from optimized.errors import EmptyDecodeError
from optimized.sampling_params import SamplingParams

if TYPE_CHECKING:  # the lazy names, as mypy should see them
    from optimized.llm import LLM as LLM
    from optimized.llm import RequestOutput as RequestOutput
    from optimized.scheduler import Scheduler as Scheduler
    from optimized.scheduler import SchedulerConfig as SchedulerConfig
    from optimized.scheduler import Sequence as Sequence
    from optimized.scheduler import SequenceStatus as SequenceStatus

_LAZY = {
    "Scheduler": "optimized.scheduler",
    "SchedulerConfig": "optimized.scheduler",
    "Sequence": "optimized.scheduler",
    "SequenceStatus": "optimized.scheduler",
    "LLM": "optimized.llm",
    "RequestOutput": "optimized.llm",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'optimized' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise AttributeError(f"optimized.{name} is not implemented yet") from None
    return getattr(module, name)


__all__ = ["EmptyDecodeError", "SamplingParams", *_LAZY]
