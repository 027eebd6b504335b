"""Checked by mypy (pyproject's [tool.mypy] files), never run: both backends satisfy spec.Backend."""

import fast
import spec
from spec.protocol import Backend

_spec: Backend = spec
_fast: Backend = fast
