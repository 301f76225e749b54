"""The evidence commands, each run as `python -m evidence.<script>`; each writes its tables into
docs/RESULTS.md under its command (evidence/results.py)."""
