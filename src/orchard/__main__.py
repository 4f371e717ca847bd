"""``python -m orchard``: the same as the ``orchard`` command."""

import sys

from ._cli import main

sys.exit(main())
