"""Named errors raised by an explicit ``apply()``.

Every message says what was expected and what was found, so a user can tell at a glance
whether their deepspeed is too old, too new, or changed in a way we do not recognise.
"""


class Zero3RecomputeError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class _ExpectedVsGot(Zero3RecomputeError):
    """An error whose message says what was expected and what was found."""

    what = ""

    def __init__(self, expected: str, got: str):
        self.expected = expected
        self.got = got
        super().__init__(f"zero3_recompute: {self.what}: expected {expected}, got {got}")


class UnsupportedDeepSpeedVersion(_ExpectedVsGot):
    """The installed deepspeed is outside the range this package knows how to patch."""

    what = "unsupported deepspeed version"


class PatchTargetMismatch(_ExpectedVsGot):
    """A deepspeed attribute we rely on is missing or no longer has the shape we checked."""

    def __init__(self, target: str, expected: str, got: str):
        self.target = target
        self.what = f"patch target {target} changed"
        super().__init__(expected, got)


class UnknownPolicy(_ExpectedVsGot):
    """The release policy asked for does not exist, or cannot run on the installed deepspeed."""

    what = "unknown release policy"


class UnknownLayer(_ExpectedVsGot):
    """A layer named to switch off does not exist."""

    what = "unknown layer"


class RevertRefused(_ExpectedVsGot):
    """revert() would leave a graph reading storage the package freed."""

    what = "revert() refused, nothing changed"
