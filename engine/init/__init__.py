"""`tierzero.Init`: building a model already partitioned (context.py), its slices
staged onto their tiers as they are built (staging.py)."""
