"""On PYTHONPATH, makes ``import litdata`` fail as it does where litdata is not installed (CI installs it)."""
import sys

sys.modules["litdata"] = None  # the import system raises ImportError for a None entry
