"""engine: ZeRO-3 partitioning, module hooks, training API, config, checkpoints, CLI.

Knows modules and ranks; asks `offload` for residency. Public names are
re-exported here; everything else is private to the package.
"""

from engine.config import Config, ConfigError, load_config

__all__: list[str] = ["Config", "ConfigError", "load_config"]
