"""The one exception every bad config value raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, misspelt, of the wrong type or out of range.

    ``key`` is the dotted path of the offending key as the user wrote it
    (``zero_optimization.stage`` for a DeepSpeed file, ``zero.stage`` for a
    native one; ``""`` for the file as a whole). The message always names the
    key, the value seen and what is allowed.
    """

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}" if key else problem)
