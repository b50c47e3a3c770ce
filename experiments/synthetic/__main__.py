"""Entry point of `python experiments/synthetic ACTION ...` (run from anywhere; needs jrt-rnn importable).

This folder is not a package (no `__init__.py`), so nothing named `experiments` or `synthetic` becomes importable
from the repository root; Python puts this folder on `sys.path` when it runs it, which makes the harness package
`jrt_synthetic` importable under its own name.
"""

import sys

from jrt_synthetic.cli import main

if __name__ == "__main__":
    sys.exit(main())
