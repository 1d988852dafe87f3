# A stand-in for nixpkgs in the offline tests (`--override-input nixpkgs
# path:tests/nix/stub-nixpkgs`): the attributes the flake uses, nothing more.
{
  outputs =
    { self }:
    {
      lib = import ./lib.nix;
      legacyPackages.x86_64-linux = import ./. { system = "x86_64-linux"; };
    };
}
