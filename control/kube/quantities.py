"""Kubernetes resource quantities ("500m", "1.5", "32Gi", "1e3") read as exact numbers.

Pure syntax: the suffixes and rounding of the apimachinery `resource.Quantity`, nothing of how
this product counts or places anything. That is why it lives apart from the planner: the
simulated API server (`sim.kubeapi.scheduler`) reads quantities with it too, while it writes the
scheduler's counting rules again from Kubernetes' own, so that the planner's arithmetic is
checked against a second reading and never against itself.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from fractions import Fraction

from wire.errors import ApiError, ErrorCode

__all__ = ["QuantityError", "cpu_millis", "memory_bytes", "parse_quantity"]


class QuantityError(ApiError):
    """A Kubernetes resource quantity that does not parse."""

    def __init__(self, text: object, field: str | None = None) -> None:
        super().__init__(
            ErrorCode.INVALID_ARGUMENT,
            f"{text!r} is not a Kubernetes quantity; write a number with an optional suffix "
            "(m, k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei or an exponent such as e3)",
            field=field,
        )


_QUANTITY = re.compile(r"([+-]?)(\d+\.?\d*|\.\d+)(.*)")
_SUFFIXES: Mapping[str, Fraction] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}
_EXPONENT = re.compile(r"[eE]([+-]?\d+)")


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> Fraction:
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise QuantityError(text)
    sign, number, suffix = match.groups()
    # A bare "E" is exa; "e3"/"E3" is an exponent (Kubernetes checks the exact suffixes first).
    multiplier = _SUFFIXES.get(suffix)
    if multiplier is None:
        exponent = _EXPONENT.fullmatch(suffix)
        if exponent is None:
            raise QuantityError(text)
        multiplier = Fraction(10) ** int(exponent.group(1))
    value = Fraction(number) * multiplier
    return -value if sign == "-" else value


def parse_quantity(value: str | int | float, *, field: str | None = None) -> Fraction:
    """A Kubernetes quantity ("500m", "1.5", "1Gi", "100M", "1e3") as an exact number."""
    if isinstance(value, bool):
        raise QuantityError(value, field)
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(value)
    try:
        return _parse_text(value.strip())
    except QuantityError:
        raise QuantityError(value, field) from None


def _ceil(value: Fraction) -> int:
    return -((-value.numerator) // value.denominator)


def cpu_millis(value: str | int | float, *, field: str | None = None) -> int:
    """CPU in millicores, rounded up as Kubernetes' MilliValue does ("1.5" -> 1500)."""
    if isinstance(value, str):
        try:
            return _cpu_text(value)
        except QuantityError:
            raise QuantityError(value, field) from None
    return _ceil(parse_quantity(value, field=field) * 1000)


def memory_bytes(value: str | int | float, *, field: str | None = None) -> int:
    """Memory (or any count) in whole units, rounded up as Kubernetes' Value does."""
    if isinstance(value, str):
        try:
            return _count_text(value)
        except QuantityError:
            raise QuantityError(value, field) from None
    return _ceil(parse_quantity(value, field=field))


# A cluster repeats a handful of quantity strings across thousands of pods; parse each once.
@functools.lru_cache(maxsize=4096)
def _cpu_text(text: str) -> int:
    return _ceil(_parse_text(text.strip()) * 1000)


@functools.lru_cache(maxsize=4096)
def _count_text(text: str) -> int:
    return _ceil(_parse_text(text.strip()))
