"""The shadow checker: spec beside an engine that already exists, comparing every step it runs.

    from shadow import ShadowChecker
    checker = ShadowChecker(config)   # then checker.check(...) and checker.record_sampled(...) each step

`shadow.checker` is the checker (its docstring is the manual), `shadow.compare_steps` and `shadow.inputs`
what it compares and how it reads an engine's arrays, `shadow.repro` the reproduction scripts it writes,
and `shadow.vllm_attach` the checker attached to a running vLLM (also its `vllm.general_plugins` entry
point). The package needs spec alone: it sits above spec and fast and below the conformance suite, which
uses its comparer (`shadow.compare`).
"""

from shadow.checker import ShadowChecker, ShadowMismatchError, ShadowRefusalError, replay

__all__ = ["ShadowChecker", "ShadowMismatchError", "ShadowRefusalError", "replay"]
