"""The error every check raises for a user's mistake; ``memfit.settings.cli`` prints it as one line and exits 2."""


class UserError(Exception):
    """A bad setting or input the user can fix. The message names the bad value and the fix."""
