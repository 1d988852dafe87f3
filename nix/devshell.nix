# `nix develop`: the environment the Ansible roles build, on any Linux host.
# Python of the pinned version, the CUDA toolkit of the pinned version (from
# the CUDA package set), the engine and the start script on PATH, verl patched
# by the engine, and (shell-hook.sh) the host driver's libraries plus a venv of
# exactly the roles' lock.
{
  pkgs,
  cudaPkgs,
  oldgpu,
  packages,
}:
let
  cudaPackages = cudaPkgs.${oldgpu.cudaPackagesAttr};
in
pkgs.mkShell {
  name = "oldgpu-verl-${oldgpu.versions.verl}";
  packages = [
    packages.python
    packages.oldgpu
    packages.verl-train
    packages.host-driver
    cudaPackages.cudatoolkit
    pkgs.git
  ];

  OLDGPU_PYTHON = "${packages.python}/bin/python3";
  OLDGPU_LOCKS = builtins.path {
    path = oldgpu.root + "/files/requirements";
    name = "oldgpu-locks";
  };
  OLDGPU_RUNTIME_LIBS = "${packages.runtime-libs}/lib";
  VERL_DIR = packages.verl-patched;
  CUDA_HOME = cudaPackages.cudatoolkit;
  CUDA_PATH = cudaPackages.cudatoolkit;

  shellHook = builtins.readFile ./shell-hook.sh;
}
