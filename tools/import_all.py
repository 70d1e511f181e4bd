"""Import every module of one package: proof that its declared dependencies are enough.

Each ``tox -e imports-*`` env installs one package with only what its pyproject declares and runs
this script on it. ``__main__`` modules are not imported (they run a program); a module that
needs an extra the env does not install is named with ``--skip``, and ``--forbid torch`` fails
the run if any imported module pulled torch in.

    python tools/import_all.py nedolm.data --skip nedolm.data.loader --forbid torch
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def module_names(package_name: str) -> list[str]:
    """Every module and subpackage below ``package_name`` (itself included), sorted."""
    package = importlib.import_module(package_name)
    found = pkgutil.walk_packages(package.__path__, f"{package_name}.")
    return sorted({package_name, *(m.name for m in found)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", help="import name, e.g. nedolm.data or nedolm_sft")
    parser.add_argument("--skip", action="append", default=[], help="module needing an extra")
    parser.add_argument("--forbid", action="append", default=[], help="module that must not load")
    args = parser.parse_args(argv)

    names = [n for n in module_names(args.package) if n.rsplit(".", 1)[-1] != "__main__"]
    stale = sorted(set(args.skip) - set(names))
    if stale:
        print(f"error: --skip names no module of {args.package}: {stale}", file=sys.stderr)
        return 2
    for name in names:
        if name not in args.skip:
            importlib.import_module(name)
    leaked = [m for m in args.forbid if m in sys.modules]
    if leaked:
        print(f"error: importing {args.package} loaded {leaked}", file=sys.stderr)
        return 1
    print(f"{args.package}: imported {len(names) - len(args.skip)} modules, skipped {args.skip}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
