"""What verl imports from us: ``VERL_USE_EXTERNAL_MODULES=oldgpu.verl_plugin.hook``.

verl (>= 0.6) imports the modules named there at the end of ``verl/__init__.py``, in
every process that imports verl (the driver, the TaskRunner, each Ray worker), so this
is where the Pascal rollout joins verl's registries without a change to verl's tree:

- the ``cpu`` platform (``cpu_platform``), for ``VERL_PLATFORM=cpu`` proof runs only,
  first: the registry's imports must not resolve verl's platform before it exists;
- the ``oldgpu-hf`` rollout (``registry``), always.
"""

from __future__ import annotations

import os

from oldgpu.verl_plugin import cpu_platform, registry

if os.environ.get("VERL_PLATFORM", "").strip().lower() == cpu_platform.NAME:
    cpu_platform.register()

REGISTERED = registry.register()
