"""The one exception every bad config value raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, misspelt, of the wrong type or out of range.

    ``key`` is the dotted path of the offending key as the user wrote it
    (``zero_optimization.stage`` for a DeepSpeed file, ``zero.stage`` for a
    native one; ``""`` for the file as a whole) and ``file`` the config file,
    when there is one. The message names the key, the value seen and what is
    allowed.
    """

    def __init__(self, key: str, problem: str, file: str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.file = file
        where = ": ".join(part for part in (file, key) if part)
        super().__init__(f"{where}: {problem}" if where else problem)

    def in_file(self, file: str) -> ConfigError:
        """The same error, naming the file it came from."""
        return ConfigError(self.key, self.problem, file)
