"""Copy the executor runtime this script belongs to into TARGET/runtime.

The injector image's entrypoint; it runs on the bundled Python itself, so the
injector image holds nothing but the runtime::

    /orchard/lib/ld.so --library-path /orchard/lib --inhibit-cache \
        /orchard/bin/python3 -OO /orchard/install.py TARGET

The copy is made under a temporary name and renamed into place, so
TARGET/runtime is either absent or complete: a shared volume can be filled
by concurrent installers, and a second run finds it there and does nothing.
"""

import os
import shutil
import sys


def main() -> int:
    """Entry point."""
    source = os.path.dirname(os.path.abspath(__file__))
    target = sys.argv[1] if len(sys.argv) > 1 else "/target"
    dest = os.path.join(target, "runtime")
    if os.path.isfile(os.path.join(dest, "MANIFEST")):
        print(f"orchard-install: {dest} is already installed", file=sys.stderr)
        return 0
    os.makedirs(target, exist_ok=True)
    tmp = os.path.join(target, f".runtime-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        shutil.copytree(source, tmp, symlinks=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, "MANIFEST")):
                raise
            print(f"orchard-install: {dest} was installed concurrently", file=sys.stderr)
            return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"orchard-install: installed {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
