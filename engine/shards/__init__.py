"""Where each rank's flat shards live: the flat layout of a unit's parameters
(flat.py), the store that owns every shard tensor (store.py: all on the device) and
the same interface over offload's tier manager (tiered.py)."""
