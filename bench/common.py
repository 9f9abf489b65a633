"""Shared by the scripts in bench/: the package's run metadata and JSON writer."""
from flexevict.bench.report import run_metadata, write_json  # noqa: F401
