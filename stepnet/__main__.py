"""``python -m stepnet ...`` is the ``stepnet`` command."""

import sys

from .cli import main

sys.exit(main())
