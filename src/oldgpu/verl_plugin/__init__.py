"""What joins verl from outside its tree: the module verl imports is ``hook``
(``VERL_USE_EXTERNAL_MODULES=oldgpu.verl_plugin.hook``); ``registry`` and
``cpu_platform`` are what it registers, importable without side effects."""
