"""``python -m tierkv.cli``: the ``tierkv`` command."""

import sys

from tierkv.cli import main

sys.exit(main())
