"""On PYTHONPATH, makes the packages named in MEMFIT_TEST_WITHOUT (comma-separated) fail to import, as they do where
they are not installed (CI installs them)."""

import os
import sys

for name in filter(None, os.environ.get("MEMFIT_TEST_WITHOUT", "").split(",")):
    sys.modules[name] = None  # the import system raises ImportError for a None entry
