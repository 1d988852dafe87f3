# `import nixpkgs { system; config; }` for the offline tests: the packages the
# flake names, as real derivations with a /bin/sh builder. The few that the
# tests build (runCommand, the engine, the unit) work with the host's tools
# (/usr/bin: python3, install, cmp); the rest only evaluate.
{
  system,
  config ? { },
  overlays ? [ ],
}:
let
  hostPath = "/usr/bin:/bin";
  binPath = inputs: builtins.concatStringsSep ":" (map (p: "${p}/bin") inputs ++ [ hostPath ]);

  runCommand =
    name: env: script:
    let
      passthru = env.passthru or { };
      inputs = (env.nativeBuildInputs or [ ]) ++ (env.buildInputs or [ ]);
    in
    derivation (
      removeAttrs env [
        "passthru"
        "meta"
      ]
      // {
        inherit name system;
        builder = "/bin/sh";
        args = [
          "-e"
          "-c"
          script
        ];
        PATH = binPath inputs;
      }
    )
    // passthru
    // {
      meta = env.meta or { };
    };

  stub = name: attrs: runCommand name attrs "mkdir -p $out/bin";

  # An application's modules and a launcher on the host's python3 (-I: the
  # caller's PYTHONPATH does not leak in, as with nixpkgs' wrappers).
  buildPythonApplication =
    {
      pname,
      version,
      src,
      meta ? { },
      ...
    }:
    runCommand "${pname}-${version}" { inherit meta; } ''
      site=$out/${python311.sitePackages}
      mkdir -p $out/bin $site
      cp -rL ${src}/src/${pname} $site/${pname}
      cat > $out/bin/${pname} <<EOF
      #!/bin/sh
      exec /usr/bin/python3 -I -c 'import runpy, sys; sys.path.insert(0, "$site"); sys.argv[0] = "${pname}"; runpy.run_module("${pname}", run_name="__main__")' "\$@"
      EOF
      chmod +x $out/bin/${pname}
    '';

  python311 =
    runCommand "python3-3.11-stub" { } "mkdir -p $out/bin; ln -s /usr/bin/python3 $out/bin/python3"
    // {
      sitePackages = "lib/python3.11/site-packages";
      pkgs = {
        inherit buildPythonApplication;
        setuptools = stub "python3.11-setuptools-stub" { };
        pytest = stub "python3.11-pytest-stub" { };
      };
      withPackages = f: stub "python3-3.11-env-stub" { packages = f python311.pkgs; };
    };

  driver =
    version:
    stub "nvidia-x11-${version}-stub" { }
    // {
      inherit version;
      bin = stub "nvidia-x11-${version}-bin-stub" { };
    };
in
{
  inherit config runCommand python311;
  lib = import ./lib.nix;
  stdenv = {
    hostPlatform.system = system;
    cc.cc.lib = stub "gcc-lib-stub" { };
  };
  mkShell = attrs: runCommand (attrs.name or "shell") attrs "mkdir $out";
  symlinkJoin = attrs: stub attrs.name { paths = attrs.paths; };
  writeShellApplication = attrs: stub attrs.name { inherit (attrs) text; };
  fetchFromGitHub =
    attrs:
    stub "source" { }
    // {
      inherit (attrs)
        owner
        repo
        rev
        hash
        ;
    };
  # The sdist's name and sum, for the tests to read (nothing is fetched offline).
  fetchPypi =
    attrs:
    stub "${attrs.pname}-${attrs.version}.tar.gz" { }
    // {
      inherit (attrs) pname version sha256;
    };
  cudaPackages_11_8.cudatoolkit = stub "cudatoolkit-11.8-stub" { };
  linuxPackages.nvidiaPackages = {
    # The branches NixOS 25.05 carries (no legacy_580 there yet).
    legacy_470 = driver "470.256.02";
    legacy_535 = driver "535.216.01";
    production = driver "570.153.02";
    stable = driver "570.153.02";
    latest = driver "570.153.02";
  };
}
// builtins.listToAttrs (
  map
    (name: {
      inherit name;
      value = stub "${name}-stub" { };
    })
    [
      "bash"
      "coreutils"
      "diffutils"
      "findutils"
      "git"
      "gnugrep"
      "gnused"
      "gnutar"
      "gzip"
      "makeWrapper"
      "nixfmt-rfc-style"
      "pciutils"
      "zlib"
    ]
)
