"""Named errors raised by an explicit ``apply()``.

Every message says what was expected and what was found, so a user can tell at a glance
whether their deepspeed is too old, too new, or changed in a way we do not recognise.
"""


class Zero3RecomputeError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class UnsupportedDeepSpeedVersion(Zero3RecomputeError):
    """The installed deepspeed is outside the range this package knows how to patch."""

    def __init__(self, expected: str, got: str):
        self.expected = expected
        self.got = got
        super().__init__(f"zero3_recompute: unsupported deepspeed version: expected {expected}, got {got}")


class PatchTargetMismatch(Zero3RecomputeError):
    """A deepspeed attribute we rely on is missing or no longer has the shape we checked."""

    def __init__(self, target: str, expected: str, got: str):
        self.target = target
        self.expected = expected
        self.got = got
        super().__init__(f"zero3_recompute: patch target {target} changed: expected {expected}, got {got}")


class UnknownPolicy(Zero3RecomputeError):
    """The release policy asked for does not exist, or cannot run on the installed deepspeed."""

    def __init__(self, expected: str, got: str):
        self.expected = expected
        self.got = got
        super().__init__(f"zero3_recompute: unknown release policy: expected {expected}, got {got}")


class UnknownLayer(Zero3RecomputeError):
    """A layer named to switch off does not exist."""

    def __init__(self, expected: str, got: str):
        self.expected = expected
        self.got = got
        super().__init__(f"zero3_recompute: unknown layer: expected {expected}, got {got}")


class RevertRefused(Zero3RecomputeError):
    """revert() would leave a graph reading storage the package freed."""

    def __init__(self, expected: str, got: str):
        self.expected = expected
        self.got = got
        super().__init__(f"zero3_recompute: revert() refused, nothing changed: expected {expected}, got {got}")
