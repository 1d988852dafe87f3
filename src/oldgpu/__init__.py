"""oldgpu: the engine that makes verl train on old NVIDIA GPUs.

Ansible and Nix call it for every decision: what GPU this is (detect), what it
needs (profile), how verl must change for it (patch), what fits in its memory
(plan) and whether the host is healthy (doctor).
"""

__version__ = "0.1.0"
