"""The directory a guarded job puts first on PYTHONPATH: it holds ``sitecustomize.py``.

Python imports ``sitecustomize`` at start-up from the first directory on ``sys.path``
that has one, so every process of the job (Ray's workers included, which inherit the
environment) arms :mod:`oldgpu.guard` when ``OLDGPU_GUARD`` is set. This file only
makes the directory a package, so that it ships with the engine.
"""
