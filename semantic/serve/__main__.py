"""``python -m semantic.serve [serve] --model ...``: the same flags as ``semantic serve``."""

import sys

from semantic.serve.cli import main

sys.exit(main())
