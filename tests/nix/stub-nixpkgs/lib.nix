# The part of nixpkgs' lib the flake and its module use, small enough to read:
# the option types it declares, mkIf/mkMerge/mkDefault, and a module system
# that works like nixpkgs' where the module relies on it (properties pushed
# down to the options before conditions are evaluated, priorities, defaults,
# submodules with their name, attrsOf, list concatenation, type checks,
# "option does not exist"). A stand-in for offline tests, not a replacement.
let
  inherit (builtins)
    all
    attrNames
    concatLists
    concatMap
    concatStringsSep
    elem
    filter
    foldl'
    head
    isAttrs
    isBool
    isFloat
    isFunction
    isInt
    isList
    isPath
    isString
    length
    listToAttrs
    mapAttrs
    tail
    ;

  last = l: builtins.elemAt l (length l - 1);
  showLoc = loc: concatStringsSep "." loc;
  isOption = v: isAttrs v && (v._type or null) == "option";
  isDerivation = v: isAttrs v && (v.type or null) == "derivation";
  minList = l: foldl' (a: b: if b < a then b else a) (head l) (tail l);

  mkOverride = priority: content: {
    _type = "override";
    inherit priority content;
  };

  # A definition's values with its properties resolved: [ { priority; value; } ].
  discharge =
    prio: v:
    let
      t = v._type or null;
    in
    if t == "merge" then
      concatMap (discharge prio) v.contents
    else if t == "if" then
      (if v.condition then discharge prio v.content else [ ])
    else if t == "override" then
      discharge v.priority v.content
    else
      [
        {
          priority = prio;
          value = v;
        }
      ];

  # Properties of an attribute set moved onto its attributes, so that the
  # names are known before any condition is evaluated (as nixpkgs does).
  pushDown =
    v:
    let
      t = v._type or null;
    in
    if t == "merge" then
      concatMap pushDown v.contents
    else if t == "if" then
      map (mapAttrs (_: x: lib.mkIf v.condition x)) (pushDown v.content)
    else if t == "override" then
      map (mapAttrs (_: x: mkOverride v.priority x)) (pushDown v.content)
    else
      [ v ];

  mergeOption =
    loc: opt: defs:
    let
      given = concatMap (discharge 100) defs;
      all' = given ++ (if opt ? default then discharge 1500 opt.default else [ ]);
      best = minList (map (d: d.priority) all');
      values = map (d: d.value) (filter (d: d.priority == best) all');
      bad = filter (v: !(opt.type.check v)) values;
    in
    if all' == [ ] then
      throw "The option `${showLoc loc}' is used but not defined."
    else if bad != [ ] then
      throw "The option `${showLoc loc}' has a value of the wrong type (${opt.type.name})."
    else
      opt.type.merge loc values;

  evalTree =
    loc: decl: defs:
    if isOption decl then
      mergeOption loc decl defs
    else
      let
        pushed = concatMap pushDown defs;
        undeclared = filter (n: !(decl ? ${n})) (concatMap attrNames pushed);
      in
      if undeclared != [ ] then
        throw "The option `${showLoc (loc ++ [ (head undeclared) ])}' does not exist."
      else
        mapAttrs (
          name: sub: evalTree (loc ++ [ name ]) sub (concatMap (p: if p ? ${name} then [ p.${name} ] else [ ]) pushed)
        ) decl;

  mergeDecls =
    a: b:
    a
    // mapAttrs (
      n: v: if a ? ${n} && !(isOption v) && !(isOption a.${n}) then mergeDecls a.${n} v else v
    ) b;

  evalModules =
    {
      modules,
      specialArgs ? { },
      prefix ? [ ],
    }:
    let
      args = {
        inherit lib config;
        options = decls;
      }
      // specialArgs;
      load =
        m:
        let
          f = if isPath m || isString m then import m else m;
          r = if isFunction f then f args else f;
          normal =
            if r ? options || r ? config then
              {
                options = r.options or { };
                config = r.config or { };
              }
            else
              {
                options = { };
                config = removeAttrs r [
                  "imports"
                  "_file"
                  "key"
                  "meta"
                ];
              };
        in
        [ normal ] ++ concatMap load (r.imports or [ ]);
      loaded = concatMap load modules;
      decls = foldl' mergeDecls { } (map (m: m.options) loaded);
      config = evalTree prefix decls (map (m: m.config) loaded);
    in
    {
      inherit config;
      options = decls;
    };

  mkOptionType =
    {
      name,
      check ? (_: true),
      merge ? mergeEqual,
    }:
    {
      inherit name check merge;
    };

  mergeEqual =
    loc: values:
    if all (v: v == head values) values then
      head values
    else
      throw "The option `${showLoc loc}' has conflicting definition values.";

  mergeAnything =
    loc: values:
    if all isAttrs values && !(all isDerivation values) then
      let
        pushed = concatMap pushDown values;
        names = attrNames (foldl' (a: b: a // b) { } pushed);
      in
      listToAttrs (
        concatMap (
          n:
          let
            ds = concatMap (discharge 100) (concatMap (p: if p ? ${n} then [ p.${n} ] else [ ]) pushed);
          in
          if ds == [ ] then
            [ ]
          else
            [
              {
                name = n;
                value = mergeAnything (loc ++ [ n ]) (map (d: d.value) ds);
              }
            ]
        ) names
      )
    else if all isList values then
      concatLists values
    else
      mergeEqual loc values;

  types = rec {
    str = mkOptionType {
      name = "str";
      check = isString;
    };
    lines = mkOptionType {
      name = "lines";
      check = isString;
      merge = _: values: concatStringsSep "\n" values;
    };
    int = mkOptionType {
      name = "int";
      check = isInt;
    };
    number = mkOptionType {
      name = "number";
      check = v: isInt v || isFloat v;
    };
    bool = mkOptionType {
      name = "bool";
      check = isBool;
    };
    path = mkOptionType {
      name = "path";
      check = v: isPath v || ((isString v || isDerivation v) && builtins.substring 0 1 (toString v) == "/");
    };
    package = mkOptionType {
      name = "package";
      check = v: isDerivation v || (isAttrs v && v ? outPath);
    };
    anything = mkOptionType {
      name = "anything";
      merge = mergeAnything;
    };
    attrs = mkOptionType {
      name = "attrs";
      check = isAttrs;
      merge = _: values: foldl' lib.recursiveUpdate { } values;
    };
    raw = mkOptionType {
      name = "raw";
      merge = _: values: last values;
    };
    enum =
      values:
      mkOptionType {
        name = "enum ${builtins.toJSON values}";
        check = v: elem v values;
      };
    # nixpkgs' ints.positive / ints.unsigned and either, as the module uses them.
    ints = {
      positive = mkOptionType {
        name = "positive integer, meaning >0";
        check = v: isInt v && v > 0;
      };
      unsigned = mkOptionType {
        name = "unsigned integer, meaning >=0";
        check = v: isInt v && v >= 0;
      };
    };
    either =
      a: b:
      mkOptionType {
        name = "${a.name} or ${b.name}";
        check = v: a.check v || b.check v;
      };
    nullOr =
      t:
      mkOptionType {
        name = "null or ${t.name}";
        check = v: v == null || t.check v;
        merge =
          loc: values:
          if all (v: v == null) values then
            null
          else
            t.merge loc (filter (v: v != null) values);
      };
    listOf =
      t:
      mkOptionType {
        name = "list of ${t.name}";
        check = v: isList v && all t.check v;
        merge = _: values: concatLists values;
      };
    attrsOf =
      t:
      mkOptionType {
        name = "attribute set of ${t.name}";
        check = isAttrs;
        merge =
          loc: values:
          let
            pushed = concatMap pushDown values;
            names = attrNames (foldl' (a: b: a // b) { } pushed);
            defsOf = n: concatMap (p: if p ? ${n} then [ p.${n} ] else [ ]) pushed;
            present = filter (n: concatMap (discharge 100) (defsOf n) != [ ]) names;
          in
          listToAttrs (
            map (n: {
              name = n;
              value = mergeOption (loc ++ [ n ]) { type = t; } (defsOf n);
            }) present
          );
      };
    submodule =
      module:
      mkOptionType {
        name = "submodule";
        check = v: isAttrs v || isFunction v;
        merge =
          loc: values:
          (evalModules {
            modules = [ module ] ++ map (v: { config = v; }) values;
            specialArgs.name = last loc;
            prefix = loc;
          }).config;
      };
  };

  lib = {
    inherit
      types
      mkOptionType
      mkOverride
      evalModules
      ;
    mkOption = attrs: attrs // { _type = "option"; };
    mkEnableOption =
      name:
      lib.mkOption {
        type = types.bool;
        default = false;
        description = "Whether to enable ${name}.";
      };
    mkIf = condition: content: {
      _type = "if";
      inherit condition content;
    };
    mkMerge = contents: {
      _type = "merge";
      inherit contents;
    };
    mkDefault = mkOverride 1000;
    mkForce = mkOverride 50;
    literalExpression = text: {
      _type = "literalExpression";
      inherit text;
    };

    optional = cond: x: if cond then [ x ] else [ ];
    optionals = cond: xs: if cond then xs else [ ];
    optionalAttrs = cond: as: if cond then as else { };
    inherit concatMap last;
    nameValuePair = name: value: { inherit name value; };
    mapAttrs' = f: set: listToAttrs (map (n: f n set.${n}) (attrNames set));
    filterAttrs =
      pred: set:
      listToAttrs (
        concatMap (
          n:
          if pred n set.${n} then
            [
              {
                name = n;
                value = set.${n};
              }
            ]
          else
            [ ]
        ) (attrNames set)
      );
    recursiveUpdate =
      a: b:
      a
      // mapAttrs (
        n: v: if isAttrs v && isAttrs (a.${n} or null) then lib.recursiveUpdate a.${n} v else v
      ) b;
    getBin = p: p.bin or p.out or p;
    boolToString = b: if b then "true" else "false";

    # nixpkgs' lib.nixosSystem over the options of ./nixos-base.nix.
    nixosSystem =
      {
        system,
        modules,
        specialArgs ? { },
      }:
      evalModules {
        modules = [ ./nixos-base.nix ] ++ modules;
        specialArgs = {
          pkgs = import ./. { inherit system; };
        }
        // specialArgs;
      };
  };
in
lib
