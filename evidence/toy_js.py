"""
toy_js.py's full run, its tables also written into docs/RESULTS.md (section "toy_js").

    python -m evidence.toy_js
"""

import argparse
import time

import toy_js
from evidence.results import commit, one_line_errors, record

parser = argparse.ArgumentParser("python -m evidence.toy_js", description=__doc__.split("\n")[1])

if __name__ == "__main__":
    parser.parse_args()
    started, code = time.time(), commit()
    with one_line_errors():
        lines = toy_js.main("out/toy_js")
        record("toy_js", "python -m evidence.toy_js", lines, at=code)
    written = "out/toy_js/toy_js.json and toy_js.png and docs/RESULTS.md (section toy_js)"
    print(f"\nwrote {written} in {time.time() - started:.1f} s")
