"""Shared by the scripts in bench/: the package's run metadata and JSON writer.

    python bench/common.py      # the run metadata every result here records, for this machine
"""
import argparse
import json

from flexevict.bench.report import write_json  # noqa: F401
from flexevict.runtime.machine import run_metadata

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(json.dumps(run_metadata("cpu"), indent=1))
