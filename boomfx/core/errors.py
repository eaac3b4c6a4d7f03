"""User-facing errors: each carries one sentence that the CLI prints on stderr (no traceback)."""


class BoomfxError(Exception):
    """Base of every error caused by the user's input rather than a bug in boomfx."""


class DimError(BoomfxError):
    """A symbolic dimension is unbound, unknown, or outside its exported range."""


class OptionError(BoomfxError):
    """An option has a value boomfx does not know."""


class CollectiveError(BoomfxError):
    """A collective that cannot be priced as asked: unknown op, negative size, a group that does not fit."""
class UnsupportedError(BoomfxError):
    """The program needs something boomfx cannot model; the message says what and what to do instead."""
