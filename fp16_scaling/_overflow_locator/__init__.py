"""The overflow locator (:func:`fp16_scaling.locate_overflow`): a host-side
debugging tool, apart from the step, that re-runs a step op by op to find
the op that made its first float16 inf or NaN (docs/locate-overflow.md).
``locate`` is its entry point, ``locator`` the interpreter, ``location``
the record it returns.
"""
