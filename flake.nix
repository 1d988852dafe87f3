{
  description = "verl 0.5.0 on old NVIDIA GPUs: the Ansible roles' environment, declaratively";

  # NixOS 25.05 is the last release with cudaPackages_11_8 (nixpkgs removed
  # every CUDA 11.x set in August 2025). `nix flake lock` refreshes the rev.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.05";

  outputs =
    { self, nixpkgs }:
    let
      # Every version comes from files/pins.json (and is checked against the
      # locks the roles install): see nix/lib.nix.
      oldgpu = import ./nix/lib.nix { root = ./.; };

      systems = [ "x86_64-linux" ];
      forAllSystems =
        f:
        builtins.listToAttrs (
          map (system: {
            name = system;
            value = f system;
          }) systems
        );

      # Two package sets, as nixified-ai does: a free default, and one for
      # NVIDIA's CUDA with only NVIDIA's licences allowed.
      pkgsFor = system: import nixpkgs { inherit system; };
      cudaPkgsFor =
        system:
        import nixpkgs {
          inherit system;
          config = {
            allowUnfreePredicate = oldgpu.allowNvidiaUnfree;
            cudaSupport = true;
            inherit (oldgpu) cudaCapabilities;
            cudaForwardCompat = false;
          };
        };

      packagesFor = system: import ./nix/packages.nix {
        pkgs = pkgsFor system;
        inherit oldgpu;
      };

      # The module on a NixOS host with the test job (tests/nix/test-job.json).
      testHostWith =
        modules:
        nixpkgs.lib.nixosSystem {
          system = "x86_64-linux";
          modules = [
            self.nixosModules.default
            ./nix/test-host.nix
          ]
          ++ modules;
        };
      testHost = testHostWith [ ];
    in
    {
      lib = oldgpu // {
        inherit
          pkgsFor
          cudaPkgsFor
          packagesFor
          testHostWith
          ;
        # The test host's evaluated configuration (what checks.module builds on).
        testHostConfig = testHost.config;
      };

      packages = forAllSystems (
        system:
        let
          p = packagesFor system;
        in
        {
          inherit (p)
            default
            oldgpu
            verl-train
            verl-src
            verl-patched
            unit
            host-driver
            runtime-libs
            ;
        }
      );

      devShells = forAllSystems (system: {
        default = import ./nix/devshell.nix {
          pkgs = pkgsFor system;
          cudaPkgs = cudaPkgsFor system;
          packages = packagesFor system;
          inherit oldgpu;
        };
      });

      nixosModules.default = import ./nix/module.nix {
        inherit oldgpu packagesFor cudaPkgsFor;
      };
      nixosModules.verl-train = self.nixosModules.default;

      nixosConfigurations.verl-test = testHost;

      checks = forAllSystems (
        system:
        import ./nix/checks.nix {
          pkgs = pkgsFor system;
          packages = packagesFor system;
          inherit oldgpu testHost;
        }
      );

      formatter = forAllSystems (system: (pkgsFor system).nixfmt-rfc-style);
    };
}
