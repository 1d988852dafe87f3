"""Every scenario's testinfra tests import ``playbook`` from molecule/shared.

One conftest for all scenarios: pytest loads it for molecule/<scenario>/tests/ because
the project's pyproject.toml makes the project's root pytest's rootdir.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "shared"))
