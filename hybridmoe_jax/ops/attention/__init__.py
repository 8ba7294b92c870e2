"""MLA attention: api.py (entries, the one table), reference.py, one file per core."""
