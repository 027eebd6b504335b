"""Moved: the shadow checker is the `shadow` package now (`from shadow import ShadowChecker`).

This module keeps the old import path working for one release and warns once imported.
"""

import warnings

from shadow.checker import ShadowChecker, ShadowMismatchError, ShadowRefusalError, replay

warnings.warn(
    "conformance.shadow moved to the shadow package: `from shadow import ShadowChecker` "
    "(conformance.shadow goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["ShadowChecker", "ShadowMismatchError", "ShadowRefusalError", "replay"]
