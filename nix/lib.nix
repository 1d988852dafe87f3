# What the flake and its NixOS module know, as data and pure functions: the
# pins (files/pins.json), the Python locks the roles install, the engine's job
# settings, fixed paths and driver verdicts (nix/engine.json, written by the engine), the
# env-file renderer and the unit file. Builtins only: no nixpkgs needed, so
# every line here is evaluated offline by `make nix`.
{ root }:
let
  inherit (builtins)
    attrNames
    concatStringsSep
    elem
    elemAt
    filter
    foldl'
    fromJSON
    head
    isString
    listToAttrs
    map
    match
    readFile
    replaceStrings
    split
    toJSON
    ;

  pins = fromJSON (readFile (root + "/files/pins.json"));
  engine = fromJSON (readFile (root + "/nix/engine.json"));
  sourceHashes = fromJSON (readFile (root + "/nix/source-hashes.json"));

  chars = s: builtins.genList (i: builtins.substring i 1 s) (builtins.stringLength s);
  lower = replaceStrings (chars "ABCDEFGHIJKLMNOPQRSTUVWXYZ") (chars "abcdefghijklmnopqrstuvwxyz");

  # pip's name normalisation (PEP 503), as the engine's lockcheck.normalise.
  normalise = name: concatStringsSep "-" (filter isString (split "[-_.]+" (lower name)));

  # A lock file (name==version per line, # comments) as { name = version; }.
  readLock =
    path:
    let
      lines = filter isString (split "\n" (readFile path));
      body = l: head (match "([^#]*).*" l);
      entry =
        l:
        let
          m = match "[[:space:]]*([A-Za-z0-9._-]+)(\\[[^]]*])?==([^[:space:];]+)[[:space:]]*" (body l);
        in
        if m == null then
          if match "[[:space:]]*" (body l) != null then
            null
          else
            throw "oldgpu: ${toString path}: '${l}' is not name==version"
        else
          {
            name = normalise (elemAt m 0);
            value = elemAt m 2;
          };
    in
    listToAttrs (filter (e: e != null) (map entry lines));

  locks = {
    cu118 = readLock (root + "/files/requirements/cu118.lock");
    pypi = readLock (root + "/files/requirements/pypi.lock");
  };

  # What each lock must hold for the pins to be true: every pinned Python
  # package (torch with the variant's local version) and the variant's own
  # CUDA runtime wheels. `set` is the default's pins or a newer release's.
  expectedIn =
    set: variant:
    let
      v = set.torch.variants.${variant};
      local = name: if name == "torch" then v.local_version else "";
    in
    (listToAttrs (
      map (name: {
        name = normalise name;
        value = set.python_packages.${name} + local name;
      }) (attrNames set.python_packages)
    ))
    // (v.requires or { })
    // {
      torch = set.torch.version + v.local_version;
      triton = set.torch.triton;
    };

  compare =
    want: have: file:
    map
      (
        n:
        "${n}: files/pins.json says ${want.${n}}, files/requirements/${file} ${
          if have ? ${n} then "has ${have.${n}}" else "does not list it"
        }"
      )
      (filter (n: (have.${n} or null) != want.${n}) (attrNames want));

  disagreements = variant: compare (expectedIn pins variant) locks.${variant} "${variant}.lock";

  # The newer verl releases (pins.verl_releases), each with its own locks: the
  # default index's (<lock>.lock, CPU hosts) and PyTorch's cu118 one
  # (<lock>-cu118.lock), keyed as the default's variants are.
  releasePins = pins.verl_releases or { };
  releaseLockName =
    version: variant:
    releasePins.${version}.lock + (if variant == "cu118" then "-cu118" else "") + ".lock";
  releaseLocks = builtins.mapAttrs (
    version: _:
    listToAttrs (
      map (variant: {
        name = variant;
        value = readLock (root + "/files/requirements/${releaseLockName version variant}");
      }) (attrNames locks)
    )
  ) releasePins;
  releaseDisagreements = builtins.concatLists (
    map (
      version:
      builtins.concatLists (
        map (
          variant:
          compare (expectedIn releasePins.${version} variant) releaseLocks.${version}.${variant} (
            releaseLockName version variant
          )
        ) (attrNames locks)
      )
    ) (attrNames releasePins)
  );

  allDisagreements = disagreements "cu118" ++ disagreements "pypi" ++ releaseDisagreements;

  # The pins, once they are known to agree with the locks; every output goes
  # through this, so a flake whose pins and locks disagree does not evaluate.
  checkedPins =
    if allDisagreements == [ ] then
      pins
    else
      throw (
        "oldgpu: the pins and the locks the roles install disagree:\n  "
        + concatStringsSep "\n  " allDisagreements
        + "\nregenerate the locks (make lock) or fix files/pins.json"
      );

  dotted = sep: v: replaceStrings [ "." ] [ sep ] v;

  versions = {
    python = checkedPins.python.version;
    cuda = checkedPins.cuda.version;
    torch = checkedPins.torch.version;
    torchVariant = checkedPins.torch.variant;
    verl = checkedPins.verl.version;
    verlCommit = checkedPins.verl.commit;
    engine = (fromTOML (readFile (root + "/pyproject.toml"))).project.version;
    pythonPackages = checkedPins.python_packages;
    inherit locks;
  };

  # --- jobs ---------------------------------------------------------------

  jobFields = engine.job_fields;
  # The fields that land in the env file (`enabled` is systemd's business).
  envFields = filter (f: f.env != null) jobFields;

  # json.dumps of a list of strings, as the engine writes it (", " between items).
  pythonJsonList = items: "[" + concatStringsSep ", " (map toJSON items) + "]";

  # Floats as the engine writes them (%g): Nix's JSON of a float is that text.
  envValue =
    f: v:
    if f.type == "list" || f.type == "indices" then
      pythonJsonList v
    else if f.type == "float" then
      toJSON v
    else
      toString v;

  # The env file of one job: byte for byte what `oldgpu job env` prints for the
  # same settings (a test compares them; the module also has the engine check
  # it when the file is built).
  renderEnv =
    job:
    concatStringsSep "\n" (
      [ "# verl training job ${job.name}: read by verl-train@${job.name}.service" ]
      ++ map (f: "${f.env}='${envValue f job.${f.name}}'") envFields
    )
    + "\n";

  # The settings as the JSON the engine reads (`oldgpu job env FILE`), as Ansible passes them.
  jobJson =
    job:
    toJSON (
      listToAttrs (
        map (f: {
          inherit (f) name;
          value = job.${f.name};
        }) jobFields
      )
    );

  # Checks the module makes before the engine sees a job (it checks the rest
  # when the env file is built): the name makes a unit and a directory, and
  # Nix's JSON differs from Python's for characters outside printable ASCII.
  jobProblems =
    name: job:
    let
      bad = v: match "[ -~]*" v == null;
      lists = filter (f: f.type == "list") envFields;
    in
    (
      if match "[a-z0-9][a-z0-9_-]{0,31}" name == null then
        [ "job name '${name}' must be 1-32 of a-z 0-9 _ - (it names a unit and a directory)" ]
      else
        [ ]
    )
    ++ foldl' (
      acc: f:
      acc
      ++ map (v: "job ${name}: ${f.name}: '${v}' must be printable ASCII") (filter bad job.${f.name})
    ) [ ] lists;

  # --- the host -----------------------------------------------------------

  # The user and directories the unit names (`oldgpu paths`): constants, not options.
  paths = engine.paths;

  # --- the GPU ------------------------------------------------------------

  profiles = engine.profiles;
  # The branches the project installs (every profile is asked about the same ones).
  driverBranches = map fromJSON (attrNames profiles.cpu.requests);

  # The engine's verdict on a driver branch and module flavour for an
  # architecture: null where it accepts them, else its message.
  driverProblem =
    arch: branch: open:
    let
      p = profiles.${arch};
      flavour = if open then "open" else "proprietary";
      verdict = p.requests.${toString branch}.${flavour} or {
        message = "driver branch ${toString branch} is not one the project installs";
      };
    in
    if !(elem branch p.driver.branches) then
      "driver branch ${toString branch} does not drive ${arch} GPUs; choose one of ${toJSON p.driver.branches}"
    else if verdict == null then
      null
    else
      verdict.message;

  # The NVIDIA driver package of a branch from a kernel package set's
  # nvidiaPackages: legacy_<branch> where nixpkgs has it, else whichever of its
  # current drivers is of that branch.
  nvidiaPackageFor =
    nvidiaPackages: branch:
    let
      b = toString branch;
      major = p: head (match "([0-9]+).*" p.version);
      named = filter (n: nvidiaPackages ? ${n}) [
        "legacy_${b}"
        "production"
        "stable"
        "latest"
        "dc_${b}"
      ];
      ofBranch = filter (n: (builtins.tryEval (major nvidiaPackages.${n})).value or null == b) named;
    in
    if ofBranch == [ ] then
      throw "oldgpu: this nixpkgs has no NVIDIA driver of branch ${b} (looked for ${concatStringsSep ", " named}); choose services.verl-train.nvidia.branch from the ones it has"
    else
      nvidiaPackages.${head ofBranch};
  # The licences of NVIDIA's CUDA redistributables nixpkgs marks unfree.
  nvidiaLicenses = [
    "CUDA EULA"
    "cuDNN EULA"
    "cuTENSOR EULA"
    "cuSPARSELt EULA"
    "NVidia OptiX EULA"
  ];
  # NVIDIA's driver packages (licence unfreeRedistributable: allowed by name).
  nvidiaDriverNames = [
    "nvidia-x11"
    "nvidia-persistenced"
    "nvidia-settings"
  ];

