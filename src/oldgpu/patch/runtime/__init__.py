"""The runtime modules ``oldgpu patch`` drops into verl's tree: ``compat.py`` becomes
``verl/utils/oldgpu_compat.py`` with ``compat_logits.py``, ``compat_base16.py`` and
``compat_rollout.py`` (every tree), ``compat_cpu.py``
(cpu trees) and ``compat_fp16.py`` (fp16 trees) appended (``compat_module.py`` renders it).
They import nothing of the engine: they run inside the job's venv, beside verl."""
