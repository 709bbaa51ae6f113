"""The number types every setting uses: finite, in range, never a bool.

pydantic reads ``true`` as 1 and ``"inf"`` as infinity in a float field; a setting that means a
bound or a rate must be neither (``recompute_tokens_per_s: inf`` would switch restores off,
``max_pending_s: inf`` would remove the bound, ``cpu_bytes_to_use: true`` would mean one byte).
:class:`StrictNumbers` refuses a bool in any field not declared as one; the aliases below add the
ranges. Every wait is at most :data:`MAX_WAIT_S`.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator

__all__ = ["MAX_RATE_TOKENS_S", "MAX_WAIT_S", "Bytes", "Count", "Rate", "Seconds", "StrictNumbers",
           "TokenRate"]

#: the longest any wait or deadline may be (one hour): a deadline is a bound, never "forever"
MAX_WAIT_S = 3600.0
#: the highest prefill rate a setting may claim (tokens/s): no engine computes faster
MAX_RATE_TOKENS_S = 1e9

#: seconds of a wait or a deadline: > 0, finite, at most an hour
Seconds = Annotated[float, Field(gt=0, le=MAX_WAIT_S, allow_inf_nan=False)]
#: a rate (bytes/s, for instance): > 0 and finite
Rate = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: a prefill rate in tokens/s: at least 1e-3 and at most :data:`MAX_RATE_TOKENS_S`
TokenRate = Annotated[float, Field(ge=1e-3, le=MAX_RATE_TOKENS_S, allow_inf_nan=False)]
#: a count of things (slots, requests, threads): a positive integer
Count = Annotated[int, Field(gt=0)]
#: a size in bytes: a positive integer
Bytes = Annotated[int, Field(gt=0)]


def _allows_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return any(_allows_bool(a) for a in typing.get_args(annotation))


class StrictNumbers(BaseModel):
    """A model whose number fields refuse ``true`` / ``false`` (pydantic would read them as 1 / 0)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and not _allows_bool(field.annotation) and field.annotation is not Any:
                raise ValueError("must be a number, not true/false")
        return value
