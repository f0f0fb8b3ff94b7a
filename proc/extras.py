"""Which of a program's optional packages are missing, said before the program starts.

The wheel's base dependencies are what every program uses; `levers9-agent` and
`levers9-control` each need an extra of their own (`levers9[agent]`, `levers9[control]`, so
neither image carries the other's packages). Without its extra a program would otherwise die on
an ImportError deep inside start-up; this names the extra and the command that installs it.
The extras' lists are read from the installed wheel's metadata, so pyproject.toml stays the one
place that names them.
"""

from __future__ import annotations

import re
from importlib import metadata

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def extra_requirements(requirements: list[str], extra: str) -> list[str]:
    """The distribution names `extra` adds, from a wheel's Requires-Dist lines."""
    names = []
    for line in requirements:
        requirement, _, marker = line.partition(";")
        if extra in _EXTRA.findall(marker):
            found = _NAME.match(requirement.strip())
            if found is not None:
                names.append(found.group(0))
    return names


def missing_extra(program: str, extra: str, distribution: str = "levers9") -> str | None:
    """None when every package of `distribution[extra]` is installed (or `distribution` itself
    is not, as when run from a source tree); else what to tell the user."""
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return None
    missing = []
    for name in extra_requirements(requirements, extra):
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    if not missing:
        return None
    return (
        f"{program} needs the packages of {distribution}[{extra}] (missing: "
        f"{', '.join(missing)}); install them with: pip install '{distribution}[{extra}]'"
    )
