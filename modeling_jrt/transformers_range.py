"""The transformers releases this model code runs on, checked before anything of transformers is imported.

A saved folder's user may have any transformers: outside the range an import would fail deep inside transformers
or, worse, load. `pyproject.toml` declares the same range (a test keeps the two equal).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

MIN_TRANSFORMERS = (5, 5)
"""The oldest release the model code runs on (inclusive), as (major, minor)."""
MAX_TRANSFORMERS = (6, 0)
"""The first release outside the range (exclusive), as (major, minor)."""
TRANSFORMERS_RANGE = f">={MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]},<{MAX_TRANSFORMERS[0]}"


def check_transformers_release(version: str | None = None) -> None:
    """Raise `ImportError` in one line unless `version` (default: the installed transformers) is in the range."""
    if version is None:
        import transformers

        version = transformers.__version__
    match = re.match(r"(\d+)\.(\d+)", version)  # "5.24.0", "5.25.0.dev0", "6.0.0rc1"
    if match is None:
        raise ValueError(f"Cannot read a transformers version from {version!r}.")
    if not MIN_TRANSFORMERS <= (int(match.group(1)), int(match.group(2))) < MAX_TRANSFORMERS:
        raise ImportError(f"jrt-rnn's model code needs transformers{TRANSFORMERS_RANGE}; found {version}. Install a "
                          "release in the "
                          f'range: pip install "transformers{TRANSFORMERS_RANGE}"')


KERNELS_CLASH = "Either a revision or a version must be specified"


@contextlib.contextmanager
def importing_transformers() -> Iterator[None]:
    """Around the model file's transformers imports: transformers 5.5 - 5.13 fail to import with `kernels` >= 0.19
    (`KERNELS_CLASH`, every model alike); that failure becomes one line that says what to do."""
    try:
        yield
    except ValueError as error:
        if KERNELS_CLASH not in str(error):
            raise
        import transformers

        raise ImportError(
            f"transformers {transformers.__version__} cannot import its model classes with the installed `kernels` "
            "package (0.19 or newer; transformers 5.5 - 5.13 are affected, every model alike): run "
            '`pip uninstall kernels`, or `pip install "kernels<0.19"`, or upgrade transformers to 5.14 or newer.'
        ) from error


__all__ = [
    "MAX_TRANSFORMERS", "MIN_TRANSFORMERS", "TRANSFORMERS_RANGE", "check_transformers_release",
    "importing_transformers",
]
