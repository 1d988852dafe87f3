# nixosModules.default: a NixOS host that trains with verl on an old NVIDIA GPU,
# as the Ansible roles provision one: the driver branch and module flavour the
# engine accepts for the GPU, the verl user and directories, the venv of the
# roles' lock, verl patched by the engine, and the same template unit
# (files/systemd/verl-train@.service, byte for byte) with one env file per job,
# rendered as `oldgpu job env` renders it and checked by the engine when built.
{
  oldgpu,
  packagesFor,
  cudaPkgsFor,
}:
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    mkDefault
    mkIf
    mkMerge
    mkOption
    types
    ;
  cfg = config.services.verl-train;
  system = pkgs.stdenv.hostPlatform.system;
  flakePackages = packagesFor system;
  profile = oldgpu.profiles.${cfg.gpu.architecture};
  nvidia = config.hardware.nvidia;
  branchOf = p: builtins.fromJSON (builtins.head (builtins.match "([0-9]+).*" p.version));
  driverProblem = oldgpu.driverProblem cfg.gpu.architecture (branchOf nvidia.package) nvidia.open;

  # The user and directories the unit names: the engine's constants
  # (`oldgpu paths`, through nix/engine.json), not options.
  paths = oldgpu.paths;
  codeDir = paths.code_dir;
  venvDir = paths.venv_dir;
  venvsDir = paths.venvs_dir;
  jobsDir = paths.jobs_dir;
  # environment.etc takes names relative to /etc.
  etcJobsDir =
    if builtins.substring 0 5 jobsDir == "/etc/" then
      builtins.substring 5 (builtins.stringLength jobsDir) jobsDir
    else
      throw "oldgpu: the jobs' directory ${jobsDir} is not under /etc";

  fieldType =
    f:
    {
      str = types.str;
      path = types.str;
      int = types.int;
      # An int or a float: `kl_loss_coef = 0;` reads as the engine's 0.
      float = types.number;
      bool = types.bool;
      list = types.listOf types.str;
      # A GPU count or "all"; GPU indices (the engine checks both against the host).
      count = types.either types.ints.positive (types.enum [ "all" ]);
      indices = types.listOf types.ints.unsigned;
    }
    .${f.type};

  jobModule =
    { name, ... }:
    {
      options =
        builtins.listToAttrs (
          map (f: {
            inherit (f) name;
            value = mkOption (
              {
                type = fieldType f;
                description = f.help;
              }
              // (
                if f.name == "name" then
                  { default = name; }
                else if f.required then
                  { }
                else
                  { inherit (f) default; }
              )
            );
          }) oldgpu.jobFields
        )
        // {
          secretsFile = mkOption {
            type = types.nullOr types.str;
            default = null;
            example = "/run/secrets/verl-job.env";
            description = ''
              A file of KEY='value' lines outside the Nix store (sops-nix,
              agenix), linked as ${jobsDir}/<name>.secrets.env: systemd reads it as
              root before the job drops to the ${paths.user} user.
            '';
          };
        };
    };

  # A job's settings as the engine reads them (the fields only).
  jobValues = job: builtins.listToAttrs (map (f: {
    inherit (f) name;
    value = job.${f.name};
  }) oldgpu.jobFields);

  # The env file: the text Nix renders, built by the engine from the same
  # settings and compared (a job the engine refuses fails the build with its
  # reason; a renderer that drifted from the engine's fails it too).
  envFile =
    name: job:
    pkgs.runCommand "verl-job-${name}.env" {
      nativeBuildInputs = [ cfg.package ];
      text = oldgpu.renderEnv (jobValues job);
      json = oldgpu.jobJson (jobValues job);
      passAsFile = [
        "text"
        "json"
      ];
      passthru.text = oldgpu.renderEnv (jobValues job);
    } ''
      oldgpu job env "$jsonPath" > $out
      if ! cmp -s "$textPath" $out; then
        echo "verl job ${name}: the module's env file differs from the engine's:" >&2
        diff -u $out "$textPath" >&2 || true
        exit 1
      fi
    '';

  lockFile = builtins.path {
    path = oldgpu.lockFile cfg.python.lock;
    name = "verl-${cfg.python.lock}.lock";
  };
  pipSources =
    if cfg.python.wheelhouse != "" then
      [
        "--no-index"
        "--wheelhouse"
        cfg.python.wheelhouse
      ]
    else
      lib.optionals (cfg.python.indexUrl != "") [
        "--index-url"
        cfg.python.indexUrl
      ]
      ++ lib.optionals (cfg.python.torchIndexUrl != "") [
        "--extra-index-url"
        cfg.python.torchIndexUrl
      ];
  venvSources = pipSources ++ map (p: "--extra=" + p) cfg.python.extraPackages;
  quote = s: "'" + builtins.replaceStrings [ "'" ] [ "'\\''" ] s + "'";
  args = l: builtins.concatStringsSep " " (map quote l);

  # The engine's `oldgpu venv ensure`, as the python_env role runs it: a venv
  # per lock, built only when none holds it, verified, then linked in.
  venvScript = ''
    set -euo pipefail
    oldgpu venv ensure ${lockFile} ${codeDir} --link ${venvDir} --venvs ${venvsDir} \
      --python ${cfg.python.package}/bin/python3 --keep ${toString cfg.python.keepPrevious} \
      --ignore verl ${args venvSources}
  '';

  # The newer verl releases the host carries (pins.verl_releases), as the roles'
  # verl_releases: each its own venv from its own lock and its own patched tree,
  # in the engine's places for it (`oldgpu paths`: /opt/verl/venv-<v>, verl-<v>).
  knownReleases = builtins.attrNames oldgpu.releases;
  releases = map (v: oldgpu.releases.${v}) (
    builtins.filter (v: builtins.elem v knownReleases) cfg.verlReleases
  );
  releaseTree = r: flakePackages.verlReleaseFor r.version cfg.gpu.architecture;
  releaseLock =
    r:
    builtins.path {
      path = oldgpu.releaseLockFile r.version cfg.python.lock;
      name = "verl-${r.version}-${cfg.python.lock}.lock";
    };
  # Not for releases, as in the roles: python.extraPackages (the default's venv only).
  releaseVenvScript = builtins.concatStringsSep "" (map (r: ''
    oldgpu venv ensure ${releaseLock r} ${codeDir} --link ${r.where.venv_dir} --venvs ${r.where.venvs_dir} \
      --python ${cfg.python.package}/bin/python3 --keep ${toString cfg.python.keepPrevious} \
      --ignore verl ${args pipSources}
  '') releases);

  driverLibraries = "/run/opengl-driver/lib:${flakePackages.runtime-libs}/lib";
