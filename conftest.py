"""Makes `tools` importable from tests (the notebook pipeline lives there)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
