"""The NVML facade's errors, sorted by what the caller can do about them.

pynvml raises one exception class per NVML return code; none of them leaves `nvml.facade`. There
each becomes one of these:
- `NvmlUnavailableError`: NVML cannot be used on this machine at all (no driver, no library,
  wrong permissions); nothing here will work until an operator acts;
- `DeviceUnresponsiveError`: one card stopped answering; the other cards may still serve;
- `NotSupportedError`: the card or driver does not offer a query; the facade reports "unknown";
- `NvmlError`: anything else.
"""

from __future__ import annotations


class NvmlError(Exception):
    """An NVML call failed. `function` is the NVML function, `code` its NVML_ERROR_* number."""

    def __init__(self, message: str, *, function: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.function = function
        self.code = code


class NvmlUnavailableError(NvmlError):
    """NVML cannot be used on this machine at all. `action` says what an operator can do."""

    def __init__(
        self, message: str, *, action: str, function: str = "", code: int | None = None
    ) -> None:
        super().__init__(message, function=function, code=code)
        self.action = action


class DeviceUnresponsiveError(NvmlError):
    """A card did not answer (lost, needs a reset, or the driver failed for it)."""


class NotSupportedError(NvmlError):
    """The card or the installed driver does not offer this query."""
