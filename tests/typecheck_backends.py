"""Checked by mypy (pyproject's [tool.mypy] files), never run: both backends satisfy spec.Backend."""

import fast
import spec
from spec.protocol import Backend, MlaBackend, SparseBackend

_spec: Backend = spec
_fast: Backend = fast
_spec_mla: MlaBackend = spec
_fast_mla: MlaBackend = fast
_spec_sparse: SparseBackend = spec
_fast_sparse: SparseBackend = fast