in
{
  inherit
    nvidiaLicenses
    nvidiaDriverNames
    root
    pins
    checkedPins
    versions
    locks
    normalise
    readLock
    allDisagreements
    jobFields
    envFields
    renderEnv
    jobJson
    jobProblems
    paths
    profiles
    driverBranches
    driverProblem
    nvidiaPackageFor
    releaseLocks
    ;

  # The newer releases a host may carry, from the pins (checked against their
  # locks), with the engine's places for each (`oldgpu paths`: venv, tree, sdist).
  releases = builtins.mapAttrs (
    version: r:
    r
    // {
      inherit version;
      where = engine.paths.releases.${version};
    }
  ) (checkedPins.verl_releases or { });
  releaseLockFile =
    version: variant: root + "/files/requirements/${releaseLockName version variant}";
  # VERL_DIR_0_9_0 / VERL_VENV_0_9_0: the variables the engine reads a release's
  # places from (oldgpu.verl_release.dirs).
  releaseSuffix = version: dotted "_" version;

  # Attribute names in nixpkgs, from the pins: python311, cudaPackages_11_8.
  pythonAttr = "python" + dotted "" versions.python;
  cudaPackagesAttr = "cudaPackages_" + dotted "_" versions.cuda;
  # What the CUDA package set builds kernels for: torch's own cu118 list.
  cudaCapabilities = checkedPins.torch.cuda_arch_list;

  # The one unit file of every job, for Ansible and NixOS alike (a store
  # path's name cannot hold "@": copied under another name, same bytes).
  unitFile = root + "/files/systemd/verl-train@.service";
  unitFileStore = builtins.path {
    path = root + "/files/systemd/verl-train@.service";
    name = "verl-train-template.service";
  };
  startScript = root + "/files/bin/verl-train";
  lockFile = variant: root + "/files/requirements/${variant}.lock";

  # Nix's hash of a pinned source, by the commit the pins name.
  sourceHash =
    source: commit:
    sourceHashes.${source}.${commit} or (throw
      "oldgpu: nix/source-hashes.json has no hash for ${source} at ${commit} (the commit files/pins.json names); add it (docs/nix.md)"
    );

  makeBinPath = packages: concatStringsSep ":" (map (p: "${p}/bin") packages);

  # The verl repository (owner and name) from the pins' URL.
  verlRepo =
    let
      m = match "https://github.com/([^/]+)/([^/.]+)(\\.git)?" checkedPins.verl.repo_url;
    in
    if m == null then
      throw "oldgpu: verl.repo_url ${checkedPins.verl.repo_url} is not a GitHub URL"
    else
      {
        owner = elemAt m 0;
        repo = elemAt m 1;
      };

  # allowUnfreePredicate: NVIDIA's drivers and CUDA redistributables, nothing else unfree.
  allowNvidiaUnfree =
    pkg:
    let
      l = pkg.meta.license or [ ];
      licenses = if builtins.isList l then l else [ l ];
    in
    elem (builtins.parseDrvName (pkg.name or "")).name nvidiaDriverNames
    || (
      licenses != [ ]
      && builtins.all (x: (x.free or false) || elem (x.shortName or "") nvidiaLicenses) licenses
    );
}
