"""``python -m isotui`` is the ``isotui`` command."""

import sys

from isotui.cli import main

sys.exit(main())
