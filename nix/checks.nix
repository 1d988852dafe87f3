# `nix flake check`: CPU only. Formatting of the Nix files, the engine's unit
# tests, the pins against the locks, and the module evaluated with the test
# job: its env file equals `oldgpu job env` of the same job, and its unit is
# the file the verl_jobs role installs.
{
  pkgs,
  oldgpu,
  packages,
  testHost,
}:
let
  inherit (packages) python;
  cfg = testHost.config;
  failed = builtins.filter (a: !a.assertion) cfg.assertions;
  unitPackage = builtins.head cfg.systemd.packages;
  testJob = builtins.path {
    path = oldgpu.root + "/tests/nix/test-job.json";
    name = "test-job.json";
  };
  nixFiles = builtins.path {
    path = oldgpu.root;
    name = "oldgpu-nix-files";
    filter =
      path: type:
      (type == "directory" && baseNameOf path != ".git")
      || builtins.match ".*\\.nix" (baseNameOf path) != null;
  };
in
{
  formatting = pkgs.runCommand "oldgpu-nix-formatting" {
    nativeBuildInputs = [ pkgs.nixfmt-rfc-style ];
  } ''
    cd ${nixFiles}
    find . -name '*.nix' -print0 | xargs -0 nixfmt --check
    touch $out
  '';

  engine-tests = pkgs.runCommand "oldgpu-engine-tests" {
    nativeBuildInputs = [ (python.withPackages (ps: [ ps.pytest ])) ];
  } ''
    cp -r ${packages.src} src
    chmod -R u+w src
    cd src
    export HOME=$TMPDIR PYTHONPATH=${./.}
    # Tests that need verl's sdist (slow) or a package of the training venv
    # run in `make unit`, in the engine's venv: pytest_venv_only skips those
    # that fail on a missing package; the two below need the venv's python.
    python -m pytest -q -p no:cacheprovider -p pytest_venv_only -m "not slow" tests \
      --ignore=tests/nix \
      --deselect tests/test_doctor.py::test_cli_cpu_host_exits_0 \
      --deselect tests/test_plot.py::test_cli_no_metrics_exit_status
    touch $out
  '';

  pins = pkgs.runCommand "oldgpu-pins-match-locks" {
    versions = builtins.toJSON oldgpu.versions;
  } "touch $out";

  module =
    if failed != [ ] then
      throw "the test host's assertions failed: ${builtins.concatStringsSep "; " (map (a: a.message) failed)}"
    else
      pkgs.runCommand "oldgpu-module-test-job" {
        nativeBuildInputs = [ packages.oldgpu ];
        envFile = cfg.environment.etc."verl/jobs/smoke.env".source;
      } ''
        oldgpu job env ${testJob} > expected.env
        cmp expected.env "$envFile"
        cmp ${unitPackage}/lib/systemd/system/verl-train@.service ${oldgpu.unitFileStore}
        touch $out
      '';
}
