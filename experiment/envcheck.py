"""Does this Python hold what requirements.txt asks for? One `error:` line and exit 2 if not.

    python experiment/envcheck.py requirements.txt

Standard library only: it runs before anything else, on interpreters that may have no torch at all.
A pin (name==version) must match the installed version up to a local build tag (2.13.0+cpu and
2.13.0+cu128 both satisfy torch==2.13.0); a bare name must be installed. pytest is for the tests
alone (and pytest-xdist), pyarrow for Parquet data files alone (its reader says what to install when
one is read without it): a launch does not ask for them.
"""

from __future__ import annotations

import sys
from importlib import metadata


def requirements(path: str) -> list[tuple[str, str | None]]:
    """(name, pinned version or None) for each requirement line."""
    wanted = []
    for line in open(path):
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            wanted.append((name.strip(), version.strip() or None))
    return wanted


TEST_ONLY = {"pytest", "pytest-xdist"}
ON_DEMAND = {"pyarrow"}  # only a Parquet data file needs it (experiment/records.py)


def problems(wanted: list[tuple[str, str | None]]) -> list[str]:
    found = []
    for name, pin in wanted:
        if name in TEST_ONLY or name in ON_DEMAND:
            continue
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            found.append(f"no {name}" + (f" (requirements.txt pins {name}=={pin})" if pin else ""))
            continue
        if pin and have.split("+")[0] != pin:
            found.append(f"{name} {have}, requirements.txt pins {name}=={pin}")
    return found


def main(argv: list[str]) -> int:
    found = problems(requirements(argv[0]))
    if found:
        print(f"error: {sys.executable} has {'; '.join(found)}. Fix: unset PYTHON and deactivate the venv, and the "
              "launcher creates .venv with the pinned versions; or install them into this Python: "
              f"{sys.executable} -m pip install -r requirements.txt", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
