# The flake's packages, from one nixpkgs (the free set): the engine, the start
# script, verl's pinned source and that source patched by the engine for a
# GPU profile, the unit file, and the helpers the dev shell uses.
{ pkgs, oldgpu }:
let
  inherit (oldgpu) checkedPins root;
  python = pkgs.${oldgpu.pythonAttr};
  version = oldgpu.versions.engine;

  # What the engine's build and tests read: pyproject, src/ (whose
  # data/pins.json links to files/pins.json, and data/verl-train@.service to the
  # unit file: `oldgpu job env` reads what its sandbox hides) and tests/.
  src = builtins.path {
    path = root;
    name = "oldgpu-source";
    filter =
      path: type:
      let
        rel = builtins.substring (builtins.stringLength (toString root) + 1) (-1) (toString path);
        top = builtins.head (builtins.split "/" rel);
        base = baseNameOf rel;
      in
      base != "__pycache__"
      && builtins.match ".*\\.egg-info" base == null
      && (
        builtins.elem rel [
          "pyproject.toml"
          "README.md"
          "files"
          "files/pins.json"
          "files/systemd"
          "files/systemd/verl-train@.service"
        ]
        || builtins.elem top [
          "src"
          "tests"
        ]
      );
  };

  oldgpu-engine = python.pkgs.buildPythonApplication {
    pname = "oldgpu";
    inherit version src;
    pyproject = true;
    build-system = [ python.pkgs.setuptools ];
    # Standard library only (NVML is optional); checks.engine-tests runs the tests.
    doCheck = false;
    pythonImportsCheck = [ "oldgpu" ];
    meta = {
      description = "Engine that makes verl train on old NVIDIA GPUs: detect, profile, patch, plan, doctor";
      mainProgram = "oldgpu";
    };
  };

  # The start script of files/bin/verl-train, unchanged but for its #! line;
  # the engine it calls is this one unless OLDGPU_BIN says otherwise.
  verl-train = pkgs.runCommand "verl-train-${version}" {
    nativeBuildInputs = [ pkgs.makeWrapper ];
    buildInputs = [ pkgs.bash ];
    meta.mainProgram = "verl-train";
  } ''
    install -Dm0755 ${
      builtins.path {
        path = oldgpu.startScript;
        name = "verl-train";
      }
    } $out/bin/verl-train
    patchShebangs --host $out/bin/verl-train
    wrapProgram $out/bin/verl-train \
      --prefix PATH : ${oldgpu.makeBinPath [ pkgs.coreutils ]} \
      --set-default OLDGPU_BIN ${oldgpu-engine}/bin/oldgpu
  '';

  # verl at the pinned commit (the roles check out the same tag and commit).
  verl-src = pkgs.fetchFromGitHub {
    inherit (oldgpu.verlRepo) owner repo;
    rev = checkedPins.verl.commit;
    hash = oldgpu.sourceHash "verl" checkedPins.verl.commit;
  };

  # verl patched for one architecture's profile by the engine's own patcher
  # (`oldgpu patch`, as the verl role runs it on a host; no patch files).
  verlPatchedFor =
    arch:
    let
      profile = oldgpu.profiles.${arch}.name;
    in
    pkgs.runCommand "verl-patched-${checkedPins.verl.version}-${profile}" {
      nativeBuildInputs = [ oldgpu-engine ];
      passthru = {
        inherit profile;
        src = verl-src;
      };
    } ''
      cp -r ${verl-src} $out
      chmod -R u+w $out
      oldgpu patch $out --profile ${profile}
      oldgpu patch $out --profile ${profile} --check
    '';

  # A newer release's tree (pins.verl_releases): its sdist at the pinned sha256
  # (the verl role's `oldgpu verl-sdist` checks the same sum), unpacked and patched
  # for one architecture's profile by the engine, as the role's release phase does.
  verlReleaseSrc =
    version:
    pkgs.fetchPypi {
      pname = "verl";
      inherit version;
      sha256 = oldgpu.releases.${version}.sdist_sha256;
    };
  verlReleaseFor =
    version: arch:
    let
      profile = oldgpu.profiles.${arch}.name;
    in
    pkgs.runCommand "verl-patched-${version}-${profile}" {
      nativeBuildInputs = [
        oldgpu-engine
        pkgs.gnutar
        pkgs.gzip
      ];
      passthru = {
        inherit profile version;
        src = verlReleaseSrc version;
      };
    } ''
      mkdir $out
      tar -xzf ${verlReleaseSrc version} -C $out --strip-components=1 --no-same-owner
      oldgpu patch $out --profile ${profile}
      oldgpu patch $out --profile ${profile} --check
    '';

  # The template unit, the same bytes the verl_jobs role installs.
  unit = pkgs.runCommand "verl-train-unit-${version}" {
    passthru.unitFile = oldgpu.unitFileStore;
  } ''
    install -Dm0644 ${oldgpu.unitFileStore} $out/lib/systemd/system/verl-train@.service
  '';

  # libstdc++ and zlib for the wheels pip installs into a venv of nixpkgs' Python.
  runtime-libs = pkgs.symlinkJoin {
    name = "verl-runtime-libs";
    paths = [
      pkgs.stdenv.cc.cc.lib
      pkgs.zlib
    ];
  };

  # Finds the host driver's libcuda (NixOS or not) for the dev shell; the
  # engine judges how the loaded driver fits CUDA (python reads its JSON).
  host-driver = pkgs.writeShellApplication {
    name = "oldgpu-host-driver";
    runtimeInputs = [
      pkgs.coreutils
      pkgs.findutils
      pkgs.gnugrep
      pkgs.gnused
      python
      oldgpu-engine
    ];
    text = ''
      : "''${OLDGPU_MIN_DRIVER:=${checkedPins.cuda.min_driver}}"
      export OLDGPU_MIN_DRIVER
    ''
    + builtins.readFile ./host-driver.sh;
  };
in
{
  inherit
    python
    src
    verl-train
    verl-src
    verlPatchedFor
    verlReleaseSrc
    verlReleaseFor
    unit
    runtime-libs
    host-driver
    ;
  oldgpu = oldgpu-engine;
  default = oldgpu-engine;
  # Pascal first: the P40 is the card the project starts from.
  verl-patched = verlPatchedFor "pascal";
}
