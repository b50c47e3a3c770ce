"""`python -m jrt_cli.synthetic ...` is `jrt synthetic ...`."""

import sys

from jrt_cli.main import main

sys.exit(main(["synthetic", *sys.argv[1:]]))
