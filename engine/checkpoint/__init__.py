"""Checkpoints: save and load of every rank's shards and state (save.py, load.py),
their on-disk layout and atomic writes (layout.py, io.py), background saves
(background.py; of a step whose optimizer update is still deferred: deferred.py), the
state of the engine and its components (state.py), and consolidation into one model file
(consolidate.py)."""