in
{
  options.services.verl-train = {
    enable = lib.mkEnableOption "verl training jobs on old NVIDIA GPUs (verl-train@<name>.service)";

    gpu.architecture = mkOption {
      type = types.enum (builtins.attrNames oldgpu.profiles);
      default = "pascal";
      description = ''
        The architecture of the host's oldest GPU (`oldgpu detect` names it);
        cpu for a host without one. It picks the driver branch and module
        flavour (the engine's profile table) and the patch set of verl.
      '';
    };

    nvidia = {
      enable = mkOption {
        type = types.bool;
        default = profile.device == "cuda";
        defaultText = lib.literalExpression ''gpu.architecture != "cpu"'';
        description = "Configure hardware.nvidia for the GPU (the proprietary or open modules the engine accepts).";
      };
      branch = mkOption {
        type = types.nullOr (types.enum oldgpu.driverBranches);
        default = null;
        description = ''
          Driver branch (470, 535, 550 or 580); null: the engine's default for the
          architecture. The package is nvidiaPackages.legacy_<branch> where
          nixpkgs has it, else its current driver of that branch.
        '';
      };
      acceptLicense = mkOption {
        type = types.bool;
        default = true;
        description = "Set nixpkgs.config.nvidia.acceptLicense (needed for the legacy and data-centre drivers).";
      };
      allowUnfree = mkOption {
        type = types.bool;
        default = true;
        description = ''
          Set nixpkgs.config.allowUnfreePredicate to allow NVIDIA's driver and
          CUDA packages only. Turn off if you set your own predicate (one
          replaces the other) and allow those there.
        '';
      };
    };

    cuda = {
      enable = mkOption {
        type = types.bool;
        default = profile.device == "cuda";
        defaultText = lib.literalExpression ''gpu.architecture != "cpu"'';
        description = "Install the CUDA toolkit of the pinned version, as the cuda role does.";
      };
      package = mkOption {
        type = types.package;
        default = (cudaPkgsFor system).${oldgpu.cudaPackagesAttr}.cudatoolkit;
        defaultText = lib.literalExpression "cudaPackages_11_8.cudatoolkit of the flake's CUDA package set";
        description = "The CUDA toolkit.";
      };
    };

    package = mkOption {
      type = types.package;
      default = flakePackages.oldgpu;
      defaultText = lib.literalExpression "oldgpu.packages.\${system}.oldgpu";
      description = "The engine (the oldgpu command).";
    };
    startScript = mkOption {
      type = types.package;
      default = flakePackages.verl-train;
      defaultText = lib.literalExpression "oldgpu.packages.\${system}.verl-train";
      description = "The start script, linked as ${paths.start_script} (the unit's ExecStart).";
    };
    verlPackage = mkOption {
      type = types.package;
      default = flakePackages.verlPatchedFor cfg.gpu.architecture;
      defaultText = lib.literalExpression "verl at the pinned commit, patched by the engine for gpu.architecture";
      description = "The patched verl tree the jobs import (VERL_DIR; linked as ${paths.verl_dir}).";
    };

    python = {
      package = mkOption {
        type = types.package;
        default = flakePackages.python;
        defaultText = lib.literalExpression "the Python the pins name";
        description = "The interpreter of the training venv.";
      };
      lock = mkOption {
        type = types.enum [
          "cu118"
          "pypi"
        ];
        default = if profile.device == "cuda" then "cu118" else "pypi";
        defaultText = lib.literalExpression ''if gpu.architecture == "cpu" then "pypi" else "cu118"'';
        description = "Which lock of files/requirements the venv holds (python_env_variant).";
      };
      torchIndexUrl = mkOption {
        type = types.str;
        default = "";
        description = ''
          Where torch comes from (python_env_torch_index_url): PyTorch's cu118
          wheel index or a mirror of it. The cu118 lock needs it or wheelhouse.
        '';
      };
      indexUrl = mkOption {
        type = types.str;
        default = "";
        description = "The pip index for everything else; empty: pip's configuration.";
      };
      wheelhouse = mkOption {
        type = types.str;
        default = "";
        description = "A directory of wheels to install from alone (air-gapped hosts).";
      };
      extraPackages = mkOption {
        type = types.listOf types.str;
        default = [ ];
        description = "Extra packages (name==version) for the venv.";
      };
      keepPrevious = mkOption {
        type = types.int;
        default = 1;
        description = "How many older venvs to keep for rollback.";
      };
    };

    verlReleases = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "0.9.0" ];
      description = ''
        Newer verl releases to carry beside the default (${oldgpu.versions.verl}), as the
        roles' verl_releases: each one's venv from its own lock (files/pins.json
        verl_releases) and its sdist patched for gpu.architecture, in the engine's
        places for it. A job picks one with verl_version. One of:
        ${builtins.concatStringsSep ", " (builtins.attrNames oldgpu.releases)}.
      '';
    };

    jobs = mkOption {
      type = types.attrsOf (types.submodule jobModule);
      default = { };
      description = ''
        Training jobs, one verl-train@<name>.service each; the settings are the
        engine's (`oldgpu job fields`), the same keys as the verl_jobs role's.
      '';
    };
  };

  config = mkIf cfg.enable (mkMerge [
    {
      assertions = [
        {
          assertion = cfg.python.lock != "cu118" || cfg.python.torchIndexUrl != "" || cfg.python.wheelhouse != "";
          message = "services.verl-train.python.torchIndexUrl is empty: torch ${oldgpu.versions.torch}+cu118 is only on PyTorch's cu118 wheel index; set it to that index (or a mirror), or python.wheelhouse to a directory holding its wheels";
        }
      ]
      ++ map (v: {
        assertion = builtins.elem v knownReleases;
        message = "verl-version-unknown: services.verl-train.verlReleases = ${builtins.toJSON cfg.verlReleases}: each must be one of files/pins.json's verl_releases (${builtins.concatStringsSep ", " knownReleases}); the default release ${oldgpu.versions.verl} is always installed";
      }) cfg.verlReleases
      ++ lib.concatMap (
        name:
        let
          job = cfg.jobs.${name};
        in
        map (message: {
          assertion = false;
          inherit message;
        }) (oldgpu.jobProblems name (jobValues job))
        ++ [
          {
            assertion = job.name == name;
            message = "services.verl-train.jobs.${name}.name is ${job.name}: a job's name is its attribute name";
          }
          {
            # A newer release runs from its own venv and tree: the host must carry it.
            assertion =
              !(builtins.elem job.verl_version knownReleases) || builtins.elem job.verl_version cfg.verlReleases;
            message = "job-verl-release-missing in job ${name}: verl_version ${job.verl_version} is not one of the releases this host carries (services.verl-train.verlReleases = ${builtins.toJSON cfg.verlReleases}); add it there";
          }
          {
            assertion = job.secretsFile == null || builtins.substring 0 11 job.secretsFile != "/nix/store/";
            message = "services.verl-train.jobs.${name}.secretsFile is in the Nix store, which every user can read";
          }
        ]
      ) (builtins.attrNames cfg.jobs);

      users.users.${paths.user} = {
        isSystemUser = true;
        group = paths.group;
        home = paths.data_dir;
        createHome = false;
        description = "verl training jobs";
      };
      users.groups.${paths.group} = { };

      environment.systemPackages = [ cfg.package ] ++ lib.optional cfg.cuda.enable cfg.cuda.package;

      # The same directories as the base role, and the fixed paths the unit names.
      systemd.tmpfiles.rules = [
        "d ${codeDir} 0755 root root -"
        "d ${paths.bin_dir} 0755 root root -"
        "L+ ${paths.start_script} - - - - ${cfg.startScript}/bin/verl-train"
        "d ${paths.engine_dir} 0755 root root -"
        "L+ ${paths.engine_dir}/current - - - - ${cfg.package}/${cfg.python.package.sitePackages}"
        "L+ ${paths.verl_dir} - - - - ${cfg.verlPackage}"
        "d ${venvsDir} 0755 root root -"
        "d ${paths.data_dir} 0750 ${paths.user} ${paths.group} -"
        "d ${paths.log_dir} 0750 ${paths.user} ${paths.group} -"
        "d ${paths.config_dir} 0755 root root -"
        "d ${jobsDir} 0750 root ${paths.group} -"
      ]
      ++ lib.concatMap (r: [
        "d ${r.where.venvs_dir} 0755 root root -"
        "L+ ${r.where.verl_dir} - - - - ${releaseTree r}"
      ]) releases;

      # The template unit itself, unchanged; NixOS's additions go in drop-ins.
      systemd.packages = [ flakePackages.unit ];
      systemd.services = {
        "verl-train@" = {
          overrideStrategy = "asDropin";
          wants = [ "verl-venv.service" ];
          after = [ "verl-venv.service" ];
          path = [ pkgs.pciutils ] ++ lib.optional cfg.nvidia.enable (lib.getBin nvidia.package);
          environment = {
            OLDGPU_BIN = "${cfg.package}/bin/oldgpu";
            OLDGPU_VENV_PYTHON = paths.venv_python;
            VERL_VENV = venvDir;
            VERL_DIR = "${cfg.verlPackage}";
            LD_LIBRARY_PATH = driverLibraries;
          }
          # A job's verl_version picks these (oldgpu.verl_release.dirs reads them).
          // builtins.listToAttrs (
            lib.concatMap (r: [
              {
                name = "VERL_DIR_${oldgpu.releaseSuffix r.version}";
                value = "${releaseTree r}";
              }
              {
                name = "VERL_VENV_${oldgpu.releaseSuffix r.version}";
                value = r.where.venv_dir;
              }
            ]) releases
          );
        };
        verl-venv = {
          description = "The verl training venvs from ${cfg.python.lock}.lock and the releases' locks";
          wantedBy = [ "multi-user.target" ];
          wants = [ "network-online.target" ];
          after = [ "network-online.target" ];
          path = [
            cfg.package
            pkgs.coreutils
          ];
          environment.LD_LIBRARY_PATH = driverLibraries;
          serviceConfig = {
            Type = "oneshot";
            RemainAfterExit = true;
          };
          script = venvScript + releaseVenvScript;
        };
      }
      // lib.mapAttrs' (
        name: job:
        lib.nameValuePair "verl-train@${name}" (
          {
            overrideStrategy = "asDropin";
            # A new env file restarts a running job on switch (the role's try-restart).
            restartTriggers = [ (envFile name job) ];
          }
          // lib.optionalAttrs job.enabled { wantedBy = [ "multi-user.target" ]; }
        )
      ) cfg.jobs;

      environment.etc =
        lib.mapAttrs' (
          name: job:
          lib.nameValuePair "${etcJobsDir}/${name}.env" {
            source = envFile name job;
            mode = "0640";
            user = "root";
            group = paths.group;
          }
        ) cfg.jobs
        // lib.mapAttrs' (
          name: job: lib.nameValuePair "${etcJobsDir}/${name}.secrets.env" { source = job.secretsFile; }
        ) (lib.filterAttrs (_: job: job.secretsFile != null) cfg.jobs);
    }

    (mkIf cfg.nvidia.enable {
      assertions = [
        {
          assertion = driverProblem == null;
          message = "services.verl-train: ${toString driverProblem} (hardware.nvidia.package ${nvidia.package.version}, hardware.nvidia.open = ${lib.boolToString nvidia.open})";
        }
      ];
      services.xserver.videoDrivers = [ "nvidia" ];
      hardware.graphics.enable = mkDefault true;
      hardware.nvidia = {
        package = mkDefault (
          oldgpu.nvidiaPackageFor config.boot.kernelPackages.nvidiaPackages (
            if cfg.nvidia.branch == null then profile.driver.default else cfg.nvidia.branch
          )
        );
        # Open kernel modules need Turing or newer: the engine's flavour.
        open = mkDefault (profile.driver.flavour == "open");
        # The unit starts after nvidia-persistenced.service.
        nvidiaPersistenced = mkDefault true;
        nvidiaSettings = mkDefault false;
      };
      nixpkgs.config = mkMerge [
        (mkIf cfg.nvidia.acceptLicense { nvidia.acceptLicense = true; })
        (mkIf cfg.nvidia.allowUnfree {
          allowUnfreePredicate = oldgpu.allowNvidiaUnfree;
        })
      ];
    })
  ]);
}
