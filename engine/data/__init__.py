"""Data shipped with tierzero: the byte-level corpus of `tierzero train` (corpus.txt)."""
