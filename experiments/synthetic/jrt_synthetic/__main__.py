"""`python -m jrt_synthetic ...` (with `experiments/synthetic` on `PYTHONPATH`) = `python experiments/synthetic ...`."""

import sys

from jrt_synthetic.cli import main

if __name__ == "__main__":
    sys.exit(main())
