# The NixOS options the module sets and the test host uses, declared with the
# types NixOS 25.05 gives them (where the module depends on the type), so a
# misspelt option or a wrong type fails here as it would on NixOS.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib) mkOption types;
  opt = type: default: mkOption { inherit type default; };
  strs = opt (types.listOf types.str) [ ];

  serviceModule = {
    options = {
      enable = opt types.bool true;
      description = opt types.str "";
      overrideStrategy = opt (types.enum [
        "asDropinIfExists"
        "asDropin"
      ]) "asDropinIfExists";
      wantedBy = strs;
      requiredBy = strs;
      wants = strs;
      requires = strs;
      after = strs;
      before = strs;
      path = opt (types.listOf types.package) [ ];
      environment = opt (types.attrsOf (types.nullOr types.str)) { };
      serviceConfig = opt (types.attrsOf types.anything) { };
      unitConfig = opt (types.attrsOf types.anything) { };
      restartTriggers = opt (types.listOf types.anything) [ ];
      script = opt types.lines "";
    };
  };

  etcModule =
    { name, ... }:
    {
      options = {
        target = opt types.str name;
        text = opt (types.nullOr types.lines) null;
        source = mkOption { type = types.path; };
        mode = opt types.str "symlink";
        user = opt types.str "+0";
        group = opt types.str "+0";
      };
    };

  failed = builtins.filter (a: !a.assertion) config.assertions;
in
{
  options = {
    assertions = opt (types.listOf types.anything) [ ];
    warnings = strs;

    nixpkgs.config = opt types.attrs { };

    boot.loader.grub.enable = opt types.bool true;
    boot.kernelPackages = opt types.raw pkgs.linuxPackages;
    fileSystems = opt (types.attrsOf types.anything) { };
    system.stateVersion = opt types.str "25.05";

    users.users = opt (types.attrsOf types.anything) { };
    users.groups = opt (types.attrsOf types.anything) { };

    environment.systemPackages = opt (types.listOf types.package) [ ];
    environment.etc = opt (types.attrsOf (types.submodule etcModule)) { };

    systemd.packages = opt (types.listOf types.package) [ ];
    systemd.services = opt (types.attrsOf (types.submodule serviceModule)) { };
    systemd.targets = opt (types.attrsOf types.anything) { };
    systemd.tmpfiles.rules = strs;

    services.xserver.videoDrivers = strs;
    hardware.graphics.enable = opt types.bool false;
    hardware.nvidia = {
      package = opt types.package config.boot.kernelPackages.nvidiaPackages.stable;
      open = opt (types.nullOr types.bool) null;
      nvidiaPersistenced = opt types.bool false;
      nvidiaSettings = opt types.bool true;
      modesetting.enable = opt types.bool true;
    };

    # As on NixOS, the system is only built once every assertion holds.
    system.build.toplevel = opt types.package (
      if failed != [ ] then
        throw "\nFailed assertions:\n- ${builtins.concatStringsSep "\n- " (map (a: a.message) failed)}"
      else
        pkgs.runCommand "nixos-system-stub" {
          etc = map (e: e.source) (builtins.attrValues config.environment.etc);
          units = config.systemd.packages;
        } "mkdir $out"
    );
  };
}
