"""The miniatures: their weights in the folders beside this code, their data (data.py) and the
command that trains them (build.py)."""
