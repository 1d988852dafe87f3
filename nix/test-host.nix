# A NixOS host with the module and the test job both front-ends render
# (tests/nix/test-job.json): nixosConfigurations.verl-test and checks.module.
{ lib, ... }:
{
  services.verl-train = {
    enable = true;
    gpu.architecture = "pascal";
    # Offline hosts install the lock from a directory of wheels.
    python.wheelhouse = "/srv/wheelhouse";
    jobs.smoke = builtins.removeAttrs (builtins.fromJSON (builtins.readFile ../tests/nix/test-job.json)) [
      "name"
    ];
  };

  # What any NixOS system needs to evaluate.
  boot.loader.grub.enable = false;
  fileSystems."/" = {
    device = "none";
    fsType = "tmpfs";
  };
  system.stateVersion = lib.mkDefault "25.05";
}
