"""The one validator, composed once for ``LLM`` and the server's HTTP side (ENG-10, ARCH-6).

Invariant: ``validated_request`` changes nothing and refuses with a ``RequestRefused``; a request it passes, with
the engine's limits and tracing, is one the engine takes (``LLM.add_validated`` checks only trust and the
trace's writability). It needs no model: the server's HTTP process, which holds none, calls it with the engine's
``EngineLimits`` and its own copy of the tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from optimized.engine.sampling_params import RequestRefused, SamplingParams
from optimized.engine.validation import EngineLimits, prompt_ids, validate_priority, validate_request
from optimized.trace.recorder import check_add_record

if TYPE_CHECKING:
    from optimized.models.tokenizer import Tokenizer

__all__ = ["AddCheck", "trace_check", "validated_request"]

AddCheck = Callable[[list[int], SamplingParams], None]  # raises ValueError for a request it cannot take


def trace_check(traced: bool) -> AddCheck | None:
    """TRACE-4: a traced engine's ``add`` record must be a line the trace reader takes; None when not traced."""
    if not traced:
        return None

    def check(ids: list[int], params: SamplingParams) -> None:
        check_add_record(ids, params.max_tokens, params.ignore_eos)

    return check


def validated_request(prompt: object, params: SamplingParams | Callable[[int], SamplingParams],
                      limits: EngineLimits, tokenizer: Tokenizer, check_add: AddCheck | None,
                      priority: object = 0) -> tuple[list[int], SamplingParams, int]:
    """The prompt's token ids, the request's params and its priority, or a ``RequestRefused`` (nothing changed).

    ``params``: a ``SamplingParams`` the caller was given (checked again: it may have been changed since it was
    made), or a function that makes them from the prompt's length (the server's: a max_tokens left to it is the
    room the limits leave), checked as they are made and not again. ``check_add``: the engine's last word (the
    trace's add record, ``trace_check``); its ValueError refuses the prompt, whose length is at fault.
    ``priority``: an int64, other than 0 only under the ``priority`` policy (POLICY-12).
    """
    ids = prompt_ids(prompt, tokenizer)
    if isinstance(params, SamplingParams) or not callable(params):  # validate_request refuses what is none
        made, recheck = params, True
    else:
        made, recheck = params(len(ids)), False
    ids = validate_request(ids, made, limits, recheck)
    checked = validate_priority(priority, limits)
    if check_add is not None:
        try:
            check_add(ids, made)
        except RequestRefused:
            raise
        except ValueError as e:
            raise RequestRefused("prompt", f"is too long for the trace: {e}") from None
    return ids, made, checked
